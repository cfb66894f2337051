"""Exports of a pruned model, written atomically, plus the loader for the physically pruned format.

Formats (docs/EXPORT.md describes the files):
- "zeroed":  the original shapes with pruned heads zeroed (`analysis.arch.head_gates.zero_heads` on a
  copy), safetensors + config.json: loads anywhere, no smaller, no faster.
- "pruned":  the physically smaller model (`analysis.compress.surgery.prune_heads`) + head_layout.json;
  `load_pruned(path)` rebuilds it (per-layer head counts need the layout).
- "stock":   when every layer keeps the same head counts, config.json says so
  (num_attention_heads / num_key_value_heads / head_dim) and stock
  `AutoModel*.from_pretrained` loads it with no custom code; refused where the family's config
  cannot express it.
- "onnx":    model.onnx of the pruned model (inputs input_ids, attention_mask; output logits or
  last_hidden_state), runnable by ONNX Runtime.
Every export folder also holds mask.json (`MaskRecord`): model, scorer, z, sparsity, per-head
scores, kept heads, tool version; `mask_from_json` rebuilds the boolean mask from it.

Atomicity: everything is written into a temporary folder next to the target and renamed into
place at the end; an existing non-empty target is only replaced with overwrite=True, and only
when it is a headscope export (its mask.json says so: user files are never deleted); a failure
at any point removes the temporary folder (and any parent folders the export created). A killed
export's temporaries, and an overwrite's old copy, are cleaned or recovered by the next export
into the same folder (`clean_leftovers`). Paths typed by a user are confined to an output root
with `resolve_under`; export names follow NAME_RULE (`check_export_name`).

Loading (`load_pruned`) never runs custom code (trust_remote_code is passed explicitly, default
off), reads only safetensors (a pickle .bin is refused, not unpickled), and checks that
config.json's architecture is a transformers model class of the config's own type.
"""
from __future__ import annotations

import copy
import errno
import json
import os
import re
import secrets
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import psutil
import torch
from torch import nn

from analysis.arch import resize

from analysis.core import schemas
from analysis.arch.adapters import adapter_for, in_memory_copy, input_device, is_dispatched
from analysis.core.atomic import disk_full, os_problem
from analysis.core.errors import HeadscopeError, InputError, ModelLoadError, custom_code_refused, first_line
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import zero_heads
from analysis.arch.models import quiet_load_report, quiet_progress_bars
from analysis.core.progress import Progress, no_progress
from analysis.compress.surgery import HeadLayout, apply_layout, prune_heads

TOOL = "headscope"
TOOL_VERSION = "0.1.0"
MASK_FORMAT = 1
MASK_FILE = "mask.json"
LAYOUT_FILE = "head_layout.json"
ONNX_FILE = "model.onnx"
WEIGHTS_FILE = "model.safetensors"
FORMATS = ("zeroed", "pruned", "stock", "onnx")



class ExportError(HeadscopeError):
    """An export could not be written (the message says where and how to fix it)."""


# ---------------------------------------------------------------------------------------------
# Paths
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
    base = Path(root).expanduser().resolve()
    candidate = Path(text).expanduser()
    resolved = (candidate if candidate.is_absolute() else base / candidate).resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise InputError(f"The export path {text!r} is outside the output folder {base}. Use a folder name "
                         f"inside it (no '..', no absolute path elsewhere).")
    return resolved


# ---------------------------------------------------------------------------------------------
# Atomic folders
# ---------------------------------------------------------------------------------------------

def _os_reason(err: OSError) -> str:
    return os_problem(err)[0]


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
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[^/]+")


