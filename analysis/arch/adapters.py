"""Architecture adapters: the ONLY module that knows Hugging Face module and tensor names.

Every family is one row of `FAMILIES` (a lookup table, not a class per architecture): where
the layer list lives under `model.base_model`, where the attention module lives in a layer,
and a `Layout` that says how Q/K/V/O are stored. The adapter turns those tensors into a
head-major view (`HeadWeights`) and back, hands out the output-projection module that the
masking hook attaches to, and names the tensors so the streaming profiler can read a
checkpoint without building the model.

Layouts (the quirks are handled here and nowhere else):
- `Separate`: q/k/v/o are four `nn.Linear` layers, weights [out, in] (Llama, OPT, BERT, ...).
- `Stacked`: one Linear holds [Q; K; V] rows one block after another (Phi-3's qkv_proj).
- `Interleaved`: one Linear holds, per head, [q_h; k_h; v_h] (GPT-NeoX, Bloom), i.e. its rows
  reshape to [H, 3, d].
- `GPT2Conv1D`: GPT-2's `Conv1D` stores weights [in, out], the transpose of `nn.Linear`;
  c_attn's columns are [Q | K | V].

Placement (accelerate's `device_map`) is read here too, since only this layer looks inside
modules: `input_device` (where token ids go: the input embedding's execution device),
`real_weights` (a layer's projections with their real weights: an offloaded module keeps meta
tensors and its weights in accelerate's hook; every weight read goes through it) and
`real_state_dict` (a whole model's tensors, offloaded ones loaded one module at a time) and
`in_memory_copy` (a plain single-device copy, for exports).
"""
from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, replace
from typing import Callable, ClassVar, Iterator, Mapping

import torch
from accelerate.utils import align_module_device, has_offloaded_params
from torch import nn

from analysis.core.errors import UnsupportedModelError
from analysis.arch.geometry import HeadGeometry

Tensor = torch.Tensor


@dataclass
class HeadWeights:
    """One layer's attention weights, head-major. Shapes (D = input width, D_out = O's output):"""
    q: Tensor            # [H, d, D]       rows of W_Q, per query head
    k: Tensor            # [H_kv, d, D]    rows of W_K, per KV group
    v: Tensor            # [H_kv, d, D]    rows of W_V, per KV group
    o: Tensor            # [H, d, D_out]   o[h, j, :] = W_O[:, h*d + j]  (O's columns)
    q_bias: Tensor | None = None   # [H, d]
    k_bias: Tensor | None = None   # [H_kv, d]
    v_bias: Tensor | None = None   # [H_kv, d]
    o_bias: Tensor | None = None   # [D_out], shared by every head, never pruned

    def map(self, fn: Callable[[Tensor], Tensor]) -> "HeadWeights":
        """Apply `fn` to every tensor that is present."""
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else fn(getattr(self, f.name)))
                                for f in fields(self)})


# ---------------------------------------------------------------------------------------------
# Layouts: tensors (by role) <-> HeadWeights. Roles are "<proj>.weight" / "<proj>.bias" keys whose
# module paths the layout knows; every method is pure tensor reshaping.
# ---------------------------------------------------------------------------------------------

def _linear_rows(w: Tensor, n: int, d: int) -> Tensor:
    """Linear weight [n*d, D] -> [n, d, D]."""
    return w.reshape(n, d, w.shape[-1])


def _linear_cols(w: Tensor, n: int, d: int) -> Tensor:
    """Linear O weight [D_out, n*d] -> head-major columns [n, d, D_out]."""
    return w.t().reshape(n, d, w.shape[0])


def _opt(x: Tensor | None, shape) -> Tensor | None:
    return None if x is None else x.reshape(shape)


def _linear_o(hw: "HeadWeights") -> dict[str, Tensor]:
    """O back to an nn.Linear: weight [D_out, H*d] from the head-major columns, and its bias."""
    out = {"o.weight": hw.o.reshape(-1, hw.o.shape[-1]).t()}                 # [D_out, H*d]
    if hw.o_bias is not None:
        out["o.bias"] = hw.o_bias
    return out


