"""Exports of a pruned model, written atomically, plus the loader for the physically pruned format.

Formats (docs/EXPORT.md describes the files):
- "zeroed":  the original shapes with pruned heads zeroed (`analysis.masking.zero_heads` on a
  copy), safetensors + config.json: loads anywhere, no smaller, no faster.
- "pruned":  the physically smaller model (`analysis.surgery.prune_heads`) + head_layout.json;
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
place at the end; an existing non-empty target is only replaced with overwrite=True, and a
failure at any point removes the temporary folder (and any parent folders the export created).
Paths typed by a user are confined to an output root with `resolve_under`.
"""
from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from .adapters import adapter_for
from .errors import HeadscopeError, InputError, ModelLoadError
from .geometry import HeadGeometry
from .masking import zero_heads
from .models import quiet_progress_bars
from .surgery import HeadLayout, apply_layout, prune_heads

TOOL = "headscope"
TOOL_VERSION = "0.1.0"
MASK_FORMAT = 1
MASK_FILE = "mask.json"
LAYOUT_FILE = "head_layout.json"
ONNX_FILE = "model.onnx"
WEIGHTS_FILE = "model.safetensors"
FORMATS = ("zeroed", "pruned", "stock", "onnx")

Progress = Callable[[float, str], None]


class ExportError(HeadscopeError):
    """An export could not be written (the message says where and how to fix it)."""


def _no_progress(fraction: float, message: str) -> None:
    return None


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
    return err.strerror or type(err).__name__


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
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"The export folder {target} already exists and is not empty; choose another name "
                          f"or allow overwriting it.")


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, replacing an existing `target` only after the new one is complete."""
    if not target.exists():
        os.rename(tmp, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(backup)
    os.rename(target, backup)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


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

    ExportError if `target` exists and is not empty (unless overwrite), or cannot be written.
    On any failure the temporary folder (and parents this call created) are removed."""
    target = Path(target)
    _check_target(target, overwrite)
    try:
        created = _make_parents(target.parent)
    except OSError as err:
        raise ExportError(f"Cannot create the folder {target.parent} ({_os_reason(err)}); choose a writable "
                          f"output folder.") from err
    try:
        tmp = _fresh_dir(target.parent, f".{target.name}.tmp-")
    except OSError as err:
        _remove_empty(created)
        raise ExportError(f"Cannot write into {target.parent} ({_os_reason(err)}); choose a writable output "
                          f"folder.") from err
    try:
        yield tmp
        _check_target(target, overwrite)          # someone may have written it meanwhile
        _swap_into_place(tmp, target)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        if isinstance(err, OSError):
            raise ExportError(f"Writing the export to {target} failed ({_os_reason(err)}); nothing was left "
                              f"behind. Check free disk space and permissions, then export again.") from err
        if isinstance(err, Exception) and not isinstance(err, HeadscopeError):
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ExportError(f"The export to {target} failed halfway ({type(err).__name__}: {first}); nothing "
                              f"was left behind. Export again; if it fails again, try another format.") from err
        raise


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
        try:
            record = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
            record.kept = [[int(h) for h in row] for row in record.kept]
            record.n_layers, record.n_heads, record.n_kv_heads = (int(record.n_layers), int(record.n_heads),
                                                                  int(record.n_kv_heads))
        except (TypeError, ValueError) as err:
            raise InputError(f"mask.json is incomplete or malformed ({err}); export the mask again.") from err
        if int(record.format) > MASK_FORMAT:
            raise InputError(f"mask.json has format {record.format}; this headscope reads up to {MASK_FORMAT}. "
                             f"Update headscope.")
        if len(record.kept) != record.n_layers or any(
                not 0 <= h < record.n_heads for row in record.kept for h in row):
            raise InputError(f"mask.json lists kept heads that do not fit {record.n_layers} layers x "
                             f"{record.n_heads} heads; export the mask again.")
        return record


