"""Streaming profiler: MP / MP-G row norms straight from safetensors files, no model built.

`profile_checkpoint(folder)` reads config.json (for the architecture and the head geometry),
finds the attention tensors of every layer by the names the adapter gives
(`Adapter.tensor_suffixes`, matched by suffix because checkpoints differ in prefix), and reads
them layer by layer with `safetensors.safe_open`, so only one layer's attention weights are
in memory at a time (and half-precision tensors are upcast a few heads at a time). A 7B-70B
checkpoint on disk can be profiled on a laptop; the numbers equal `profile_model`'s.

Layouts: a single `model.safetensors`, or shards listed in `model.safetensors.index.json`.
A missing shard, a folder without safetensors weights, or a tensor the adapter expects but
the checkpoint lacks raise ModelLoadError saying what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from analysis.adapters import Adapter, adapter_for
from analysis.errors import ModelLoadError
from analysis.profiles import STREAM_CHUNK, NormProfile, head_norms, stack_layers
from analysis.progress import Progress, ShouldStop, check_stop, report

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_folder(path) -> Path:
    """The folder of a checkpoint given as a folder, its index file or a .safetensors file."""
    p = Path(path).expanduser()
    if p.is_file() and (p.name == INDEX_FILE or p.suffix == ".safetensors"):
        return p.parent
    if not p.is_dir():
        raise ModelLoadError(f"{p} is not a checkpoint folder. Pass the folder that holds config.json and "
                             f"the *.safetensors weights (or {INDEX_FILE} for a sharded checkpoint).")
    return p


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file that holds it. ModelLoadError on missing shards."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({err}); re-download or re-save "
                                 "the checkpoint.") from err
        files = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise ModelLoadError(
                f"The checkpoint in {folder} is missing {len(missing)} of its shards: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}. Download or copy every file listed in {INDEX_FILE}.")
        return files
    singles = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else sorted(folder.glob("*.safetensors"))
    if len(singles) != 1:
        found = "several .safetensors files but no index" if singles else "no .safetensors weights"
        raise ModelLoadError(
            f"{folder} has {found}. The streaming profiler reads {SINGLE_FILE} or shards listed in "
            f"{INDEX_FILE}; re-save the model with save_pretrained(..., safe_serialization=True).")
    try:
        with safe_open(str(singles[0]), framework="pt") as handle:
            return {name: singles[0] for name in handle.keys()}
    except (OSError, SafetensorError) as err:
        raise ModelLoadError(f"Could not read {singles[0]}: {err}. Re-download or re-save the weights.") from err


def load_config(folder: Path):
    """The checkpoint's config (no weights read); ModelLoadError when config.json is absent or bad."""
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; the streaming profiler needs it for the "
                             "architecture and head counts. Copy the model's config.json next to the weights.")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"Could not read {folder / 'config.json'}: {err}") from err


def layer_tensor_names(adapter: Adapter, layer: int, names: dict[str, Path], prefix: str | None) -> dict[str, str]:
    """Role key ("q.weight", "qkv.weight", ...) -> the checkpoint's tensor name, for weights only."""
    wanted = {role: suffix for role, suffix in adapter.tensor_suffixes(layer).items() if role.endswith(".weight")}
    out = {}
    for role, suffix in wanted.items():
        name = prefix + suffix if prefix is not None else suffix
        if name not in names:
            raise ModelLoadError(
                f"The checkpoint has no tensor '{name}' ({adapter.model_type} attention, layer {layer}). "
                "Is config.json from the same model as the weights? Every shard must be present.")
        out[role] = name
    return out


def name_prefix(adapter: Adapter, names: dict[str, Path]) -> str:
    """The prefix ("model.", "transformer.", "") that this checkpoint puts before the adapter's names."""
    suffix = next(s for role, s in adapter.tensor_suffixes(0).items() if role.endswith(".weight"))
    matches = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    if not matches:
        raise ModelLoadError(
            f"No tensor ending in '{suffix}' in the checkpoint: the weights do not look like a "
            f"{adapter.model_type} model. Check that config.json belongs to these weights.")
    return matches[0][: len(matches[0]) - len(suffix)]


def profile_checkpoint(path, *, progress: Progress | None = None,
                       should_stop: ShouldStop | None = None) -> NormProfile:
    """Row-norm profile of a safetensors checkpoint, one layer's attention tensors at a time."""
    folder = checkpoint_folder(path)
    config = load_config(folder)
    adapter = adapter_for(config)
    geometry = adapter.geometry(config)
    names = tensor_files(folder)
    prefix = name_prefix(adapter, names)
    l2_layers, l1_layers, scratch = [], [], {}
    for layer in range(geometry.n_layers):
        check_stop(should_stop, "Profiling")
        tensors = read_tensors(layer_tensor_names(adapter, layer, names, prefix), names)
        hw = adapter.heads_from_tensors(tensors, geometry)
        norms = head_norms(hw, (2, 1), STREAM_CHUNK, scratch)  # L1 from the same read: no second pass over the file
        l2_layers.append(norms[2])
        l1_layers.append(norms[1])
        del tensors, hw
        report(progress, (layer + 1) / geometry.n_layers, f"streamed layer {layer + 1}/{geometry.n_layers}")
    return NormProfile(l2=stack_layers(l2_layers), l1=stack_layers(l1_layers), source=str(folder))


def read_tensors(roles: dict[str, str], files: dict[str, Path]) -> dict:
    """Role -> tensor read from its file; each file is opened (memory-mapped) only while read."""
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for role, name in roles.items():
        by_file.setdefault(files[name], []).append((role, name))
    out = {}
    for file, items in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                for role, name in items:
                    out[role] = handle.get_tensor(name)
        except (OSError, SafetensorError) as err:
            raise ModelLoadError(f"Could not read {file}: {err}. Re-download or re-copy that file.") from err
    return out
