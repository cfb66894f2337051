"""From head scores to a pruning mask: global ranking, policies, the KV-group rule, summaries.

Ranking (docs/DEFINITIONS.md): all L*H heads ascending by score; ties broken by the plain
magnitude tie-break (ascending), then by (layer, head): one stable sort by score of the heads
taken in tie-break order (which weight-only scorers sort once per profile). The mask at sparsity s prunes the
first k = floor(s * L * H) heads of that order (a 1e-9 guard absorbs float error, so
s = 0.29 on 100 heads prunes 29). A KV group is pruned when all of its query heads are.

Policies:
- "global" (default): exactly k heads, wherever the ranking puts them.
- "min-per-layer": still exactly k heads, walking the same order but skipping heads of
  layers that already have only `min_per_layer` heads left (InputError if k cannot fit).
- "uniform": floor(s * H) heads in every layer (the lowest-ranked within each layer), so an
  export keeps one head count for all layers; the total is L * floor(s * H) <= k.

Everything here is numpy on [L, H] arrays: a new mask after a z or sparsity change is a sort
of L*H numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from analysis.errors import InputError
from analysis.head_gates import kv_groups_emptied

POLICIES = ("global", "min-per-layer", "uniform")
_FLOOR_GUARD = 1e-9


def check_sparsity(sparsity: float) -> float:
    """Validate a head sparsity; InputError outside [0, 1) or NaN."""
    try:
        s = float(sparsity)
    except (TypeError, ValueError):
        raise InputError(f"Sparsity must be a number in [0, 1); got {sparsity!r}.") from None
    if math.isnan(s):
        raise InputError("Sparsity is NaN; use a fraction of heads to prune in [0, 1), e.g. 0.25.")
    if s == 1.0:
        raise InputError("Sparsity 1.0 would prune every head of the model; use a value below 1, e.g. 0.5.")
    if not 0.0 <= s < 1.0:
        raise InputError(f"Sparsity must be in [0, 1) (the fraction of heads to prune); got {s:g}.")
    return s


def heads_to_prune(sparsity: float, n_heads: int) -> int:
    """k = floor(s * n) for a validated sparsity, guarded against float error."""
    return int(math.floor(check_sparsity(sparsity) * n_heads + _FLOOR_GUARD))


def rank_heads(scores: np.ndarray, tiebreak: np.ndarray | None = None, *,
               tie_order: np.ndarray | None = None) -> np.ndarray:
    """Prune-first order of the flat head indices (layer * H + head) of scores [L, H].

    Ascending score, then ascending tie-break, then ascending (layer, head). Returns [L*H].
    `tie_order` (optional, [L*H]) is `tie_order_of(tiebreak)` when the caller has it cached: the
    tie-break's order does not change with z, so a scorer can sort it once per profile.
    """
    flat = _check_scores(scores).reshape(-1)  # [L*H]
    return _rank(flat, _resolve_tie_order(flat, tiebreak, tie_order))


def _resolve_tie_order(flat: np.ndarray, tiebreak: np.ndarray | None, tie_order: np.ndarray | None) -> np.ndarray:
    """The given tie order [L*H] (checked against the head count), else the tie-break's sort."""
    if tie_order is None:
        return tie_order_of(tiebreak, flat.size)  # [L*H]
    if tie_order.shape != flat.shape:
        raise InputError(f"tie order has {tie_order.size} entries but there are {flat.size} heads.")
    return tie_order


def _rank(flat: np.ndarray, tie_order: np.ndarray) -> np.ndarray:
    """A stable sort by score [L*H] of the heads taken in tie-break order keeps that order among equal scores."""
    return tie_order[np.argsort(flat[tie_order], kind="stable")]  # [L*H]


def _lowest(flat: np.ndarray, tie_order: np.ndarray, k: int) -> np.ndarray:
    """The first k heads of the ranking as a mask [L*H], without sorting all of it: every head
    below the k-th smallest score, then the heads equal to it, in tie-break order."""
    if k == 0:
        return np.zeros(flat.size, dtype=bool)  # [L*H]
    kth = np.partition(flat, k - 1)[k - 1]
    pruned = flat < kth  # [L*H]
    ties = tie_order[flat[tie_order] == kth]  # [t] heads scoring exactly kth, in tie-break order
    pruned[ties[: k - int(np.count_nonzero(pruned))]] = True
    return pruned


