"""GGUF files for llama.cpp from a physically pruned model (per-layer head counts included).

What llama.cpp runs (read in its source, proven by tests/test_gguf.py running it):
- its hyper-parameters read `{arch}.attention.head_count` / `head_count_kv` as per-layer arrays
  (`n_head_arr`, `n_head_kv_arr`), but most graph builders use layer 0's counts everywhere: the
  `llama` builder sizes Q/K/V/O from `hparams.n_head()` (layer 0) and so refuses a file whose
  layers differ ("wrong shape"); `qwen2` even sizes Q and O as hidden x hidden;
- the `deci` architecture (made for Nemotron-NAS models) reads `n_head(il)` / `n_head_kv(il)` per
  layer for the tensor shapes, the KV cache and the graph, and runs a layer with `n_head(il) == 0`
  without attention (no attention norm, no Q/K/V/O: the residual passes through). Its rope is
  llama's (interleaved pairs), it takes optional Q/K/V biases (qwen2) and an optional O bias.
So: a dense model keeps its family's own architecture (`llama`, `qwen2`); a pruned llama/mistral
model with one head count for all layers stays `llama`; every other cut is written as `deci`.
One exception: llama.cpp reads the head size only when layer 0 has heads (`if n_head() > 0`), so a
layout that empties layer 0 is refused with the mask policy that avoids it.

Weights: HF's rotate-half rope pairs element j with j + d/2; llama.cpp's `llama` and `deci` rope
pairs 2j with 2j+1, so Q and K rows (and biases) are permuted per head (`_interleave_rope`); the
`qwen2` builder uses the rotate-half ("NEOX") rope and gets them as they are.
Types: F32 / F16 / Q8_0 are written here with the `gguf` package (1-D tensors stay F32, a Q8_0
tensor whose rows are not a multiple of 32 falls back to F16); Q4_K_M / Q5_K_M / Q6_K are made
by llama.cpp's own quantizer (`llama_cpp.llama_model_quantize`) from an F32 file written first.

Streaming by design: `plan_tensors` lists every tensor (name, shape, type) from names and shapes
alone, `GGUFTensorWriter` writes the header from that plan and then takes the tensors one at a
time in plan order, so a checkpoint can be fed shard by shard without building the model.

Tokenizer: the `tokenizer.*` keys (vocabulary, merges, special ids, chat template) are copied from
a GGUF file the model came from (the built-in SmolLM2's own file, `source_gguf`), so llama.cpp
tokenizes exactly as that file does; a model from an HF folder gets them converted from its
tokenizer.json (byte-level BPE: `analysis.compress.export.gguf.tokenizer`); otherwise the file gets
`tokenizer.ggml.model = "none"` plus the vocabulary size (token ids only: enough for evaluation by ids).
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from analysis.arch.adapters import adapter_for, real_state_dict
from analysis.compress.export.gguf.types import (DEFAULT_EMBEDDING_TYPE, DEFAULT_WEIGHT_TYPE,  # noqa: F401 (re-exported)
                                                  EMBEDDING_TYPES, WEIGHT_TYPES)
from analysis.compress.surgery import HeadLayout
from analysis.core.errors import InputError, OutputError, UnsupportedModelError

GGUF_FILE = "model.gguf"

PER_LAYER_ARCH = "deci"          # llama.cpp's architecture that honours per-layer head counts

# HF parameter name -> (GGUF name template, role). Roles: "q"/"k" (rope-permuted for llama-style
# rope), "attn" (other attention tensors: absent in a layer without heads), "embed", "output",
# "plain". Shared by llama, mistral and qwen2 (same module names; qwen2 adds Q/K/V biases).
_LLAMA_LIKE_TENSORS: tuple[tuple[str, str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight", "embed"),
    (r"model\.norm\.weight", "output_norm.weight", "plain"),
    (r"lm_head\.weight", "output.weight", "output"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "blk.{0}.attn_norm.weight", "attn"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "blk.{0}.attn_q.{1}", "q"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "blk.{0}.attn_k.{1}", "k"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "blk.{0}.attn_v.{1}", "attn"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "blk.{0}.attn_output.{1}", "attn"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "blk.{0}.ffn_norm.weight", "plain"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "blk.{0}.ffn_gate.weight", "plain"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "blk.{0}.ffn_up.weight", "plain"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "blk.{0}.ffn_down.weight", "plain"),
)


@dataclass(frozen=True)
class GGUFFamily:
    """How one HF family becomes GGUF."""
    native_arch: str               # llama.cpp architecture of the dense model
    native_interleaved_rope: bool  # the native builder's rope pairs (2j, 2j+1): permute Q/K
    native_uniform_cut: bool       # the native builder sizes Q/O as n_head * head_dim (uniform cuts fit)
    tensors: tuple[tuple[str, str, str], ...] = _LLAMA_LIKE_TENSORS


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("llama", True, True),
    "mistral": GGUFFamily("llama", True, True),     # llama.cpp converts Mistral checkpoints as llama
    "qwen2": GGUFFamily("qwen2", False, False),     # qwen2's builder sizes Q and O as hidden x hidden
}


def family_for(model_type: str) -> GGUFFamily:
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"GGUF export supports {', '.join(sorted(FAMILIES))} models, not '{model_type}'; use the "
            f"'pruned' or 'onnx' export for it.")
    return FAMILIES[model_type]


def check_embedding_type(embedding_type: str, weight_type: str) -> str:
    """The embedding type, checked: one of EMBEDDING_TYPES, and not "auto" only where llama.cpp's
    quantizer writes the file (the k-quants and q4_0 / q4_1)."""
    key = str(embedding_type).lower()
    if key not in EMBEDDING_TYPES:
        raise InputError(f"Unknown GGUF embedding type {embedding_type!r}; choose one of {', '.join(EMBEDDING_TYPES)}.")
    if EMBEDDING_TYPES[key] is not None and WEIGHT_TYPES[check_weight_type(weight_type)][0] is not None:
        quantized = ", ".join(k for k, v in WEIGHT_TYPES.items() if v[0] is None)
        raise InputError(f"The GGUF embedding type applies to the types llama.cpp's quantizer makes ({quantized}), "
                         f"not to {weight_type}; leave it at auto or choose one of those weight types.")
    return key


def check_weight_type(weight_type: str) -> str:
    key = str(weight_type).lower()
    if key not in WEIGHT_TYPES:
        raise InputError(f"Unknown GGUF weight type {weight_type!r}; choose one of {', '.join(WEIGHT_TYPES)}.")
    return key


# ---------------------------------------------------------------------------------------------
# The plan: architecture, metadata and the list of tensors (no tensor data needed)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: where it comes from and what is written."""
    hf_name: str
    name: str                      # GGUF name
    shape: tuple[int, ...]         # numpy / PyTorch order ([out, in] for weights)
    ggml_type: str                 # "F32", "F16", "Q8_0"
    interleave_rope: bool = False  # permute rows per head (HF rotate-half -> llama.cpp pairs)