def mask_record(pruned, *, geometry: HeadGeometry, model: str = "", model_type: str = "", scores=None,
                scorer: str | None = None, z: float | None = None, sparsity: float | None = None,
                policy: str | None = None, tiebreak=None, scorer_params: dict | None = None) -> MaskRecord:
    """A MaskRecord for `pruned` [L, H]. `scores` may be a [L, H] array or an analysis.scoring
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
                      sparsity=None if sparsity is None else float(sparsity), policy=policy,
                      scores=_finite_table(scores, shape, "Head scores"),
                      tiebreak=_finite_table(tiebreak, shape, "Tie-break values"))


def read_mask_json(source) -> MaskRecord:
    """A MaskRecord from a dict, JSON text, a mask.json path or an export folder holding one."""
    if isinstance(source, dict):
        return MaskRecord.from_dict(source)
    text = str(source)
    if not text.lstrip().startswith("{"):
        path = Path(text)
        path = path / MASK_FILE if path.is_dir() else path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise InputError(f"Cannot read the mask file {path} ({_os_reason(err)}).") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(f"The mask file is not valid JSON ({err}); export the mask again.") from err
    if not isinstance(data, dict):
        raise InputError("The mask file must hold a JSON object; export the mask again.")
    return MaskRecord.from_dict(data)


def mask_from_json(source) -> np.ndarray:
    """The boolean mask [L, H] (True = pruned) stored in a mask.json (see read_mask_json)."""
    return read_mask_json(source).pruned()


def _default_record(model, pruned, record: MaskRecord | None) -> MaskRecord:
    if record is not None:
        if record.pruned().shape != np.asarray(pruned).shape or not np.array_equal(record.pruned(),
                                                                                    np.asarray(pruned, bool)):
            raise InputError("The mask record does not describe the mask being exported; build it from the "
                             "same mask (analysis.export.mask_record).")
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

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_common(tmp: Path, record: MaskRecord, tokenizer, layout: HeadLayout | None) -> None:
    (tmp / MASK_FILE).write_text(record.to_json(), encoding="utf-8")
    if layout is not None:
        (tmp / LAYOUT_FILE).write_text(layout.to_json(), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


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
    report = progress or _no_progress
    target = Path(target)
    report(0.0, f"{fmt} export: writing to a temporary folder")
    with atomic_folder(target, overwrite=overwrite) as tmp:
        layout = write(tmp)
        report(0.9, f"{fmt} export: moving into place")
    report(1.0, f"{fmt} export written to {target}")
    return ExportResult(format=fmt, path=target, files=_listing(target), layout=layout)


def export_zeroed(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                  overwrite: bool = False, progress: Progress | None = None) -> ExportResult:
    """Original shapes, pruned heads zeroed (safetensors + config.json + mask.json)."""
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
            f"heads {per_layer} per layer. Use the 'uniform' mask policy (and kv_policy='expand' if some "
            f"layers keep uneven GQA groups), or export the head-layout checkpoint instead.")
    return adapter_for(model).stock_config(model.config, counts[0], counts[1], layout.head_dim)


def export_stock(model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
                 kv_policy: str = "auto", rounds=None, overwrite: bool = False,
                 progress: Progress | None = None) -> ExportResult:
    """A uniform-per-layer pruned checkpoint that stock `from_pretrained` loads (no custom code)."""
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
    ids = _example_ids(model)                                                     # [2, 8]
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
    return EXPORTERS[fmt](model, pruned, resolve_under(root, name), **kwargs)


# ---------------------------------------------------------------------------------------------
# Loading the physically pruned format
# ---------------------------------------------------------------------------------------------

def _architecture_class(config):
    import transformers
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    raise ModelLoadError(f"config.json names no architecture this transformers version provides ({names}); "
                         f"export the pruned model again with this version.")


def _producer(weights: Path) -> str | None:
    """The "producer" metadata of a safetensors file (headscope's pruned format sets it), or None."""
    from safetensors import safe_open
    if not weights.is_file():
        return None
    with safe_open(str(weights), framework="pt") as handle:
        return (handle.metadata() or {}).get("producer")


def load_pruned(path, *, attn_implementation: str | None = None) -> nn.Module:
    """Rebuild a model exported by `export_pruned`: build it from config.json, apply
    head_layout.json's shapes, load model.safetensors. A stock export (a save_pretrained
    checkpoint whose config.json already holds the pruned counts) is loaded with its class's
    from_pretrained."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    folder = Path(path)
    layout_file = folder / LAYOUT_FILE
    if not layout_file.is_file():
        raise ModelLoadError(f"{folder} has no {LAYOUT_FILE}; it is not a headscope pruned export. Load zeroed "
                             f"or stock exports with transformers' from_pretrained.")
    layout = HeadLayout.from_json(layout_file.read_text(encoding="utf-8"))
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / "model.safetensors.index.json").is_file():
        raise ModelLoadError(f"{folder} has no {WEIGHTS_FILE}; an ONNX export holds model.onnx only (run it with "
                             f"ONNX Runtime). Otherwise export the pruned model again.")
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        adapter = adapter_for(config)
        g = adapter.geometry(config)
        cls = _architecture_class(config)
        if _producer(folder / WEIGHTS_FILE) != TOOL:           # a stock (save_pretrained) checkpoint
            if (g.n_heads, g.n_kv_heads) != (layout.uniform_counts() or (layout.n_heads, layout.n_kv_heads)):
                raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) does "
                                     f"not match its {LAYOUT_FILE}; export it again.")
            with quiet_progress_bars():
                return cls.from_pretrained(folder, local_files_only=True, **kwargs).eval()
        if (g.n_heads, g.n_kv_heads) != (layout.n_heads, layout.n_kv_heads):
            raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) is not the "
                                 f"original model's config its {LAYOUT_FILE} expects; export it again.")
        state = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"Cannot read the pruned checkpoint in {folder} ({str(err).splitlines()[0]}); "
                             f"export it again.") from err
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