def is_headscope_export(folder: Path) -> bool:
    """True when `folder` holds a mask.json written by headscope (what --overwrite may replace)."""
    try:
        data = json.loads((Path(folder) / MASK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("tool") == TOOL


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
        if not match or not entry.is_dir() or entry.is_symlink() or psutil.pid_exists(int(match["pid"])):
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


EXPORT_ROOT_ENV = "HEADSCOPE_EXPORT_ROOT"
DEFAULT_EXPORT_ROOT = "~/headscope-exports"


def default_export_root() -> Path:
    """Where the app exports by default: $HEADSCOPE_EXPORT_ROOT, else ~/headscope-exports."""
    return Path(os.environ.get(EXPORT_ROOT_ENV) or DEFAULT_EXPORT_ROOT).expanduser()


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
        problem, fix = os_problem(err)
        raise ExportError(f"Cannot create the folder {target.parent} ({problem}); {fix}.") from err
    try:
        tmp = _fresh_dir(target.parent, f".{target.name}.tmp-{os.getpid()}-")
    except OSError as err:
        _remove_empty(created)
        problem, fix = os_problem(err)
        raise ExportError(f"Cannot write into {target.parent} ({problem}); {fix}.") from err
    try:
        (tmp / TMP_MARKER).write_text(json.dumps({"tool": TOOL, "pid": os.getpid()}))
        yield tmp
        (tmp / TMP_MARKER).unlink()
        _check_target(target, overwrite)          # someone may have written it meanwhile
        _swap_into_place(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(err, HeadscopeError) or not isinstance(err, Exception):
            raise
        raise _write_failed(target, err) from err


# ---------------------------------------------------------------------------------------------
# Mask JSON
# ---------------------------------------------------------------------------------------------

def _finite_table(values, shape, what: str) -> list[list[float]] | None:
    if values is None:
        return None
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != shape:
        raise InputError(f"{what} must have shape {list(shape)}; got {list(arr.shape)}.")
    if not np.isfinite(arr).all():
        raise InputError(f"{what} contain NaN or infinity; score the heads again before exporting.")
    return arr.tolist()


@dataclass
class MaskRecord:
    """Everything needed to rebuild and explain a mask (the contents of mask.json)."""
    model: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    kept: list[list[int]]                       # [L][kept query heads]
    scorer: str | None = None
    scorer_params: dict = field(default_factory=dict)
    z: float | None = None
    sparsity: float | None = None
    policy: str | None = None
    kv_policy: str | None = None                # surgery's kv_policy (auto / expand / strict); None: not cut
    scores: list[list[float]] | None = None     # [L][H], higher = more important
    tiebreak: list[list[float]] | None = None   # [L][H], the ranking's tie-break
    tool: str = TOOL
    tool_version: str = TOOL_VERSION
    format: int = MASK_FORMAT

    def pruned(self) -> np.ndarray:
        """The boolean mask [L, H] (True = pruned)."""
        mask = np.ones((self.n_layers, self.n_heads), dtype=bool)   # [L, H]
        for layer, kept in enumerate(self.kept):
            mask[layer, kept] = False
        return mask

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict) -> "MaskRecord":
        """Validate (analysis.core.schemas.MASK_SCHEMA: exact types and ranges, then the cross-field rules)."""
        fix = "export the mask again"
        if isinstance(data, dict) and _strict_int(data.get("format")) and data["format"] > MASK_FORMAT:
            raise InputError(f"mask.json has format {data['format']}; this headscope reads up to {MASK_FORMAT}. "
                             f"Update headscope.")
        schemas.check(data, schemas.MASK_SCHEMA, "mask.json", fix)
        record = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        L, H = record.n_layers, record.n_heads
        if len(record.kept) != L or any(h >= H for row in record.kept for h in row):
            raise InputError(f"mask.json lists kept heads that do not fit {L} layers x {H} heads; {fix}.")
        if H % record.n_kv_heads:
            raise InputError(f"mask.json says {H} heads in {record.n_kv_heads} KV groups, which does not divide; "
                             f"{fix}.")
        for name in ("scores", "tiebreak"):
            table = getattr(record, name)
            if table is not None and (len(table) != L or any(len(row) != H for row in table)
                                      or not np.isfinite(np.asarray(table, dtype=np.float64)).all()):
                raise InputError(f"mask.json's {name} must be {L} rows of {H} finite numbers; {fix}.")
        return record

    def check_geometry(self, geometry: HeadGeometry) -> None:
        """InputError unless this mask was made for a model of `geometry`'s shape."""
        mine = (self.n_layers, self.n_heads, self.n_kv_heads)
        theirs = (geometry.n_layers, geometry.n_heads, geometry.n_kv_heads)
        if mine != theirs:
            raise InputError(f"mask.json is for {mine[0]} layers x {mine[1]} heads ({mine[2]} KV heads), but the model "
                             f"has {theirs[0]} x {theirs[1]} ({theirs[2]} KV heads); use the mask exported for this "
                             f"model.")


def mask_record(pruned, *, geometry: HeadGeometry, model: str = "", model_type: str = "", scores=None,
                scorer: str | None = None, z: float | None = None, sparsity: float | None = None,
                policy: str | None = None, tiebreak=None, scorer_params: dict | None = None,
                kv_policy: str | None = None) -> MaskRecord:
    """A MaskRecord for `pruned` [L, H]. `scores` may be a [L, H] array or an analysis.score.scoring
    HeadScores (its name, params and tie-break are used unless given)."""
    p = np.asarray(pruned, dtype=bool)
    shape = (geometry.n_layers, geometry.n_heads)
    if p.shape != shape:
        raise InputError(f"Mask must have shape {list(shape)} (layers x heads); got {list(p.shape)}.")
    if hasattr(scores, "scores"):
        scorer = scorer or scores.name
        scorer_params = scorer_params if scorer_params is not None else dict(scores.params)
        tiebreak = tiebreak if tiebreak is not None else scores.tiebreak
        scores = scores.scores
    if z is None and scorer_params and "z" in scorer_params:
        z = scorer_params["z"]
    params = json.loads(json.dumps(scorer_params or {}, default=str))
    return MaskRecord(model=model, model_type=model_type, n_layers=shape[0], n_heads=shape[1],
                      n_kv_heads=geometry.n_kv_heads, kept=[np.flatnonzero(~row).tolist() for row in p],
                      scorer=scorer, scorer_params=params, z=None if z is None else float(z),
                      sparsity=None if sparsity is None else float(sparsity), policy=policy, kv_policy=kv_policy,
                      scores=_finite_table(scores, shape, "Head scores"),
                      tiebreak=_finite_table(tiebreak, shape, "Tie-break values"))


def _strict_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_mask_json(source, *, geometry: HeadGeometry | None = None) -> MaskRecord:
    """A MaskRecord from a dict, JSON text, a mask.json path or an export folder holding one.

    With `geometry`, the mask must be for a model of that shape (InputError otherwise)."""
    fix = "export the mask again"
    if isinstance(source, dict):
        record = MaskRecord.from_dict(source)
    else:
        text = str(source)
        if not text.lstrip().startswith(("{", "[")):
            try:
                path = Path(text)
                path = path / MASK_FILE if path.is_dir() else path
                if path.is_file() and path.stat().st_size > schemas.MAX_JSON_CHARS:
                    raise InputError(f"The mask file {path} is larger than any mask.json; {fix}.")
                text = path.read_text(encoding="utf-8")
            except (OSError, ValueError) as err:   # ValueError: a NUL byte, or not UTF-8
                reason = _os_reason(err) if isinstance(err, OSError) else "it is not UTF-8 text or not a path"
                raise InputError(f"Cannot read the mask file {text[:80]!r} ({reason}); give the path of a "
                                 f"mask.json or of an export folder holding one.") from None
        data = schemas.load_json_text(text, "The mask file", fix)
        if not isinstance(data, dict):
            raise InputError(f"The mask file must hold a JSON object; {fix}.")
        record = MaskRecord.from_dict(data)
    if geometry is not None:
        record.check_geometry(geometry)
    return record


def mask_from_json(source, *, geometry: HeadGeometry | None = None) -> np.ndarray:
    """The boolean mask [L, H] (True = pruned) stored in a mask.json (see read_mask_json)."""
    return read_mask_json(source, geometry=geometry).pruned()


def _default_record(model, pruned, record: MaskRecord | None) -> MaskRecord:
    if record is not None:
        if record.pruned().shape != np.asarray(pruned).shape or not np.array_equal(record.pruned(),
                                                                                    np.asarray(pruned, bool)):
            raise InputError("The mask record does not describe the mask being exported; build it from the "
                             "same mask (analysis.compress.export.mask_record).")
        return record
    adapter = adapter_for(model)
    return mask_record(pruned, geometry=adapter.geometry(model), model=str(model.config._name_or_path or ""),
                       model_type=adapter.model_type)


# ---------------------------------------------------------------------------------------------
# Exports
# ---------------------------------------------------------------------------------------------

@dataclass
class ExportResult:
    """What an export wrote: its format, final folder, file name -> size in bytes."""
    format: str
    path: Path
    files: dict[str, int]
    layout: HeadLayout | None = None
    notes: list[str] = field(default_factory=list)   # leftovers of killed exports cleaned or recovered

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_common(tmp: Path, record: MaskRecord, tokenizer, layout: HeadLayout | None) -> None:
    if layout is not None:          # a physical cut: mask.json says which kv_policy built it
        record = replace(record, kv_policy=layout.kv_policy)
    (tmp / MASK_FILE).write_text(record.to_json(), encoding="utf-8")
    if layout is not None:
        (tmp / LAYOUT_FILE).write_text(layout.to_json(), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def _resident(model: nn.Module) -> nn.Module:
    """`model`, or for one accelerate dispatched or offloaded an in-memory copy on the CPU: an export
    writes real tensors from one device (costs the model's size in RAM, once, for the export)."""
    return in_memory_copy(model) if is_dispatched(model) else model


def _save_model(model: nn.Module, folder: Path, config=None) -> None:
    """Hugging Face checkpoint (save_pretrained: its key conventions), optionally another config."""
    with quiet_progress_bars():
        model.save_pretrained(folder, safe_serialization=True)
    if config is not None:
        config.architectures = [type(model).__name__]
        config.save_pretrained(folder)


def _save_pruned(model: nn.Module, folder: Path) -> None:
    """The pruned format: model.safetensors keyed exactly by `model.state_dict()` names (tied
    tensors stored once) plus the original config.json; `load_pruned` reads it back."""
    from safetensors.torch import save_model
    save_model(model, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "producer": TOOL})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)


def _run_export(fmt: str, target, overwrite: bool, write: Callable[[Path], HeadLayout | None],
                progress: Progress | None) -> ExportResult:
    report = progress or no_progress
    target = Path(target)
    notes = clean_leftovers(target.parent)
    for note in notes:
        report(0.0, note)
    report(0.0, f"{fmt} export: writing to a temporary folder")
    with atomic_folder(target, overwrite=overwrite) as tmp:
        layout = write(tmp)
        report(0.9, f"{fmt} export: moving into place")
    report(1.0, f"{fmt} export written to {target}")
    return ExportResult(format=fmt, path=target, files=_listing(target), layout=layout, notes=notes)


def export_zeroed(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                  overwrite: bool = False, progress: Progress | None = None) -> ExportResult:
    """Original shapes, pruned heads zeroed (safetensors + config.json + mask.json)."""
    model = _resident(model)
    record = _default_record(model, pruned, record)

    def write(tmp: Path):
        _save_model(zero_heads(copy.deepcopy(model), pruned), tmp)
        _write_common(tmp, record, tokenizer, None)
        return None

    return _run_export("zeroed", target, overwrite, write, progress)


def export_pruned(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                  kv_policy: str = "auto", rounds=None, overwrite: bool = False,
                  progress: Progress | None = None) -> ExportResult:
    """The physically pruned model + head_layout.json (+ mask.json); load with `load_pruned`."""
    model = _resident(model)
    record = _default_record(model, pruned, record)
    smaller, layout = prune_heads(model, pruned, kv_policy=kv_policy, rounds=rounds)

    def write(tmp: Path):
        _save_pruned(smaller, tmp)
        _write_common(tmp, record, tokenizer, layout)
        return layout

    return _run_export("pruned", target, overwrite, write, progress)


def stock_config_for(model: nn.Module, layout: HeadLayout):
    """The config stock Hugging Face code needs to build `layout`'s shapes (uniform layouts only)."""
    counts = layout.uniform_counts()
    if counts is None:
        per_layer = [layout.layer_counts(layer) for layer in range(layout.n_layers)]
        raise InputError(
            f"A stock checkpoint needs the same head counts in every layer, but this mask keeps (query, KV) "
            f"heads {per_layer} per layer. Use the 'balanced-uniform' mask policy (or 'uniform' with "
            f"kv_policy='expand', which copies K/V for uneven GQA groups), or export the head-layout checkpoint "
            f"instead.")
    return resize.stock_config(adapter_for(model), model.config, counts[0], counts[1], layout.head_dim)


@dataclass(frozen=True)
class StockCheck:
    """Whether a stock config (plain `from_pretrained`) can describe what surgery makes of a mask,
    and the nearest sparsities at which one can: [(sparsity, policy, kv_policy, (H', Hkv'))]."""
    ok: bool
    reason: str
    counts: tuple[int, int] | None
    nearest: list

    def message(self) -> str:
        if self.ok:
            return (f"A stock config describes this mask ({self.counts[0]} query / {self.counts[1]} KV heads in "
                    f"every layer): the 'stock' export loads with plain from_pretrained.")
        options = "; ".join(f"sparsity {s:.4g} ({policy} policy, kv_policy {kv}: {h} query / {kv_h} KV heads per "
                            f"layer)" for s, policy, kv, (h, kv_h) in self.nearest[:3])
        return f"No stock config can describe this mask: {self.reason} " + (
            f"Nearest sparsities that can: {options}." if options else "No sparsity can (this family's config "
                                                                      "cannot describe pruned heads).")


def _stock_accepts(adapter, config, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
    """'' when stock code can build n_heads / n_kv_heads per layer, else why not."""
    try:
        resize.stock_config(adapter, config, n_heads, n_kv_heads, head_dim)
    except HeadscopeError as err:
        return str(err)
    return ""


def stock_sparsities(model_or_config) -> list[tuple[float, str, str, tuple[int, int]]]:
    """Every sparsity below 1 whose mask a stock config can describe, with the policy that makes it:
    balanced-uniform (c heads from every group, K/V kept) or, where that is not the only way,
    uniform + kv_policy 'expand' (K/V copied per query head: bigger KV cache)."""
    adapter = adapter_for(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    g = adapter.geometry(config)
    out = []
    for kept in range(g.n_heads - 1, 0, -1):                     # H' query heads kept per layer
        sparsity = (g.n_heads - kept) / g.n_heads
        if g.group_size == 1:
            candidates = [("uniform", "auto", kept)]
        else:
            candidates = ([("balanced-uniform", "auto", g.n_kv_heads)] if kept % g.n_kv_heads == 0 else []) + [
                ("uniform", "expand", kept)]
        for policy, kv_policy, n_kv in candidates:
            if not _stock_accepts(adapter, config, kept, n_kv, g.head_dim):
                out.append((sparsity, policy, kv_policy, (kept, n_kv)))
                break
    return out


def stock_check(model_or_config, pruned, *, kv_policy: str = "auto", sparsity: float | None = None) -> StockCheck:
    """Can a stock config describe what surgery makes of pruned [L, H] under kv_policy? `nearest`
    lists the stock-describable sparsities closest to `sparsity` (default: the mask's)."""
    from analysis.score.masks import plan_layout
    adapter = adapter_for(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    g = adapter.geometry(config)
    p = np.asarray(pruned, dtype=bool)
    target = float(p.mean() if sparsity is None else sparsity)
    nearest = sorted(stock_sparsities(config), key=lambda c: (abs(c[0] - target), c[0]))
    heads, kv_heads = plan_layout(p, g.group_size, kv_policy)
    counts = sorted({(len(h), len(kv)) for h, kv in zip(heads, kv_heads)})
    if len(counts) != 1 or counts[0][0] == 0:
        reason = (f"the layers keep different (query, KV) head counts {counts[:4]}{' ...' if len(counts) > 4 else ''}"
                  if len(counts) != 1 else "every head is pruned") + "; a stock config has one count for all layers."
        return StockCheck(False, reason, None, nearest)
    (h, kv), = counts
    if (h, kv) == (g.n_heads, g.n_kv_heads):
        return StockCheck(True, "", (h, kv), nearest)
    why = _stock_accepts(adapter, config, h, kv, g.head_dim)
    return StockCheck(not why, why, (h, kv), nearest)


def export_stock(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                 kv_policy: str = "auto", rounds=None, overwrite: bool = False,
                 progress: Progress | None = None) -> ExportResult:
    """A uniform-per-layer pruned checkpoint that stock `from_pretrained` loads (no custom code)."""
    model = _resident(model)
    record = _default_record(model, pruned, record)
    smaller, layout = prune_heads(model, pruned, kv_policy=kv_policy, rounds=rounds)
    config = stock_config_for(model, layout)

    def write(tmp: Path):
        _save_model(smaller, tmp, config)
        _write_common(tmp, record, tokenizer, layout)
        return layout

    return _run_export("stock", target, overwrite, write, progress)


class _FirstOutput(nn.Module):
    """ONNX wrapper: (input_ids, attention_mask) -> the model's first output, no KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.use_cache = hasattr(model.config, "use_cache")

    def forward(self, input_ids, attention_mask):
        extra = {"use_cache": False} if self.use_cache else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)[0]


def _example_ids(model: nn.Module, batch: int = 2, seq: int = 8) -> torch.Tensor:
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(0)
    return torch.randint(min(4, vocab - 1), vocab, (batch, seq), generator=g)   # [batch, seq]


def write_onnx(model: nn.Module, path: Path, *, opset: int = 17) -> str:
    """Trace `model` to ONNX at `path` with dynamic batch and sequence axes; returns the output name."""
    ids = _example_ids(model).to(input_device(model))                             # [2, 8]
    mask = torch.ones_like(ids)                                                   # [2, 8]
    wrapper = _FirstOutput(model).eval()
    with torch.no_grad():
        outputs = model(input_ids=ids, attention_mask=mask, return_dict=True)
    name = next(iter(outputs.keys()))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            name: {0: "batch", 1: "sequence"}}
    with warnings.catch_warnings():
        # the tracer's notes on Python-level shape logic; the dynamic axes are checked by the tests
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
        try:
            torch.onnx.export(wrapper, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                              output_names=[name], dynamic_axes=axes, opset_version=opset, dynamo=False)
        except OSError:
            raise
        except Exception as first:  # the TorchScript tracer failed: try the dynamo exporter
            try:
                batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", min=2)
                torch.onnx.export(wrapper, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                                  output_names=[name], opset_version=max(opset, 18), dynamo=True,
                                  dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                  "attention_mask": {0: batch, 1: seq}})
            except Exception as second:
                raise ExportError(f"ONNX export of this model failed (TorchScript: {str(first).splitlines()[0]}; "
                                  f"dynamo: {str(second).splitlines()[0]}). Use the safetensors exports "
                                  f"instead.") from second
    return name


def export_onnx(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                kv_policy: str = "auto", rounds=None, overwrite: bool = False, opset: int = 17,
                progress: Progress | None = None) -> ExportResult:
    """model.onnx of the physically pruned model (+ head_layout.json, mask.json, config.json)."""
    model = _resident(model)
    record = _default_record(model, pruned, record)
    smaller, layout = prune_heads(model, pruned, kv_policy=kv_policy, rounds=rounds)

    def write(tmp: Path):
        write_onnx(smaller, tmp / ONNX_FILE, opset=opset)
        smaller.config.architectures = [type(smaller).__name__]
        smaller.config.save_pretrained(tmp)
        _write_common(tmp, record, tokenizer, layout)
        return layout

    return _run_export("onnx", target, overwrite, write, progress)


EXPORTERS: dict[str, Callable[..., ExportResult]] = {
    "zeroed": export_zeroed, "pruned": export_pruned, "stock": export_stock, "onnx": export_onnx,
}


def export(fmt: str, model: nn.Module, pruned, root, name: str, **kwargs) -> ExportResult:
    """Export in format `fmt` to the folder `name`, confined to the output folder `root`."""
    if fmt not in EXPORTERS:
        raise InputError(f"Unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    target = resolve_under(root, name)              # escapes first: their message says "outside"
    check_export_name(name)
    return EXPORTERS[fmt](model, pruned, target, **kwargs)


# ---------------------------------------------------------------------------------------------
# Loading the physically pruned format
# ---------------------------------------------------------------------------------------------

def _architecture_class(config):
    """The transformers model class config.architectures names, if it is one for this config type."""
    import transformers
    from transformers import PreTrainedModel
    names = getattr(config, "architectures", None)
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    for name in names:
        cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
        if (isinstance(cls, type) and issubclass(cls, PreTrainedModel)
                and getattr(cls.config_class, "model_type", None) == config.model_type):
            return cls
    raise ModelLoadError(f"config.json names no {config.model_type} model class this transformers version "
                         f"provides (architectures: {names[:3]}); it was edited or comes from another version. "
                         f"Export the pruned model again with this version.")


def _producer(weights: Path) -> str | None:
    """The "producer" metadata of a safetensors file (headscope's pruned format sets it), or None."""
    from safetensors import safe_open
    if not weights.is_file():
        return None
    with safe_open(str(weights), framework="pt") as handle:
        return (handle.metadata() or {}).get("producer")


def load_pruned(path, *, attn_implementation: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Rebuild a model exported by `export_pruned`: build it from config.json, apply
    head_layout.json's shapes, load model.safetensors. A stock export (a save_pretrained
    checkpoint whose config.json already holds the pruned counts) is loaded with its class's
    from_pretrained. Custom code in config.json (auto_map) runs only with trust_remote_code."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from analysis.arch.checkpoint import INDEX_FILE, weight_map
    folder = Path(path)
    layout_file = folder / LAYOUT_FILE
    if not layout_file.is_file():
        raise ModelLoadError(f"{folder} has no {LAYOUT_FILE}; it is not a headscope pruned export. Load zeroed "
                             f"or stock exports with transformers' from_pretrained.")
    try:
        layout = HeadLayout.from_json(layout_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"Cannot read {layout_file} ({type(err).__name__}); export the pruned model again.") from None
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        if pickled:
            raise ModelLoadError(f"{folder} holds {pickled[0]}, a pickle file, not {WEIGHTS_FILE}: headscope exports "
                                 f"are safetensors and pickles are not loaded (they can run code). Export the pruned "
                                 f"model again.")
        raise ModelLoadError(f"{folder} has no {WEIGHTS_FILE}; an ONNX export holds model.onnx only (run it with "
                             f"ONNX Runtime). Otherwise export the pruned model again.")
    mapping = weight_map(folder)                              # shards outside the folder are refused
    files = [folder / WEIGHTS_FILE] if mapping is None else [folder / f for f in sorted(set(mapping.values()))]
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=bool(trust_remote_code))
        adapter = adapter_for(config)
        g = adapter.geometry(config)
        cls = _architecture_class(config)
        if _producer(files[0]) != TOOL:                       # a stock (save_pretrained) checkpoint
            if (g.n_heads, g.n_kv_heads) != (layout.uniform_counts() or (layout.n_heads, layout.n_kv_heads)):
                raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) does "
                                     f"not match its {LAYOUT_FILE}; export it again.")
            with quiet_progress_bars(), quiet_load_report():
                return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                           trust_remote_code=bool(trust_remote_code), **kwargs).eval()
        if (g.n_heads, g.n_kv_heads) != (layout.n_heads, layout.n_kv_heads):
            raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) is not the "
                                 f"original model's config its {LAYOUT_FILE} expects; export it again.")
        state = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}   # shards (streamed)
    except HeadscopeError:
        raise
    except Exception as err:  # a tampered config or file: transformers' and safetensors' own errors
        if not trust_remote_code and "trust_remote_code" in str(err):
            raise custom_code_refused(f"config.json in {folder}") from None
        raise ModelLoadError(f"Cannot read the pruned checkpoint in {folder} ({first_line(err)}); export it "
                             f"again.") from None
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if isinstance(dtype, torch.dtype):
        kwargs["dtype"] = dtype
    model = cls._from_config(config, **kwargs)
    apply_layout(model, layout, adapter=adapter)
    _load_state(model, state, folder)
    return model.eval()


def _load_state(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    expected = model.state_dict()
    bad = [k for k, v in state.items() if k in expected and tuple(expected[k].shape) != tuple(v.shape)]
    if bad:
        raise ModelLoadError(f"The weights in {folder} do not fit its head_layout.json (e.g. {bad[0]}); "
                             f"export the pruned model again.")
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[k]) for k in state if k in params}
    # tied weights (e.g. lm_head = embeddings) are saved once: missing names that share a loaded tensor are fine
    missing = [k for k in result.missing_keys if not (k in params and id(params[k]) in loaded_ids)]
    if missing or result.unexpected_keys:
        what = missing[0] if missing else result.unexpected_keys[0]
        raise ModelLoadError(f"The weights in {folder} do not match the model its config builds ({what}); "
                             f"export the pruned model again.")
