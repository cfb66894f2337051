"""The predicted cost of a cut: FLOPs and bytes, counted, nothing timed (the measured side: analysis.compress.timing).

One FLOP convention, for the dense model and every kind of cut alike (docs/DEFINITIONS.md, "FLOPs"):
- a matmul of an [n, k] input with a [k, m] weight is 2*n*k*m FLOPs, over every matmul module (attention
  projections, MLP, LM head); embedding lookups, norms, activations and softmax are not counted;
- the attention scores (QK^T and AV) are 4*d FLOPs per (query, key) pair, causal: each query reads every earlier
  key and itself (what SDPA's causal kernel computes: a prefill of S tokens is S (S + 1) / 2 pairs per query
  head, a decode step at context C is C pairs), a windowed KV head's query heads at most sinks + recent keys
  (analysis.arch.window.read_keys, the one count);
- the LM head runs on `logits` positions: every token of a forward unless told otherwise; a generation's prefill
  (logits_to_keep=1, what the speed report times on a causal LM and what `predict` counts) computes it on the
  last token only.

The count is of the model that runs:
- `forward_flops(model, ...)` counts a model as it is (a dense model, a pruned twin, an export folder's model):
  its matmul weights, the query heads of each of its layers (`Adapter.query_heads`: O's input width) and, when
  it runs under a KV plan's windows, which of its KV heads are windowed;
- `cut_flops(dense, cut, ...)` counts what a cut deploys without building it (the app's live views): a mask as
  surgery will cut it (`analysis.score.masks.surgery_counts` under kv_policy: its heads and weights), a plan as
  `kv_plan_model`'s twin (pruned KV heads removed with their query heads, windowed ones on the window), a model
  of its own on itself. Equal to `forward_flops` on analysis.compress.kvruntime.physical(cut) (tested).

`predict(dense, cut, context)` puts dense and the cut side by side at a context: prefill and decode FLOPs, the
bytes a decode step reads (every matmul weight once and the whole KV cache once: on most hardware decode is
bound by these reads, so their ratio is the closer prediction of decode speed, the FLOP ratio of prefill's),
and the KV cache's bytes. What it assumes: kernels that skip the keys outside a window and a cache that holds
only the kept tokens (headscope's compact cache, analysis.arch.kvcache).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import nn

from analysis.arch.adapters import Adapter, adapter_for
from analysis.arch.cut import Cut
from analysis.arch.kvcache import windowed_rows
from analysis.arch.resize import matmul_module_types
from analysis.arch.window import Window, read_keys
from analysis.core.errors import InputError, check_whole_number
from analysis.score.masks import surgery_counts

FLOP_NOTE = (
    "FLOPs are counted, not measured: 2 per multiply-add of every matmul (attention projections, MLP, LM head) "
    "plus the attention scores over the keys each query reads, causal (each query its earlier keys and itself: "
    "S (S + 1) / 2 pairs per head for a prefill of S tokens, what SDPA's causal kernel computes; at most sinks + "
    "recent for a windowed KV head); a causal LM's prefill computes the LM head on its last token only, as a "
    "generation does and as it is timed here.")


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one forward: every matmul module, of which the attention projections, plus the attention scores
    (QK^T and AV)."""
    matmul: int
    attention_projections: int
    attention_scores: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention_scores

    @property
    def attention(self) -> int:
        return self.attention_projections + self.attention_scores


@dataclass(frozen=True)
class Shape:
    """What a FLOP count reads of the model that runs: weights of its matmuls, of its attention projections and of
    its LM head, and per layer the query heads reading every earlier key (`full`) or the window (`windowed`)."""
    matmul: int                      # weight elements of every distinct matmul module (a tied LM head included)
    projections: int                 # of which the attention projections (Q, K, V, O)
    lm_head: int                     # of which the LM head (0: none)
    full: list                       # [L] query heads reading every earlier key
    windowed: list                   # [L] query heads reading at most the window
    head_dim: int
    window: Window | None = None


def _matmul_weights(model: nn.Module) -> int:
    """Sum of weight elements over distinct matmul modules (a tied LM head is still a matmul)."""
    types = matmul_module_types()
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, types) and id(module) not in seen:
            seen.add(id(module))
            total += module.weight.numel()
    return total


def attention_weights(model: nn.Module, adapter: Adapter | None = None) -> int:
    """Weight elements of the attention projections (Q, K, V, O) of every layer of `model`."""
    adapter = adapter or adapter_for(model)
    return sum(m.weight.numel() for layer in range(len(adapter.layers(model)))
               for m in adapter.projection_modules(model, layer).values())


