"""A GGUF file's header, read and checked before llama.cpp or the gguf package touches the file.

llama.cpp and `gguf.GGUFReader` believe what a file says about itself: a file that is no GGUF, an
empty or truncated one, or one with a wrong tensor size ends in a numpy or llama.cpp traceback;
counts in the header size what `GGUFReader` allocates; a head-count array that disagrees with the
attention tensors is run (or refused with a crash deep in llama.cpp). `read_gguf(path)` parses the
header itself, from a regular file only (`analysis.core.files.open_regular`: a FIFO never hangs,
/dev/zero is never read), never reading tensor data and keeping only small values, and checks:

- the frame: the magic, a version llama.cpp reads (2 or 3, little-endian), counts within bounds,
  every key / value and tensor entry inside the file, known value types, no nested arrays, no
  duplicate keys or tensor names, a power-of-two alignment;
- every tensor: 1 to 4 dimensions, a known ggml type whose block divides the first dimension, an
  aligned offset, its bytes inside the file and overlapping no other tensor's;
- the model: general.architecture, `{arch}.block_count`, `{arch}.embedding_length`,
  `{arch}.attention.head_count` / `head_count_kv` (one number, or one per layer), and the attention
  tensors of every layer against those counts (Q / K / V / O or fused QKV rows = heads x head size,
  no attention tensors in a layer of 0 heads, none in a layer past block_count), the token embedding
  against embedding_length.

The result (`GGUFHeader`) is what the deployment report reads: architecture, weight type, head counts,
vocabulary, each tensor's type and byte count. Any problem is one InputError naming the file, what
is wrong with it, and what to do.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from analysis.core.errors import InputError, shorten
from analysis.core.files import open_regular
from analysis.core.schemas import MAX_HEADS, MAX_LAYERS

MAGIC = b"GGUF"
VERSIONS = (2, 3)                    # what llama.cpp reads (version 1 is long gone)
DEFAULT_ALIGNMENT = 32
MAX_KEYS = 2**16                     # a real file has a few dozen
MAX_TENSORS = 2**16                  # a 400B-parameter model has about a thousand
MAX_KEY_BYTES = 2**16
MAX_NAME_BYTES = 63                  # llama.cpp's GGML_MAX_NAME (64) with its NUL
MAX_DIMS = 4                         # GGML_MAX_DIMS
MAX_ARRAY_ITEMS = 2**22              # per array: 10x the largest vocabulary (or merge list) in use
MAX_HEADER_ITEMS = 2**23             # array items in the whole header
KEPT_ARRAY_ITEMS = MAX_LAYERS        # numeric arrays up to this long are kept (per-layer counts)
KEPT_STRING_BYTES = 2**12            # longer strings (chat templates) are skipped, not kept
FIX = ("export it again (`python -m analysis export --export-format gguf`) or re-download it")

# GGUF value type id -> (name, struct format or None for string / array)
_SCALARS = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
            5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
            12: ("FLOAT64", "<d")}
_STRING, _ARRAY = 8, 9
_INTEGER_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_NORMS = ("norm.weight", "norm.bias")


class GGUFError(InputError):
    """A file that is not a GGUF llama.cpp can load (the message names the file, the problem and the fix)."""


@dataclass(frozen=True)
class GGUFArray:
    """An array value that was not kept (strings, or more numbers than KEPT_ARRAY_ITEMS): its size."""
    item_type: str
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry: GGUF dimensions (ne0 first: a weight is [in, out]), type, where its bytes are."""
    name: str
    dims: tuple[int, ...]
    type_name: str                   # ggml type ("F32", "Q8_0", ...)
    start: int                       # first byte in the file
    nbytes: int


@dataclass
class GGUFHeader:
    """What a checked GGUF file holds, without its tensor data."""
    path: Path
    size: int                        # bytes of the file
    version: int
    values: dict[str, object]        # key -> int / float / bool / str / list (short numeric arrays) / GGUFArray
    value_types: dict[str, str]      # key -> GGUF type name ("UINT32", "STRING", "ARRAY", ...)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)

    def arch_value(self, key: str, default=None):
        return self.values.get(f"{self.arch}.{key}", default)

    @property
    def arch(self) -> str:
        return str(self.values["general.architecture"])

    @property
    def block_count(self) -> int:
        return int(self.arch_value("block_count"))

    @property
    def embedding_length(self) -> int:
        return int(self.arch_value("embedding_length"))

    @property
    def head_counts(self) -> list[int]:
        return _per_layer(self.arch_value("attention.head_count"), self.block_count)

    @property
    def kv_head_counts(self) -> list[int]:
        return _per_layer(self.arch_value("attention.head_count_kv", self.arch_value("attention.head_count")),
                          self.block_count)

    @property
    def vocab_size(self) -> int:
        """Rows of the token embedding (the ids llama.cpp accepts)."""
        return self.tensors["token_embd.weight"].dims[1]

    @property
    def file_type(self) -> int | None:
        value = self.values.get("general.file_type")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def weight_type(self) -> str:
        """The file's weight type: its general.file_type (llama.cpp's ftype name), else the ggml type
        of most of its 2-D tensors' bytes."""
        if self.file_type is not None:
            return _ftype_name(self.file_type)
        share: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.dims) >= 2:
                share[t.type_name] = share.get(t.type_name, 0) + t.nbytes
        return max(share, key=share.get) if share else "none"


