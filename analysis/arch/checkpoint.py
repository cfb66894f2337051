"""Safetensors checkpoints on disk, read without building a model: the folder, its index and
shards, config.json, the tensor names an adapter expects, header checks and one-file-at-a-time
reads, and the raw headers (`read_header`, `checkpoint_entries`: dtype, shape, byte range of every
tensor, checked against the file size) that the streamed export copies byte ranges by.
The streamed profile (`analysis.measure.streaming`) and the streamed export read through here.

Layouts: a single `model.safetensors`, or shards listed in `model.safetensors.index.json`.
A missing shard, a folder without safetensors weights, or a tensor the adapter expects but
the checkpoint lacks raise ModelLoadError saying what to fix.

Hostile checkpoints: the index must map tensor names to shard files inside the folder (a name
with "..", or an absolute path, is refused; symlinks such as the hub cache's are followed);
every attention tensor's header (shape, dtype) is checked against config.json before it is read,
and its float32 copy against free memory, so a lying header or config is a clear error, never a
MemoryError. config.json is read with trust_remote_code from the caller (default off): an
`auto_map` never runs code, and transformers never prompts on stdout.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import psutil
import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from analysis.core.atomic import path_problem
from analysis.arch.adapters import Adapter
from analysis.core.errors import HeadscopeError, ModelLoadError, custom_code_refused, first_line

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
INDEX_MAX_BYTES = 64 * 2**20           # the index of a 400B-parameter model is a few MB

# attention role -> rows of that projection in units of head_dim (its other side is `hidden`)
ROLE_ROWS = {
    "q.weight": lambda g: g.n_heads,
    "k.weight": lambda g: g.n_kv_heads,
    "v.weight": lambda g: g.n_kv_heads,
    "o.weight": lambda g: g.n_heads,
    "qkv.weight": lambda g: g.n_heads + 2 * g.n_kv_heads,
}


def checkpoint_folder(path) -> Path:
    """The folder of a checkpoint given as a folder, its index file or a .safetensors file."""
    p = Path(path).expanduser()
    problem = path_problem(p)                # a name too long (errno 36) would raise from is_file()
    if problem is not None:
        raise ModelLoadError(f"The checkpoint path {str(p)[:80]!r}{'...' if len(str(p)) > 80 else ''} cannot be "
                             f"used: {problem[0]}; {problem[1]}.")
    if p.is_file() and (p.name == INDEX_FILE or p.suffix == ".safetensors"):
        return p.parent
    if not p.is_dir():
        raise ModelLoadError(f"{p} is not a checkpoint folder. Pass the folder that holds config.json and "
                             f"the *.safetensors weights (or {INDEX_FILE} for a sharded checkpoint).")
    return p


def _shard_name_ok(shard) -> bool:
    """A shard file name that stays inside the checkpoint folder (no "..", not absolute, no NUL)."""
    if not isinstance(shard, str) or not shard or "\x00" in shard or "\\" in shard:
        return False
    parts = PurePosixPath(shard).parts
    return not PurePosixPath(shard).is_absolute() and ".." not in parts and bool(parts)


def weight_map(folder: Path) -> dict[str, str] | None:
    """The checked {tensor name: shard file} of `folder`'s safetensors index, or None without an index.

    ModelLoadError for an index that is not JSON, not a {str: str} map, or names a file outside
    the folder (such files are never opened)."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    fix = "re-download or re-save the checkpoint (save_pretrained(..., safe_serialization=True))"
    from analysis.core.files import read_file_text
    try:
        text = read_file_text(index, INDEX_MAX_BYTES, what=INDEX_FILE, fix=fix)   # bounded, regular files only
    except HeadscopeError as err:
        raise ModelLoadError(str(err)) from None
    try:
        mapping = json.loads(text)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ModelLoadError(f"{index} is not a valid safetensors index ({first_line(err)}); {fix}.") from None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names (a JSON object of "
                             f"strings), got {type(mapping).__name__}; {fix}.")
    outside = sorted({shard for shard in mapping.values() if not _shard_name_ok(shard)})
    if outside:
        raise ModelLoadError(f"{index} names shard files outside the checkpoint folder ({outside[0]!r}); headscope "
                             f"reads only files inside {folder}. Use an index whose shards are plain file names "
                             f"next to it.")
    return mapping


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file that holds it. ModelLoadError on missing shards."""
    mapping = weight_map(folder)
    if mapping is not None:
        files = {name: folder / shard for name, shard in mapping.items()}
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


CONFIG_MAX_BYTES = 16 * 2**20        # a config.json is a few KiB
# the tokenizer's files of a model folder (transformers reads them; the streamed export copies them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
SIDE_FILES = TOKENIZER_FILES + ("generation_config.json", "preprocessor_config.json")
SIDE_FILE_MAX_BYTES = 256 * 2**20    # the largest tokenizer.json in use is ~35 MB


def check_side_files(folder) -> None:
    """ModelLoadError unless each of SIDE_FILES that `folder` has is a regular file of at most
    SIDE_FILE_MAX_BYTES: transformers opens them itself (unbounded), so a link to /dev/zero, a FIFO or a
    2 GiB file there is refused here, before it reads a byte."""
    from analysis.core.files import check_regular_size
    folder = Path(folder)
    for name in SIDE_FILES:
        path = folder / name
        if not os.path.lexists(path):
            continue
        try:
            check_regular_size(path, SIDE_FILE_MAX_BYTES, what=name,
                               fix=f"replace it with the model's own {name} or remove it")
        except HeadscopeError as err:
            raise ModelLoadError(str(err)) from None
# geometry fields under their names in the families' configs -> what they count
_COUNT_FIELDS = {
    "num_attention_heads": "attention heads", "n_head": "attention heads", "n_heads": "attention heads",
    "num_key_value_heads": "KV heads", "num_hidden_layers": "layers", "n_layer": "layers", "n_layers": "layers",
    "hidden_size": "hidden size", "n_embd": "hidden size", "dim": "hidden size", "d_model": "hidden size",
    "head_dim": "head size",
}
_FIELD_GROUPS = {"heads": ("num_attention_heads", "n_head", "n_heads"), "hidden": ("hidden_size", "n_embd", "dim", "d_model")}


def read_config_json(folder: Path) -> dict:
    """The checked contents of `folder`/config.json, before transformers builds anything from it.

    ModelLoadError (one line, with the fix) for a file that is no regular file or too large, not
    JSON, nested too deeply, not a JSON object, or with impossible geometry (0 heads, "two"
    layers, a hidden size the heads do not divide): transformers would raise ZeroDivisionError,
    TypeError or its strict-config errors, which are no ValueErrors. The one config validator:
    `load_config` (streaming) and `analysis.arch.models` (loading) both call it."""
    from analysis.core import schemas
    from analysis.core.files import read_file_text
    fix = "replace it with the model's original config.json"
    path = Path(folder) / "config.json"
    try:
        text = read_file_text(path, CONFIG_MAX_BYTES, what="config.json", fix=fix)
    except HeadscopeError as err:
        raise ModelLoadError(str(err)) from None
    try:
        data = schemas.load_json_text(text, "it", fix)
    except HeadscopeError as err:
        raise ModelLoadError(f"Could not read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__ if data is not None else 'null'}, not a "
                             f"config object; {fix}.")
    for key, meaning in _COUNT_FIELDS.items():
        value = data.get(key)
        if key in data and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelLoadError(f"{path} gives {key} = {str(value)[:40]!r}; the number of {meaning} must be a whole "
                                 f"number >= 1. {fix[0].upper()}{fix[1:]}.")
    heads = next((data[k] for k in _FIELD_GROUPS["heads"] if isinstance(data.get(k), int)), None)
    hidden = next((data[k] for k in _FIELD_GROUPS["hidden"] if isinstance(data.get(k), int)), None)
    kv = data.get("num_key_value_heads")
    if heads and hidden and not data.get("head_dim") and hidden % heads:
        raise ModelLoadError(f"{path}: {heads} attention heads do not divide the hidden size {hidden} (and no "
                             f"head_dim is given), so no head has a size. {fix[0].upper()}{fix[1:]}.")
    if heads and isinstance(kv, int) and (kv > heads or heads % kv):
        raise ModelLoadError(f"{path}: {kv} KV heads do not divide the {heads} attention heads. "
                             f"{fix[0].upper()}{fix[1:]}.")
    return data


def _has_auto_map(folder: Path) -> bool:
    try:
        return bool(read_config_json(folder).get("auto_map"))
    except ModelLoadError:
        return False


def load_config(folder: Path, *, trust_remote_code: bool = False):
    """The checkpoint's config (no weights read); ModelLoadError when config.json is absent or bad.

    Custom config code (auto_map) runs only with trust_remote_code=True; never a prompt."""
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json; the streaming profiler needs it for the "
                             "architecture and head counts. Copy the model's config.json next to the weights.")
    read_config_json(folder)                 # not a config, or impossible geometry: refused before building
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=bool(trust_remote_code),
                                          local_files_only=True)
    except Exception as err:                 # transformers 5's strict-config errors are no ValueErrors
        if _has_auto_map(folder) and not trust_remote_code:
            raise custom_code_refused(str(folder / "config.json"), "--trust-remote-code (trust_remote_code=True)") from None
        raise ModelLoadError(f"Could not read {folder / 'config.json'} ({first_line(err)}). Replace it with the "
                             f"model's original config.json.") from None


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


def check_tensor_header(role: str, name: str, shape: list[int], geometry, file: Path,
                        available_bytes: int | None = None) -> None:
    """ModelLoadError unless tensor `name`'s header shape fits the config's geometry and its
    float32 copy fits in free memory (checked before a byte of it is read)."""
    rows = ROLE_ROWS.get(role)
    expected = None if rows is None else rows(geometry) * geometry.head_dim * geometry.hidden
    numel = 1
    for size in shape:
        numel *= int(size)
    if len(shape) != 2 or (expected is not None and (numel != expected or geometry.hidden not in shape)):
        raise ModelLoadError(
            f"Tensor '{name}' in {file.name} has shape {list(shape)}, but config.json ({geometry.n_heads} heads, "
            f"{geometry.n_kv_heads} KV heads, head_dim {geometry.head_dim}, hidden {geometry.hidden}) needs "
            f"{expected} values in 2 dimensions. Use the config.json that belongs to these weights.")
    check_tensor_memory(name, file, 2 * 4 * numel, "profile",   # the float32 upcast and one temporary of its size
                        available_bytes=available_bytes)


def check_tensor_memory(name: str, file: Path, need: int, doing: str, *, available_bytes: int | None = None) -> None:
    """ModelLoadError unless `need` bytes (what reading tensor `name` of `file` and working on it takes)
    fit in free RAM: the one check, made before a byte of the tensor is read, by the streamed profile
    (`doing` = "profile") and the streamed export ("export")."""
    free = psutil.virtual_memory().available if available_bytes is None else available_bytes
    if need > free:
        raise ModelLoadError(f"Tensor '{name}' in {Path(file).name} needs about {need / 2**30:.2f} GiB of RAM to "
                             f"{doing}, but only {free / 2**30:.2f} GiB is free. Close other programs or {doing} on a "
                             f"machine with more memory.")


def check_finite_tensor(tensor: torch.Tensor, name: str, where: str) -> None:
    """ModelLoadError when tensor `name` (of `where`: a file name, "the model") holds NaN or infinite values:
    the scorers refuse such weights (their norms), and a cut of them computes NaN, so the exports (streamed
    and in memory, with a mask file that skips scoring) refuse them too."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise ModelLoadError(f"Tensor '{name}' in {where} holds NaN or infinite values; a model cut from it computes "
                             f"NaN. Use an intact copy of the weights (re-download or re-save them).")