@dataclass
class GGUFPlan:
    arch: str
    weight_type: str
    head_counts: list[int]         # [L] query heads per layer, as written
    kv_head_counts: list[int]      # [L] KV heads per layer, as written
    head_dim: int
    tensors: list[TensorSpec]
    metadata: list[tuple[str, object, str, str | None]] = field(default_factory=list)  # key, value, type, sub

    @property
    def per_layer(self) -> bool:
        return self.arch == PER_LAYER_ARCH


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise UnsupportedModelError(f"GGUF export does not write rope scaling '{kind}' yet; use the 'pruned' "
                                    "or 'onnx' export for this model.")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def choose_arch(family: GGUFFamily, layout: HeadLayout) -> str:
    """The family's own architecture where its builder fits the layout, else `deci`."""
    if layout.is_identity:
        return family.native_arch
    if family.native_uniform_cut and layout.uniform_counts() is not None:
        return family.native_arch
    if layout.heads and not layout.heads[0]:
        raise InputError("GGUF export: this mask removes every head of layer 0, which llama.cpp cannot load "
                         "(it reads the head size from layer 0). Use the mask policy 'min-per-layer' "
                         "(keep >= 1 head per layer) or a lower sparsity.")
    return PER_LAYER_ARCH


def _ggml_type(shape: tuple[int, ...], weight_type: str) -> str:
    """1-D tensors (norms, biases) stay F32; 2-D weights get the weight type (Q8_0 needs rows
    that are a multiple of its 32-value block, else F16). k-quants: F32 here, llama.cpp quantizes."""
    base = WEIGHT_TYPES[weight_type][0]
    if len(shape) < 2 or base is None:
        return "F32"
    if base == "Q8_0" and shape[-1] % 32:
        return "F16"
    return base


