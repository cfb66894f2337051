"""The predicted cost of a KV plan at a context, counted without building anything: FLOPs of prefill and of
one decode step, and the bytes a decode step reads (weights + KV cache), dense vs the plan. For the app's
live view (every grid edit): the same numbers as analysis.compress.kvspeed's predictions, which count on
the physically pruned twin (`planned_flops`; building the twin takes a second or two on SmolLM2).

Conventions are kvspeed's (`planned_flops`, `read_keys`): a matmul of an [n, k] input with a [k, m] weight is
2*n*k*m FLOPs; the attention scores QK^T and AV cost 4*d FLOPs per (query, key) pair, each query reading every
earlier key (itself included, causal) for a full KV head and at most sinks + recent for a windowed one; a
prefill of `context` tokens computes the LM head on its last token only (a generation's prefill). Under a plan:
- a **pruned** KV head removes its K and V rows and its G query heads' Q rows and O columns from the matmuls
  (what surgery removes) and all their attention scores;
- a **windowed** KV head's G query heads read at most sinks + recent keys per query;
- a decode step reads every matmul weight once and the whole KV cache once (`KVPlan.kv_bytes`): on most
  hardware a decode step is bound by these reads, so the bytes ratio is the closer prediction of decode
  speed, the FLOP ratio of prefill speed.

What it assumes: kernels that skip the keys outside a window and a cache that holds only the kept tokens
(headscope's compact cache, analysis.compress.kvruntime). Measured speeds: analysis.compress.kvspeed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.arch.adapters import adapter_for
from analysis.core.errors import check_whole_number
from analysis.compress.kvspeed import read_keys
from analysis.compress.speed import forward_flops

SIDES = ("dense", "plan")


@dataclass(frozen=True)
class PlanCost:
    """One side (dense or the plan) at one context: FLOPs and bytes."""
    prefill_flops: int          # a forward of `context` tokens (the LM head on the last one)
    decode_flops: int           # one new token at `context` tokens of cache
    weight_bytes: int           # matmul weights read per decode step
    kv_bytes: int               # the KV cache at `context` (read once per decode step)

    @property
    def decode_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class PlanPrediction:
    """Dense and the plan at `context` tokens, `dtype_bytes` per value; ratios are dense / plan (above 1 = the
    plan is cheaper)."""
    context: int
    dtype_bytes: int
    dense: PlanCost
    plan: PlanCost

    def ratio(self, what: str) -> float:
        """dense / plan of a PlanCost field ("prefill_flops", "decode_flops", "decode_bytes", "kv_bytes")."""
        a, b = getattr(self.dense, what), getattr(self.plan, what)
        return float("inf") if b == 0 else float(a / b)

    def rows(self) -> list[dict]:
        """The table the app shows (and a JSON report can keep)."""
        mib = 2 ** 20
        out = []
        for what, name, scale, unit in (("prefill_flops", f"prefill of {self.context:,} tokens", 1e9, "GFLOP"),
                                        ("decode_flops", "one decode step", 1e9, "GFLOP"),
                                        ("decode_bytes", "bytes read per decode step (weights + KV)", mib, "MiB"),
                                        ("kv_bytes", "KV cache", mib, "MiB")):
            out.append({"what": name, "unit": unit, "dense": getattr(self.dense, what) / scale,
                        "plan": getattr(self.plan, what) / scale, "dense / plan": self.ratio(what)})
        return out


def predict(model, plan, context: int, *, dtype_bytes: int | None = None, adapter=None) -> PlanPrediction:
    """Dense vs `plan` (a KVPlan of the model's geometry) at `context` tokens. `dtype_bytes`: bytes per
    weight and cached value (default: the model's parameters')."""
    context = check_whole_number(context, "The context length", low=1)
    adapter = adapter or adapter_for(model)
    g = adapter.geometry(model)
    plan.check_geometry(g)
    if dtype_bytes is None:
        dtype_bytes = next(model.parameters()).element_size()
    d, D, G = g.head_dim, g.hidden, g.group_size
    weights = forward_flops(model, 1, 1, adapter=adapter).matmul // 2              # weights of every matmul
    head = model.get_output_embeddings()
    lm_head = head.weight.numel() if head is not None else 0                        # a prefill's logits: last token
    c = plan.counts()
    removed = c["prune"] * (G * 2 * d * D + 2 * d * D)                             # Q rows + O columns, K + V rows
    band = plan.window.size

    def cost(kept_weights: int, full_heads: int, window_heads: int, kv_bytes: int) -> PlanCost:
        def scores(tokens: int) -> int:                                             # QK^T and AV over the keys read
            return 4 * d * (full_heads * read_keys(tokens, context, context)
                            + window_heads * read_keys(tokens, context, band))
        return PlanCost(prefill_flops=2 * context * kept_weights - 2 * (context - 1) * lm_head + scores(context),
                        decode_flops=2 * kept_weights + scores(1), weight_bytes=kept_weights * dtype_bytes,
                        kv_bytes=kv_bytes)

    dense_kv = 2 * d * dtype_bytes * context * g.n_layers * g.n_kv_heads
    return PlanPrediction(context, int(dtype_bytes), cost(weights, g.n_layers * g.n_heads, 0, dense_kv),
                          cost(weights - removed, G * c["full"], G * c["window"],
                               plan.kv_bytes(context, head_dim=d, dtype_bytes=dtype_bytes)))


def kv_curve(plan, contexts, *, head_dim: int, dtype_bytes: int) -> np.ndarray:
    """[n] KV-cache bytes of `plan` at each of `contexts`."""
    return np.array([plan.kv_bytes(int(c), head_dim=head_dim, dtype_bytes=dtype_bytes) for c in contexts])
