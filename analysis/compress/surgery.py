"""Model surgery: physically remove pruned heads from a copy of a model.

`prune_heads(model, pruned)` makes a structural twin of the model and, per layer, keeps only the
Q rows and O columns of the kept query heads and the K/V rows of the KV heads they still use, so
the twin has smaller projections and per-layer head counts and computes what the masked model
computes (`analysis.arch.head_gates.head_mask` with the same mask). The input model is never changed.

Memory (weight sharing): the twin (`structural_twin`) has new module objects and its own config
(and every other piece of Python state), but every parameter and buffer is SHARED with the input
model: a plain parameter becomes a new `nn.Parameter` over the same storage (so `requires_grad_`,
`.to()` / `.half()` on the twin rebind the twin's own objects and leave the original alone); a
buffer, or a parameter subclass with state of its own (quantized), is the same tensor object.
Surgery then replaces only the projections that change, so its extra memory is those new
projections, not a second model. accelerate's dispatch state (`_hf_hook`s) gets new hook
objects that share the offloaded-weight and tied-parameter maps (`resize.dispatch_shared`):
copying them would copy the offloaded weights. Other plain tensor attributes of modules (rare,
small) are copied.
Writing into the twin's untouched tensors in place (an optimizer step, `zero_heads`, LoRA
merges) would write into the original: anything that trains or edits a pruned model must own
its weights first: `prune_heads(..., share=False)` or `own_tensors(model, original)` (the one
place that un-shares; `analysis.compress.recover.distill.distill` calls it on every student). `in_place=True`
reshapes the given model itself (the caller gives it up; no twin at all).

GQA groups (H query heads share H_kv KV heads, G = H / H_kv per group):
- a KV group whose query heads are all pruned loses its K/V rows;
- if every kept group keeps the same number c of query heads, the layer keeps the group
  structure (H' = c * H_kv' query heads, G' = c);
- otherwise (uneven groups, e.g. 2 + 1) no group structure expresses the layer, so K/V are
  expanded: one KV head per kept query head (a copy of its group's K/V rows), G' = 1. That
  costs K/V parameters and KV-cache memory; `HeadLayout.kv_cache_report()` says how much.
  kv_policy "expand" does this in every layer (uniform layers for a stock export), "strict"
  refuses instead.
- a layer with no heads left keeps only O's bias: its attention outputs exactly that bias (and
  caches a one-value placeholder per token so the KV cache's length stays right).

What surgery will build for a mask is planned in `analysis.score.masks.plan_layout` (shared with the
counts every page shows); `predicted_counts(model, pruned)` counts it before any copy is made.

`HeadLayout` records, per layer, the kept original query heads and, for each new KV head, the
original KV head it copies; it is saved as head_layout.json next to a pruned checkpoint and is
all `apply_layout` needs to rebuild the smaller shapes on a freshly built model.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from analysis.arch import resize

from analysis.core import schemas
from analysis.arch.adapters import Adapter, HeadWeights, adapter_for
from analysis.core.errors import InputError
from analysis.arch.geometry import HeadGeometry
from analysis.score.masks import KV_POLICIES, SurgeryCounts, kv_cache_values, plan_layout, surgery_counts  # noqa: F401
LAYOUT_FORMAT = 1


@dataclass
class HeadLayout:
    """Which heads a pruned model keeps. heads[l]: kept original query heads (ascending);
    kv_heads[l]: for each KV head of the pruned layer, the original KV head it holds."""
    model_type: str
    n_heads: int                     # original H
    n_kv_heads: int                  # original H_kv
    head_dim: int                    # d (unchanged by pruning)
    heads: list[list[int]]           # [L][H'_l]
    kv_heads: list[list[int]]        # [L][H_kv'_l]
    kv_policy: str = "auto"
    format: int = field(default=LAYOUT_FORMAT)
    rounds: list[list[int]] | None = None   # [L][H] round of an iterative run that pruned each head (0 = kept)

    # -- derived -------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.heads)

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def layer_counts(self, layer: int) -> tuple[int, int]:
        """(H'_l, H_kv'_l) of one pruned layer."""
        return len(self.heads[layer]), len(self.kv_heads[layer])

    def kv_expanded(self, layer: int) -> bool:
        """True where the layer holds more KV heads than distinct original groups (copies)."""
        return len(self.kv_heads[layer]) > len(set(self.kv_heads[layer]))

    @property
    def empty_layers(self) -> list[int]:
        return [layer for layer, kept in enumerate(self.heads) if not kept]

    @property
    def is_identity(self) -> bool:
        return all(self.layer_counts(layer) == (self.n_heads, self.n_kv_heads) for layer in range(self.n_layers))

    def uniform_counts(self) -> tuple[int, int] | None:
        """(H', H_kv') when every layer has the same non-zero counts, else None."""
        counts = {self.layer_counts(layer) for layer in range(self.n_layers)}
        if len(counts) != 1:
            return None
        (h, kv), = counts
        return (h, kv) if h > 0 else None

    def pruned_mask(self) -> np.ndarray:
        """The boolean mask [L, H] (True = pruned) this layout keeps the complement of."""
        pruned = np.ones((self.n_layers, self.n_heads), dtype=bool)   # [L, H]
        for layer, kept in enumerate(self.heads):
            pruned[layer, kept] = False
        return pruned

    def kv_cache_report(self) -> dict:
        """KV heads per layer before/after and KV-cache values per token (K and V, all layers).

        An emptied layer caches a 1-value placeholder per token for K and for V (see
        analysis/arch/resize.py), counted here."""
        before = [self.n_kv_heads] * self.n_layers
        after = [len(kv) for kv in self.kv_heads]
        values_before = kv_cache_values(before, 0, self.head_dim)
        values_after = kv_cache_values(after, len(self.empty_layers), self.head_dim)
        return {"kv_heads_before": before, "kv_heads_after": after,
                "expanded_layers": [layer for layer in range(self.n_layers) if self.kv_expanded(layer)],
                "empty_layers": self.empty_layers,
                "cache_values_per_token_before": values_before,
                "cache_values_per_token_after": values_after,
                "cache_ratio": values_after / values_before}

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict) -> "HeadLayout":
        """Rebuild and validate a layout (schemas.LAYOUT_SCHEMA's exact types, then `validate`)."""
        schemas.check(data, schemas.LAYOUT_SCHEMA, "head_layout.json", "export the pruned model again")
        layout = cls(model_type=data["model_type"], n_heads=data["n_heads"], n_kv_heads=data["n_kv_heads"],
                     head_dim=data["head_dim"], heads=[list(row) for row in data["heads"]],
                     kv_heads=[list(row) for row in data["kv_heads"]], kv_policy=data.get("kv_policy", "auto"),
                     format=data.get("format", LAYOUT_FORMAT),
                     rounds=None if data.get("rounds") is None else [list(row) for row in data["rounds"]])
        layout.validate()
        return layout

    @classmethod
    def from_json(cls, text: str) -> "HeadLayout":
        return cls.from_dict(schemas.load_json_text(text, "head_layout.json", "export the pruned model again"))

    def validate(self) -> None:
        if self.format > LAYOUT_FORMAT:
            raise InputError(f"head_layout.json has format {self.format}; this headscope reads up to "
                             f"{LAYOUT_FORMAT}. Update headscope.")
        if len(self.heads) != len(self.kv_heads) or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise InputError("head_layout.json: heads/kv_heads disagree with the head counts; export again.")
        if self.kv_policy not in KV_POLICIES:
            raise InputError(f"head_layout.json: kv_policy {str(self.kv_policy)[:40]!r} is not one of "
                             f"{', '.join(KV_POLICIES)}; export the pruned model again.")
        for layer, (heads, kv) in enumerate(zip(self.heads, self.kv_heads)):
            ok = (heads == sorted(set(heads)) and all(0 <= h < self.n_heads for h in heads)
                  and all(0 <= g < self.n_kv_heads for g in kv) and (heads or not kv)
                  and (not heads or (kv and len(heads) % len(kv) == 0)))
            if ok and heads:
                per_kv = len(heads) // len(kv)
                ok = all(self._group(h) == kv[i // per_kv] for i, h in enumerate(heads))
            if not ok:
                raise InputError(f"head_layout.json: layer {layer} is inconsistent (heads {heads}, KV heads "
                                 f"{kv}); export the pruned model again.")
            if self.kv_policy == "strict" and len(kv) > len(set(kv)):
                raise InputError(f"head_layout.json: kv_policy 'strict' never copies a KV head, but layer {layer} "
                                 f"holds copies ({kv}); export the pruned model again.")

        if self.rounds is not None and (np.asarray(self.rounds).shape != (self.n_layers, self.n_heads)
                                        or not np.array_equal(np.asarray(self.rounds) > 0, self.pruned_mask())
                                        or np.asarray(self.rounds).min() < 0):
            raise InputError("head_layout.json: the rounds table does not match the pruned heads; export again.")

    def _group(self, head: int) -> int:
        return head // self.group_size

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_mask(cls, pruned, geometry: HeadGeometry, model_type: str, kv_policy: str = "auto") -> "HeadLayout":
        """The layout that keeps the complement of `pruned` [L, H] under `kv_policy`."""
        p = np.asarray(pruned, dtype=bool)
        L, H = geometry.n_layers, geometry.n_heads
        if p.shape != (L, H):
            raise InputError(f"Mask must have shape [{L}, {H}] (layers x heads); got {list(p.shape)}.")
        heads, kv_heads = plan_layout(p, geometry.group_size, kv_policy)   # the plan masks.py counts
        layout = cls(model_type=model_type, n_heads=H, n_kv_heads=geometry.n_kv_heads,
                     head_dim=geometry.head_dim, heads=heads, kv_heads=kv_heads, kv_policy=kv_policy)
        layout.validate()
        return layout


def select_heads(hw: HeadWeights, heads: list[int], kv_heads: list[int]) -> HeadWeights:
    """The head-major weights of the kept heads: q/o rows `heads`, k/v rows `kv_heads` (repeats
    allowed: an expanded KV head is a copy). Shapes [H', d, D], [H_kv', d, D], O's bias as is."""
    q_idx = torch.as_tensor(heads, dtype=torch.long)          # [H']
    kv_idx = torch.as_tensor(kv_heads, dtype=torch.long)      # [H_kv']
    pick = lambda t, idx: None if t is None else t.index_select(0, idx)  # noqa: E731  (new memory)
    return HeadWeights(q=pick(hw.q, q_idx), k=pick(hw.k, kv_idx), v=pick(hw.v, kv_idx), o=pick(hw.o, q_idx),
                       q_bias=pick(hw.q_bias, q_idx), k_bias=pick(hw.k_bias, kv_idx),
                       v_bias=pick(hw.v_bias, kv_idx),
                       o_bias=None if hw.o_bias is None else hw.o_bias.clone())


def apply_layout(model: nn.Module, layout: HeadLayout, *, adapter: Adapter | None = None) -> nn.Module:
    """Reshape `model` IN PLACE to `layout`, keeping the selected heads' current weights.

    On a model that still has the original shapes (a copy you own or a `structural_twin`, or one
    freshly built from the original config before loading a pruned checkpoint's weights). Only
    the resized layers' projections are replaced (new modules); no tensor is written in place.
    Returns `model`."""
    adapter = adapter or adapter_for(model)
    resize.surgery_spec(adapter)                # UnsupportedModelError before touching anything
    geometry = adapter.geometry(model)
    if (geometry.n_layers, geometry.n_heads, geometry.n_kv_heads, geometry.head_dim) != (
            layout.n_layers, layout.n_heads, layout.n_kv_heads, layout.head_dim):
        raise InputError(f"The head layout is for {layout.n_layers} layers x {layout.n_heads} heads "
                         f"({layout.n_kv_heads} KV, head size {layout.head_dim}) but the model has "
                         f"{geometry.n_layers} x {geometry.n_heads} ({geometry.n_kv_heads} KV, "
                         f"{geometry.head_dim}). Use the config saved with the pruned checkpoint.")
    for layer in range(layout.n_layers):
        n_heads, n_kv = layout.layer_counts(layer)
        if (n_heads, n_kv) == (geometry.n_heads, geometry.n_kv_heads):
            continue                            # nothing removed or copied in this layer
        hw = select_heads(adapter.read_heads(model, layer, geometry), layout.heads[layer], layout.kv_heads[layer])
        resize.replace_projections(adapter, model, layer, hw, n_heads, n_kv)
        if n_heads == 0:
            resize.empty_attention(adapter, model, layer, geometry.head_dim)
        else:
            resize.set_head_inputs(adapter, model, layer, layout.heads[layer], geometry.n_heads, geometry.head_dim)
    return model


def predicted_counts(model: nn.Module, pruned, *, kv_policy: str = "auto", seq_len: int = 512,
                     adapter: Adapter | None = None) -> SurgeryCounts:
    """`analysis.score.masks.surgery_counts` of pruned [L, H] for this model (its geometry, biases, dtype):
    what `prune_heads(model, pruned, kv_policy=kv_policy)` will produce, before doing it."""
    adapter = adapter or adapter_for(model)
    g = adapter.geometry(model)
    return surgery_counts(pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden, seq_len=seq_len,
                          bias=adapter.has_qkv_bias(model), kv_policy=kv_policy,
                          dtype_bytes=next(model.parameters()).element_size())


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """What the twin holds for one of the model's tensors: a plain parameter becomes a new
    parameter over the same storage (as torch's `Parameter.__deepcopy__` builds it, without the
    clone); a buffer, or a parameter subclass with state of its own (quantized weights), is
    shared as the same object."""
    if type(tensor) is nn.Parameter:
        return nn.Parameter(tensor.data, tensor.requires_grad)
    return tensor


def structural_twin(model: nn.Module) -> nn.Module:
    """A copy of `model` whose modules, config and other Python state are new while every
    parameter and buffer shares the original's storage (see the module doc; ties are kept:
    a tensor reached twice maps to one alias). Costs no tensor memory; `model` is not changed."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = _alias(tensor)
    for shared in resize.dispatch_shared(model):
        memo[id(shared)] = shared
    return copy.deepcopy(model, memo)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(device, storage address) of a tensor with memory; None for meta / empty storage."""
    if tensor.device.type == "meta":
        return None
    address = tensor.untyped_storage().data_ptr()
    return (str(tensor.device), address) if address else None


def shared_tensors(model: nn.Module, other: nn.Module) -> list[str]:
    """Names of `model`'s parameters and buffers whose storage is also used by `other`'s."""
    theirs = {_storage_key(t) for t in (*other.parameters(), *other.buffers())} - {None}
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return [name for name, t in named if _storage_key(t) in theirs]


def own_tensors(model: nn.Module, others: nn.Module | Iterable[nn.Module]) -> nn.Module:
    """Give `model` its own copy of every parameter and buffer whose storage it shares with
    `others` (a model or several), so training or editing `model` in place cannot change them.
    Tied tensors stay tied; tensors already owned are left alone. Returns `model` (changed)."""
    others = [others] if isinstance(others, nn.Module) else list(others)
    theirs = {_storage_key(t) for o in others for t in (*o.parameters(), *o.buffers())} - {None}
    copies: dict[int, torch.Tensor] = {}

    def owned(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            copies[id(tensor)] = copy.deepcopy(tensor)      # what a deep copy of the model would hold
        return copies[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and _storage_key(tensor) in theirs:
                    table[name] = owned(tensor)
    return model


def prune_heads(model: nn.Module, pruned, *, adapter: Adapter | None = None, kv_policy: str = "auto",
                rounds=None, share: bool = True, in_place: bool = False) -> tuple[nn.Module, HeadLayout]:
    """A physically smaller copy of `model` without the heads where pruned [L, H] is True.

    The copy computes what `head_mask(model, 1 - pruned)` computes; `model` is not changed.
    share=True (default): the copy is a `structural_twin`: every untouched parameter and buffer
    is the original's storage (read-only use: evaluation, timing, export); share=False: the
    copy owns all its weights (`own_tensors`; for training). in_place=True: `model` itself is
    reshaped and returned (the caller gives up the original; `share` does not matter).
    rounds: optional int [L, H], the round of an iterative run that pruned each head (0 = kept),
    recorded in the layout. Returns (pruned_model, layout)."""
    adapter = adapter or adapter_for(model)
    resize.surgery_spec(adapter)
    geometry = adapter.geometry(model)
    layout = HeadLayout.from_mask(pruned, geometry, adapter.model_type, kv_policy)
    if rounds is not None:
        layout.rounds = np.asarray(rounds, dtype=np.int64).tolist()
        layout.validate()
    if in_place:
        return apply_layout(model, layout, adapter=adapter), layout
    twin = apply_layout(structural_twin(model), layout, adapter=adapter)
    return (twin if share else own_tensors(twin, model)), layout