def plan_tensors(shapes: dict[str, tuple[int, ...]], layout: HeadLayout, family: GGUFFamily, arch: str,
                 weight_type: str, *, tied: bool) -> list[TensorSpec]:
    """Every GGUF tensor, in file order, from HF names and shapes alone (a model's state dict or
    a checkpoint's headers). Attention tensors of emptied layers are left out (deci runs them
    without attention); a tied LM head is left out (llama.cpp reuses token_embd)."""
    interleave = family.native_interleaved_rope if arch == family.native_arch else True
    rules = [(re.compile(pattern + r"$"), template, role) for pattern, template, role in family.tensors]
    specs: list[TensorSpec] = []
    unknown = []
    for hf_name, shape in shapes.items():
        for pattern, template, role in rules:
            match = pattern.match(hf_name)
            if match:
                break
        else:
            unknown.append(hf_name)
            continue
        if role == "output" and tied:
            continue
        if role in ("q", "k", "attn") and not layout.heads[int(match.group(1))]:
            continue                                   # a layer without heads: no attention tensors
        shape = tuple(int(s) for s in shape)
        specs.append(TensorSpec(hf_name, template.format(*match.groups()), shape, _ggml_type(shape, weight_type),
                                interleave and role in ("q", "k")))
    if unknown:
        raise UnsupportedModelError(f"GGUF export does not know where these tensors go: {', '.join(unknown[:4])}"
                                    f"{' ...' if len(unknown) > 4 else ''}; use the 'pruned' export.")
    return sorted(specs, key=_file_order)      # one order whatever the source's order (state dict, shards)


def _file_order(spec: TensorSpec) -> tuple[int, str]:
    """token_embd, then block by block, then the output norm and head; by name within each."""
    match = re.match(r"blk\.(\d+)\.", spec.name)
    rank = 1 + int(match.group(1)) if match else (0 if spec.name.startswith("token_embd") else 1 << 20)
    return rank, spec.name


