"""The atomic export folder: where an export may go, what it may be called, and how it gets there.

Everything is written into a temporary folder next to the target and renamed into place at the end;
an existing non-empty target is only replaced with overwrite=True, and only when it is a headscope
export (its mask.json says so: user files are never deleted); a failure at any point removes the
temporary folder (and any parent folders the export created). A killed export's temporaries, and an
overwrite's old copy, are cleaned or recovered by the next export into the same folder
(`clean_leftovers`). Paths typed by a user are confined to an output root with `resolve_under`;
export names follow NAME_RULE (`check_export_name`). Files get the user's umask (0666 & ~umask),
whatever the writer library chose, so another user or a serving process can read the weights.

The formats (what goes into the folder) are `analysis.compress.export.formats` and its modules.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from analysis.compress.export.records import MASK_FILE, TOOL
from analysis.core import schemas
from analysis.core.atomic import LEFTOVER, disk_full, os_problem, pid_alive
from analysis.core.files import read_file_text
from analysis.core.errors import HeadscopeError, InputError, first_line


class ExportError(HeadscopeError):
    """An export could not be written (the message says where and how to fix it)."""


EXPORT_ROOT_ENV = "HEADSCOPE_EXPORT_ROOT"
DEFAULT_EXPORT_ROOT = "~/headscope-exports"


def default_export_root() -> Path:
    """Where the app exports by default: $HEADSCOPE_EXPORT_ROOT, else ~/headscope-exports."""
    return Path(os.environ.get(EXPORT_ROOT_ENV) or DEFAULT_EXPORT_ROOT).expanduser()


# ---------------------------------------------------------------------------------------------
# Paths and names
# ---------------------------------------------------------------------------------------------

def resolve_under(root, user_path) -> Path:
    """`user_path` (relative to `root`, or absolute inside it) as an absolute path inside `root`.

    InputError for an empty path, one that escapes the root ("../x", an absolute path elsewhere,
    a symlink pointing out), or the root itself."""
    text = str(user_path).strip() if user_path is not None else ""
    if not text:
        raise InputError("Give a folder name for the export (a path inside the output folder).")
    if "\x00" in text:
        raise InputError(f"The export path {text[:60]!r} holds a NUL byte; give a plain folder name.")
    root_text = str(root) if root is not None else ""
    if not root_text.strip() or "\x00" in root_text:      # "" would mean the current folder, silently
        raise InputError(f"The output folder {root_text[:60]!r} (--out-dir) is empty or holds a NUL byte; give "
                         f"a folder path such as exports.")
    try:
        base = Path(root_text).expanduser().resolve()
        candidate = Path(text).expanduser()
        resolved = (candidate if candidate.is_absolute() else base / candidate).resolve()
    except OSError as err:                                  # e.g. a name too long (errno 36)
        problem, fix = os_problem(err)
        raise InputError(f"The export path {text[:60]!r} under {root_text[:60]!r} cannot be used: {problem}; "
                         f"{fix}.") from None
    if resolved == base or not resolved.is_relative_to(base):
        raise InputError(f"The export path {text!r} is outside the output folder {base}. Use a folder name "
                         f"inside it (no '..', no absolute path elsewhere).")
    return resolved


# An export name: each folder name on it is 1-100 safe characters (letters, digits, . _ - + = @,
# inner spaces), so it is one path component, fits the temporary-folder names, and prints on one line.
NAME_RULE = ("each folder name in it must be 1-100 characters: letters, digits, '.', '_', '-', '+', '=', '@' "
             "and inner spaces, not starting with '.' or '-' (no control characters, no NUL)")
_SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_+=@](?:[A-Za-z0-9._+=@ -]{0,98}[A-Za-z0-9._+=@-])?")


def check_export_name(name) -> str:
    """`name` stripped, if every '/'-separated part of it is a safe folder name (NAME_RULE); else InputError."""
    text = "" if name is None else str(name).strip()
    parts = text.split("/")
    if not text or not all(_SAFE_COMPONENT.fullmatch(part) for part in parts) or len(parts) > 8:
        shown = repr(text if len(text) <= 60 else text[:60] + "...")
        raise InputError(f"The export name {shown} is not allowed: {NAME_RULE}. Choose a name such as "
                         f"'smollm2-mp-s0.3'.")
    return text



# ---------------------------------------------------------------------------------------------
# Atomic folders
# ---------------------------------------------------------------------------------------------
#
# A temporary folder is named .<name>.tmp-<pid>-<random> and holds TMP_MARKER until it is moved
# into place; a replaced export waits as .<name>.old-<pid>-<random> until the new one is in
# place. A process killed meanwhile leaves them behind: the next export into the same folder
# removes its own dead temporaries (name pattern, a dead pid, and TMP_MARKER or headscope's
# mask.json inside), and puts back an .old copy whose export is missing.

TMP_MARKER = ".headscope-export-in-progress"
_LEFTOVER = LEFTOVER                 # the one leftover pattern (analysis.core.atomic)


RUN_FILE = "run.json"      # what a pipeline run folder holds at its top (its exports sit inside it)


def is_headscope_export(folder: Path) -> bool:
    """True when `folder` holds a mask.json (an export) or a run.json (a pipeline run) written by
    headscope: what --overwrite may replace, and what the leftover cleaner may remove. Both are read
    through the capped, regular-file-only reader: a FIFO, a link to /dev/zero or a 2 GiB file there
    is "not headscope's" at once (no hang, no memory), never a reason to stop."""
    for name in (MASK_FILE, RUN_FILE):
        try:
            text = read_file_text(Path(folder) / name, schemas.MAX_JSON_CHARS, what=name, fix="")
            data = schemas.load_json_text(text, name, "")
        except (HeadscopeError, OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("tool") == TOOL:
            return True
    return False


def _ours(folder: Path) -> bool:
    return (folder / TMP_MARKER).is_file() or is_headscope_export(folder)


def clean_leftovers(root) -> list[str]:
    """Remove dead exports' temporaries in `root` and recover a replaced export whose new copy never
    arrived; returns one note per thing done. Folders of live processes, or not made by headscope,
    are left alone."""
    notes = []
    try:
        entries = sorted(Path(root).iterdir()) if Path(root).is_dir() else []
    except OSError:
        return notes
    for entry in entries:
        match = _LEFTOVER.fullmatch(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink() or pid_alive(int(match["pid"])):
            continue
        final = entry.with_name(match["name"])
        if match["kind"] == "tmp" and _ours(entry):
            shutil.rmtree(entry, ignore_errors=True)
            notes.append(f"Removed {entry.name}, the temporary folder of an export that was killed.")
        elif match["kind"] == "old" and not final.exists() and (is_headscope_export(entry) or not any(entry.iterdir())):
            os.rename(entry, final)
            notes.append(f"Recovered the previous export {final} from {entry.name} (an overwrite was killed "
                         f"before the new export was in place).")
        elif match["kind"] == "old" and final.exists() and is_headscope_export(entry):
            shutil.rmtree(entry, ignore_errors=True)
            notes.append(f"Removed {entry.name}, the old copy of {final.name} left by an overwrite that was killed.")
    return notes


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; returns the created ones, deepest first."""
    missing = []
    probe = folder
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for path in reversed(missing):
        path.mkdir()
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for path in folders:
        try:
            path.rmdir()
        except OSError:
            pass


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ExportError(f"{target} exists and is a file; choose another export folder name.")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ExportError(f"The export folder {target} already exists and is not empty; choose another name "
                              f"or allow overwriting it.")
        if not is_headscope_export(target):
            raise ExportError(f"{target} is not a headscope export (it has no mask.json written by headscope), so "
                              f"overwriting would delete files headscope did not write; it was left untouched. "
                              f"Choose another name, or move that folder away yourself.")


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, replacing an existing `target` only after the new one is complete."""
    if not target.exists():
        os.rename(tmp, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
    os.rmdir(backup)
    os.rename(target, backup)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def _write_failed(target: Path, err: BaseException) -> ExportError:
    """The ExportError for a failure while writing: a full disk says so, whatever raised it."""
    kept = " The previous export was kept." if target.exists() else ""
    if disk_full(err) or isinstance(err, OSError):
        problem, fix = os_problem(OSError(errno.ENOSPC, "") if disk_full(err) else err)
        return ExportError(f"Writing the export to {target} failed ({problem}); nothing was left behind.{kept} "
                           f"To fix it: {fix}.")
    return ExportError(f"The export to {target} failed halfway ({first_line(err)}); nothing was left "
                       f"behind.{kept} Export again; if it fails again, try another format.")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _ordinary_modes(folder: Path) -> None:
    """Every file in `folder` gets mode 0666 & ~umask, as `open()` would give it: some writers
    (safetensors, tempfile-based savers) leave 0600, which another user or a serving process cannot read."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def listing(folder: Path) -> dict[str, int]:
    """File name (relative to `folder`) -> size in bytes, for every file below it."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _cannot_create(folder: Path, err: OSError) -> ExportError:
    """The error for a folder that cannot be made or written into, with the true reason: a path that
    exists but takes no new folders (ENOENT from a file system such as /proc, EPERM from /sys) says
    so rather than 'does not exist' or 'not permitted'."""
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    pseudo = err.errno == errno.ENOENT or (err.errno == errno.EPERM and existing is not None and _pseudo_fs(existing))
    if pseudo and existing is not None and existing.is_dir():
        on_the_way = "" if existing == folder else f" (on the way to {folder})"
        return ExportError(f"Cannot write into {folder}: {existing}{on_the_way} exists but takes no new folders (it "
                           f"is not an ordinary disk folder, e.g. /proc or /sys); choose an output folder on a disk.")
    problem, fix = os_problem(err)
    return ExportError(f"Cannot write into {folder} ({problem}); {fix}.")


PSEUDO_FILE_SYSTEMS = ("proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "securityfs", "tracefs")


def _pseudo_fs(path: Path) -> bool:
    """Whether `path` lies on a kernel file system (/proc, /sys, ...), read from /proc/self/mounts."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    best = max(((m, t) for m, t in mounts if path == Path(m) or Path(m) in path.parents),
               key=lambda mt: len(mt[0]), default=None)
    return best is not None and best[1] in PSEUDO_FILE_SYSTEMS