@dataclass(frozen=True)
class Separate:
    """Four nn.Linear modules; paths are relative to the attention module."""
    q: str
    k: str
    v: str
    o: str
    o_input_axis: ClassVar[int] = 1          # O's weight axis that holds its inputs (H*d): nn.Linear's [out, in]

    def paths(self) -> dict[str, str]:
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}

    def split(self, t: Mapping[str, Tensor | None], g: HeadGeometry) -> HeadWeights:
        H, Hkv, d = g.n_heads, g.n_kv_heads, g.head_dim
        return HeadWeights(
            q=_linear_rows(t["q.weight"], H, d),            # [H, d, D]
            k=_linear_rows(t["k.weight"], Hkv, d),          # [H_kv, d, D]
            v=_linear_rows(t["v.weight"], Hkv, d),          # [H_kv, d, D]
            o=_linear_cols(t["o.weight"], H, d),            # [H, d, D_out]
            q_bias=_opt(t.get("q.bias"), (H, d)),
            k_bias=_opt(t.get("k.bias"), (Hkv, d)),
            v_bias=_opt(t.get("v.bias"), (Hkv, d)),
            o_bias=t.get("o.bias"),
        )

    def merge(self, hw: HeadWeights) -> dict[str, Tensor]:
        out = {"q.weight": hw.q.reshape(-1, hw.q.shape[-1]),                 # [H*d, D]
               "k.weight": hw.k.reshape(-1, hw.k.shape[-1]),                 # [H_kv*d, D]
               "v.weight": hw.v.reshape(-1, hw.v.shape[-1]),                 # [H_kv*d, D]
               **_linear_o(hw)}
        for role, b in (("q", hw.q_bias), ("k", hw.k_bias), ("v", hw.v_bias)):
            if b is not None:
                out[f"{role}.bias"] = b.reshape(-1)
        return out


@dataclass(frozen=True)
class FusedQKV:
    """A layout whose Q, K and V are one projection (`qkv`) beside O (`o`); subclasses say how its rows
    split into heads (`split`) and merge back (`merge`)."""
    qkv: str
    o: str
    o_input_axis: ClassVar[int] = 1

    def paths(self) -> dict[str, str]:
        return {"qkv": self.qkv, "o": self.o}


@dataclass(frozen=True)
class Stacked(FusedQKV):
    """One Linear whose rows are [Q (H*d); K (H_kv*d); V (H_kv*d)] (Phi-3), plus a Linear O."""

    def split(self, t, g):
        H, Hkv, d = g.n_heads, g.n_kv_heads, g.head_dim
        q, k, v = t["qkv.weight"].split([H * d, Hkv * d, Hkv * d], dim=0)
        b = t.get("qkv.bias")
        qb, kb, vb = (None, None, None) if b is None else b.split([H * d, Hkv * d, Hkv * d])
        return HeadWeights(q=_linear_rows(q, H, d), k=_linear_rows(k, Hkv, d), v=_linear_rows(v, Hkv, d),
                           o=_linear_cols(t["o.weight"], H, d),
                           q_bias=_opt(qb, (H, d)), k_bias=_opt(kb, (Hkv, d)), v_bias=_opt(vb, (Hkv, d)),
                           o_bias=t.get("o.bias"))

    def merge(self, hw):
        D = hw.q.shape[-1]
        out = {"qkv.weight": torch.cat([hw.q.reshape(-1, D), hw.k.reshape(-1, D), hw.v.reshape(-1, D)]),
               **_linear_o(hw)}
        if hw.q_bias is not None:
            out["qkv.bias"] = torch.cat([hw.q_bias.reshape(-1), hw.k_bias.reshape(-1), hw.v_bias.reshape(-1)])
        return out


@dataclass(frozen=True)
class Interleaved(FusedQKV):
    """One Linear whose rows reshape to [H, 3, d]: per head q, k, v (GPT-NeoX, Bloom). MHA only."""

    def split(self, t, g):
        H, d = g.n_heads, g.head_dim
        w = t["qkv.weight"].reshape(H, 3, d, -1)                     # [H, 3, d, D]
        b = t.get("qkv.bias")
        b = None if b is None else b.reshape(H, 3, d)                # [H, 3, d]
        return HeadWeights(q=w[:, 0], k=w[:, 1], v=w[:, 2], o=_linear_cols(t["o.weight"], H, d),
                           q_bias=None if b is None else b[:, 0], k_bias=None if b is None else b[:, 1],
                           v_bias=None if b is None else b[:, 2], o_bias=t.get("o.bias"))

    def merge(self, hw):
        D = hw.q.shape[-1]
        out = {"qkv.weight": torch.stack([hw.q, hw.k, hw.v], dim=1).reshape(-1, D),   # [H*3*d, D]
               **_linear_o(hw)}
        if hw.q_bias is not None:
            out["qkv.bias"] = torch.stack([hw.q_bias, hw.k_bias, hw.v_bias], dim=1).reshape(-1)
        return out


