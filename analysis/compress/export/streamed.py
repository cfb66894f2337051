"""Streamed export: a safetensors checkpoint cut to a head layout without building the model.

`export_checkpoint(fmt, folder, pruned, target)` writes the same "pruned" or "stock" export
folder that `analysis.compress.export` writes from a model in memory (`prune_heads` + export),
reading the checkpoint one tensor at a time:

- the attention tensors (Q/K/V/O weights and biases, named by the adapter) of each layer whose
  head counts change are cut to the layout surgery builds (`HeadLayout.from_mask`, i.e.
  `analysis.score.masks.plan_layout`: expanded K/V for uneven groups, emptied layers) by the same
  functions surgery runs -- the family layout's split, `surgery.select_heads`, the layout's merge --
  run once per layer on a small probe of row positions (`_cut_gathers`), which gives each tensor's
  cut as one `index_select` of its rows or columns; each tensor is then read, gathered and written
  alone. The values are bit for bit the in-memory export's, in the checkpoint's dtype;
- every other tensor is copied byte for byte (`os.copy_file_range`, no trip through Python);
- the names are the ones the in-memory export writes: a skeleton of the model on the meta
  device (no memory) gives its state-dict names, shapes and tied tensors, and transformers' own
  renaming rules map the checkpoint's names onto them ("pruned": state-dict names, a tied tensor
  stored once under the name safetensors' `save_model` keeps; "stock": the checkpoint's
  save_pretrained names). Tensors the model does not use are left out, as from_pretrained does.

Output: one shard per input shard (`model.safetensors`, or `model-0000i-of-0000n.safetensors` +
`model.safetensors.index.json`), written by `SafetensorsWriter` (header first, then each tensor's
bytes: it holds one tensor at a time), config.json (the original for "pruned", the pruned counts
for "stock"), head_layout.json, mask.json, and the checkpoint's tokenizer / generation files.
The folder is atomic like every export (`analysis.compress.export.atomic_folder`).

Checks before a byte is written: every shard present and complete (headers parsed and sized,
`analysis.arch.checkpoint.read_header`), the index inside the folder, every tensor's shape equal
to what config.json builds, attention tensors in a float dtype the cut can keep.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from analysis.arch import resize
from analysis.arch.adapters import Adapter, adapter_for
from analysis.arch.checkpoint import (DTYPE_BYTES, FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES,
                                      TensorEntry, check_finite_tensor, check_tensor_header, check_tensor_memory,
                                      checkpoint_entries, checkpoint_folder, load_config, read_tensor)
from analysis.arch.geometry import HeadGeometry
from analysis.arch.models import quiet_load_report
from analysis.compress.export.folder import ExportError, atomic_folder, clean_leftovers, listing
from analysis.compress.export.kvfile import plan_for_export
from analysis.compress.export.formats import FORMATS, ExportResult, StreamSpec, write_common
from analysis.compress.export.pruned import architecture_class
from analysis.compress.export.records import TOOL, MaskRecord, mask_record
from analysis.compress.export.selfcheck import read_self_checks
from analysis.compress.export.stock import stock_config_for
from analysis.compress.surgery import HeadLayout, select_heads
from analysis.core.errors import InputError, ModelLoadError, UnsupportedModelError, first_line
from analysis.core.progress import Progress, ShouldStop, check_stop, report

COPY_CHUNK = 64 * 2**20                      # bytes per copy_file_range call (a stop check between)

# safetensors dtype -> torch dtype, for the tensors the cut reads (attention: float only; a
# quantized checkpoint's scales would have to follow the heads too)
SLICE_DTYPES = FLOAT_DTYPES
_TORCH_NAMES = {v: k for k, v in SLICE_DTYPES.items()}

# files of the checkpoint folder copied into the export as they are (tokenizer and generation settings)
PASS_THROUGH = TOKENIZER_FILES
HF_PASS_THROUGH = ("generation_config.json",)     # with config.json only (a Hugging Face folder)


# ---------------------------------------------------------------------------------------------
# The writer: one safetensors file, one tensor at a time
# ---------------------------------------------------------------------------------------------

class SafetensorsWriter:
    """Writes one .safetensors file tensor by tensor: the header (every name, dtype, shape) is
    written first, then each tensor's bytes in header order, so only the tensor being written is
    in memory. `specs`: [(name, safetensors dtype, shape)] in the order they will be given."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]):
        header, offset = {}, 0
        self._sizes = []
        for name, dtype, shape in specs:
            numel = 1
            for s in shape:
                numel *= int(s)
            size = numel * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + size]}
            self._sizes.append((name, dtype, tuple(int(s) for s in shape), size))
            offset += size
        header["__metadata__"] = dict(metadata)
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)                    # safetensors aligns the data to 8 bytes
        self.path = path
        self.total_bytes = offset
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)

    def _expect(self, name: str) -> tuple[str, str, tuple[int, ...], int]:
        if self._next >= len(self._sizes) or self._sizes[self._next][0] != name:
            expected = self._sizes[self._next][0] if self._next < len(self._sizes) else None
            raise ValueError(f"SafetensorsWriter: got {name!r}, expected {expected or 'nothing more'!r}")
        self._next += 1
        return self._sizes[self._next - 1]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's values (its dtype and shape must be the header's)."""
        _, dtype, shape, size = self._expect(name)
        if _TORCH_NAMES.get(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"SafetensorsWriter: {name} is {tensor.dtype} {list(tensor.shape)}, the header says "
                             f"{dtype} {list(shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)   # [size] bytes
        if data.numel():
            self._file.write(memoryview(data.numpy()))

    def copy(self, name: str, entry: TensorEntry, should_stop: ShouldStop | None = None) -> None:
        """The next tensor's bytes, copied from `entry`'s file by the kernel (in COPY_CHUNK pieces)."""
        _, dtype, shape, size = self._expect(name)
        if (entry.dtype, entry.shape, entry.nbytes) != (dtype, shape, size):
            raise ValueError(f"SafetensorsWriter: {name} source {entry.dtype} {list(entry.shape)} differs from the header")
        self._file.flush()
        out = self._file.fileno()
        with open(entry.file, "rb") as source:
            position, left = entry.start, size
            while left:
                check_stop(should_stop, "The export")
                n = _copy_range(source.fileno(), out, min(left, COPY_CHUNK), position)
                position += n
                left -= n
        self._file.seek(0, os.SEEK_END)

    def close(self) -> None:
        """Finish the file; ValueError if a tensor of the header was never written."""
        try:
            if self._next != len(self._sizes):
                raise ValueError(f"SafetensorsWriter: {len(self._sizes) - self._next} tensors of {self.path.name} "
                                 f"were never written")
            self._file.flush()
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close the file after a failure (it is incomplete; the atomic folder around it is removed)."""
        self._file.close()