def tie_order_of(tiebreak: np.ndarray | None, n_heads: int) -> np.ndarray:
    """Flat head indices [n_heads] by ascending tie-break, then (layer, head); identity when None."""
    if tiebreak is None:
        return np.arange(n_heads)  # [L*H]
    tie = np.asarray(tiebreak, dtype=np.float64).reshape(-1)  # [L*H]
    if tie.size != n_heads:
        raise InputError(f"tie-break has {tie.size} entries but there are {n_heads} heads.")
    return np.argsort(tie, kind="stable")  # [L*H]


def _check_scores(scores) -> np.ndarray:
    scores = np.asarray(getattr(scores, "scores", scores), dtype=np.float64)
    if scores.ndim != 2 or scores.size == 0:
        raise InputError(f"Scores must be a non-empty [layers, heads] array; got shape {scores.shape}.")
    if not np.isfinite(scores).all():
        raise InputError("Some head scores are NaN or infinite, so heads cannot be ranked. Check the "
                         "model's weights (or the calibration text) and score again.")
    return scores


@dataclass(frozen=True)
class MaskPlan:
    """A pruning decision. pruned [L, H] and kv_pruned [L, Hkv] are boolean; order is [L*H].

    The global policy does not need the whole ranking, so `order` (the full prune-first order)
    is sorted on first access, from the scores and tie order the plan was made from.
    """

    pruned: np.ndarray
    kv_pruned: np.ndarray
    sparsity: float
    policy: str
    min_per_layer: int = 0
    ranking: tuple[np.ndarray, np.ndarray] = field(default=None, repr=False, compare=False)  # (flat, tie_order)

    @cached_property
    def order(self) -> np.ndarray:
        flat, tie_order = self.ranking
        return _rank(flat, tie_order)  # [L*H]

    @property
    def n_pruned(self) -> int:
        return int(self.pruned.sum())

    @property
    def group_size(self) -> int:
        return self.pruned.shape[1] // self.kv_pruned.shape[1]

    def gates(self) -> np.ndarray:
        """Gates [L, H] for `analysis.head_gates.head_mask`: 1 keep, 0 prune."""
        return (~self.pruned).astype(np.float32)


def kv_pruned_from(pruned: np.ndarray, group_size: int) -> np.ndarray:
    """[L, H] pruned -> [L, Hkv]: True where every query head of the KV group is pruned."""
    if group_size < 1 or pruned.shape[1] % group_size:
        raise InputError(f"KV group size {group_size} does not divide {pruned.shape[1]} heads.")
    return kv_groups_emptied(pruned, group_size)  # [L, Hkv]


def plan_mask(scores, sparsity: float, *, group_size: int = 1, tiebreak: np.ndarray | None = None,
              policy: str = "global", min_per_layer: int = 1) -> MaskPlan:
    """The mask at `sparsity` for scores [L, H] (or a HeadScores, whose tie-break is used)."""
    tie_order = None
    if tiebreak is None:
        tiebreak, tie_order = getattr(scores, "tiebreak", None), getattr(scores, "tie_order", None)
    scores = _check_scores(scores)
    L, H = scores.shape
    if policy not in POLICIES:
        raise InputError(f"Unknown mask policy {policy!r}; choose one of {', '.join(POLICIES)}.")
    flat = scores.reshape(-1)  # [L*H]
    tie_order = _resolve_tie_order(flat, tiebreak, tie_order)  # [L*H]
    k = heads_to_prune(sparsity, L * H)
    order = None if policy == "global" else _rank(flat, tie_order)  # [L*H]; the other policies walk it
    if policy == "global":
        pruned = _lowest(flat, tie_order, k)  # [L*H]
    elif policy == "min-per-layer":
        pruned = _prune_keeping(order, k, L, H, int(min_per_layer))
    else:
        pruned = _prune_uniform(order, L, H, int(math.floor(float(sparsity) * H + _FLOOR_GUARD)))
    pruned = pruned.reshape(L, H)  # [L, H]
    plan = MaskPlan(pruned, kv_pruned_from(pruned, group_size), float(sparsity), policy,
                    int(min_per_layer) if policy == "min-per-layer" else 0, (flat, tie_order))
    if order is not None:
        plan.__dict__["order"] = order  # fill the cached property: no second sort
    return plan


def _prune_keeping(order: np.ndarray, k: int, L: int, H: int, keep: int) -> np.ndarray:
    """Walk the global order, pruning k heads but never more than H - keep per layer."""
    if not 0 <= keep <= H:
        raise InputError(f"'keep at least m heads per layer' needs 0 <= m <= {H}; got {keep}.")
    cap = H - keep
    if k > L * cap:
        raise InputError(f"Pruning {k} heads while keeping {keep} of {H} heads in each of {L} layers is "
                         f"impossible (at most {L * cap}); lower the sparsity or m.")
    pruned = np.zeros(L * H, dtype=bool)  # [L*H]
    per_layer = np.zeros(L, dtype=int)  # [L]
    taken = 0
    for flat in order:
        if taken == k:
            break
        layer = flat // H
        if per_layer[layer] < cap:
            pruned[flat] = True
            per_layer[layer] += 1
            taken += 1
    return pruned