def plan_gguf(model_or_config, layout: HeadLayout, weight_type: str = DEFAULT_WEIGHT_TYPE, *,
              shapes: dict[str, tuple[int, ...]] | None = None, name: str = "",
              tokenizer_gguf: str | os.PathLike | None = None) -> GGUFPlan:
    """The GGUF file for a model built to `layout` (the physically pruned model), or for its original
    config plus the pruned tensors' `shapes` (HF name -> shape, e.g. from checkpoint headers: a
    streaming exporter needs no model): architecture, metadata and tensors in file order. Raises
    UnsupportedModelError / InputError before anything is written."""
    weight_type = check_weight_type(weight_type)
    is_model = isinstance(model_or_config, nn.Module)
    config = model_or_config.config if is_model else model_or_config
    family = family_for(getattr(config, "model_type", None))
    arch = choose_arch(family, layout)
    if shapes is None:
        if not is_model:
            raise InputError("plan_gguf needs the tensors' shapes when given a config instead of a model.")
        shapes = {k: tuple(v.shape) for k, v in model_or_config.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in shapes
    tensors = plan_tensors(shapes, layout, family, arch, weight_type, tied=tied)
    heads = [len(h) for h in layout.heads]                 # [L]
    kv = [len(k) for k in layout.kv_heads]                 # [L]
    d = layout.head_dim
    vocab = int(shapes["model.embed_tokens.weight"][0])
    uniform = len(set(heads)) == 1 and len(set(kv)) == 1
    head_value = (heads[0], "UINT32", None) if uniform else (heads, "ARRAY", "UINT32")
    kv_value = (kv[0], "UINT32", None) if uniform else (kv, "ARRAY", "UINT32")
    file_type = _llama_ftype(WEIGHT_TYPES[weight_type][1]) if WEIGHT_TYPES[weight_type][0] else 0
    meta: list[tuple[str, object, str, str | None]] = [
        ("general.type", "model", "STRING", None),
        ("general.name", name or str(getattr(config, "_name_or_path", "") or config.model_type), "STRING", None),
        ("general.file_type", file_type, "UINT32", None),
        (f"{arch}.context_length", int(config.max_position_embeddings), "UINT32", None),
        (f"{arch}.embedding_length", int(config.hidden_size), "UINT32", None),
        (f"{arch}.block_count", layout.n_layers, "UINT32", None),
        (f"{arch}.feed_forward_length", int(config.intermediate_size), "UINT32", None),
        (f"{arch}.attention.head_count", *head_value),
        (f"{arch}.attention.head_count_kv", *kv_value),
        (f"{arch}.attention.key_length", d, "UINT32", None),
        (f"{arch}.attention.value_length", d, "UINT32", None),
        (f"{arch}.rope.dimension_count", d, "UINT32", None),
        (f"{arch}.rope.freq_base", _rope_theta(config), "FLOAT32", None),
        (f"{arch}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps), "FLOAT32", None),
        (f"{arch}.vocab_size", vocab, "UINT32", None),
    ]
    if WEIGHT_TYPES[weight_type][0] == "Q8_0":
        meta.append(("general.quantization_version", 2, "UINT32", None))
    meta += tokenizer_metadata(tokenizer_gguf, vocab)
    return GGUFPlan(arch=arch, weight_type=weight_type, head_counts=heads, kv_head_counts=kv, head_dim=d,
                    tensors=tensors, metadata=meta)


def _llama_ftype(name: str) -> int:
    import gguf
    return int(getattr(gguf.LlamaFileType, name))


# ---------------------------------------------------------------------------------------------
# Tokenizer metadata
# ---------------------------------------------------------------------------------------------

def tokenizer_metadata(source: str | os.PathLike | None, vocab_size: int) -> list[tuple]:
    """The `tokenizer.*` keys of `source`: a GGUF file (its keys, raw bytes kept) or an HF tokenizer
    folder (tokenizer.json converted by `analysis.compress.export.gguf.tokenizer`); a "none" vocabulary (token
    ids only) when there is no source or the folder's tokenizer is not one that module converts. The
    source must describe `vocab_size` tokens."""
    none = [("tokenizer.ggml.model", "none", "STRING", None)]
    if source is None:
        return none
    if Path(source).is_dir():
        from analysis.compress.export.gguf.tokenizer import hf_tokenizer_metadata
        return hf_tokenizer_metadata(source, vocab_size) or none
    from gguf import GGUFReader, GGUFValueType
    reader = GGUFReader(str(source))
    meta = []
    for key, fld in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = fld.types[0]
        if main == GGUFValueType.ARRAY:
            sub = fld.types[-1]
            if sub == GGUFValueType.STRING:
                value = [bytes(fld.parts[i]) for i in fld.data]    # exact bytes of every token
            else:
                value = fld.contents()
            meta.append((key, value, "ARRAY", sub.name))
        elif main == GGUFValueType.STRING:
            meta.append((key, bytes(fld.parts[fld.data[0]]), "STRING", None))
        else:
            meta.append((key, fld.contents(), main.name, None))
    tokens = next((v for k, v, *_ in meta if k == "tokenizer.ggml.tokens"), None)
    if tokens is not None and len(tokens) != vocab_size:
        raise InputError(f"The tokenizer in {source} has {len(tokens)} tokens but the model has {vocab_size}; "
                         "export without that tokenizer source.")
    return meta


def source_gguf(model_name: str) -> Path | None:
    """The GGUF file a built-in model was converted from (its tokenizer is carried over), else None."""
    from analysis.arch import models
    builtin = models.BUILTIN_MODELS.get(model_name)
    if builtin is None:
        return None
    try:
        folder = models._package_dir(builtin)
    except Exception:       # package missing: no tokenizer source (the export still works by ids)
        return None
    files = sorted(folder.glob("*.gguf"))
    return files[0] if files else None


# ---------------------------------------------------------------------------------------------
# The streaming writer
# ---------------------------------------------------------------------------------------------

def _interleave_rope(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of each head reordered from HF's halves (j, j + d/2) to llama.cpp's pairs (2j, 2j+1)."""
    rows = w.shape[0]                                                       # heads * d
    return (w.reshape(rows // head_dim, 2, head_dim // 2, *w.shape[1:])     # [h, 2, d/2, ...]
             .swapaxes(1, 2)                                                # [h, d/2, 2, ...]
             .reshape(w.shape))                                             # [h*d, ...]


def _encode(spec: TensorSpec, array: np.ndarray, head_dim: int) -> np.ndarray:
    import gguf
    if tuple(array.shape) != spec.shape:
        raise InputError(f"GGUF export: tensor {spec.hf_name} has shape {list(array.shape)}, the plan says "
                         f"{list(spec.shape)}; export the model again.")
    array = np.ascontiguousarray(array, dtype=np.float32)
    if spec.interleave_rope:
        array = _interleave_rope(array, head_dim)
    if spec.ggml_type == "F32":
        return array
    if spec.ggml_type == "F16":
        return array.astype(np.float16)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[spec.ggml_type])    # uint8 blocks


def _with_errno(err: OSError, path: Path, nbytes: int) -> OSError:
    """numpy's `tofile` reports a short write as an OSError without errno ("n requested and m
    written"); when the disk has no room for the tensor, that is a full disk: say so (ENOSPC)."""
    if err.errno is not None:
        return err
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return err
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) if free < nbytes + 65536 else err


class GGUFTensorWriter:
    """Writes one GGUF file: header, metadata and tensor table from the plan at open, then the
    tensors one at a time (`write(spec, tensor)`, in plan order), then `close()`."""

    def __init__(self, path: str | os.PathLike, plan: GGUFPlan):
        import gguf
        self.plan = plan
        self.path = Path(path)
        self._next = 0
        self._writer = gguf.GGUFWriter(str(path), plan.arch)
        for key, value, vtype, sub in plan.metadata:
            self._writer.add_key_value(key, value, gguf.GGUFValueType[vtype],
                                       sub_type=None if sub is None else gguf.GGUFValueType[sub])
        for spec in plan.tensors:
            qtype = gguf.GGMLQuantizationType[spec.ggml_type]
            if spec.ggml_type in ("F32", "F16"):
                dtype = np.float32 if spec.ggml_type == "F32" else np.float16
                self._writer.add_tensor_info(spec.name, spec.shape, np.dtype(dtype),
                                             int(np.prod(spec.shape)) * np.dtype(dtype).itemsize)
            else:
                byte_shape = gguf.quant_shape_to_byte_shape(spec.shape, qtype)
                self._writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                             raw_dtype=qtype)
        self._writer.write_header_to_file()
        self._writer.write_kv_data_to_file()
        self._writer.write_ti_data_to_file()

    def write(self, spec: TensorSpec, tensor) -> None:
        expected = self.plan.tensors[self._next]
        if spec.name != expected.name:
            raise InputError(f"GGUF export: got tensor {spec.name}, expected {expected.name} next.")
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.detach().to("cpu", torch.float32).numpy()
        data = _encode(spec, tensor, self.plan.head_dim)
        try:
            self._writer.write_tensor_data(data)
        except OSError as err:
            raise _with_errno(err, self.path, data.nbytes) from err
        self._next += 1

    def abandon(self) -> None:
        """Close the file after a failure (the caller removes it; the export's folder is temporary)."""
        try:
            self._writer.close()
        except OSError:
            pass

    def close(self) -> None:
        try:
            if self._next != len(self.plan.tensors):
                raise InputError(f"GGUF export: {len(self.plan.tensors) - self._next} tensors were not written.")
            self._writer.flush()
        finally:
            self._writer.close()


def write_tensors(path: str | os.PathLike, plan: GGUFPlan, fetch: Callable[[str], object],
                  progress: Callable[[float, str], None] | None = None) -> None:
    """Write `plan` to `path`, asking `fetch(hf_name)` for each tensor in turn."""
    writer = GGUFTensorWriter(path, plan)
    try:
        for i, spec in enumerate(plan.tensors):
            writer.write(spec, fetch(spec.hf_name))
            if progress:
                progress(i / len(plan.tensors), f"GGUF: {spec.name}")
    except BaseException:
        writer.abandon()             # the error that stopped the writing is the one to report
        raise
    writer.close()


# ---------------------------------------------------------------------------------------------
# k-quants through llama.cpp
# ---------------------------------------------------------------------------------------------

def llama_quantize(source: Path, target: Path, weight_type: str, *, threads: int | None = None,
                   embedding_type: str = DEFAULT_EMBEDDING_TYPE) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`) from an F32/F16 GGUF to a k-quant one;
    embedding_type (not "auto"): its token_embedding_type and output_tensor_type parameters."""
    import gguf

    from analysis.compress.export.gguf.llamacpp import llama_cpp_module, llama_log
    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + WEIGHT_TYPES[weight_type][1])
    explicit = EMBEDDING_TYPES[check_embedding_type(embedding_type, weight_type)]
    if explicit is not None:                # ggml_type ids: the gguf package's GGMLQuantizationType
        params.token_embedding_type = params.output_tensor_type = int(gguf.GGMLQuantizationType[explicit])
    params.nthread = threads or (os.cpu_count() or 1)
    with llama_log():                       # its per-tensor fallback notes stay off the console
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise OutputError(f"llama.cpp could not quantize the GGUF file to {weight_type} (status {status}); "
                          f"check the free disk space at {target.parent} and try again.")


# ---------------------------------------------------------------------------------------------
# The whole file from an in-memory model
# ---------------------------------------------------------------------------------------------

@dataclass
class GGUFWritten:
    path: Path
    arch: str
    weight_type: str
    head_counts: list[int]
    kv_head_counts: list[int]
    bytes: int


def write_gguf(model: nn.Module, layout: HeadLayout, path: str | os.PathLike, *,
               weight_type: str = DEFAULT_WEIGHT_TYPE, tokenizer_gguf: str | os.PathLike | None = None,
               name: str = "", progress: Callable[[float, str], None] | None = None,
               embedding_type: str = DEFAULT_EMBEDDING_TYPE) -> GGUFWritten:
    """Write the physically pruned `model` (built to `layout`, e.g. by `prune_heads`) as one GGUF
    file at `path`. k-quants go through an F32 file next to `path` that is removed afterwards;
    embedding_type: the token embedding's / output's type there (EMBEDDING_TYPES)."""
    weight_type = check_weight_type(weight_type)
    embedding_type = check_embedding_type(embedding_type, weight_type)
    adapter_for(model)                                 # a family headscope knows at all
    path = Path(path)
    plan = plan_gguf(model, layout, weight_type, name=name, tokenizer_gguf=tokenizer_gguf)
    state = real_state_dict(model)
    needs_quantizer = WEIGHT_TYPES[weight_type][0] is None
    first = path.with_name(path.name + ".f32.tmp") if needs_quantizer else path
    try:
        write_tensors(first, plan, state.__getitem__, progress)
        if needs_quantizer:
            llama_quantize(first, path, weight_type, embedding_type=embedding_type)
    finally:
        if needs_quantizer and first.exists():
            first.unlink()
    return GGUFWritten(path=path, arch=plan.arch, weight_type=weight_type, head_counts=plan.head_counts,
                       kv_head_counts=plan.kv_head_counts, bytes=path.stat().st_size)
