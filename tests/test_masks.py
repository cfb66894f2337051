"""Masks: exactly floor(s*L*H) heads for every s, deterministic tie-breaks, the KV-group rule,
the policies (global, min-per-layer, uniform, balanced, groups), summaries counted by hand, and bad sparsity values."""

import math
from fractions import Fraction

import numpy as np
import pytest

from analysis.core.errors import InputError
from analysis.score.masks import (
    attention_costs,
    check_sparsity,
    plan_mask,
    rank_heads,
    summarize_mask,
    tie_order_of,
)
from analysis.score.scoring import MPGScorer, MPScorer
from tests._scoring_fixtures import HAND_ORDER_Z05, hand_profile, random_profile

SPARSITIES = [f"{i / 40:.3f}" for i in range(40)] + ["0.125", "0.29", "0.3", "0.7", "0.999"]


def _exact_k(s: str, n: int) -> int:
    return int(Fraction(s) * n)  # floor of the exact decimal


@pytest.mark.parametrize("shape,G", [((30, 9), 3), ((3, 2), 2), ((7, 5), 1), ((10, 10), 5)])
def test_global_mask_prunes_exactly_floor_s_l_h(shape, G):
    rng = np.random.default_rng(0)
    scores = rng.random(shape)
    for s in SPARSITIES:
        plan = plan_mask(scores, float(s), group_size=G)
        assert plan.n_pruned == _exact_k(s, scores.size), s
        # the pruned heads are the k lowest scores
        if plan.n_pruned:
            assert scores[plan.pruned].max() < scores[~plan.pruned].min()


def test_same_inputs_same_mask_and_hand_tie_break():
    profile = hand_profile()
    scores = MPScorer(z=0.5).score(profile)
    assert rank_heads(scores.scores, scores.tiebreak).tolist() == HAND_ORDER_Z05
    first = plan_mask(scores, 0.5, group_size=2)
    again = plan_mask(MPScorer(z=0.5).score(hand_profile()), 0.5, group_size=2)
    assert np.array_equal(first.pruned, again.pruned) and np.array_equal(first.order, again.order)
    # k = 3: both heads of layer 2 (smallest magnitude, tie -> head 0 first), then head 0 of layer 1
    assert first.pruned.tolist() == [[False, False], [True, False], [True, True]]


def test_without_tiebreak_ties_go_by_layer_then_head():
    scores = np.zeros((3, 2))
    scores[0, 0] = 1.0
    assert rank_heads(scores).tolist() == [1, 2, 3, 4, 5, 0]


def test_kv_rows_pruned_only_when_the_group_is_empty():
    rng = np.random.default_rng(1)
    scores = rng.random((6, 6))
    for s in ("0.2", "0.5", "0.8"):
        plan = plan_mask(scores, float(s), group_size=3)
        groups = plan.pruned.reshape(6, 2, 3)
        assert np.array_equal(plan.kv_pruned, groups.all(axis=-1))
    # a group with 2 of its 3 heads pruned keeps K/V
    scores = np.array([[0.0, 0.1, 9.0, 5.0, 6.0, 7.0]])
    plan = plan_mask(scores, 0.34, group_size=3)
    assert plan.pruned.tolist() == [[True, True, False, False, False, False]]
    assert plan.kv_pruned.tolist() == [[False, False]]
    plan = plan_mask(scores, 0.5, group_size=3)  # 3 heads: 0, 1 and 3 -> still no group empty
    assert plan.kv_pruned.tolist() == [[False, False]]
    plan = plan_mask(np.array([[0.0, 0.1, 0.2, 5.0, 6.0, 7.0]]), 0.5, group_size=3)
    assert plan.kv_pruned.tolist() == [[True, False]]


