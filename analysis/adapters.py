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
"""
from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, fields, replace
from typing import Callable, Mapping

import torch
from torch import nn

from .errors import UnsupportedModelError
from .geometry import HeadGeometry

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
class Stacked:
    """One Linear whose rows are [Q (H*d); K (H_kv*d); V (H_kv*d)] (Phi-3), plus a Linear O."""
    qkv: str
    o: str

    def paths(self) -> dict[str, str]:
        return {"qkv": self.qkv, "o": self.o}

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
class Interleaved:
    """One Linear whose rows reshape to [H, 3, d]: per head q, k, v (GPT-NeoX, Bloom). MHA only."""
    qkv: str
    o: str

    def paths(self):
        return {"qkv": self.qkv, "o": self.o}

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
class GPT2Conv1D:
    """GPT-2: Conv1D weights are [in, out] (transposed vs nn.Linear); c_attn's columns are [Q|K|V]."""
    qkv: str
    o: str

    def paths(self):
        return {"qkv": self.qkv, "o": self.o}

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


def _get(module: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path ("" is the module itself), one attribute lookup per part.

    (`get_submodule` checks every step: ~5x slower, and profiling walks 4-5 paths per layer.)"""
    for part in path.split(".") if path else ():
        module = getattr(module, part)
    return module


# =============================================================================================
# Surgery support: what analysis/surgery.py needs to resize a family's attention.
#
# Physically removing heads needs three more pieces of family knowledge, kept here as a second
# lookup table (`SURGERY`, keyed by model_type like FAMILIES):
# - which module attributes the family's forward reads for the head counts (e.g. Llama's
#   `num_key_value_groups`, OPT's `num_heads`, GPT-2's `split_size`); most families reshape
#   with -1 and need only the GQA factor. An attribute path starting with "config." is a config
#   value the forward reads (Phi-3 reads `self.config.num_attention_heads`): that module gets a
#   per-module view of the shared config with the value overridden (`_ConfigView`);
# - what the attention block must return when a layer has lost every head (its forward cannot
#   run: `view(..., -1, d)` of an empty tensor is ambiguous): the block is switched to a subclass
#   whose forward returns exactly O's bias (plus the residual where the block adds it, Bloom),
#   and still advances the KV cache by a one-value-per-token placeholder so the cache length
#   that transformers reads from it stays right;
# - inputs shaped per head that the layer receives from outside (Bloom's ALiBi bias
#   [batch*H, 1, seq]), sliced to the kept heads by the same subclass;
# - which config keys describe a uniform per-layer head structure to stock Hugging Face code.
# =============================================================================================

_QUANTITIES = ("heads", "kv_heads", "groups", "width")


@dataclass(frozen=True)
class SurgerySpec:
    """What surgery needs to know about one family (paths relative to the attention module).

    head_attrs: attribute path -> quantity ("heads" H', "kv_heads" H_kv', "groups" H'/H_kv',
        "width" H'*d), set on the resized attention after each layer's surgery.
    core: the module whose forward is replaced in a layer with no heads left ("" = the
        attention module itself; BERT: "self", whose output is O's input).
    empty_returns: what that forward returns as its first output: "o_output" (O's bias),
        "o_input" (a zero-width tensor that O turns into its bias), "o_output+residual" (Bloom).
    cache_arg / residual_arg: the forward's argument names for the KV cache and the residual.
    per_head_kwargs: forward arguments shaped [batch*H, ...] that must follow the kept heads.
    stock_config: config key -> quantity ("heads", "kv_heads", "head_dim") that makes stock
        from_pretrained build the uniform pruned shapes; None when the config cannot say it.
    stock_refusal / unsupported: why stock export / surgery is impossible (user-facing).
    """
    head_attrs: Mapping[str, str]
    core: str = ""
    empty_returns: str = "o_output"
    cache_arg: str | None = "past_key_values"
    residual_arg: str | None = None
    per_head_kwargs: tuple[str, ...] = ()
    stock_config: Mapping[str, str] | None = None
    stock_refusal: str = ""
    unsupported: str = ""


_GQA_STOCK = {"num_attention_heads": "heads", "num_key_value_heads": "kv_heads", "head_dim": "head_dim"}
_LLAMA_SURGERY = SurgerySpec({"num_key_value_groups": "groups"}, stock_config=_GQA_STOCK)


def _derived_head_size(name: str, formula: str) -> str:
    return (f"{name}: the head size is {formula}, so the config cannot describe fewer heads of the same "
            f"size. Export the head-layout checkpoint (load it with analysis.export.load_pruned) "
            f"or the zeroed-weights checkpoint instead.")


SURGERY: dict[str, SurgerySpec] = {
    "llama": _LLAMA_SURGERY,
    "mistral": _LLAMA_SURGERY,
    "mixtral": _LLAMA_SURGERY,
    "qwen2": _LLAMA_SURGERY,
    "qwen3": _LLAMA_SURGERY,
    "gemma": _LLAMA_SURGERY,
    "gemma2": _LLAMA_SURGERY,
    "gemma3_text": _LLAMA_SURGERY,
    "olmo": _LLAMA_SURGERY,
    "starcoder2": _LLAMA_SURGERY,
    "phi": _LLAMA_SURGERY,
    "phi3": SurgerySpec({"num_key_value_groups": "groups", "num_key_value_heads": "kv_heads",
                         "config.num_attention_heads": "heads"}, stock_config=_GQA_STOCK),
    "gpt2": SurgerySpec({"num_heads": "heads", "split_size": "width"},
                        stock_refusal=_derived_head_size("GPT-2", "n_embd / n_head")),
    "gpt_neox": SurgerySpec({}, cache_arg="layer_past",
                            stock_refusal=_derived_head_size("GPT-NeoX", "hidden_size / num_attention_heads")),
    "bloom": SurgerySpec({"num_heads": "heads", "split_size": "width"}, empty_returns="o_output+residual",
                         cache_arg="layer_past", residual_arg="residual", per_head_kwargs=("alibi",),
                         stock_refusal="Bloom derives both the head size (hidden_size / n_head) and the ALiBi "
                                       "slopes of every head from n_head, so its config cannot describe "
                                       "pruned heads. Export the head-layout checkpoint (analysis.export."
                                       "load_pruned) or the zeroed-weights checkpoint instead."),
    "gptj": SurgerySpec({"num_attention_heads": "heads"}, cache_arg="layer_past",
                        stock_refusal=_derived_head_size("GPT-J", "n_embd / n_head")),
    "opt": SurgerySpec({"num_heads": "heads"},
                       stock_refusal=_derived_head_size("OPT", "hidden_size / num_attention_heads")),
    "distilbert": SurgerySpec({"n_heads": "heads"}, cache_arg=None,
                              stock_refusal=_derived_head_size("DistilBERT", "dim / n_heads")),
}
_BERT_SURGERY = SurgerySpec({"self.num_attention_heads": "heads", "self.all_head_size": "width"},
                            core="self", empty_returns="o_input",
                            stock_refusal=_derived_head_size("BERT-style encoders",
                                                             "hidden_size / num_attention_heads"))
SURGERY.update({name: _BERT_SURGERY for name in ("bert", "roberta", "xlm-roberta", "electra")})


class _ConfigView:
    """A per-module view of a shared config with a few values overridden (per-layer head counts).

    Reads fall through to the shared config (so later changes to it, e.g. the attention
    implementation, still apply); writes go to the shared config unless the name is overridden."""

    def __init__(self, base, overrides: Mapping[str, object]):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_base", "_overrides"):
            raise AttributeError(name)
        overrides = self._overrides
        return overrides[name] if name in overrides else getattr(self._base, name)

    def __setattr__(self, name, value):
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._base, name, value)

    def __repr__(self):
        return f"_ConfigView({self._overrides}, base={type(self._base).__name__})"


def _shared_config(config):
    return config._base if isinstance(config, _ConfigView) else config


def _new_linear(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """nn.Linear holding `weight` [out, in] and `bias` [out] (no random init)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    module.weight = nn.Parameter(weight.contiguous())
    if bias is not None:
        module.bias = nn.Parameter(bias.contiguous())
    return module


def _new_conv1d(weight: Tensor, bias: Tensor | None) -> nn.Module:
    """GPT-2 Conv1D holding `weight` [in, out] and `bias` [out]."""
    from transformers.pytorch_utils import Conv1D
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        module = Conv1D(weight.shape[1], weight.shape[0])
    module.weight = nn.Parameter(weight.contiguous())
    module.bias = nn.Parameter(bias.contiguous() if bias is not None else weight.new_zeros(weight.shape[1]))
    return module


def _projection_builders() -> dict[type, Callable[[Tensor, Tensor | None], nn.Module]]:
    from transformers.pytorch_utils import Conv1D
    return {nn.Linear: _new_linear, Conv1D: _new_conv1d}


def matmul_module_types() -> tuple[type, ...]:
    """Module types whose forward is one matmul with their weight (for FLOP counting)."""
    return tuple(_projection_builders())


def _output_width(module: nn.Module) -> int:
    """Output features of a Linear ([out, in]) or Conv1D ([in, out]) projection."""
    return int(getattr(module, "out_features", None) or module.nf)


def _set_path(root: nn.Module, path: str, value) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent), name, value)


def _argument(bound: inspect.BoundArguments, name: str | None):
    """A forward argument by name, whether passed by position, keyword, or through **kwargs."""
    if name is None:
        return None
    if name in bound.arguments:
        return bound.arguments[name]
    for param in bound.signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return bound.arguments.get(param.name, {}).get(name)
    return None


@dataclass
class _SurgeryState:
    """Per-module surgery facts the swapped-in forward reads."""
    spec: SurgerySpec
    empty: bool = False                 # every head of this layer is gone
    kept: Tensor | None = None          # [H'] kept original heads, for per-head inputs
    n_heads: int = 0                    # original H (the layout of per-head inputs)
    head_dim: int = 0
    o_path: str = ""                    # O relative to this module ("" when O is outside it)


def _surgery_forward(self, *args, **kwargs):
    """Forward of a module changed by surgery: per-head inputs follow the kept heads; a layer with
    no heads returns O's bias (what the masked model computes) without running attention."""
    state: _SurgeryState = self._headscope_surgery
    base = type(self)._headscope_base
    bound = type(self)._headscope_signature.bind(self, *args, **kwargs)
    if state.kept is not None and state.spec.per_head_kwargs:
        for name in state.spec.per_head_kwargs:
            value = _argument(bound, name)
            if value is not None and name in bound.arguments:
                lead = value.shape[0] // state.n_heads
                per_head = value.reshape(lead, state.n_heads, *value.shape[1:])      # [B, H, ...]
                bound.arguments[name] = per_head[:, state.kept.to(value.device)].reshape(
                    lead * len(state.kept), *value.shape[1:])                      # [B*H', ...]
        args, kwargs = bound.args[1:], bound.kwargs
    if not state.empty:
        return base.forward(self, *args, **kwargs)
    hidden = bound.arguments[next(iter(list(bound.signature.parameters)[1:]))]     # [B, S, D]
    lead = hidden.shape[:-1]
    cache = _argument(bound, state.spec.cache_arg)
    if cache is not None and hasattr(getattr(cache, "self_attention_cache", cache), "update"):
        # A placeholder of one value per token, never read: the cache still reports this layer's
        # length (transformers reads it from layer 0's keys, and an empty tensor reports 0).
        placeholder = hidden.new_zeros(lead[0], 1, lead[1], 1)                      # [B, 1, S, 1]
        getattr(cache, "self_attention_cache", cache).update(placeholder, placeholder, self.layer_idx)
    if state.spec.empty_returns == "o_input":
        return hidden.new_zeros(*lead, 0), None                                    # [B, S, 0]
    o = _get(self, state.o_path)
    bias = getattr(o, "bias", None)
    out = (bias.to(hidden.dtype).expand(*lead, -1) if bias is not None
           else hidden.new_zeros(*lead, _output_width(o)))                          # [B, S, D_out]
    if state.spec.empty_returns == "o_output+residual":
        out = out + _argument(bound, state.spec.residual_arg)                      # [B, S, D]
    return out, None


_SURGERY_CLASSES: dict[type, type] = {}


def _surgery_class(cls: type) -> type:
    """The subclass of `cls` with `_surgery_forward` (one per class, registered for pickling)."""
    if getattr(cls, "_headscope_base", None) is not None:
        return cls
    if cls not in _SURGERY_CLASSES:
        name = f"Pruned{cls.__name__}"
        sub = type(name, (cls,), {"forward": _surgery_forward, "_headscope_base": cls,
                                  "_headscope_signature": inspect.signature(cls.forward),
                                  "__module__": __name__, "__qualname__": name})
        globals()[name] = sub
        _SURGERY_CLASSES[cls] = sub
    return _SURGERY_CLASSES[cls]


def _install_surgery_state(module: nn.Module, state: _SurgeryState) -> None:
    module.__class__ = _surgery_class(type(module))
    module._headscope_surgery = state


class Adapter:
    """The head-shaped view of one architecture family. Stateless: every call takes the model."""

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
        return _get(model.base_model, self.family.layers)

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return _get(self.layers(model)[layer], self.family.attn)

    def o_proj(self, model: nn.Module, layer: int) -> nn.Module:
        """The output projection; its input is [..., H*d], one head after another."""
        return _get(self.attention(model, layer), self.family.layout.o)

    def projection_modules(self, model: nn.Module, layer: int) -> dict[str, nn.Module]:
        """Role ("q","k","v","o" or "qkv","o") -> the projection module of that layer."""
        attn = self.attention(model, layer)
        return {role: _get(attn, path) for role, path in self.family.layout.paths().items()}

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
        with torch.no_grad():
            hw = self.family.layout.split(self._tensors(model, layer), g)
            return hw.map(lambda t: t.detach().clone())

    def write_heads(self, model: nn.Module, layer: int, hw: HeadWeights) -> None:
        """Copy `hw` back into the model's parameters in place (same shapes as read_heads gave)."""
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

    # -- surgery (physically smaller attention; see the SURGERY table) -----------------------
    def surgery_spec(self) -> SurgerySpec:
        """This family's surgery row (UnsupportedModelError where surgery cannot be exact)."""
        spec = SURGERY.get(self.model_type)
        if spec is None:
            raise UnsupportedModelError(f"'{self.model_type}' has no surgery entry yet (analysis/adapters.py SURGERY); "
                                        f"export the zeroed-weights checkpoint instead.")
        if spec.unsupported:
            raise UnsupportedModelError(spec.unsupported)
        return spec

    def replace_projections(self, model: nn.Module, layer: int, hw: HeadWeights, n_heads: int,
                             n_kv_heads: int) -> None:
        """Swap `layer`'s Q/K/V/O modules for new ones of the sizes in `hw` (head-major, see
        HeadWeights; hw.q [H', d, D], hw.k/v [H_kv', d, D], hw.o [H', d, D_out]) and set the head
        counts the family's forward reads. H' = 0 leaves zero-width projections (see empty_attention)."""
        spec = self.surgery_spec()
        if hw.q.shape[0] != n_heads or hw.k.shape[0] != n_kv_heads:
            raise ValueError(f"replace_projections: {hw.q.shape[0]} query / {hw.k.shape[0]} KV heads in the "
                             f"weights, told {n_heads} / {n_kv_heads}.")
        if n_heads and n_heads % max(n_kv_heads, 1):
            raise ValueError(f"replace_projections: {n_heads} query heads do not share {n_kv_heads} KV heads evenly.")
        merged = self.family.layout.merge(hw)
        attn = self.attention(model, layer)
        builders = _projection_builders()
        for role, path in self.family.layout.paths().items():
            old = _get(attn, path)
            build = next((b for t, b in builders.items() if isinstance(old, t)), None)
            if build is None:
                raise UnsupportedModelError(f"{self.model_type}: cannot resize a {type(old).__name__} projection.")
            weight = merged[f"{role}.weight"].to(old.weight.dtype)
            bias = merged.get(f"{role}.bias")
            new = build(weight, None if bias is None else bias.to(old.weight.dtype))
            new.train(old.training)
            new.weight.requires_grad_(old.weight.requires_grad)
            _set_path(attn, path, new)
        d = hw.q.shape[1]
        values = {"heads": n_heads, "kv_heads": n_kv_heads, "width": n_heads * d,
                  "groups": n_heads // n_kv_heads if n_kv_heads else 1}
        config_overrides = {}
        for path, quantity in spec.head_attrs.items():
            if path.startswith("config."):
                config_overrides[path[len("config."):]] = values[quantity]
            else:
                owner, _, name = path.rpartition(".")
                setattr(_get(attn, owner), name, values[quantity])
        if config_overrides:
            attn.config = _ConfigView(_shared_config(attn.config), config_overrides)

    def set_head_inputs(self, model: nn.Module, layer: int, kept: list[int], n_heads: int, head_dim: int) -> None:
        """Make per-head inputs from outside the layer (Bloom's ALiBi) follow the kept heads `kept`."""
        spec = self.surgery_spec()
        if not spec.per_head_kwargs:
            return
        attn = self.attention(model, layer)
        _install_surgery_state(attn, _SurgeryState(spec=spec, kept=torch.as_tensor(kept, dtype=torch.long),
                                                   n_heads=n_heads, head_dim=head_dim))

    def empty_attention(self, model: nn.Module, layer: int, head_dim: int) -> None:
        """`layer` has no heads left: its attention returns exactly O's bias (what the masked model
        computes), keeping the KV cache's length right. Call after replace_projections(..., 0, 0)."""
        spec = self.surgery_spec()
        attn = self.attention(model, layer)
        core = _get(attn, spec.core)
        o_path = self.family.layout.o if not spec.core else ""
        _install_surgery_state(core, _SurgeryState(spec=spec, empty=True, head_dim=head_dim, o_path=o_path))

    def stock_config(self, config, n_heads: int, n_kv_heads: int, head_dim: int):
        """A copy of `config` from which stock Hugging Face code builds every layer with n_heads
        query heads, n_kv_heads KV heads of size head_dim; UnsupportedModelError where it cannot."""
        spec = self.surgery_spec()
        g = self.geometry(config)
        if (n_heads, n_kv_heads) == (g.n_heads, g.n_kv_heads):
            return copy.deepcopy(_shared_config(config))
        if spec.stock_config is None:
            raise UnsupportedModelError(spec.stock_refusal or f"'{self.model_type}' configs cannot describe pruned heads.")
        values = {"heads": n_heads, "kv_heads": n_kv_heads, "head_dim": head_dim}
        new = copy.deepcopy(_shared_config(config))
        try:
            for key, quantity in spec.stock_config.items():
                setattr(new, key, values[quantity])
            getattr(new, "validate", lambda: None)()
        except Exception as err:     # transformers' own config checks (StrictDataclass... errors)
            reason = str(err).strip().splitlines()[-1].strip()
            raise UnsupportedModelError(
                f"transformers rejects a {self.model_type} config with {n_heads} query / {n_kv_heads} KV heads per "
                f"layer ({reason}). Choose a sparsity that keeps an allowed head count per layer, or export the "
                f"head-layout checkpoint instead.") from err
        return new


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
        f"{', '.join(SUPPORTED_MODEL_TYPES)}. Adding one is a row in analysis/adapters.py FAMILIES.")
