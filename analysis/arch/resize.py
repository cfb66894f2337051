"""Surgery mechanics: how a family's attention is physically resized (what analysis/compress/surgery.py calls).

`analysis.arch.adapters` is the read-only head view (which tensors are a family's Q/K/V/O and how heads
are laid out in them); this module changes modules: it builds smaller projections, sets the
head counts a family's forward reads, gives a module a per-module view of a shared config
(`_ConfigView`), and switches attention blocks that lose every head (or that take per-head inputs)
to a subclass whose forward handles that. The subclasses are made once per class with `type()`
and kept in `_SURGERY_CLASSES`, owned by this module. Every function takes the family's Adapter.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from analysis.arch.adapters import Adapter, HeadWeights, submodule_at
from analysis.core.errors import UnsupportedModelError

Tensor = torch.Tensor

# Physically removing heads needs more family knowledge than the head view, kept here as a
# second lookup table (`SURGERY`, keyed by model_type like adapters.FAMILIES):
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
            f"size. Export the head-layout checkpoint (load it with analysis.compress.export.load_pruned) "
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
                                       "pruned heads. Export the head-layout checkpoint (analysis.compress.export."
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
    setattr(submodule_at(root, parent), name, value)


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
    o = submodule_at(self, state.o_path)
    bias = getattr(o, "bias", None)
    out = (bias.to(hidden.dtype).expand(*lead, -1) if bias is not None
           else hidden.new_zeros(*lead, _output_width(o)))                          # [B, S, D_out]
    if state.spec.empty_returns == "o_output+residual":
        out = out + _argument(bound, state.spec.residual_arg)                      # [B, S, D]
    return out, None


_SURGERY_CLASSES: dict[type, type] = {}


def _surgery_class(cls: type) -> type:
    """The subclass of `cls` with `_surgery_forward`, made once per class and kept in _SURGERY_CLASSES."""
    if getattr(cls, "_headscope_base", None) is not None:
        return cls
    if cls not in _SURGERY_CLASSES:
        name = f"Pruned{cls.__name__}"
        _SURGERY_CLASSES[cls] = type(name, (cls,), {"forward": _surgery_forward, "_headscope_base": cls,
                                                    "_headscope_signature": inspect.signature(cls.forward),
                                                    "__module__": __name__, "__qualname__": name})
    return _SURGERY_CLASSES[cls]


def __getattr__(name: str) -> type:
    """Module attribute lookup of a made class by name (what pickle does), without writing globals."""
    for sub in _SURGERY_CLASSES.values():
        if sub.__name__ == name:
            return sub
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_surgery_state(module: nn.Module, state: _SurgeryState) -> None:
    module.__class__ = _surgery_class(type(module))
    module._headscope_surgery = state


def surgery_spec(adapter: Adapter) -> SurgerySpec:
    """This family's surgery row (UnsupportedModelError where surgery cannot be exact)."""
    spec = SURGERY.get(adapter.model_type)
    if spec is None:
        raise UnsupportedModelError(f"'{adapter.model_type}' has no surgery entry yet (analysis/arch/resize.py SURGERY); "
                                    f"export the zeroed-weights checkpoint instead.")
    if spec.unsupported:
        raise UnsupportedModelError(spec.unsupported)
    return spec

def replace_projections(adapter: Adapter, model: nn.Module, layer: int, hw: HeadWeights, n_heads: int,
                        n_kv_heads: int) -> None:
    """Swap `layer`'s Q/K/V/O modules for new ones of the sizes in `hw` (head-major, see
    HeadWeights; hw.q [H', d, D], hw.k/v [H_kv', d, D], hw.o [H', d, D_out]) and set the head
    counts the family's forward reads. H' = 0 leaves zero-width projections (see empty_attention)."""
    spec = surgery_spec(adapter)
    if hw.q.shape[0] != n_heads or hw.k.shape[0] != n_kv_heads:
        raise ValueError(f"replace_projections: {hw.q.shape[0]} query / {hw.k.shape[0]} KV heads in the "
                         f"weights, told {n_heads} / {n_kv_heads}.")
    if n_heads and n_heads % max(n_kv_heads, 1):
        raise ValueError(f"replace_projections: {n_heads} query heads do not share {n_kv_heads} KV heads evenly.")
    merged = adapter.family.layout.merge(hw)
    attn = adapter.attention(model, layer)
    builders = _projection_builders()
    for role, path in adapter.family.layout.paths().items():
        old = submodule_at(attn, path)
        build = next((b for t, b in builders.items() if isinstance(old, t)), None)
        if build is None:
            raise UnsupportedModelError(f"{adapter.model_type}: cannot resize a {type(old).__name__} projection.")
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
            setattr(submodule_at(attn, owner), name, values[quantity])
    if config_overrides:
        attn.config = _ConfigView(_shared_config(attn.config), config_overrides)