def read_tensors(roles: dict[str, str], entries: dict[str, "TensorEntry"], geometry=None,
                 buffers: dict[str, torch.Tensor] | None = None) -> dict:
    """Role -> tensor read from its byte range (`read_tensor`, a plain read: nothing stays mapped,
    so the read is done when this returns and a reader thread can run it ahead of the compute).
    With `geometry`, every header is checked first (`check_tensor_header`). With `buffers` (role ->
    uint8 buffer, filled in here), each read lands in the buffer the same role used last time: the
    caller promises it is done with the tensors of that last call."""
    if geometry is not None:
        for role, name in roles.items():
            check_tensor_header(role, name, list(entries[name].shape), geometry, entries[name].file)
    for role, name in roles.items():
        if entries[name].dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"Tensor '{name}' in {entries[name].file.name} has dtype {entries[name].dtype}; its "
                                 f"heads can be scored from {', '.join(FLOAT_DTYPES)} weights only. Use an unquantized "
                                 f"copy of the checkpoint.")
    if buffers is None:
        return {role: read_tensor(entries[name]) for role, name in roles.items()}
    out = {}
    for role, name in roles.items():
        if role not in buffers or buffers[role].numel() != entries[name].nbytes:
            buffers[role] = torch.empty(entries[name].nbytes, dtype=torch.uint8)  # [nbytes]
        out[role] = read_tensor(entries[name], buffers[role])
    return out