def test_keep_at_least_m_per_layer():
    scores = np.array([[0.0, 0.1, 0.2, 0.3], [5.0, 6.0, 7.0, 8.0]])
    plan = plan_mask(scores, 0.5, policy="min-per-layer", min_per_layer=2)
    assert plan.n_pruned == 4
    assert plan.pruned.tolist() == [[True, True, False, False], [True, True, False, False]]
    rng = np.random.default_rng(2)
    big = rng.random((8, 6))
    for s in ("0.1", "0.4", "0.66"):
        plan = plan_mask(big, float(s), policy="min-per-layer", min_per_layer=2)
        assert plan.n_pruned == _exact_k(s, 48)
        assert ((~plan.pruned).sum(axis=1) >= 2).all()
    with pytest.raises(InputError, match="impossible"):
        plan_mask(big, 0.7, policy="min-per-layer", min_per_layer=2)
    with pytest.raises(InputError):
        plan_mask(big, 0.1, policy="min-per-layer", min_per_layer=7)


def test_uniform_per_layer():
    rng = np.random.default_rng(3)
    scores = rng.random((5, 8))
    for s in ("0.125", "0.3", "0.5"):
        plan = plan_mask(scores, float(s), policy="uniform")
        per_layer = int(Fraction(s) * 8)
        assert (plan.pruned.sum(axis=1) == per_layer).all()
        for layer in range(5):  # the lowest-scoring heads of each layer
            lowest = np.argsort(scores[layer])[:per_layer]
            assert plan.pruned[layer, lowest].all()


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "half", None])
def test_bad_sparsity_is_an_input_error(bad):
    with pytest.raises(InputError):
        check_sparsity(bad)
    with pytest.raises(InputError):
        plan_mask(np.ones((2, 2)), bad)


def test_sparsity_one_says_every_head():
    with pytest.raises(InputError, match="every head"):
        plan_mask(np.ones((2, 2)), 1.0)


def test_bad_scores_and_policy():
    with pytest.raises(InputError, match="NaN"):
        plan_mask(np.array([[1.0, np.nan]]), 0.5)
    with pytest.raises(InputError):
        plan_mask(np.ones(4), 0.5)
    with pytest.raises(InputError, match="policy"):
        plan_mask(np.ones((2, 2)), 0.5, policy="random")
    with pytest.raises(InputError):
        plan_mask(np.ones((2, 4)), 0.5, group_size=3)


