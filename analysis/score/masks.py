"""From head scores to a pruning mask: global ranking, policies, the KV-group rule, summaries.

Ranking (docs/DEFINITIONS.md): all L*H heads ascending by score; ties broken by the plain
magnitude tie-break (ascending), then by (layer, head): one stable sort by score of the heads
taken in tie-break order (which weight-only scorers sort once per profile). The mask at sparsity s prunes the
first k = floor(s * L * H) heads of that order (a 1e-9 guard absorbs float error, so
s = 0.29 on 100 heads prunes 29). A KV group is pruned when all of its query heads are.

Policies (`default_policy`: "groups" on GQA models, which never grows the model; "global" on MHA):
- "global" (the paper's setting; `plan_mask`'s default argument): exactly k heads, wherever the ranking puts them.
- "min-per-layer": still exactly k heads, walking the same order but skipping heads of
  layers that already have only `min_per_layer` heads left (InputError if k cannot fit).
- "uniform": floor(s * H) heads in every layer (the lowest-ranked within each layer), so an
  export keeps one head count for all layers; the total is L * floor(s * H) <= k.
- "balanced" (GQA): in each layer l the same number c_l of query heads from every KV group (the
  lowest-ranked of each group), so K/V never expand; the c_l are chosen by score (one "slice" =
  the next-lowest head of every group of a layer, slices taken by ascending summed score).
  Feasible totals are multiples of Hkv; "balanced-uniform": the same c in every layer (one stock
  config), feasible totals multiples of L * Hkv.
- "groups" (GQA): whole KV groups (G query heads + their K/V rows), ranked by their heads' summed
  score; feasible totals are multiples of G.
  Where k is not feasible these prune the nearest feasible count (ties: the smaller) and the
  plan's `note` says so; InputError with the feasible sparsities when that count would be 0.
  On MHA (G = 1) no mask expands K/V: balanced is global, balanced-uniform is uniform, groups
  (of one head) equals global; the plan records the policy actually used.

What surgery makes of a mask (`plan_layout`, shared with analysis.compress.surgery) and every number
shown for a mask (`surgery_counts`, `summarize_mask`) follow the same per-layer layout: kept
query heads, and the KV heads they need -- one per kept group when every kept group keeps the
same number of heads, else one copy per kept query head (uneven groups: K/V expanded).

Each policy is one `MaskPolicy` record in the registry `POLICIES` (name, label, help, where it applies,
its planner, and for the GQA policies their step), registered once with `register_policy`; the CLI's
--policy, the app's policy box and its link field, and `plan_mask` read the registry.

Everything here is numpy on [L, H] arrays: a new mask after a z or sparsity change is a sort
of L*H numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from analysis.core.errors import InputError
from analysis.core.registry import Registry
from analysis.arch.geometry import kv_groups_emptied
from analysis.arch.window import read_keys

KV_POLICIES = ("auto", "expand", "strict")
DEFAULT_GQA_POLICY = "groups"   # never grows the model; on SmolLM2 it beats balanced at 25 % and 50 % (docs/results.md)


def default_policy(group_size: int) -> str:
    """The mask policy a model gets unless one is chosen: "groups" on GQA / MQA models (G > 1: whole KV
    groups go, so K/V and the KV cache shrink with the queries and surgery never copies K/V; on SmolLM2
    at 25 % it removes 24.4 % of the attention at perplexity 54.3, where "balanced" gives 161.5,
    docs/results.md), "global" on MHA models (the paper's setting; with G = 1 no policy can grow the model)."""
    return DEFAULT_GQA_POLICY if int(group_size) > 1 else "global"


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
    requested: int = -1  # k = floor(s * L * H) asked for (-1: not recorded)
    note: str = ""       # why n_pruned differs from `requested` (GQA policies' nearest feasible count)

    @classmethod
    def from_pruned(cls, pruned, group_size: int = 1, *, sparsity: float | None = None,
                    policy: str = "given") -> "MaskPlan":
        """A plan for a given mask [L, H] (e.g. read from mask.json); its order is (layer, head)."""
        p = np.asarray(pruned, dtype=bool)  # [L, H]
        n = int(p.sum())
        return cls(p, kv_pruned_from(p, group_size), float(n / p.size if sparsity is None else sparsity), policy,
                   ranking=(np.where(p.reshape(-1), 0.0, 1.0), np.arange(p.size)), requested=n)

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
        """Gates [L, H] for `analysis.arch.head_gates.head_mask`: 1 keep, 0 prune."""
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
    spec = policy_of(policy)
    if group_size < 1 or H % group_size:
        raise InputError(f"KV group size {group_size} does not divide {H} heads.")
    if group_size == 1 and spec.mha_equivalent:
        spec = POLICIES[spec.mha_equivalent]
    flat = scores.reshape(-1)  # [L*H]
    ranking = Ranking(flat, _resolve_tie_order(flat, tiebreak, tie_order), heads_to_prune(sparsity, L * H), L, H,
                      group_size, float(sparsity), int(min_per_layer))
    pruned, note = spec.plan(ranking)
    pruned = pruned.reshape(L, H)  # [L, H]
    plan = MaskPlan(pruned, kv_pruned_from(pruned, group_size), float(sparsity), spec.name,
                    ranking.min_per_layer if spec.takes_m else 0, (flat, ranking.tie_order), ranking.k, note)
    if "order" in ranking.__dict__:
        plan.__dict__["order"] = ranking.order  # fill the cached property: no second sort
    return plan


@dataclass
class Ranking:
    """What a policy's planner reads: the scores flat [L*H], the tie order [L*H], k = floor(s * L * H),
    the shape, the sparsity and min_per_layer; `order` (the whole prune-first order) is sorted on first use."""
    flat: np.ndarray
    tie_order: np.ndarray
    k: int
    L: int
    H: int
    G: int
    sparsity: float
    min_per_layer: int = 1

    @cached_property
    def order(self) -> np.ndarray:
        return _rank(self.flat, self.tie_order)  # [L*H]


@dataclass(frozen=True)
class MaskPolicy:
    """One mask policy, registered once (`register_policy`): what the CLI, the app and `plan_mask` read."""
    name: str                                         # the CLI / URL name
    label: str                                        # what the app's policy box shows (short)
    help: str                                         # one line: the CLI's help, the app's tooltip
    plan: Callable[[Ranking], tuple[np.ndarray, str]]  # -> (pruned [L*H] bool, note: why the count differs from k)
    gqa: bool = False                                 # differs from other policies only on GQA models (G > 1)
    mha_equivalent: str = ""                          # the policy it is on MHA models (G = 1), if another
    step: Callable[[int, int, int], int] | None = None  # (L, H, G) -> the head count it prunes in steps of
    unit: Callable[[int, int, int], str] | None = None  # (L, H, G) -> that step in words
    takes_m: bool = False                             # reads min_per_layer ("keep at least m heads per layer")


POLICIES: Registry = Registry("mask policy")


def register_policy(policy: MaskPolicy) -> MaskPolicy:
    """Add a mask policy to the registry; InputError for a taken name (the same record again is a no-op)."""
    return POLICIES.add(policy.name, policy)


def policy_of(name: str) -> MaskPolicy:
    """The registered policy; InputError naming the choices otherwise."""
    return POLICIES.of(name)


def feasible_counts(policy: str, n_layers: int, n_heads: int, group_size: int) -> np.ndarray:
    """Every head count a GQA policy can prune exactly (ascending, below L*H)."""
    step = policy_of(policy).step(n_layers, n_heads, group_size)
    return np.arange(0, n_layers * n_heads, step)  # [n]


def _nearest_feasible(policy: str, k: int, L: int, H: int, group_size: int, sparsity: float) -> tuple[int, str]:
    """(the feasible count nearest k -- ties go to the smaller --, a note when it is not k).
    InputError listing the nearest feasible sparsities when that count is 0 but k is not."""
    counts = feasible_counts(policy, L, H, group_size)  # [n]
    best = int(counts[np.argmin(np.abs(counts - k))])  # argmin takes the first (smaller) of a tie
    if best == k:
        return k, ""
    unit = policy_of(policy).unit(L, H, group_size)
    options = ", ".join(f"{c / (L * H):.4g} ({c} heads)" for c in counts[counts > 0][:4])
    if best == 0:
        raise InputError(f"The {policy!r} policy cannot prune {k} of {L * H} heads (sparsity {sparsity:g}): it "
                         f"prunes in steps of {unit}, and the nearest feasible count is 0. Feasible "
                         f"sparsities: {options or 'none below 1'}; or use the global policy.")
    return best, (f"{policy}: {k} heads requested (sparsity {sparsity:g}) is not a multiple of {unit}; pruning "
                  f"the nearest feasible count, {best} (sparsity {best / (L * H):.4g}).")


def _rank_positions(order: np.ndarray) -> np.ndarray:
    """rank [L*H]: the position of each flat head in the prune-first order."""
    rank = np.empty(order.size, dtype=np.int64)  # [L*H]
    rank[order] = np.arange(order.size)
    return rank


def _group_slices(flat: np.ndarray, order: np.ndarray, L: int, H: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and KV group its heads in prune-first order: heads [L, G, Hkv] (flat indices;
    heads[l, c, g] is the (c+1)-th lowest of group g in layer l) and their scores [L, G, Hkv]."""
    rank = _rank_positions(order).reshape(L, H // G, G)  # [L, Hkv, G]
    within = np.argsort(rank, axis=-1, kind="stable")  # [L, Hkv, G]
    base = (np.arange(L)[:, None, None] * H + np.arange(H // G)[None, :, None] * G)  # [L, Hkv, 1]
    heads = (base + within).transpose(0, 2, 1)  # [L, G, Hkv]
    return heads, flat[heads]


def _plan_balanced(r: Ranking) -> tuple[np.ndarray, str]:
    """c_l heads from every group of layer l: slices (one head per group) by ascending summed score."""
    L, H, G = r.L, r.H, r.G
    count, note = _nearest_feasible("balanced", r.k, L, H, G, r.sparsity)
    heads, values = _group_slices(r.flat, r.order, L, H, G)  # [L, G, Hkv] each
    rank = _rank_positions(r.order)  # [L*H]
    slice_score = values.sum(axis=-1).reshape(-1)  # [L*G] slice (l, c) -> summed score
    slice_rank = rank[heads].sum(axis=-1).reshape(-1)  # [L*G] tie-break: summed position in the order
    # within a layer slice c+1 scores >= slice c and ranks later, so this order takes them in turn
    chosen = np.lexsort((slice_rank, slice_score))[: count // (H // G)]  # [n slices]
    pruned = np.zeros(L * H, dtype=bool)  # [L*H]
    pruned[heads.reshape(L * G, -1)[chosen].reshape(-1)] = True
    return pruned, note


def _plan_balanced_uniform(r: Ranking) -> tuple[np.ndarray, str]:
    """The same c heads from every group of every layer (the c lowest-ranked of each group)."""
    L, H, G = r.L, r.H, r.G
    count, note = _nearest_feasible("balanced-uniform", r.k, L, H, G, r.sparsity)
    heads, _ = _group_slices(r.flat, r.order, L, H, G)  # [L, G, Hkv]
    pruned = np.zeros(L * H, dtype=bool)  # [L*H]
    pruned[heads[:, : count // (L * (H // G))].reshape(-1)] = True
    return pruned, note


def _plan_groups(r: Ranking) -> tuple[np.ndarray, str]:
    """Whole KV groups by ascending summed score of their G heads (then summed rank, then index)."""
    L, H, G = r.L, r.H, r.G
    count, note = _nearest_feasible("groups", r.k, L, H, G, r.sparsity)
    group_score = r.flat.reshape(-1, G).sum(axis=-1)  # [L*Hkv]
    group_rank = _rank_positions(r.order).reshape(-1, G).sum(axis=-1)  # [L*Hkv]
    chosen = np.lexsort((np.arange(group_score.size), group_rank, group_score))[: count // G]  # [n groups]
    pruned = np.zeros((L * H // G, G), dtype=bool)  # [L*Hkv, G]
    pruned[chosen] = True
    return pruned.reshape(-1), note


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


def _plan_uniform(r: Ranking) -> tuple[np.ndarray, str]:
    return _prune_uniform(r.order, r.L, r.H, int(math.floor(r.sparsity * r.H + _FLOOR_GUARD))), ""


# The built-in policies (docstring above). With G = 1 every mask keeps K/V aligned with the queries:
# balanced is the global policy there and balanced-uniform the uniform one.
for _policy in (
    MaskPolicy("global", "global: lowest anywhere (paper)",
               "the lowest-scored heads anywhere in the model: the paper's setting. On GQA models it leaves KV "
               "groups unevenly pruned, which surgery can only build by copying K/V (a bigger model).",
               lambda r: (_lowest(r.flat, r.tie_order, r.k), "")),
    MaskPolicy("min-per-layer", "min-per-layer: global, m kept", "global, but every layer keeps at least m heads.",
               lambda r: (_prune_keeping(r.order, r.k, r.L, r.H, r.min_per_layer), ""), takes_m=True),
    MaskPolicy("uniform", "uniform: same count per layer", "the same number of heads pruned in every layer.",
               _plan_uniform),
    MaskPolicy("balanced", "balanced (GQA): same per group",
               "(GQA) the same number pruned from every KV group, so K/V never expand.", _plan_balanced,
               gqa=True, mha_equivalent="global", step=lambda L, H, G: H // G,
               unit=lambda L, H, G: f"{H // G} heads (one per KV group of a layer)"),
    MaskPolicy("balanced-uniform", "balanced-uniform (GQA)",
               "(GQA) balanced, with one count in every layer: the pruned model is a stock config.",
               _plan_balanced_uniform, gqa=True, mha_equivalent="uniform", step=lambda L, H, G: L * (H // G),
               unit=lambda L, H, G: f"{L * (H // G)} heads (one per KV group in every layer)"),
    MaskPolicy("groups", "groups (GQA): whole KV groups",
               "(GQA) whole KV groups (a KV head with all its query heads): never makes the model bigger. "
               "The default on GQA models.", _plan_groups, gqa=True, step=lambda L, H, G: G,
               unit=lambda L, H, G: f"{G} heads (one whole KV group)"),
):
    register_policy(_policy)
del _policy
GQA_POLICIES = tuple(name for name, p in POLICIES.items() if p.step is not None)  # the built-ins that never expand K/V


def plan_layout(pruned, group_size: int, kv_policy: str = "auto") -> tuple[list[list[int]], list[list[int]]]:
    """The per-layer layout surgery builds for pruned [L, H]: (heads, kv_heads), where heads[l] are
    the kept query heads (ascending) and kv_heads[l] the original KV group each new KV head holds.

    A layer whose kept groups all keep the same number of heads keeps one KV head per kept group;
    otherwise (uneven, e.g. 2 + 1 + 0) -- or in every layer with kv_policy "expand" -- each kept
    query head gets its own copy of its group's K/V (G' = 1); "strict" refuses uneven layers."""
    if kv_policy not in KV_POLICIES:
        raise InputError(f"Unknown KV policy {kv_policy!r}; choose one of {', '.join(KV_POLICIES)}.")
    p = np.asarray(pruned, dtype=bool)  # [L, H]
    G = int(group_size)
    heads, kv_heads = [], []
    for layer in range(p.shape[0]):
        kept = [int(h) for h in np.flatnonzero(~p[layer])]
        per_group = np.bincount([h // G for h in kept], minlength=p.shape[1] // G)  # [Hkv]
        groups = [int(g) for g in np.flatnonzero(per_group)]
        even = len(set(per_group[groups].tolist())) <= 1
        if kv_policy == "strict" and not even:
            raise InputError(f"Layer {layer} keeps an uneven number of query heads per KV group "
                             f"({per_group.tolist()}); the 'strict' KV policy refuses to expand K/V. Use a "
                             f"'balanced' or 'groups' mask policy (K/V never expand), or kv_policy='auto'.")
        expand = G > 1 and bool(kept) and (kv_policy == "expand" or not even)
        heads.append(kept)
        kv_heads.append([h // G for h in kept] if expand else groups)
    return heads, kv_heads


def kv_cache_values(kv_counts: list[int], n_empty: int, head_dim: int) -> int:
    """K and V values cached per token: 2 * d per KV head, and a one-value placeholder for K and for
    V in a layer with no heads left (see analysis/arch/adapters.py, empty_attention)."""
    return 2 * int(sum(kv_counts)) * int(head_dim) + 2 * int(n_empty)


@dataclass(frozen=True)
class SurgeryCounts:
    """What `analysis.compress.surgery.prune_heads(model, pruned, kv_policy=...)` will produce, counted
    from `plan_layout` before any surgery: per-layer (query, KV) heads, attention parameters,
    attention FLOPs for one sequence of seq_len tokens, KV-cache bytes per token and the change of
    the checkpoint's tensor bytes. "removed" numbers are dense - pruned: negative means growth."""

    kv_policy: str
    layer_counts: list            # [L] (H'_l, Hkv'_l)
    expanded_layers: list         # layers whose K/V are copied per query head
    empty_layers: list            # layers with no head left
    kv_heads: int                 # L * Hkv before
    kv_heads_after: int
    attention_params: int         # before (Q/K/V weights and biases, O weights; O's bias is kept)
    attention_params_after: int
    seq_len: int
    attention_flops: int
    attention_flops_after: int
    dtype_bytes: int
    kv_cache_bytes_per_token: int
    kv_cache_bytes_per_token_after: int
    warnings: list

    @property
    def params_removed(self) -> int:
        return self.attention_params - self.attention_params_after

    @property
    def attention_flops_removed(self) -> int:
        return self.attention_flops - self.attention_flops_after

    @property
    def kv_heads_removed(self) -> int:
        return self.kv_heads - self.kv_heads_after

    @property
    def kv_cache_ratio(self) -> float:
        return self.kv_cache_bytes_per_token_after / self.kv_cache_bytes_per_token

    @property
    def checkpoint_bytes_change(self) -> int:
        """Change of the weights' bytes in a checkpoint (tensor data; the file header aside)."""
        return -self.params_removed * self.dtype_bytes

    def as_dict(self) -> dict:
        out = dict(self.__dict__)
        out.update(params_removed=self.params_removed, attention_flops_removed=self.attention_flops_removed,
                   kv_heads_removed=self.kv_heads_removed, kv_cache_ratio=self.kv_cache_ratio,
                   checkpoint_bytes_change=self.checkpoint_bytes_change)
        return out


def surgery_counts(pruned, *, group_size: int, head_dim: int, hidden: int, seq_len: int = 512,
                   bias: bool = False, kv_policy: str = "auto", dtype_bytes: int = 4) -> SurgeryCounts:
    """Count what surgery of pruned [L, H] under `kv_policy` produces (see SurgeryCounts)."""
    if int(seq_len) < 1:
        raise InputError(f"Sequence length for the FLOP count must be >= 1; got {seq_len}.")
    p = np.asarray(pruned, dtype=bool)  # [L, H]
    L, H = p.shape
    Hkv = H // int(group_size)
    heads, kv_heads = plan_layout(p, group_size, kv_policy)
    costs = attention_costs(head_dim, hidden, seq_len, bias=bias)
    counts = [(len(h), len(kv)) for h, kv in zip(heads, kv_heads)]
    n_q = sum(c[0] for c in counts)
    n_kv = sum(c[1] for c in counts)
    expanded = [layer for layer, kv in enumerate(kv_heads) if len(kv) > len(set(kv))]
    empty = [layer for layer, (h, _) in enumerate(counts) if h == 0]
    cache_before = kv_cache_values([Hkv] * L, 0, head_dim) * int(dtype_bytes)
    cache_after = kv_cache_values([c[1] for c in counts], len(empty), head_dim) * int(dtype_bytes)
    result = SurgeryCounts(
        kv_policy=kv_policy, layer_counts=counts, expanded_layers=expanded, empty_layers=empty,
        kv_heads=L * Hkv, kv_heads_after=n_kv,
        attention_params=L * (H * costs["head_params"] + Hkv * costs["group_params"]),
        attention_params_after=n_q * costs["head_params"] + n_kv * costs["group_params"],
        seq_len=int(seq_len),
        attention_flops=L * (H * costs["head_flops"] + Hkv * costs["group_flops"]),
        attention_flops_after=n_q * costs["head_flops"] + n_kv * costs["group_flops"],
        dtype_bytes=int(dtype_bytes), kv_cache_bytes_per_token=cache_before,
        kv_cache_bytes_per_token_after=cache_after, warnings=[])
    result.warnings.extend(_growth_warnings(result, p, int(group_size)))
    return result


def _growth_warnings(c: SurgeryCounts, pruned: np.ndarray, G: int) -> list[str]:
    """Say where the pruned model is not smaller than the numbers suggest, why, and what avoids it."""
    if not c.expanded_layers:
        return []
    layer = c.expanded_layers[0]
    kept = (~pruned[layer]).reshape(-1, G).sum(axis=1)  # [Hkv] kept query heads per group
    cause = ("kv_policy 'expand' copies K/V for every kept query head" if c.kv_policy == "expand" else
             f"they keep uneven numbers of query heads per KV group (layer {layer}: "
             f"{' + '.join(str(int(n)) for n in kept)}), which GQA's shared K/V cannot express, so surgery "
             f"copies K/V for every kept query head")
    fix = ("use kv_policy 'auto'" if c.kv_policy == "expand" else
           "the 'balanced', 'balanced-uniform' or 'groups' mask policy never expands K/V (kv_policy 'strict' "
           "refuses such masks)")
    growth = (f"the attention GROWS by {-c.params_removed:,} parameters" if c.params_removed < 0 else
              f"only {c.params_removed:,} attention parameters are removed")
    return [f"K/V are expanded in {len(c.expanded_layers)} of {len(c.layer_counts)} layers because {cause}: "
            f"{growth}, and the KV cache per token becomes {c.kv_cache_ratio:.3g}x the dense one. To avoid it, "
            f"{fix}."]


@dataclass(frozen=True)
class MaskSummary:
    """What a mask removes once surgery builds it. Mask-level counts here; everything surgery
    decides -- KV heads, params, FLOPs, KV cache, checkpoint bytes, per-layer counts -- is
    `surgery` (a SurgeryCounts under kv_policy), whose fields and properties read through, e.g.
    `summary.params_removed`. Removed = dense - pruned, so a negative number is growth."""

    n_heads: int
    n_pruned: int
    requested: int
    note: str
    pruned_per_layer: list
    zero_score_heads: int
    zero_score_pruned: int
    kv_removed_per_layer: list
    warnings: list
    surgery: SurgeryCounts

    def __getattr__(self, name):
        if name == "surgery":               # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.surgery, name)

    @property
    def params_removed_fraction(self) -> float:
        return self.params_removed / self.attention_params

    @property
    def flops_removed_fraction(self) -> float:
        return self.attention_flops_removed / self.attention_flops

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "surgery"}
        out.update({k: v for k, v in self.surgery.as_dict().items() if k != "warnings"})
        out.update(params_removed_fraction=self.params_removed_fraction,
                   flops_removed_fraction=self.flops_removed_fraction)
        return out