def _copy_range(src: int, dst: int, count: int, offset: int) -> int:
    """Copy up to `count` bytes from `src` at `offset` to `dst`'s position; returns the bytes copied."""
    try:
        n = os.copy_file_range(src, dst, count, offset)
    except OSError as err:
        if err.errno not in (18, 22, 38, 95):          # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: copy by hand
            raise
        n = os.write(dst, os.pread(src, count, offset))
    if n <= 0:
        raise OSError(5, f"the source file ended early (copying {count} bytes at offset {offset})")
    return n


# ---------------------------------------------------------------------------------------------
# Names: the checkpoint's tensors onto the model's (a skeleton on the meta device)
# ---------------------------------------------------------------------------------------------

@dataclass
class _Names:
    """How the checkpoint's tensors map onto the model the config builds."""
    source: dict[str, str]            # model state-dict name -> checkpoint name holding its values
    model_of: dict[str, str]          # checkpoint name -> model name (only tensors the model uses)
    shapes: dict[str, tuple]          # model name -> dense shape config.json builds
    ties: list[list[str]]             # groups of model names that are one tensor (sorted)
    dropped: list[str]                # checkpoint tensors the model does not use


def _skeleton(config):
    """The model config.json describes, built on the meta device (no weights, no memory)."""
    cls = architecture_class(config)
    with torch.device("meta"), warnings.catch_warnings(), quiet_load_report():
        warnings.simplefilter("ignore")
        return cls._from_config(config)