def set_head_inputs(adapter: Adapter, model: nn.Module, layer: int, kept: list[int], n_heads: int,
                    head_dim: int) -> None:
    """Make per-head inputs from outside the layer (Bloom's ALiBi) follow the kept heads `kept`."""
    spec = surgery_spec(adapter)
    if not spec.per_head_kwargs:
        return
    attn = adapter.attention(model, layer)
    _install_surgery_state(attn, _SurgeryState(spec=spec, kept=torch.as_tensor(kept, dtype=torch.long),
                                               n_heads=n_heads, head_dim=head_dim))

def empty_attention(adapter: Adapter, model: nn.Module, layer: int, head_dim: int) -> None:
    """`layer` has no heads left: its attention returns exactly O's bias (what the masked model
    computes), keeping the KV cache's length right. Call after replace_projections(..., 0, 0)."""
    spec = surgery_spec(adapter)
    attn = adapter.attention(model, layer)
    core = submodule_at(attn, spec.core)
    o_path = adapter.family.layout.o if not spec.core else ""
    _install_surgery_state(core, _SurgeryState(spec=spec, empty=True, head_dim=head_dim, o_path=o_path))

# accelerate's dispatch hooks (`module._hf_hook`, a hook or a SequentialHook of `.hooks`) hold
# the offloaded weights (`weights_map`: a state dict or memory-mapped files) and one map of tied
# parameters per model (`tied_params_map`); a structural twin shares these, never copies them.
_HOOK_SHARED_ATTRS = ("weights_map", "tied_params_map")


def dispatch_shared(model: nn.Module) -> list[object]:
    """accelerate's per-model data objects that `surgery.structural_twin` must share with the
    original instead of deep-copying (the twin gets new hook objects pointing at them)."""
    shared = []
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for part in getattr(hook, "hooks", (hook,)) if hook is not None else ():
            shared.extend(value for name in _HOOK_SHARED_ATTRS
                          if (value := getattr(part, name, None)) is not None)
    return shared


def stock_config(adapter: Adapter, config, n_heads: int, n_kv_heads: int, head_dim: int):
    """A copy of `config` from which stock Hugging Face code builds every layer with n_heads
    query heads, n_kv_heads KV heads of size head_dim; UnsupportedModelError where it cannot."""
    spec = surgery_spec(adapter)
    g = adapter.geometry(config)
    if (n_heads, n_kv_heads) == (g.n_heads, g.n_kv_heads):
        return copy.deepcopy(_shared_config(config))
    if spec.stock_config is None:
        raise UnsupportedModelError(spec.stock_refusal or f"'{adapter.model_type}' configs cannot describe pruned heads.")
    values = {"heads": n_heads, "kv_heads": n_kv_heads, "head_dim": head_dim}
    new = copy.deepcopy(_shared_config(config))
    try:
        for key, quantity in spec.stock_config.items():
            setattr(new, key, values[quantity])
        getattr(new, "validate", lambda: None)()
    except Exception as err:     # transformers' own config checks (StrictDataclass... errors)
        reason = str(err).strip().splitlines()[-1].strip()
        raise UnsupportedModelError(
            f"transformers rejects a {adapter.model_type} config with {n_heads} query / {n_kv_heads} KV heads per "
            f"layer ({reason}). Choose a sparsity that keeps an allowed head count per layer, or export the "
            f"head-layout checkpoint instead.") from err
    return new