@dataclass(frozen=True)
class GPT2Conv1D(FusedQKV):
    """GPT-2: Conv1D weights are [in, out] (transposed vs nn.Linear); c_attn's columns are [Q|K|V]."""
    o_input_axis: ClassVar[int] = 0

    def split(self, t, g):
        H, d = g.n_heads, g.head_dim
        w = t["qkv.weight"].t()                                      # [3*H*d, D]  (Conv1D transpose)
        q, k, v = w.reshape(3, H, d, -1).unbind(0)                   # each [H, d, D]
        b = t.get("qkv.bias")
        qb, kb, vb = (None, None, None) if b is None else b.reshape(3, H, d).unbind(0)
        o = t["o.weight"].reshape(H, d, -1)                          # [H, d, D_out]: Conv1D rows = O's inputs
        return HeadWeights(q=q, k=k, v=v, o=o, q_bias=qb, k_bias=kb, v_bias=vb, o_bias=t.get("o.bias"))

    def merge(self, hw):
        D = hw.q.shape[-1]
        out = {"qkv.weight": torch.cat([hw.q, hw.k, hw.v]).reshape(-1, D).t(),    # [D, 3*H*d]
               "o.weight": hw.o.reshape(-1, hw.o.shape[-1])}                      # [H*d, D_out]
        if hw.q_bias is not None:
            out["qkv.bias"] = torch.cat([hw.q_bias, hw.k_bias, hw.v_bias]).reshape(-1)
        if hw.o_bias is not None:
            out["o.bias"] = hw.o_bias
        return out


Layout = Separate | Stacked | Interleaved | GPT2Conv1D


@dataclass(frozen=True)
class Family:
    """Where one architecture family keeps its attention: paths relative to `model.base_model`."""
    layers: str      # the nn.ModuleList of blocks
    attn: str        # the attention module inside one block
    layout: Layout
    mha_only: bool = False   # the layout cannot express H_kv < H


_LLAMA_LIKE = Family("layers", "self_attn", Separate("q_proj", "k_proj", "v_proj", "o_proj"))
_BERT_LIKE = Family("encoder.layer", "attention", Separate("self.query", "self.key", "self.value", "output.dense"))

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    "olmo": _LLAMA_LIKE,
    "starcoder2": _LLAMA_LIKE,
    "phi": Family("layers", "self_attn", Separate("q_proj", "k_proj", "v_proj", "dense")),
    "phi3": Family("layers", "self_attn", Stacked("qkv_proj", "o_proj")),
    "gpt2": Family("h", "attn", GPT2Conv1D("c_attn", "c_proj"), mha_only=True),
    "gpt_neox": Family("layers", "attention", Interleaved("query_key_value", "dense"), mha_only=True),
    "bloom": Family("h", "self_attention", Interleaved("query_key_value", "dense"), mha_only=True),
    "gptj": Family("h", "attn", Separate("q_proj", "k_proj", "v_proj", "out_proj"), mha_only=True),
    "opt": Family("decoder.layers", "self_attn", Separate("q_proj", "k_proj", "v_proj", "out_proj"),
                  mha_only=True),
    "bert": _BERT_LIKE,
    "roberta": _BERT_LIKE,
    "xlm-roberta": _BERT_LIKE,
    "electra": _BERT_LIKE,
    "distilbert": Family("transformer.layer", "attention", Separate("q_lin", "k_lin", "v_lin", "out_lin"),
                         mha_only=True),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))

# Config model_types known to have no attention heads at all: named in the error so the user
# is not told "unsupported" about something that could never be supported.
ATTENTION_FREE = {"mamba", "mamba2", "rwkv", "resnet", "convnext", "convnextv2", "regnet", "mobilenet_v1",
                  "mobilenet_v2", "efficientnet", "van", "poolformer", "falcon_mamba"}


# Families headscope knows but refuses, with the reason (user-facing).
REFUSED = {
    "olmo2": "OLMo-2 normalizes Q and K over all heads together (q_norm/k_norm span H*d), so a head cannot be "
             "removed alone: zeroing its rows changes the kept heads' values, and the masked model, the "
             "zeroed-weights model and a physically smaller one would all disagree. Use an OLMo (v1) or a "
             "Llama-style model instead.",
}