def attention_costs(head_dim: int, hidden: int, seq_len: int, *, bias: bool = False) -> dict[str, int]:
    """Parameters and FLOPs of one query head (Q rows + O columns, attention) and one KV head.

    q_head params d*D (+d) + d*D; kv head params 2*(d*D (+d)). FLOPs per sequence of T tokens, causal (each
    query reads the keys up to its own: read_keys(T, T) = T (T + 1) / 2 pairs, docs/DEFINITIONS.md "FLOPs"):
    query head 2*T*D*d (Q) + 2*d per pair (QK^T) + 2*d per pair (AV) + 2*T*d*D (O); KV head 2 * 2*T*D*d.
    """
    d, D, T = int(head_dim), int(hidden), int(seq_len)
    b = d if bias else 0
    return dict(
        head_params=d * D + b + d * D,
        group_params=2 * (d * D + b),
        head_flops=2 * T * D * d + 4 * d * read_keys(T, T) + 2 * T * d * D,
        group_flops=4 * T * D * d,
    )


def summarize_mask(plan: MaskPlan, scores=None, *, head_dim: int, hidden: int, seq_len: int = 512,
                   bias: bool = False, kv_policy: str = "auto", dtype_bytes: int = 4) -> MaskSummary:
    """Counts for `plan`: pruned heads per layer, zero-score heads, and -- from the layout surgery
    builds under `kv_policy` -- KV heads, params, FLOPs, KV cache and checkpoint bytes removed."""
    L, H = plan.pruned.shape
    zero = np.zeros((L, H), dtype=bool) if scores is None else (_check_scores(scores) == 0)  # [L, H]
    c = surgery_counts(plan.pruned, group_size=plan.group_size, head_dim=head_dim, hidden=hidden, seq_len=seq_len,
                       bias=bias, kv_policy=kv_policy, dtype_bytes=dtype_bytes)
    per_layer = plan.pruned.sum(axis=1)  # [L]
    Hkv = plan.kv_pruned.shape[1]
    warnings = ([plan.note] if plan.note else []) + list(c.warnings)
    if c.empty_layers:
        warnings.append(f"Layers {c.empty_layers} lose every head (their attention outputs only O's bias). "
                        f"The min-per-layer policy keeps some heads in every layer.")
    return MaskSummary(
        n_heads=L * H,
        n_pruned=plan.n_pruned,
        requested=plan.requested if plan.requested >= 0 else plan.n_pruned,
        note=plan.note,
        pruned_per_layer=per_layer.tolist(),
        zero_score_heads=int(zero.sum()),
        zero_score_pruned=int((zero & plan.pruned).sum()),
        kv_removed_per_layer=[Hkv - kv for _, kv in c.layer_counts],
        warnings=warnings,
        surgery=c,
    )


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Overlap of two pruned masks [L, H]: |a & b| / |a | b|; 1.0 when both prune nothing (identical)."""
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise InputError(f"Cannot compare masks of shapes {list(a.shape)} and {list(b.shape)}.")
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union