def _ftype_name(value: int) -> str:
    import gguf
    try:
        return gguf.LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"


def _per_layer(value, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


# ---------------------------------------------------------------------------------------------
# The frame: keys, values and tensor entries, read with every size checked against the file
# ---------------------------------------------------------------------------------------------

class _Cursor:
    """Reads the header front to back; every read and skip is checked against the file's size."""

    def __init__(self, handle, size: int, path: Path):
        self.handle, self.size, self.path, self.pos = handle, size, path, 0
        self.items = 0

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{shorten(self.path, 120)} is not a GGUF file llama.cpp can load: {why}; {FIX}.")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes): it is "
                            f"truncated or damaged")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.handle.read(n)
        if len(data) != n:
            raise self.fail(f"the file ended early, at byte {self.pos + len(data)}")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.handle.seek(n, os.SEEK_CUR)
        self.pos += n

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None) -> bytes | int:
        """A GGUF string's bytes (its length when longer than `limit`: skipped, not kept)."""
        n = self.scalar("<Q", f"the length of {what}")
        if limit is not None and n > limit:
            self.skip(n, what)
            return n
        return self.read(n, what)

    def unique_name(self, what: str, limit: int, seen) -> str:
        """A length-prefixed UTF-8 name (a key, a tensor's) of at most `limit` bytes, not one of `seen`."""
        raw = self.string(what, limit)
        if isinstance(raw, int):
            raise self.fail(f"{what} is {raw:,} bytes long (llama.cpp allows {limit:,})")
        name = _text(raw, self, what)
        if name in seen:
            raise self.fail(f"{name!r} appears twice")
        return name

    def count_items(self, n: int, what: str) -> None:
        self.items += n
        if n > MAX_ARRAY_ITEMS or self.items > MAX_HEADER_ITEMS:
            raise self.fail(f"{what} claims {n:,} items, more than any real GGUF file holds")