def _renamer(model):
    """checkpoint name -> model name by transformers' own loading rules (renamings; a converter,
    which merges or splits tensors on load, cannot be streamed)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:                                   # another transformers: names as they are
        return lambda name: name
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()

    def rename(name: str) -> str:
        new, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, meta_state)
        if converter is not None:
            raise UnsupportedModelError(
                f"transformers converts the checkpoint tensor '{name}' when it loads it (merges or splits it), so "
                f"the streamed export cannot copy it as it is. Export from the loaded model (--model) instead.")
        return new
    return rename


def _names(config, entries: dict[str, TensorEntry], folder: Path) -> _Names:
    model = _skeleton(config)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    rename = _renamer(model)
    model_of, dropped = {}, []
    for name in entries:
        target = rename(name)
        (model_of.__setitem__(name, target) if target in state else dropped.append(name))
    holder = {}
    for ckpt, target in model_of.items():
        holder.setdefault(target, ckpt)
    source = {}
    for members in groups.values():
        held = [holder[m] for m in sorted(members) if m in holder]
        if not held:
            raise ModelLoadError(f"The checkpoint in {folder} has no tensor for '{members[0]}', which config.json's "
                                 f"model needs. Is config.json from the same model, and is every shard there?")
        source.update({m: held[0] for m in members})
    return _Names(source=source, model_of=model_of, shapes={n: tuple(t.shape) for n, t in state.items()},
                  ties=[sorted(m) for m in groups.values() if len(m) > 1], dropped=dropped)


# ---------------------------------------------------------------------------------------------
# Attention tensors of each layer and their cut shapes
# ---------------------------------------------------------------------------------------------

def _layer_roles(adapter: Adapter, layer: int, entries: dict[str, TensorEntry], prefix: str) -> dict[str, str]:
    """Role ("q.weight", "qkv.bias", ...) -> checkpoint name of `layer`'s attention tensors (weights
    required, biases where the checkpoint has them)."""
    out = {}
    for role, suffix in adapter.tensor_suffixes(layer).items():
        name = prefix + suffix
        if name in entries:
            out[role] = name
        elif role.endswith(".weight"):
            raise ModelLoadError(f"The checkpoint has no tensor '{name}' ({adapter.model_type} attention, layer "
                                 f"{layer}). Is config.json from the same model as the weights? Every shard must "
                                 f"be present.")
    return out


def _cut(adapter: Adapter, geometry: HeadGeometry, tensors: dict[str, torch.Tensor], heads: list[int],
         kv_heads: list[int]) -> dict[str, torch.Tensor]:
    """Role -> the layer's tensor cut to `heads` / `kv_heads`: surgery's own split, select, merge."""
    hw = adapter.heads_from_tensors(tensors, geometry)          # head-major views
    merged = adapter.family.layout.merge(select_heads(hw, heads, kv_heads))
    return {role: t.contiguous() for role, t in merged.items()}


def _cut_gathers(adapter: Adapter, geometry: HeadGeometry, roles: list[str], heads: list[int],
                 kv_heads: list[int]) -> dict[str, tuple[int, torch.Tensor] | None]:
    """The cut as one gather per tensor: role -> (axis, positions along it, in output order), or None
    for a tensor the cut leaves as it is (O's bias, shared by every head).

    Surgery's own split / select / merge (`_cut`) run on a probe: each role tensor with its hidden
    side of size 1 and, along its head side, the positions of its rows (or columns), offset per role;
    what comes out names, for every output tensor, which positions of its own input it holds (K/V
    repeated where they are expanded). `tensor.index_select(axis, positions)` then makes exactly
    `_cut`'s values, but moves each row or column block once (no transposes of the head-major view)."""
    from dataclasses import replace
    from analysis.arch.adapters import HeadWeights
    probe_g = replace(geometry, hidden=1)
    H, Hkv, d = geometry.n_heads, geometry.n_kv_heads, geometry.head_dim
    has = {p: any(r in roles for r in (f"{p}.bias", "qkv.bias")) for p in "qkv"}
    meta = HeadWeights(q=torch.empty(H, d, 1), k=torch.empty(Hkv, d, 1), v=torch.empty(Hkv, d, 1),
                       o=torch.empty(H, d, 1), q_bias=torch.empty(H, d) if has["q"] else None,
                       k_bias=torch.empty(Hkv, d) if has["k"] else None, v_bias=torch.empty(Hkv, d) if has["v"] else None)
    shapes = {role: tuple(t.shape) for role, t in adapter.family.layout.merge(meta).items()}   # hidden side = 1
    probes, ranges, axes, base = {}, {}, {}, 0
    for role in roles:
        if role == "o.bias":
            continue
        shape = shapes[role]
        n = max(shape)
        axes[role] = 0 if len(shape) == 1 else shape.index(n)
        probes[role] = torch.arange(base, base + n, dtype=torch.long).reshape(shape)       # positions, offset
        ranges[role] = (base, base + n)
        base += n
    if "o.bias" in roles:
        probes["o.bias"] = torch.zeros(1, dtype=torch.long)
    out = {}
    for role, positions in _cut(adapter, probe_g, probes, heads, kv_heads).items():
        if role == "o.bias":
            out[role] = None
            continue
        flat = positions.reshape(-1)
        lo, hi = ranges[role]
        if flat.numel() and not bool(((flat >= lo) & (flat < hi)).all()):
            raise UnsupportedModelError(f"{adapter.model_type}: the cut of {role} mixes tensors; the streamed "
                                        f"export cannot write it. Export from the loaded model (--model).")
        out[role] = (axes[role], flat - lo)
    return out


def _prefix(adapter: Adapter, entries: dict[str, TensorEntry]) -> str:
    from analysis.arch.checkpoint import name_prefix
    return name_prefix(adapter, entries)


@dataclass(frozen=True)
class _Item:
    """One output tensor: its name, header, and where its values come from."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    entry: TensorEntry                # the checkpoint tensor it comes from
    layer: int | None = None          # cut from this layer's attention (None: bytes copied)
    role: str | None = None


def streamed_formats() -> list[str]:
    """The registered export formats that can be written from a checkpoint (their `streamed` spec)."""
    return [name for name, form in FORMATS.items() if form.streamed is not None]


def _plan(spec: StreamSpec, adapter, geometry, layout: HeadLayout, entries, names: _Names, folder: Path):
    """(output shards [(file name, [_Item]) in input order], {layer: {role: checkpoint name}}, alias metadata)."""
    prefix = _prefix(adapter, entries)
    roles = {layer: _layer_roles(adapter, layer, entries, prefix) for layer in range(geometry.n_layers)}
    cut_role = {}                                       # checkpoint name -> (layer, role) of a layer that changes
    for layer, by_role in roles.items():
        if layout.layer_counts(layer) != (geometry.n_heads, geometry.n_kv_heads):
            cut_role.update({name: (layer, role) for role, name in by_role.items()})
    for by_role in roles.values():                      # header checks before a byte is read or written
        for role, name in by_role.items():
            entry = entries[name]
            if role.endswith(".weight"):
                check_tensor_header(role, name, list(entry.shape), geometry, entry.file, available_bytes=2**62)
            if name in cut_role and entry.dtype not in SLICE_DTYPES:
                raise ExportError(f"Tensor '{name}' in {entry.file.name} is {entry.dtype}; the streamed export cuts "
                                  f"attention heads of {', '.join(SLICE_DTYPES)} checkpoints only (a quantized "
                                  f"checkpoint's scales would have to be cut too). Use a bfloat16, float16 or float32 "
                                  f"checkpoint.")
    for ckpt, model_name in names.model_of.items():
        entry, want = entries[ckpt], names.shapes[model_name]
        if entry.shape != want:
            raise ModelLoadError(f"Tensor '{ckpt}' in {entry.file.name} has shape {list(entry.shape)}, but config.json "
                                 f"builds {list(want)} for it. Use the config.json that belongs to these weights.")
    cut_shapes = {}                                     # (layer, role) -> shape after the cut (meta tensors)
    for layer in {layer for layer, _ in cut_role.values()}:
        meta = {role: torch.empty(entries[name].shape, dtype=SLICE_DTYPES[entries[name].dtype], device="meta")
                for role, name in roles[layer].items()}
        try:
            cut = _cut(adapter, geometry, meta, layout.heads[layer], layout.kv_heads[layer])
        except (RuntimeError, ValueError) as err:
            raise ModelLoadError(f"The attention tensors of layer {layer} in {folder} do not have the layout "
                                 f"config.json describes ({first_line(err)}). Use the config.json that belongs to "
                                 f"these weights.") from None
        cut_shapes.update({(layer, role): tuple(t.shape) for role, t in cut.items()})

    # output names: "state_dict" = the model's names, a tied tensor once (save_model keeps the first
    # name in sorted order and records the others in the metadata); "checkpoint" = the checkpoint's names
    alias = {}
    if spec.names == "state_dict":
        out_names = {}
        for members in [sorted(m) for m in _groups(names)]:
            out_names.setdefault(names.source[members[0]], []).append(members[0])
            alias.update({m: members[0] for m in members[1:]})
    else:
        out_names = {ckpt: [ckpt] for ckpt in names.model_of}
    by_file: dict[Path, list[_Item]] = {}
    for ckpt, entry in entries.items():                 # input order: shard by shard, offset order
        for out in out_names.get(ckpt, ()):
            layer, role = cut_role.get(ckpt, (None, None))
            shape = cut_shapes[(layer, role)] if layer is not None else entry.shape
            by_file.setdefault(entry.file, []).append(_Item(out, entry.dtype, shape, entry, layer, role))
    files = sorted(by_file)
    n = len(files)
    shards = [(SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors", by_file[f])
              for i, f in enumerate(files)]
    _check_memory(spec, [item for _, items in shards for item in items], _attention_names(roles))
    return shards, roles, alias


def _attention_names(roles: dict[int, dict[str, str]]) -> set[str]:
    """The checkpoint names of every layer's attention tensors (read and checked finite, cut or not)."""
    return {name for by_role in roles.values() for name in by_role.values()}


def _check_memory(spec: StreamSpec, items: list, attention: set[str]) -> None:
    """The free-memory check `score --checkpoint` makes, for the one tensor at a time the export holds:
    the GGUF writer reads every tensor and makes float32 copies of it (about 3 x 4 bytes per value on top
    of the read); the safetensors writer reads the attention tensors (and a cut's output), the rest it
    copies by byte range. The largest need must fit, before the temporary folder is made."""
    def numel(shape) -> int:
        n = 1
        for size in shape:
            n *= int(size)
        return n

    def need(item) -> int:
        if spec.writer == "gguf":
            return item.entry.nbytes + 3 * 4 * numel(item.shape)
        if item.entry.name in attention and item.entry.dtype in FLOAT_DTYPES:
            return item.entry.nbytes + numel(item.shape) * DTYPE_BYTES[item.dtype]
        return 0
    largest = max(items, key=need, default=None)
    if largest is not None and need(largest):
        check_tensor_memory(largest.entry.name, largest.entry.file, need(largest), "export")


def _groups(names: _Names) -> list[list[str]]:
    """Every model tensor as a group of its names (one name unless tied)."""
    tied = {m for group in names.ties for m in group}
    return names.ties + [[m] for m in names.source if m not in tied]


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------

def _write_shards(tmp: Path, fmt: str, spec: StreamSpec, shards, roles, alias, adapter, geometry,
                  layout: HeadLayout, progress: Progress | None, should_stop: ShouldStop | None) -> None:
    total = sum(item.entry.nbytes for _, items in shards for item in items) or 1
    done = 0
    metadata = {"format": "pt", **({"producer": TOOL} if spec.producer else {})}
    gathers: dict[int, dict] = {}                       # layer -> role -> (axis, positions) of the cut
    attention = _attention_names(roles)
    weight_map = {}
    for file_name, items in shards:
        extra = {k: v for k, v in alias.items() if any(i.name == v for i in items)}
        writer = SafetensorsWriter(tmp / file_name, [(i.name, i.dtype, i.shape) for i in items], {**metadata, **extra})
        try:
            for item in items:
                check_stop(should_stop, "The export")
                if item.layer is None and item.entry.name in attention and item.entry.dtype in FLOAT_DTYPES:
                    # an attention tensor kept whole: read and checked finite, like the cut ones
                    tensor = read_tensor(item.entry)
                    check_finite_tensor(tensor, item.entry.name, item.entry.file.name)
                    writer.write(item.name, tensor)
                    del tensor
                    what = f"copied {item.name}"
                elif item.layer is None:
                    writer.copy(item.name, item.entry, should_stop)
                    what = f"copied {item.name}"
                else:
                    if item.layer not in gathers:
                        gathers[item.layer] = _cut_gathers(adapter, geometry, list(roles[item.layer]),
                                                           layout.heads[item.layer], layout.kv_heads[item.layer])
                    gather = gathers[item.layer][item.role]
                    tensor = read_tensor(item.entry)                           # this one tensor only
                    check_finite_tensor(tensor, item.entry.name, item.entry.file.name)
                    writer.write(item.name, tensor if gather is None else tensor.index_select(*gather))
                    del tensor
                    what = f"layer {item.layer + 1}/{geometry.n_layers}: cut {item.name}"
                done += item.entry.nbytes
                weight_map[item.name] = file_name
                report(progress, min(0.89, 0.89 * done / total), f"{fmt} export: {what}")
        except BaseException:
            writer.abort()
            raise
        writer.close()
    if len(shards) > 1:
        total_size = sum((tmp / f).stat().st_size for f, _ in shards)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _write_gguf(tmp: Path, config, folder: Path, shards, names: _Names, roles, adapter, geometry,
                layout: HeadLayout, progress: Progress | None, should_stop: ShouldStop | None,
                gguf_type: str, gguf_embedding_type: str) -> list[str]:
    """model.gguf through analysis.compress.export.gguf.writer: its plan from the cut's names and shapes, then
    every tensor read (and cut) from the checkpoint when the writer asks for it, one at a time. A lossy
    type is self-checked against an F32 GGUF of the same cut in llama.cpp (written as a temporary, read
    from the checkpoint a second time for q8_0 / f16) when that fits SELF_CHECK_MAX_F32; returns the
    notes (a check not run says why)."""
    from analysis.compress.export.gguf import writer as gguf_writer
    from analysis.compress.export.gguf.format import tokenizer_source
    items = {item.name: item for _, shard in shards for item in shard}
    shapes = {name: item.shape for name, item in items.items()}
    for alias_name, group in ((m, g) for g in names.ties for m in g):
        if alias_name not in shapes and group[0] in shapes:
            shapes[alias_name] = shapes[group[0]]          # a tie: the writer decides whether it stores both
    weight_type = gguf_writer.check_weight_type(gguf_type)
    embedding_type = gguf_writer.check_embedding_type(gguf_embedding_type, weight_type)
    holder = SimpleNamespace(config=config)
    plan = gguf_writer.plan_gguf(config, layout, weight_type, shapes=shapes, name=str(folder.name),
                                 tokenizer_gguf=tokenizer_source(holder))
    gathers: dict[int, dict] = {}
    attention = _attention_names(roles)

    def fetch(hf_name: str) -> torch.Tensor:
        check_stop(should_stop, "The export")
        item = items.get(hf_name) or items[next(g[0] for g in names.ties if hf_name in g)]
        tensor = read_tensor(item.entry)
        if item.entry.name in attention:
            check_finite_tensor(tensor, item.entry.name, item.entry.file.name)
        if item.layer is not None:
            if item.layer not in gathers:
                gathers[item.layer] = _cut_gathers(adapter, geometry, list(roles[item.layer]),
                                                   layout.heads[item.layer], layout.kv_heads[item.layer])
            gather = gathers[item.layer][item.role]
            tensor = tensor if gather is None else tensor.index_select(*gather)
        return tensor

    path = tmp / gguf_writer.GGUF_FILE
    needs_quantizer = gguf_writer.WEIGHT_TYPES[weight_type][0] is None
    reference = _self_check_reference(plan, weight_type)   # the F32 file the self-check compares with
    first = path.with_name(path.name + ".f32.tmp") if needs_quantizer else path
    gguf_writer.write_tensors(first, plan, fetch, lambda f, m: report(progress, 0.8 * f, f"gguf export: {m}"))
    if needs_quantizer:
        gguf_writer.llama_quantize(first, path, weight_type, embedding_type=embedding_type)
    if reference is not None and not needs_quantizer:       # q8_0 / f16 written directly: F32 written too
        f32_plan = gguf_writer.plan_gguf(config, layout, "f32", shapes=shapes, name=str(folder.name),
                                         tokenizer_gguf=tokenizer_source(holder))
        first = path.with_name(path.name + ".f32.tmp")
        gguf_writer.write_tensors(first, f32_plan, fetch, lambda f, m: report(progress, 0.8 + 0.09 * f,
                                                                             f"self-check reference: {m}"))
    notes = []
    if reference is not None:
        report(progress, 0.89, f"gguf export: self-check of {weight_type} against F32 in llama.cpp")
        from analysis.compress.export.gguf.format import llamacpp_logits, self_check_gguf
        from analysis.compress.export.selfcheck import held_back_windows, write_self_checks
        text = held_back_windows(_folder_tokenizer(folder), SimpleNamespace(config=config))
        n_ctx = max(len(w) for w in text.windows)
        check = self_check_gguf(path, weight_type, text, llamacpp_logits(first, n_ctx), "the F32 GGUF in llama.cpp")
        write_self_checks(tmp, [check])
    elif gguf_writer.WEIGHT_TYPES[weight_type][2] < 32:
        notes.append(f"not self-checked: the F32 reference of this checkpoint would take "
                     f"{_f32_bytes(plan) / 2**30:.1f} GiB (more than {SELF_CHECK_MAX_F32 / 2**30:.0f} GiB); measure "
                     f"the file with `python -m analysis deploy-report` before you ship it.")
    if first != path and first.exists():
        first.unlink()
    return notes


SELF_CHECK_MAX_F32 = 4 * 2**30       # the largest F32 reference a streamed GGUF export writes for its self-check


def _f32_bytes(plan) -> int:
    return 4 * sum(int(np.prod(spec.shape)) for spec in plan.tensors)


def _self_check_reference(plan, weight_type: str):
    """True when a lossy streamed GGUF export is self-checked (its F32 reference fits SELF_CHECK_MAX_F32),
    else None (said in a note)."""
    from analysis.compress.export.gguf import writer as gguf_writer
    lossy = gguf_writer.WEIGHT_TYPES[weight_type][2] < 32
    return True if lossy and _f32_bytes(plan) <= SELF_CHECK_MAX_F32 else None


def _folder_tokenizer(folder: Path):
    """The checkpoint folder's own tokenizer (offline), or None: the self-check then uses random ids."""
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception:                       # no tokenizer files, or ones transformers cannot read
        return None


def export_checkpoint(fmt: str, source, pruned, target, *, record: MaskRecord | None = None,
                      kv_policy: str = "auto", overwrite: bool = False, trust_remote_code: bool = False,
                      progress: Progress | None = None, should_stop: ShouldStop | None = None, kv_plan=None,
                      **options) -> ExportResult:
    """Export the safetensors checkpoint `source` (a folder) cut by pruned [L, H] in format `fmt`
    ("pruned" or "stock") to the folder `target`, streaming: tensors are read, cut and written one
    at a time, never the whole model. Same files, names and tensors as `export(fmt, model, ...)` of
    the loaded model. ModelLoadError / ExportError / InputError, each one line, before anything is
    written where the checkpoint is broken; a failure or stop mid-way leaves nothing behind. kv_plan: a KVPlan
    written as kv_plan.json (as `export_to` does; pruned may then be None: the plan's own cut)."""
    spec = FORMATS[fmt].streamed if fmt in FORMATS else None
    if spec is None:
        raise InputError(f"The streamed export writes the {' and '.join(streamed_formats())} formats, not {fmt!r}; "
                         f"load the model (--model) for the others.")
    folder = checkpoint_folder(source)
    config = load_config(folder, trust_remote_code=trust_remote_code)
    adapter = adapter_for(config)
    resize.surgery_spec(adapter)                       # UnsupportedModelError before any reading
    geometry = adapter.geometry(config)
    plan_notes = []
    if kv_plan is not None:
        kv_plan, pruned, plan_notes = plan_for_export(kv_plan, pruned, geometry)
        plan_notes.append(f"{fmt}: {FORMATS[fmt].kv_windows}.")
    layout = HeadLayout.from_mask(pruned, geometry, adapter.model_type, kv_policy)
    from analysis.compress.export.formats import format_options
    opts = format_options(fmt, options)                # the format's own options (gguf_type), checked first
    out_config = _output_config(spec, config, layout) if spec.config else None
    report(progress, 0.0, f"{fmt} export: reading the checkpoint's headers")
    entries = checkpoint_entries(folder)
    names = _names(config, entries, folder)
    shards, roles, alias = _plan(spec, adapter, geometry, layout, entries, names, folder)
    if record is None:
        record = mask_record(pruned, geometry=geometry, model=str(folder), model_type=adapter.model_type)
    elif not (record.pruned().shape == tuple(layout.pruned_mask().shape)
              and (record.pruned() == layout.pruned_mask()).all()):
        raise InputError("The mask record does not describe the mask being exported; build it from the same mask "
                         "(analysis.compress.export.mask_record).")

    target = Path(target)
    notes = clean_leftovers(target.parent)
    for note in notes:
        report(progress, 0.0, note)
    if names.dropped:
        notes.append(f"Left out {len(names.dropped)} checkpoint tensors the model does not use (e.g. "
                     f"{names.dropped[0]}), as from_pretrained does.")
    report(progress, 0.0, f"{fmt} export: writing to a temporary folder")
    with atomic_folder(target, overwrite=overwrite) as tmp:
        if spec.writer == "gguf":
            notes += _write_gguf(tmp, config, folder, shards, names, roles, adapter, geometry, layout, progress,
                                 should_stop, **opts)
        else:
            _write_shards(tmp, fmt, spec, shards, roles, alias, adapter, geometry, layout, progress, should_stop)
        if out_config is not None:
            out_config.save_pretrained(tmp)
        write_common(tmp, record, None, layout, kv_plan)
        for name in PASS_THROUGH + (HF_PASS_THROUGH if out_config is not None else ()):
            if (folder / name).is_file() and not (tmp / name).exists():
                shutil.copyfile(folder / name, tmp / name)
        report(progress, 0.9, f"{fmt} export: moving into place")
    checks = read_self_checks(target)
    report(progress, 1.0, f"{fmt} export written to {target}")
    return ExportResult(format=fmt, path=target, files=listing(target), layout=layout,
                        notes=notes + plan_notes + [c["line"] for c in checks], checks=checks)


def checkpoint_has_qkv_bias(folder: Path, adapter: Adapter) -> bool:
    """Whether layer 0's Q (or fused QKV) projection has a bias in the checkpoint (names only, no data)."""
    from analysis.arch.checkpoint import name_prefix, tensor_files
    names = tensor_files(folder)
    prefix = name_prefix(adapter, names)
    suffixes = adapter.tensor_suffixes(0)
    return any(prefix + suffixes[role] in names for role in ("q.bias", "qkv.bias") if role in suffixes)


def _output_config(spec: StreamSpec, config, layout: HeadLayout):
    """config.json of the export: the original or the pruned head counts ("stock")."""
    import copy
    if spec.config == "stock":
        new = stock_config_for(config, layout)
    else:
        new = copy.deepcopy(config)
    new.architectures = [architecture_class(config).__name__]
    return new