def _prune_uniform(order: np.ndarray, L: int, H: int, per_layer: int) -> np.ndarray:
    """Prune the `per_layer` lowest-ranked heads of every layer."""
    pruned = np.zeros(L * H, dtype=bool)  # [L*H]
    rank = np.empty(L * H, dtype=int)  # [L*H] position of each head in the global order
    rank[order] = np.arange(L * H)
    for layer in range(L):
        heads = np.arange(layer * H, (layer + 1) * H)  # [H]
        pruned[heads[np.argsort(rank[heads], kind="stable")[:per_layer]]] = True
    return pruned


@dataclass(frozen=True)
class MaskSummary:
    """What a mask removes. FLOPs are dense forward multiply-adds x2 for one sequence of seq_len."""

    n_heads: int
    n_pruned: int
    pruned_per_layer: list
    empty_layers: list
    zero_score_heads: int
    zero_score_pruned: int
    kv_heads: int
    kv_heads_removed: int
    kv_removed_per_layer: list
    params_removed: int
    attention_params: int
    seq_len: int
    attention_flops_removed: int
    attention_flops: int

    @property
    def params_removed_fraction(self) -> float:
        return self.params_removed / self.attention_params

    @property
    def flops_removed_fraction(self) -> float:
        return self.attention_flops_removed / self.attention_flops

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(params_removed_fraction=self.params_removed_fraction,
                   flops_removed_fraction=self.flops_removed_fraction)
        return out


def attention_costs(head_dim: int, hidden: int, seq_len: int, *, bias: bool = False) -> dict[str, int]:
    """Parameters and FLOPs of one query head (Q rows + O columns, attention) and one KV group.

    q_head params d*D (+d) + d*D; kv_group params 2*(d*D (+d)). FLOPs per sequence of T tokens:
    query head 2*T*D*d (Q) + 2*T*T*d (QK^T) + 2*T*T*d (AV) + 2*T*d*D (O); KV group 2 * 2*T*D*d.
    """
    d, D, T = int(head_dim), int(hidden), int(seq_len)
    b = d if bias else 0
    return dict(
        head_params=d * D + b + d * D,
        group_params=2 * (d * D + b),
        head_flops=2 * T * D * d + 4 * T * T * d + 2 * T * d * D,
        group_flops=4 * T * D * d,
    )


def summarize_mask(plan: MaskPlan, scores=None, *, head_dim: int, hidden: int, seq_len: int = 512,
                   bias: bool = False) -> MaskSummary:
    """Counts for `plan`: pruned heads per layer, zero-score heads, KV heads, params and FLOPs removed."""
    if int(seq_len) < 1:
        raise InputError(f"Sequence length for the FLOP count must be >= 1; got {seq_len}.")
    L, H = plan.pruned.shape
    Hkv = plan.kv_pruned.shape[1]
    zero = np.zeros((L, H), dtype=bool) if scores is None else (_check_scores(scores) == 0)  # [L, H]
    costs = attention_costs(head_dim, hidden, seq_len, bias=bias)
    n_pruned, n_kv = plan.n_pruned, int(plan.kv_pruned.sum())
    per_layer = plan.pruned.sum(axis=1)  # [L]
    return MaskSummary(
        n_heads=L * H,
        n_pruned=n_pruned,
        pruned_per_layer=per_layer.tolist(),
        empty_layers=[int(layer) for layer in np.flatnonzero(per_layer == H)],
        zero_score_heads=int(zero.sum()),
        zero_score_pruned=int((zero & plan.pruned).sum()),
        kv_heads=L * Hkv,
        kv_heads_removed=n_kv,
        kv_removed_per_layer=plan.kv_pruned.sum(axis=1).tolist(),
        params_removed=n_pruned * costs["head_params"] + n_kv * costs["group_params"],
        attention_params=L * (H * costs["head_params"] + Hkv * costs["group_params"]),
        seq_len=int(seq_len),
        attention_flops_removed=n_pruned * costs["head_flops"] + n_kv * costs["group_flops"],
        attention_flops=L * (H * costs["head_flops"] + Hkv * costs["group_flops"]),
    )


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Overlap of two pruned masks [L, H]: |a & b| / |a | b|; 1.0 when both prune nothing (identical)."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise InputError(f"Cannot compare masks of shapes {list(a.shape)} and {list(b.shape)}.")
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union