def read_tensor(entry: "TensorEntry", buffer: torch.Tensor | None = None) -> torch.Tensor:
    """One float tensor's values, read from its byte range (a plain read: nothing stays mapped).

    The read lands in `buffer` (uint8 [entry.nbytes], whose old contents are overwritten: memory
    already touched, which reads about 2.5x faster than fresh pages the kernel must fault in and
    zero) or in a new uninitialised one (a bytearray would be zero-filled first: one more pass over
    the bytes, with the GIL held, which stalls the compute thread of a streamed profile). The
    tensor returned is a view of the buffer."""
    if buffer is None:
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)  # [nbytes], filled by the read below
    got = 0
    try:
        with open(entry.file, "rb") as handle:
            handle.seek(entry.start)
            view = memoryview(buffer.numpy())
            while got < entry.nbytes:           # readinto may return short on a pipe or a network file system
                n = handle.readinto(view[got:])
                if not n:
                    break
                got += n
    except OSError as err:
        raise ModelLoadError(f"Could not read {entry.file} ({first_line(err)}). Re-download or re-copy that file.") from None
    if got != entry.nbytes:
        raise ModelLoadError(f"{entry.file} ended before tensor '{entry.name}' did: the file is truncated. "
                             f"Re-download or re-copy it.")
    return buffer.view(FLOAT_DTYPES[entry.dtype]).reshape(entry.shape)  # entry.shape