def _config_of(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def submodule_at(module: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path ("" is the module itself), one attribute lookup per part.

    (`get_submodule` checks every step: ~5x slower, and profiling walks 4-5 paths per layer.)"""
    for part in path.split(".") if path else ():
        module = getattr(module, part)
    return module


class Adapter:
    """The head-shaped view of one architecture family. Stateless: every call takes the model.

    Resizing a family's attention (surgery) is analysis/arch/resize.py, which reads this view."""

    def __init__(self, model_type: str, family: Family):
        self.model_type = model_type
        self.family = family

    def __repr__(self):
        return f"Adapter({self.model_type!r})"

    # -- geometry --------------------------------------------------------------------------
    def geometry(self, model_or_config) -> HeadGeometry:
        cfg = _config_of(model_or_config)
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        H = int(cfg.num_attention_heads)
        D = int(cfg.hidden_size)
        Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
        d = int(getattr(cfg, "head_dim", None) or D // H)
        if self.family.mha_only:
            Hkv = H
        return HeadGeometry(n_layers=int(cfg.num_hidden_layers), n_heads=H, n_kv_heads=Hkv, head_dim=d, hidden=D)

    # -- modules ---------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return submodule_at(model.base_model, self.family.layers)

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return submodule_at(self.layers(model)[layer], self.family.attn)

    def o_proj(self, model: nn.Module, layer: int) -> nn.Module:
        """The output projection; its input is [..., H*d], one head after another."""
        return submodule_at(self.attention(model, layer), self.family.layout.o)

    def query_heads(self, model: nn.Module) -> list[int]:
        """[L] query heads each layer of `model` computes, read off its O projection's input width (H'_l * d): a
        pruned twin's own counts, 0 for an emptied layer, H everywhere on a dense model."""
        d, axis = self.geometry(model).head_dim, self.family.layout.o_input_axis
        return [int(self.o_proj(model, layer).weight.shape[axis]) // d for layer in range(len(self.layers(model)))]

    def projection_modules(self, model: nn.Module, layer: int) -> dict[str, nn.Module]:
        """Role ("q","k","v","o" or "qkv","o") -> the projection module of that layer."""
        attn = self.attention(model, layer)
        return {role: submodule_at(attn, path) for role, path in self.family.layout.paths().items()}

    def has_qkv_bias(self, model: nn.Module) -> bool:
        """Whether the Q (or fused QKV) projection has a bias: read off layer 0's module, nothing copied."""
        modules = self.projection_modules(model, 0)
        return getattr(modules["q"] if "q" in modules else modules["qkv"], "bias", None) is not None

    # -- tensor names (for reading checkpoints without a model) -----------------------------
    def tensor_suffixes(self, layer: int) -> dict[str, str]:
        """Role key ("q.weight", "qkv.bias", ...) -> the state-dict name's suffix for `layer`.

        Checkpoints differ in prefix ("model.", "transformer.", none); match by suffix."""
        base = f"{self.family.layers}.{layer}.{self.family.attn}"
        return {f"{role}.{kind}": f"{base}.{path}.{kind}"
                for role, path in self.family.layout.paths().items() for kind in ("weight", "bias")}

    def heads_from_tensors(self, tensors: Mapping[str, Tensor | None], geometry: HeadGeometry) -> HeadWeights:
        """Head-major view from role-keyed tensors (as named by `tensor_suffixes`); views, not copies."""
        return self.family.layout.split(tensors, geometry)

    # -- reading and writing weights ---------------------------------------------------------
    def _tensors(self, model, layer) -> dict[str, Tensor | None]:
        out = {}
        for role, mod in self.projection_modules(model, layer).items():
            out[f"{role}.weight"] = mod.weight
            out[f"{role}.bias"] = getattr(mod, "bias", None)
        return out

    def read_heads(self, model: nn.Module, layer: int, geometry: HeadGeometry | None = None) -> HeadWeights:
        """Detached clones of `layer`'s weights, head-major (see HeadWeights for shapes)."""
        g = geometry or self.geometry(model)
        with torch.no_grad(), self.real_weights(model, layer):
            hw = self.family.layout.split(self._tensors(model, layer), g)
            return hw.map(lambda t: t.detach().clone())

    @contextmanager
    def real_weights(self, model: nn.Module, layer: int) -> Iterator[dict[str, nn.Module]]:
        """Inside: `layer`'s projection modules (role -> module) hold their real weights.

        A module accelerate offloaded (weights on the meta device, the values in its hook's
        weights_map, on the CPU or the disk) gets them loaded onto its execution device for the
        duration and dropped again after; any other module is left exactly as it is."""
        modules = self.projection_modules(model, layer)
        with ExitStack() as stack:
            for module in modules.values():
                if has_offloaded_params(module):
                    stack.enter_context(align_module_device(module))
            yield modules

    def write_heads(self, model: nn.Module, layer: int, hw: HeadWeights) -> None:
        """Copy `hw` back into the model's parameters in place (same shapes as read_heads gave)."""
        if any(has_offloaded_params(m) for m in self.projection_modules(model, layer).values()):
            raise UnsupportedModelError("This model's weights are offloaded (accelerate keeps them on the disk or the "
                                        "CPU): they cannot be changed in place. Use masks (gates), or surgery.")
        current = self._tensors(model, layer)
        merged = self.family.layout.merge(hw)
        with torch.no_grad():
            for key, value in merged.items():
                target = current.get(key)
                if target is None:
                    raise UnsupportedModelError(f"{self.model_type}: this layer has no tensor for {key!r}.")
                if target.shape != value.shape:
                    raise ValueError(f"write_heads: {key} has shape {tuple(target.shape)}, got {tuple(value.shape)}; "
                                     "write_heads keeps shapes (use surgery to change them).")
                target.copy_(value)


def is_offloaded(model: nn.Module) -> bool:
    """Whether accelerate keeps any of the model's weights off their module (CPU or disk offload)."""
    return any(has_offloaded_params(m) for m in model.modules())


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device when offloaded, else its
    first parameter's (or buffer's) device; the CPU for a module without tensors."""
    if has_offloaded_params(module):
        device = module._hf_hook.execution_device
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    tensor = next(module.parameters(), None)
    tensor = tensor if tensor is not None else next(module.buffers(), None)
    return torch.device("cpu") if tensor is None or tensor.device.type == "meta" else tensor.device


def input_device(model: nn.Module) -> torch.device:
    """The device token ids must be on: the input embedding's (the first block's under a device_map)."""
    return execution_device(model.get_input_embeddings())


def real_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """model.state_dict() with real values: offloaded modules are loaded one at a time (onto the
    CPU) and their tensors copied out, so the full model exists at most once, in this dict.
    For a model without offload this is exactly `model.state_dict()`."""
    state = model.state_dict()
    if not is_offloaded(model):
        return state
    for name, module in model.named_modules():
        if has_offloaded_params(module):
            with align_module_device(module, torch.device("cpu")):
                for key, value in module.state_dict().items():
                    state[f"{name}.{key}" if name else key] = value.detach().clone()
    return state


def is_dispatched(model: nn.Module) -> bool:
    """Whether accelerate spread the model over several devices or offloaded part of it."""
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    return len(devices) > 1 or is_offloaded(model)


def in_memory_copy(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """A plain copy of a dispatched / offloaded model: every tensor real and on `device`,
    accelerate's hooks removed (so ONNX export, safetensors and in-place edits work on it). Costs
    the whole model's memory on `device`; `model` is not changed. Tied weights are tied again."""
    from accelerate.hooks import remove_hook_from_module
    state = real_state_dict(model)
    twin = copy.deepcopy(model)
    remove_hook_from_module(twin, recurse=True)
    twin.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    if getattr(twin.config, "tie_word_embeddings", False):
        twin.tie_weights()
    twin.__dict__.pop("hf_device_map", None)
    return twin.to(device)


def adapter_for(model_or_config) -> Adapter:
    """The adapter for a model (or its config), chosen by `config.model_type`."""
    cfg = _config_of(model_or_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type in FAMILIES:
        return Adapter(model_type, FAMILIES[model_type])
    if model_type in REFUSED:
        raise UnsupportedModelError(f"'{model_type}' is not supported: {REFUSED[model_type]}")
    if model_type in ATTENTION_FREE:
        raise UnsupportedModelError(
            f"'{model_type}' models have no attention heads, so there is nothing for headscope to score "
            f"or prune. Pick a transformer with self-attention; supported: {', '.join(SUPPORTED_MODEL_TYPES)}.")
    if model_type and not hasattr(cfg, "num_attention_heads"):
        raise UnsupportedModelError(
            f"'{model_type}' has no attention heads in its config (no num_attention_heads). headscope "
            f"needs a transformer with self-attention; supported: {', '.join(SUPPORTED_MODEL_TYPES)}.")
    raise UnsupportedModelError(
        f"Architecture '{model_type}' is not supported yet. Supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Adding one is a row in analysis/arch/adapters.py FAMILIES "
        "(and one in analysis/arch/resize.py SURGERY for surgery).")