def check_export_root(root) -> Path:
    """`root` resolved to an absolute folder that an export can be written into; ExportError with the
    true reason otherwise (a file on the path, a read-only disk, no permission, /proc or /sys).

    Probed for real before any work: a folder is made and removed in the nearest folder of the path
    that exists (the export itself creates the missing ones). A relative `root` is taken from the
    current folder (the CLI's meaning); the app refuses one first (components/exports.py)."""
    text = str(root) if root is not None else ""
    if not text.strip() or "\x00" in text:
        raise InputError(f"The output folder {text[:60]!r} is empty or holds a NUL byte; give a folder path.")
    path = Path(text).expanduser().absolute()
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is None:
        raise ExportError(f"Cannot write into {path}: no folder of its path exists.")
    if not existing.is_dir():
        raise ExportError(f"Cannot write into {path}: {existing} is a file, not a folder; choose another path.")
    try:
        probe = _fresh_dir(existing, f".headscope-probe-{os.getpid()}-")
    except OSError as err:
        raise _cannot_create(path, err) from None
    os.rmdir(probe)
    return path


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new empty folder `parent/<prefix><random>` with ordinary permissions.

    Not `tempfile.mkdtemp`: its folders are mode 0700, and an export renamed from one stayed
    unreadable to everyone but its owner. `os.mkdir` applies the user's umask like any folder."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name under {parent}")


@contextmanager
def atomic_folder(target, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `target`; on success it becomes `target`.

    ExportError if `target` exists and is not empty (unless overwrite, and then only a headscope
    export is replaced), or cannot be written. On any failure (also Ctrl-C / SIGTERM in the CLI)
    the temporary folder (and parents this call created) are removed."""
    target = Path(target)
    _check_target(target, overwrite)
    try:
        created = _make_parents(target.parent)
    except OSError as err:
        raise _cannot_create(target.parent, err) from err
    try:
        tmp = _fresh_dir(target.parent, f".{target.name}.tmp-{os.getpid()}-")
    except OSError as err:
        _remove_empty(created)
        raise _cannot_create(target.parent, err) from err
    try:
        (tmp / TMP_MARKER).write_text(json.dumps({"tool": TOOL, "pid": os.getpid()}))
        yield tmp
        (tmp / TMP_MARKER).unlink()
        _ordinary_modes(tmp)
        _check_target(target, overwrite)          # someone may have written it meanwhile
        _swap_into_place(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(err, HeadscopeError) or not isinstance(err, Exception):
            raise
        raise _write_failed(target, err) from err