# ---------------------------------------------------------------------------------------------
# Safetensors headers, parsed here (the streamed export reads and copies raw byte ranges)
# ---------------------------------------------------------------------------------------------
#
# A .safetensors file is: 8 bytes (little-endian u64) N, N bytes of JSON header
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
# data; offsets count from the end of the header.

HEADER_MAX_BYTES = 100 * 2**20          # safetensors' own limit

# safetensors dtype name -> bytes per element (every dtype a header may name whose size is whole bytes)
# safetensors dtype name -> torch dtype of the float dtypes headscope computes on (and cuts heads of)
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in `file`)."""
    name: str
    file: Path
    dtype: str                  # safetensors name ("BF16", "F32", ...)
    shape: tuple[int, ...]
    start: int                  # first byte in the file
    end: int                    # one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _bad_file(file: Path, why: str) -> ModelLoadError:
    return ModelLoadError(f"{file} is not a valid safetensors file ({why}). Re-download or re-copy that file.")


def read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """({name: TensorEntry} in file order, metadata) of one safetensors file, every entry checked:
    a known dtype, a shape of non-negative integers, a byte range of exactly dtype x shape that
    lies inside the file (a truncated file is named as such). No tensor data is read."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > HEADER_MAX_BYTES or 8 + n > size:
                raise _bad_file(file, f"it is {size} bytes, too short for its header: truncated"
                                if n > 1 and 8 + n > size else "no safetensors header")
            header = json.loads(handle.read(n).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        raise _bad_file(file, first_line(err)) from None
    if not isinstance(header, dict):
        raise _bad_file(file, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list)
                  and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
                  and all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)) and 0 <= begin <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _bad_file(file, f"tensor {name!r} has a malformed header entry")
        if dtype not in DTYPE_BYTES:
            raise ModelLoadError(f"Tensor '{name}' in {file.name} has dtype {dtype!r}, which headscope cannot read or "
                                 f"copy (known: {', '.join(DTYPE_BYTES)}). Convert the checkpoint to bfloat16, "
                                 f"float16 or float32 first.")
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * DTYPE_BYTES[dtype]:
            raise _bad_file(file, f"tensor {name!r} holds {end - begin} bytes, its shape {shape} x {dtype} needs "
                                  f"{numel * DTYPE_BYTES[dtype]}")
        if data_start + end > size:
            raise _bad_file(file, f"it is {size} bytes but tensor {name!r} ends at byte {data_start + end}: truncated")
        entries[name] = TensorEntry(name, file, dtype, tuple(shape), data_start + begin, data_start + end)
    if not isinstance(metadata, dict):
        raise _bad_file(file, "its __metadata__ is not a JSON object")
    ordered = dict(sorted(entries.items(), key=lambda item: item[1].start))
    return ordered, {str(k): str(v) for k, v in metadata.items()}


def checkpoint_entries(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in `folder` (name -> TensorEntry), shard by shard in file
    order; each shard's header is checked (`read_header`), and every name the index lists must be
    in the shard it names (ModelLoadError otherwise)."""
    files = tensor_files(folder)
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    out = {}
    for file in sorted(by_file):
        entries, _ = read_header(file)
        absent = [name for name in by_file[file] if name not in entries]
        if absent:
            raise ModelLoadError(f"{INDEX_FILE} in {folder} says {file.name} holds '{absent[0]}', but that shard has "
                                 f"no such tensor. Re-download or re-copy the checkpoint (every shard and the index "
                                 f"must come from the same save).")
        listed = set(by_file[file])
        out.update((name, entry) for name, entry in entries.items() if name in listed)
    return out
