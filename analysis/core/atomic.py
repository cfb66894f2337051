"""Atomic file writes and plain-language OS errors: the one home for "never leave a half-written file".

- `check_output_file(path, what)`: before any work, say what is wrong with an output path (its
  folder is missing, it is a folder, the folder is read-only) as an OutputError with the fix.
- `atomic_write(path, data)`: write to a temporary file in the same folder, flush and fsync it,
  then `os.replace` it over `path` (a regular file; a link is followed to the file it names; a
  character device or FIFO such as /dev/null or /dev/stdout is written to directly, never replaced); on any failure the temporary file is removed and an existing
  `path` is left exactly as it was (a full disk never leaves a truncated, valid-looking file).
- `os_problem(err)`: (what went wrong, how to fix it) for an OSError, by errno, from one table;
  `disk_full(err)` finds a full disk anywhere in an exception chain (libraries often wrap it).

- `temp_prefix(name)` / `remove_dead_temps(folder, name)`: every temporary file or folder is named
  `.<name>.tmp-<pid>-<random>`; a process killed by SIGKILL cannot remove its own, so the next run
  removes those of dead processes (`LEFTOVER`, `pid_alive`: the one leftover mechanism, which the
  export's `clean_leftovers`, the distillation checkpoints and the built-in model cache share).

Export folders are made atomic the same way, one level up, by `analysis.compress.export.atomic_folder`.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Iterator

from analysis.core.errors import OutputError, shorten

TMP_INFIX = ".tmp-"
NEW_FILE_MODE = 0o644
# .<name>.<kind>-<pid>-<random>: a temporary (tmp) or a replaced copy waiting to be deleted (old)
LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[^/]+")


def temp_prefix(name: str) -> str:
    """The prefix of this process's temporaries for `name` (mkstemp / mkdtemp add the random part)."""
    return f".{name[:64]}{TMP_INFIX}{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """True when a process `pid` exists (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_dead_temps(folder, name: str) -> list[str]:
    """Remove `folder`'s temporaries of `name` (`.<name>.tmp-<pid>-*`, files or folders) whose
    process is dead (killed before it could clean up); returns the names removed. Temporaries of
    live processes and anything else are left alone."""
    removed = []
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = LEFTOVER.fullmatch(entry.name)
        if (not match or match["kind"] != "tmp" or match["name"] != name[:64] or entry.is_symlink()
                or pid_alive(int(match["pid"]))):
            continue
        with suppress(OSError):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            removed.append(entry.name)
    return removed

# errno -> (what went wrong, how to fix it)
_OS_PROBLEMS = {
    errno.ENOSPC: ("the disk is full", "free some space or write to another disk, then run it again"),
    errno.EDQUOT: ("the disk quota is used up", "free some space or write to another disk, then run it again"),
    errno.EROFS: ("the file system is read-only", "choose a folder on a writable disk"),
    errno.EACCES: ("permission denied", "choose a writable folder, or fix its permissions"),
    errno.EPERM: ("the operation is not permitted", "choose a writable folder, or fix its permissions"),
    errno.ENAMETOOLONG: ("the name is too long", "choose a shorter file or folder name"),
    errno.ENOENT: ("a folder on the path does not exist", "create the folder first or choose another path"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose a path inside an existing folder"),
    errno.EISDIR: ("the path is a folder", "give the path of a file instead"),
}
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded")


def os_problem(err: OSError) -> tuple[str, str]:
    """(what went wrong, how to fix it) for an OSError, in plain words."""
    reason = err.strerror or type(err).__name__
    return _OS_PROBLEMS.get(err.errno, (reason.lower(), "check the path, free disk space and permissions"))


def path_problem(path) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) when `path` cannot even be looked up (a name too long, errno
    36; a NUL byte; a loop of links), else None (it may still not exist). Python 3.11's
    Path.exists() / is_dir() raise for these instead of answering, so entry points ask this first."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        return os_problem(err)
    except ValueError:
        return "the path holds a NUL byte", "give a plain path"
    return None


def disk_full(err: BaseException | None) -> bool:
    """True when `err` or an exception it was raised from is a full disk (also when a library
    only kept the OS message, as safetensors and torch do)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL:
            return True
        if any(text in str(err).lower() for text in _DISK_FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def check_output_file(path, what: str = "The output file") -> Path:
    """`path` as a Path if a file can be written there; OutputError saying what is wrong otherwise.

    Checked before long work starts, so a typo does not cost a whole run."""
    text = str(path)
    if not text.strip() or "\x00" in text:
        raise OutputError(f"{what} path {text!r} is empty or holds a NUL byte; give a file path such as out.json.")
    target = Path(text).expanduser()
    problem = path_problem(target)           # e.g. a name too long (errno 36): every probe below would raise
    if problem is not None:
        raise OutputError(f"Cannot write {what.lower()} {shorten(target)}: {problem[0]}; {problem[1]}.")
    if _deleted_link(target):                # /proc/self/fd/1 of a deleted file: it has no path to replace
        raise OutputError(f"{what} {shorten(target)} is a link to a file that was deleted "
                          f"({shorten(os.path.realpath(target))}); writing there would make a new file under that "
                          f"name. Give the path of a file (e.g. out.json), or leave --out out to print the result.")
    kind = _special_kind(target)
    if kind == "stream":                     # /dev/null, a FIFO, /dev/stdout: written directly
        if not os.access(target, os.W_OK):
            problem, fix = os_problem(OSError(errno.EACCES, ""))
            raise OutputError(f"Cannot write {what.lower()} {target}: {problem}; {fix}.")
        return target
    if kind is not None:
        raise OutputError(f"{what} {target} is {kind}, which cannot hold a result; give the path of a regular "
                          f"file (e.g. out.json).")
    if target.is_dir():
        raise OutputError(f"{what} {target} is a folder; give the path of a file inside it (e.g. {target / 'out.json'}).")
    folder = target.parent
    if not folder.exists():
        raise OutputError(f"{what}'s folder {folder} does not exist; create it first or choose another path.")
    if not folder.is_dir():
        raise OutputError(f"{what}'s folder {folder} is a file, not a folder; choose a path inside a folder.")
    if not os.access(folder, os.W_OK | os.X_OK):
        problem, fix = os_problem(OSError(errno.EROFS if _read_only(folder) else errno.EACCES, ""))
        raise OutputError(f"Cannot write {what.lower()} {target}: {problem}; {fix}.")
    return target


# st_mode test -> what an existing non-regular output is: "stream" is written to directly (a device
# or pipe is never replaced by a regular file); anything else is refused
_SPECIAL_OUTPUTS = (
    (stat.S_ISCHR, "stream"),
    (stat.S_ISFIFO, "stream"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _deleted_link(target: Path) -> bool:
    """True for a link that still reaches a regular file (stat follows /proc's fd links to the open file)
    with no name left (st_nlink 0): it was deleted while a process held it open, e.g. a redirected stdout."""
    try:
        if not target.is_symlink():
            return False
        info = os.stat(target)
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 0


def _special_kind(target: Path) -> str | None:
    """None for a regular file, a folder or a new path; else "stream" or what the target is. A
    symbolic link is judged by what it points to (/dev/stdout -> /proc/self/fd/1 -> a pipe or tty)."""
    try:
        mode = os.stat(target).st_mode
    except (OSError, ValueError):
        return None
    return next((kind for test, kind in _SPECIAL_OUTPUTS if test(mode)), None)


def _write_stream(target: Path, payload: bytes, what: str) -> Path:
    """Write to a device or pipe in place (O_NONBLOCK open: a FIFO without a reader is an error, not a hang)."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno == errno.ENXIO:
            raise OutputError(f"Cannot write {what.lower()} {target}: the pipe has no reader; start the reader "
                              f"first or write to a regular file.") from None
        problem, fix = os_problem(err)
        raise OutputError(f"Cannot write {what.lower()} {target}: {problem}; {fix}.") from None
    try:
        os.set_blocking(fd, True)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    except OSError as err:
        problem, fix = os_problem(err)
        raise OutputError(f"Writing {what.lower()} {target} failed: {problem}; {fix}.") from None
    finally:
        os.close(fd)
    return target



def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextmanager
def replaced_atomically(target: Path) -> Iterator[BinaryIO]:
    """Yields a binary stream to a temporary file beside `target`; on a clean exit it is flushed,
    fsync'ed and renamed over `target` (which keeps its permissions; a new file gets NEW_FILE_MODE).

    On any failure the temporary file is removed and `target` is untouched; OSErrors pass through
    (callers word them). The one temp + fsync + rename mechanism: `atomic_write` and the
    distillation checkpoints both write through it."""
    target = Path(target)
    mode = target.stat().st_mode & 0o7777 if target.exists() else NEW_FILE_MODE
    handle, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target.name), dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp_name)
        raise