def _text(raw: bytes, cursor: _Cursor, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise cursor.fail(f"{what} is not UTF-8 text") from None


def _value(cursor: _Cursor, type_id: int, key: str):
    """(type name, value) of one key's value; arrays of strings or long arrays become GGUFArray."""
    if type_id in _SCALARS:
        name, fmt = _SCALARS[type_id]
        return name, cursor.scalar(fmt, f"the value of {key!r}")
    if type_id == _STRING:
        raw = cursor.string(f"the value of {key!r}", KEPT_STRING_BYTES)
        return "STRING", (GGUFArray("STRING_BYTES", raw) if isinstance(raw, int)
                          else raw.decode("utf-8", "replace"))
    if type_id != _ARRAY:
        raise cursor.fail(f"key {key!r} has the unknown value type {type_id}")
    item_type = cursor.scalar("<I", f"the item type of {key!r}")
    count = cursor.scalar("<Q", f"the length of {key!r}")
    cursor.count_items(count, f"the array {key!r}")
    if item_type == _STRING:
        cursor.need(8 * count, f"the {count:,} strings of {key!r}")      # each holds at least its length
        for _ in range(count):
            cursor.string(f"an item of {key!r}", 0)
        return "ARRAY", GGUFArray("STRING", count)
    if item_type not in _SCALARS:
        raise cursor.fail(f"the array {key!r} holds items of type {item_type}, which llama.cpp does not read "
                          f"(nested arrays or an unknown type)")
    name, fmt = _SCALARS[item_type]
    size = struct.calcsize(fmt)
    if count > KEPT_ARRAY_ITEMS:
        cursor.skip(size * count, f"the array {key!r}")
        return "ARRAY", GGUFArray(name, count)
    raw = cursor.read(size * count, f"the array {key!r}")
    return "ARRAY", list(struct.unpack(f"<{count}{fmt[1]}", raw))


def _tensor_entries(cursor: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    entries, seen = [], set()
    for index in range(count):
        name = cursor.unique_name(f"the name of tensor {index}", MAX_NAME_BYTES, seen)
        seen.add(name)
        n_dims = cursor.scalar("<I", f"the dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions (llama.cpp takes 1 to {MAX_DIMS})")
        dims = struct.unpack(f"<{n_dims}Q", cursor.read(8 * n_dims, f"the dimensions of {name!r}"))
        type_id = cursor.scalar("<I", f"the type of {name!r}")
        offset = cursor.scalar("<Q", f"the offset of {name!r}")
        entries.append((name, tuple(dims), type_id, offset))
    return entries


def _tensors(cursor: _Cursor, entries, data_start: int, alignment: int) -> dict[str, GGUFTensor]:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    out = {}
    for name, dims, type_id, offset in entries:
        try:
            ggml_type = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise cursor.fail(f"tensor {name!r} has the unknown ggml type {type_id}") from None
        if any(d < 1 for d in dims) or dims[0] % block:
            raise cursor.fail(f"tensor {name!r} has the dimensions {list(dims)}, which a {ggml_type.name} tensor "
                              f"cannot have (every dimension >= 1, the first a multiple of {block})")
        if offset % alignment:
            raise cursor.fail(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_size
        start = data_start + offset
        if start + nbytes > cursor.size:
            raise cursor.fail(f"tensor {name!r} ({list(dims)} {ggml_type.name}, {nbytes:,} bytes from byte {start:,}) "
                              f"ends past the end of the file ({cursor.size:,} bytes): it is truncated or the tensor's "
                              f"size is wrong")
        out[name] = GGUFTensor(name, dims, ggml_type.name, start, nbytes)
    spans = sorted(out.values(), key=lambda t: t.start)
    for before, after in zip(spans, spans[1:]):
        if after.start < before.start + before.nbytes:
            raise cursor.fail(f"tensors {before.name!r} and {after.name!r} overlap")
    return out


def read_gguf(path) -> GGUFHeader:
    """The checked header of the GGUF file `path` (see the module docstring); GGUFError (an
    InputError) for anything llama.cpp would refuse, crash on, or misreport."""
    path = Path(path)
    if not os.path.lexists(path):
        raise GGUFError(f"No GGUF file at {shorten(path, 120)}; export one with `python -m analysis export "
                        f"--export-format gguf`.")
    with open_regular(path, what="The GGUF file", fix=FIX) as (handle, size):
        cursor = _Cursor(handle, size, path)
        if size == 0:
            raise cursor.fail("it is empty")
        if cursor.read(min(4, size), "the magic number") != MAGIC:
            raise cursor.fail("it does not start with the GGUF magic number")
        version = cursor.scalar("<I", "the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = ("it is a big-endian file" if swapped in VERSIONS
                   else f"its version is {version}, llama.cpp reads versions {' and '.join(map(str, VERSIONS))}")
            raise cursor.fail(why)
        n_tensors = cursor.scalar("<Q", "the tensor count")
        n_keys = cursor.scalar("<Q", "the key count")
        if n_tensors > MAX_TENSORS or n_keys > MAX_KEYS:
            raise cursor.fail(f"it claims {n_tensors:,} tensors and {n_keys:,} keys, more than any real model has")
        values, types = {}, {}
        for index in range(n_keys):
            key = cursor.unique_name(f"key {index}", MAX_KEY_BYTES, values)
            type_id = cursor.scalar("<I", f"the type of {key!r}")
            types[key], values[key] = _value(cursor, type_id, key)
        entries = _tensor_entries(cursor, n_tensors)
        alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in values and (types["general.alignment"] != "UINT32" or alignment < 1
                                               or alignment & (alignment - 1)):
            raise cursor.fail(f"general.alignment is {alignment!r}, not a power of two (UINT32)")
        data_start = cursor.pos + (-cursor.pos % alignment)
        tensors = _tensors(cursor, entries, data_start, alignment)
    header = GGUFHeader(path, size, version, values, types, tensors)
    _check_model(header, cursor)
    return header


# ---------------------------------------------------------------------------------------------
# The model: architecture, layer and head counts, and the attention tensors against them
# ---------------------------------------------------------------------------------------------

def _whole(header: GGUFHeader, key: str, cursor: _Cursor, low: int, high: int, *, required: bool = True):
    value, kind = header.values.get(key), header.value_types.get(key)
    if value is None and not required:
        return None
    if kind not in _INTEGER_TYPES or isinstance(value, bool) or not low <= value <= high:
        raise cursor.fail(f"{key} is {str(value)[:40] if value is not None else 'missing'}, not a whole number "
                          f"from {low:,} to {high:,}")
    return value


def _counts(header: GGUFHeader, key: str, cursor: _Cursor, layers: int) -> list[int] | None:
    """One count per layer from `key` (a number or an array of block_count numbers), each 0 .. MAX_HEADS."""
    value, kind = header.values.get(key), header.value_types.get(key)
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    ok = (kind == "ARRAY" and isinstance(value, list) and len(items) == layers) or kind in _INTEGER_TYPES
    if not ok or any(isinstance(v, (bool, float, GGUFArray)) or not 0 <= v <= MAX_HEADS for v in items):
        shown = (f"an array of {value.count if isinstance(value, GGUFArray) else len(items)} values"
                 if kind == "ARRAY" else str(value)[:40])
        raise cursor.fail(f"{key} is {shown}; it must be a whole number from 0 to {MAX_HEADS:,}, or one such number "
                          f"per layer ({layers})")
    return _per_layer(value, layers)


def _check_model(header: GGUFHeader, cursor: _Cursor) -> None:
    arch = header.values.get("general.architecture")
    if header.value_types.get("general.architecture") != "STRING" or not isinstance(arch, str) or not arch \
            or len(arch) > 64:
        raise cursor.fail("general.architecture is missing or not a short name")
    layers = _whole(header, f"{arch}.block_count", cursor, 1, MAX_LAYERS)
    hidden = _whole(header, f"{arch}.embedding_length", cursor, 1, 2**20)
    heads = _counts(header, f"{arch}.attention.head_count", cursor, layers)
    if heads is None:
        raise cursor.fail(f"{arch}.attention.head_count is missing")
    kv = _counts(header, f"{arch}.attention.head_count_kv", cursor, layers) or heads
    for layer, (h, k) in enumerate(zip(heads, kv)):
        if (h == 0) != (k == 0) or (k and (k > h or h % k)):
            raise cursor.fail(f"layer {layer} has {h} query heads and {k} KV heads; the KV heads must divide the "
                              f"query heads (and be 0 exactly when those are)")
    first = next((h for h in heads if h), 0)
    key_length = _whole(header, f"{arch}.attention.key_length", cursor, 1, 2**16, required=False) \
        or (hidden // first if first else 0)
    value_length = _whole(header, f"{arch}.attention.value_length", cursor, 1, 2**16, required=False) or key_length
    embedding = header.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.dims) != 2 or embedding.dims[0] != hidden:
        raise cursor.fail(f"token_embd.weight is {list(embedding.dims) if embedding else 'missing'}; it must be "
                          f"[{hidden}, vocabulary] ({arch}.embedding_length = {hidden})")
    expected = {   # GGUF attention tensor -> its (dimension, size) per layer's counts
        "attn_q.weight": lambda h, k: (1, h * key_length),
        "attn_k.weight": lambda h, k: (1, k * key_length),
        "attn_v.weight": lambda h, k: (1, k * value_length),
        "attn_output.weight": lambda h, k: (0, h * value_length),
        "attn_qkv.weight": lambda h, k: (1, h * key_length + k * (key_length + value_length)),
    }
    attention = {}                   # layer -> the attention weights it has
    for name, tensor in header.tensors.items():
        match = _LAYER_TENSOR.fullmatch(name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer >= layers:
            raise cursor.fail(f"it holds {name!r} but {arch}.block_count is {layers}")
        rule = expected.get(match.group(2))
        if rule is None:
            continue
        attention.setdefault(layer, []).append(match.group(2))
        axis, size = rule(heads[layer], kv[layer])
        if len(tensor.dims) != 2 or tensor.dims[axis] != size:
            raise cursor.fail(f"{name} is {list(tensor.dims)}, but layer {layer}'s {heads[layer]} heads and "
                              f"{kv[layer]} KV heads of size {key_length} need {size} in its dimension {axis}: "
                              f"the head counts do not match the tensors")
    for layer in range(layers):
        if heads[layer] and not any(n.startswith(f"blk.{layer}.attn_") and not n.endswith(_NORMS)
                                    for n in header.tensors):
            raise cursor.fail(f"layer {layer} has {heads[layer]} heads but no attention tensors")
        if not heads[layer] and attention.get(layer):
            raise cursor.fail(f"layer {layer} has 0 heads but holds attention tensors ({attention[layer][0]})")