def _lm_head(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    return head.weight.numel() if head is not None else 0


def shape_of(model: nn.Module, *, windowed=None, window: Window | None = None,
             adapter: Adapter | None = None) -> Shape:
    """The Shape of `model` as it is; windowed: [L][Hkv_l] bool rows of its own KV heads running on `window`
    (None: every head full)."""
    adapter = adapter or adapter_for(model)
    heads = adapter.query_heads(model)
    if windowed is None:
        reads = [0] * len(heads)
    else:
        if window is None:
            raise ValueError("Windowed KV heads need their window.")
        rows = [np.asarray(r, dtype=bool).reshape(-1) for r in windowed]
        reads = [int(h * r.sum()) // max(r.size, 1) for h, r in zip(heads, rows)]   # G'_l query heads each
    return Shape(_matmul_weights(model), attention_weights(model, adapter), _lm_head(model),
                 [h - w for h, w in zip(heads, reads)], reads, adapter.geometry(model).head_dim, window)


def cut_shape(dense: nn.Module, cut: Cut | None, *, kv_policy: str = "auto", adapter: Adapter | None = None) -> Shape:
    """The Shape of what `cut` deploys, from the dense model and the cut alone (nothing built; module docstring)."""
    adapter = adapter or adapter_for(dense)
    if cut is None:
        return shape_of(dense, adapter=adapter)
    if cut.kind == "model":
        return (shape_of(cut.model) if cut.plan is None else
                shape_of(cut.model, windowed=windowed_rows(cut.rows), window=cut.plan.window))
    g = adapter.geometry(dense)
    base = shape_of(dense, adapter=adapter)
    policy = "strict" if cut.kind == "plan" else kv_policy
    counts = surgery_counts(cut.mask, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden, bias=False,
                            kv_policy=policy)            # weights only: the removed Q / K / V rows and O columns
    removed = counts.params_removed
    if cut.kind == "plan":
        windowed = [int(n) * g.group_size for n in cut.plan.windowed.sum(axis=1)]      # a plan never prunes these
    else:
        windowed = [0] * g.n_layers
    full = [h - w for (h, _), w in zip(counts.layer_counts, windowed)]
    return Shape(base.matmul - removed, base.projections - removed, base.lm_head, full, windowed, g.head_dim,
                 None if cut.plan is None else cut.plan.window)


def count(shape: Shape, tokens: int, context: int, *, logits: int | None = None) -> FlopCount:
    """FLOPs of the last `tokens` tokens of a context of `context` (a prefill: tokens = context; a decode step:
    tokens = 1) on a model of this Shape; the LM head on `logits` of them (None: every one)."""
    tokens = check_whole_number(tokens, "The tokens counted", low=1)
    context = check_whole_number(context, "The context", low=tokens)
    logits = tokens if logits is None else check_whole_number(logits, "The LM head's positions", low=0, high=tokens)
    pairs = sum(shape.full) * read_keys(tokens, context)
    if sum(shape.windowed):
        pairs += sum(shape.windowed) * shape.window.read_keys(tokens, context)
    return FlopCount(matmul=2 * tokens * shape.matmul - 2 * (tokens - logits) * shape.lm_head,
                     attention_projections=2 * tokens * shape.projections,
                     attention_scores=4 * shape.head_dim * pairs)


def forward_flops(model: nn.Module, tokens: int, context: int, *, windowed=None, window: Window | None = None,
                  logits: int | None = None, adapter: Adapter | None = None) -> FlopCount:
    """FLOPs of `model` as it is (module docstring) for the last `tokens` tokens of `context`: a prefill of S tokens
    is (S, S), a decode step at context C is (1, C). windowed / window: its KV heads on a window (`shape_of`);
    logits: the LM head's positions (None: every token; a generation's prefill: 1)."""
    return count(shape_of(model, windowed=windowed, window=window, adapter=adapter), tokens, context, logits=logits)


def cut_flops(dense: nn.Module, cut: Cut | None, tokens: int, context: int, *, logits: int | None = None,
              kv_policy: str = "auto", adapter: Adapter | None = None) -> FlopCount:
    """FLOPs of what `cut` deploys (None: the dense model), counted without building it; == forward_flops on
    physical(cut, dense)."""
    return count(cut_shape(dense, cut, kv_policy=kv_policy, adapter=adapter), tokens, context, logits=logits)


def kv_bytes(dense: nn.Module, cut: Cut | None, context: int, *, kv_policy: str = "auto",
             dtype_bytes: int | None = None, adapter: Adapter | None = None) -> int | None:
    """Bytes of the KV cache after `context` tokens of what `cut` deploys (batch 1): a plan's (or a model under a
    plan's) compact cache `KVPlan.kv_bytes`, a mask's pruned twin's cache (an emptied layer keeps one placeholder
    value per token for K and V: analysis.score.masks.kv_cache_values), the dense model's; None for a model of
    its own without a plan (measure it)."""
    adapter = adapter or adapter_for(dense)
    g = adapter.geometry(dense)
    size = next(dense.parameters()).element_size() if dtype_bytes is None else int(dtype_bytes)
    if cut is not None and cut.plan is not None:
        return cut.plan.kv_bytes(context, head_dim=g.head_dim, dtype_bytes=size)
    if cut is not None and cut.kind == "model":
        return None
    mask = np.zeros((g.n_layers, g.n_heads), bool) if cut is None else cut.mask
    counts = surgery_counts(mask, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden, kv_policy=kv_policy,
                            dtype_bytes=size)
    return counts.kv_cache_bytes_per_token_after * int(context)


@dataclass(frozen=True)
class Cost:
    """One side (dense or the cut) at one context: FLOPs and bytes."""
    prefill_flops: int          # a generation's prefill of `context` tokens (the LM head on the last one)
    decode_flops: int           # one new token at `context` tokens of cache
    weight_bytes: int           # matmul weights read per decode step
    kv_bytes: int               # the KV cache at `context` (read once per decode step)

    @property
    def decode_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Prediction:
    """Dense and the cut at `context` tokens, `dtype_bytes` per value; ratios are dense / cut (above 1 = the cut is
    cheaper)."""
    context: int
    dtype_bytes: int
    dense: Cost
    cut: Cost

    def ratio(self, what: str) -> float:
        """dense / cut of a Cost field ("prefill_flops", "decode_flops", "decode_bytes", "kv_bytes")."""
        a, b = getattr(self.dense, what), getattr(self.cut, what)
        return float("inf") if b == 0 else float(a / b)

    def rows(self, label: str = "cut") -> list[dict]:
        """The table the app shows (and a JSON report can keep); `label` names the cut's column."""
        mib = 2 ** 20
        out = []
        for what, name, scale, unit in (("prefill_flops", f"prefill of {self.context:,} tokens", 1e9, "GFLOP"),
                                        ("decode_flops", "one decode step", 1e9, "GFLOP"),
                                        ("decode_bytes", "bytes read per decode step (weights + KV)", mib, "MiB"),
                                        ("kv_bytes", "KV cache", mib, "MiB")):
            out.append({"what": name, "unit": unit, "dense": getattr(self.dense, what) / scale,
                        label: getattr(self.cut, what) / scale, f"dense / {label}": self.ratio(what)})
        return out


def predict(dense: nn.Module, cut: Cut, context: int, *, kv_policy: str = "auto", dtype_bytes: int | None = None,
            adapter: Adapter | None = None) -> Prediction:
    """Dense vs `cut` (a mask or a KV plan of the dense model's geometry, or a model of its own under a KV plan) at
    `context` tokens, counted (module docstring). dtype_bytes: bytes per weight and cached value (default: the
    dense model's parameters')."""
    context = check_whole_number(context, "The context length", low=1)
    adapter = adapter or adapter_for(dense)
    if not isinstance(cut, Cut):
        raise InputError(f"predict takes a Cut (Cut.of_mask, Cut.of_plan); got {type(cut).__name__}.")
    cut.check(adapter.geometry(dense))
    size = next(dense.parameters()).element_size() if dtype_bytes is None else int(dtype_bytes)

    def cost(side: Cut | None) -> Cost:
        shape = cut_shape(dense, side, kv_policy=kv_policy, adapter=adapter)
        kv = kv_bytes(dense, side, context, kv_policy=kv_policy, dtype_bytes=size, adapter=adapter)
        if kv is None:
            raise InputError("The KV cache of a model of its own without a KV plan is not counted; measure it "
                             "(analysis.compress.timing.measure).")
        return Cost(prefill_flops=count(shape, context, context, logits=1).total,
                    decode_flops=count(shape, 1, context).total, weight_bytes=shape.matmul * size, kv_bytes=kv)
    return Prediction(context, size, cost(None), cost(cut))


def kv_curve(plan, contexts, *, head_dim: int, dtype_bytes: int) -> np.ndarray:
    """[n] KV-cache bytes of `plan` at each of `contexts`."""
    return np.array([plan.kv_bytes(int(c), head_dim=head_dim, dtype_bytes=dtype_bytes) for c in contexts])