def atomic_write(path, data: str | bytes, *, encoding: str = "utf-8", what: str = "The output file") -> Path:
    """Write `data` to `path` atomically (`replaced_atomically`: temp file in the same folder +
    fsync + os.replace).

    An existing file keeps its permissions; on failure it is untouched and the temp file is gone.
    OutputError names the problem (e.g. a full disk) and its fix."""
    target = check_output_file(path, what)
    payload = data.encode(encoding) if isinstance(data, str) else bytes(data)
    if _special_kind(target) == "stream":
        return _write_stream(target, payload, what)
    if target.is_symlink():                  # replace the file the link names, keep the link
        target = Path(os.path.realpath(target))
    opened = False
    try:
        with replaced_atomically(target) as stream:
            opened = True
            stream.write(payload)
    except OSError as err:
        problem, fix = os_problem(err)
        if not opened:
            raise OutputError(f"Cannot write {what.lower()} {target}: {problem}; {fix}.") from err
        kept = "the previous file was kept unchanged" if target.exists() else "nothing was written"
        raise OutputError(f"Writing {what.lower()} {target} failed: {problem} ({kept}); {fix}.") from err
    return target


def _split_marked(text: str, begin: str, end: str) -> tuple[str, str, str] | None:
    """(before, the section from `begin` through `end`, after) of `text`, or None without a pair."""
    if begin not in text:
        return None
    head, rest = text.split(begin, 1)
    if end not in rest:
        return None
    inside, tail = rest.split(end, 1)
    return head, begin + inside + end, tail


def write_section(path, section: str, begin: str, end: str, *, what: str = "The output file") -> Path:
    """Put `section` (which starts with `begin` and ends with `end`) into the text file `path`:
    it replaces the text between an existing pair of markers, or is appended. The rest of the
    file is kept as it is; the write is atomic (`atomic_write`). Two generators that share one
    document (scripts/results.py and bench/bench_recovery.py for docs/results.md) each own one
    marked section this way, so regenerating one never drops the other's."""
    target = Path(path)
    text = target.read_text(encoding="utf-8") if target.exists() else ""
    section = section.rstrip("\n") + "\n"
    parts = _split_marked(text, begin, end)
    if parts is not None:
        head, _, tail = parts
        tail = tail.lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section
    return atomic_write(target, text, what=what)


def marked_section(path, begin: str, end: str) -> str:
    """The text of `path` from `begin` through `end` (both included), or "" when it has none."""
    target = Path(path)
    parts = _split_marked(target.read_text(encoding="utf-8"), begin, end) if target.exists() else None
    return "" if parts is None else parts[1]