def test_summary_by_hand():
    # L = 2, H = 4, Hkv = 2 (G = 2), d = 2, D = 8, T = 10
    scores = np.array([[0.0, 0.0, 0.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    plan = plan_mask(scores, 0.375, group_size=2)  # k = 3: heads 0, 1, 2 of layer 0
    summary = summarize_mask(plan, scores, head_dim=2, hidden=8, seq_len=10)
    assert summary.pruned_per_layer == [3, 0] and summary.n_pruned == 3
    assert summary.zero_score_heads == 3 and summary.zero_score_pruned == 3
    assert summary.kv_heads == 4 and summary.kv_heads_removed == 1 and summary.kv_removed_per_layer == [1, 0]
    assert summary.empty_layers == []
    head_params, group_params = 2 * 8 + 2 * 8, 2 * (2 * 8)  # Q rows + O columns; K + V rows
    assert summary.params_removed == 3 * head_params + 1 * group_params
    assert summary.attention_params == 2 * (4 * head_params + 2 * group_params)
    pairs = sum(q + 1 for q in range(10))                    # causal: query q reads keys 0 .. q
    head_flops = 2 * 10 * 8 * 2 + 2 * pairs * 2 + 2 * pairs * 2 + 2 * 10 * 2 * 8   # Q, QK^T, AV, O
    group_flops = 2 * (2 * 10 * 8 * 2)
    assert summary.attention_flops_removed == 3 * head_flops + group_flops
    assert summary.flops_removed_fraction == pytest.approx((3 * head_flops + group_flops)
                                                           / (2 * (4 * head_flops + 2 * group_flops)))
    assert attention_costs(2, 8, 10, bias=True)["head_params"] == head_params + 2
    d = summary.as_dict()
    assert d["n_pruned"] == 3 and 0 < d["params_removed_fraction"] < 1


def test_summary_reports_emptied_layers():
    scores = np.array([[0.0, 0.0], [5.0, 6.0]])
    plan = plan_mask(scores, 0.5)
    assert summarize_mask(plan, head_dim=1, hidden=2).empty_layers == [0]


def test_mask_follows_z_on_real_profile():
    profile = random_profile(L=6, H=8, Hkv=2)
    masks = {z: plan_mask(MPGScorer(z=z).score(profile), 0.25, group_size=4).pruned for z in (0.5, 2.5)}
    assert all(m.sum() == 12 for m in masks.values())
    # at a high z most heads are in the bulk: fewer nonzero scores than at a low z
    assert MPGScorer(z=2.5).score(profile).zero_count > MPGScorer(z=0.5).score(profile).zero_count


def test_jaccard_by_hand():
    from analysis.score.masks import jaccard

    a = np.array([[1, 1, 0], [0, 0, 1]], bool)
    b = np.array([[1, 0, 0], [0, 1, 1]], bool)
    assert jaccard(a, b) == 2 / 4 and jaccard(a, a) == 1.0
    assert jaccard(np.zeros((2, 3), bool), np.zeros((2, 3), bool)) == 1.0
    assert jaccard(a, ~a) == 0.0
    with pytest.raises(InputError):
        jaccard(a, a[:1])


@pytest.mark.parametrize("seed", range(5))
def test_ranking_equals_the_three_key_definition(seed):
    # The ranking is one stable sort of the heads taken in tie-break order; check it against the
    # definition written as a three-key lexsort, on scores and tie-breaks full of ties.
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=(6, 8)).astype(float)  # [L, H], many equal scores
    tie = rng.integers(0, 3, size=(6, 8)).astype(float)  # [L, H], many equal tie-breaks
    flat_index = np.arange(scores.size)
    want = np.lexsort((flat_index, tie.ravel(), scores.ravel()))  # last key is primary
    assert rank_heads(scores, tie).tolist() == want.tolist()
    assert rank_heads(scores, tie, tie_order=tie_order_of(tie, scores.size)).tolist() == want.tolist()
    assert rank_heads(scores).tolist() == np.lexsort((flat_index, scores.ravel())).tolist()


def test_scorer_cached_tie_order_is_the_tiebreak_sort():
    profile = random_profile(seed=1)
    first = MPGScorer(z=1.0).score(profile)
    second = MPGScorer(z=2.0).score(profile)
    assert first.tie_order is second.tie_order  # sorted once per profile
    assert first.tie_order.tolist() == tie_order_of(first.tiebreak, first.scores.size).tolist()
    assert plan_mask(second, 0.5).order.tolist() == rank_heads(second.scores, second.tiebreak).tolist()
    with pytest.raises(InputError, match="tie order"):
        rank_heads(second.scores, tie_order=np.arange(3))


@pytest.mark.parametrize("seed", range(3))
def test_global_mask_is_the_first_k_of_the_full_ranking(seed):
    # The global policy picks the k lowest heads by partition (no full sort); it must be exactly
    # the first k of the ranking for every k, with scores and tie-breaks full of ties.
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 3, size=(4, 6)).astype(float)  # [L, H]
    tie = rng.integers(0, 2, size=(4, 6)).astype(float)  # [L, H]
    order = rank_heads(scores, tie)
    for k in range(scores.size):
        plan = plan_mask(scores, k / scores.size, tiebreak=tie)
        want = np.zeros(scores.size, dtype=bool)
        want[order[:k]] = True
        assert plan.n_pruned == k and np.array_equal(plan.pruned.reshape(-1), want), k
        assert plan.order.tolist() == order.tolist()


# -- GQA policies: balanced, balanced-uniform, groups ------------------------------------------

def _gqa_scores(L=4, H=6, seed=3):
    return np.random.default_rng(seed).random((L, H))


def _per_group(pruned, G):
    return pruned.reshape(pruned.shape[0], -1, G).sum(axis=-1)  # [L, Hkv] pruned per group


@pytest.mark.parametrize("sparsity", [0.25, 1 / 3, 0.5, 0.75])
def test_balanced_prunes_the_same_count_from_every_group_of_a_layer(sparsity):
    scores, G = _gqa_scores(), 3                          # L = 4, H = 6, Hkv = 2
    plan = plan_mask(scores, sparsity, group_size=G, policy="balanced")
    per_group = _per_group(plan.pruned, G)
    assert (per_group == per_group[:, :1]).all()          # c_l in every group of layer l: K/V never expand
    k = math.floor(sparsity * 24 + 1e-9)
    assert plan.requested == k
    nearest = min(range(0, 24, 2), key=lambda c: (abs(c - k), c))
    assert plan.n_pruned == nearest
    assert (plan.note == "") == (k % 2 == 0) and (not plan.note or str(nearest) in plan.note)
    # within each group the pruned heads are its lowest-scoring ones
    for l, g in np.ndindex(*per_group.shape):
        group = scores[l, g * G:(g + 1) * G]
        chosen = plan.pruned[l, g * G:(g + 1) * G]
        assert chosen.sum() == 0 or group[chosen].max() <= group[~chosen].min(initial=np.inf)


def test_balanced_takes_the_cheapest_slices_by_hand():
    # L = 2, H = 4, G = 2: slices (one head per group) of layer 0: {0, 2} sum 0.2, then {1, 3} sum 1.8;
    # layer 1: {4, 6} sum 0.5, then {5, 7} sum 1.0. k = 4 -> two slices: {0, 2} and {4, 6}.
    scores = np.array([[0.1, 0.9, 0.1, 0.9], [0.2, 0.5, 0.3, 0.5]])
    plan = plan_mask(scores, 0.5, group_size=2, policy="balanced")
    assert plan.pruned.tolist() == [[True, False, True, False], [True, False, True, False]]
    # a global mask at the same sparsity would take 0, 2, 4, 6 too; at 0.75 balanced stays even
    plan = plan_mask(scores, 0.75, group_size=2, policy="balanced")
    assert plan.n_pruned == 6 and plan.pruned[1].all() and plan.pruned[0].tolist() == [True, False, True, False]


def test_balanced_uniform_is_one_count_everywhere():
    scores, G = _gqa_scores(), 3
    plan = plan_mask(scores, 0.3, group_size=G, policy="balanced-uniform")  # k = 7 -> 8 (c = 1)
    assert plan.n_pruned == 8 and (_per_group(plan.pruned, G) == 1).all() and "8" in plan.note
    assert plan_mask(scores, 2 / 3, group_size=G, policy="balanced-uniform").n_pruned == 16


def test_groups_prunes_whole_groups_ranked_by_summed_score():
    scores = np.array([[0.1, 0.2, 5.0, 5.0], [0.3, 0.3, 0.0, 0.9]])   # group sums 0.3, 10, 0.6, 0.9
    plan = plan_mask(scores, 0.5, group_size=2, policy="groups")
    assert plan.pruned.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert plan.kv_pruned.tolist() == [[True, False], [True, False]]
    for s in (0.1, 0.3, 0.6):
        p = plan_mask(_gqa_scores(), s, group_size=3, policy="groups").pruned
        assert set(_per_group(p, 3).reshape(-1).tolist()) <= {0, 3}   # whole groups only


def test_infeasible_gqa_request_names_the_feasible_sparsities():
    scores = _gqa_scores(L=2, H=9)                        # Hkv = 3: balanced-uniform steps of 6 heads
    with pytest.raises(InputError, match=r"balanced-uniform.*0\.3333 \(6 heads\), 0\.6667 \(12 heads\)"):
        plan_mask(scores, 0.1, group_size=3, policy="balanced-uniform")   # k = 1 -> nearest 0
    with pytest.raises(InputError, match="groups.*steps of 3 heads"):
        plan_mask(scores, 0.06, group_size=3, policy="groups")  # k = 1
    # MHA: every GQA policy is exact (groups of one head)
    mha = plan_mask(scores, 0.4, group_size=1, policy="groups")
    assert mha.n_pruned == 7 and mha.note == ""
    assert np.array_equal(mha.pruned, plan_mask(scores, 0.4, policy="global").pruned)
    assert np.array_equal(plan_mask(scores, 0.4, policy="balanced").pruned, mha.pruned)
    assert np.array_equal(plan_mask(scores, 0.4, policy="balanced-uniform").pruned,
                          plan_mask(scores, 0.4, policy="uniform").pruned)
