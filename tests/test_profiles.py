"""Row-norm profiles: hand-computed thresholds and excesses, scopes, zero-std populations,
z validation, and profiles of real (tiny) models against norms taken straight from the
Hugging Face parameters."""

import math

import numpy as np
import pytest
import torch

from analysis.core.errors import InputError
from analysis.measure.profiles import (IN_MEMORY_CHUNK, STREAM_CHUNK, SUM_BLOCK, NormProfile, check_z, head_norms,
                                       profile_model, row_norms)
from tests._scoring_fixtures import constant_profile, hand_profile
from tests._tiny import tiny_model


def test_layer_thresholds_by_hand():
    taus = hand_profile().thresholds(0.5)
    np.testing.assert_allclose(taus["q"], [2.5, 3.5 + 0.5 * math.sqrt(1.75), 0.1], rtol=1e-15)
    np.testing.assert_allclose(taus["o"], [2.5, 4.0, 0.1], rtol=1e-15)
    np.testing.assert_allclose(taus["k"], [2.5, 2.0, 0.1], rtol=1e-15)
    np.testing.assert_allclose(taus["v"], [2.0, 1.0, 0.1], rtol=1e-15)


def test_excess_by_hand():
    e = hand_profile().excess(0.5)
    np.testing.assert_array_equal(e["q"][0], [[0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(e["o"][0], [[0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5]])
    np.testing.assert_array_equal(e["k"][0], [[0, 0, 0.5, 0.5]])
    for p in "qkvo":  # layer 1: every row in the bulk; layer 2: zero std; v of layer 0: zero std
        assert not e[p][1:].any(), p
    assert not e["v"][0].any()


def test_excess_at_z_zero_is_above_the_mean():
    e = hand_profile().excess(0.0)
    np.testing.assert_allclose(e["q"][1], [[0, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(e["o"][0], [[0, 0, 1, 1], [0, 0, 1, 1]])


def test_model_scope_pools_all_layers():
    profile = hand_profile()
    q = [1] * 4 + [3] * 4 + [0] + [4] * 7 + [0.1] * 8  # the 24 Q rows of the three layers
    mean = sum(q) / 24
    std = math.sqrt(sum((x - mean) ** 2 for x in q) / 24)
    taus = profile.thresholds(1.0, scope="model")
    np.testing.assert_allclose(taus["q"], [mean + std] * 3, rtol=1e-14)
    expected = np.maximum(np.array(q).reshape(3, 2, 4) - (mean + std), 0)
    np.testing.assert_allclose(profile.excess(1.0, scope="model")["q"], expected, rtol=1e-14)


@pytest.mark.parametrize("value", [2.5895367670496596, 0.1, 7.0])
def test_zero_std_population_has_no_excess_even_with_float_drift(value):
    # 12 equal copies of 2.5895... average to slightly *less* than the value in float64: a
    # naive mean + z*std would put every row a hair above tau.
    profile = constant_profile(value)
    for z in (0.0, 0.5, 2.0):
        e = profile.excess(z)
        for p in "qkvo":
            assert not e[p].any(), (p, z)
    mean, std = profile.stats()["q"]
    assert mean[0] == value and std[0] == 0.0


def test_l1_norms_use_their_own_population():
    profile = hand_profile(l1_scale=2.0)
    np.testing.assert_allclose(profile.thresholds(0.5, ord=1)["q"][0], 5.0)
    np.testing.assert_allclose(profile.excess(0.5, ord=1)["q"][0, 1], [1, 1, 1, 1])


def test_changing_z_reuses_cached_statistics():
    profile = hand_profile()
    first = profile.stats()
    profile.excess(0.5)
    profile.excess(2.5)
    assert profile.stats() is first  # no second pass over the norms


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 1e6, 10.5, "two", None])
def test_bad_z_is_an_input_error(bad):
    with pytest.raises(InputError):
        check_z(bad)
    with pytest.raises(InputError):
        hand_profile().excess(bad)


def test_bad_scope_and_ord():
    with pytest.raises(InputError):
        hand_profile().excess(1.0, scope="global")
    with pytest.raises(InputError):
        hand_profile().excess(1.0, ord=3)


def test_malformed_profile_is_rejected():
    good = hand_profile()
    with pytest.raises(InputError):
        NormProfile(l2={"q": good.l2["q"]}, l1=good.l1)
    with pytest.raises(InputError):  # 2 query heads cannot share 3 KV heads
        bad = dict(good.l2, k=np.ones((3, 3, 4)), v=np.ones((3, 3, 4)))
        NormProfile(l2=bad, l1=bad)


def _expected_llama_norms(model, layer):
    """Norms straight from the Hugging Face Linear weights (rows of q/k/v, columns of o)."""
    attn = model.model.layers[layer].self_attn
    d = model.config.head_dim
    q = attn.q_proj.weight.detach().double().reshape(-1, d, attn.q_proj.weight.shape[1])
    k = attn.k_proj.weight.detach().double().reshape(-1, d, attn.k_proj.weight.shape[1])
    v = attn.v_proj.weight.detach().double().reshape(-1, d, attn.v_proj.weight.shape[1])
    o = attn.o_proj.weight.detach().double().t().reshape(-1, d, attn.o_proj.weight.shape[0])
    return {p: (t.norm(dim=-1).numpy(), t.abs().sum(dim=-1).numpy()) for p, t in zip("qkvo", (q, k, v, o))}


def test_profile_of_tiny_llama_matches_raw_weights():
    model = tiny_model("llama")
    profile = profile_model(model)
    assert (profile.n_layers, profile.n_heads, profile.n_kv_heads, profile.head_dim) == (2, 4, 2, 8)
    for layer in range(2):
        expected = _expected_llama_norms(model, layer)
        for p in "qkvo":
            np.testing.assert_allclose(profile.l2[p][layer], expected[p][0], rtol=1e-6)
            np.testing.assert_allclose(profile.norms(1)[p][layer], expected[p][1], rtol=1e-6)


def test_profile_of_gpt2_transposes_conv1d():
    model = tiny_model("gpt2")
    profile = profile_model(model)
    D = model.config.n_embd
    d = D // model.config.n_head
    attn = model.transformer.h[1].attn
    w = attn.c_attn.weight.detach().double()  # [D, 3D] (in, out)
    q_rows = w[:, :D].t().reshape(-1, d, D)  # [H, d, D]
    o_cols = attn.c_proj.weight.detach().double().reshape(-1, d, D)  # Conv1D rows = O's columns
    np.testing.assert_allclose(profile.l2["q"][1], q_rows.norm(dim=-1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(profile.l2["o"][1], o_cols.norm(dim=-1).numpy(), rtol=1e-6)


def test_l1_is_computed_on_first_use_only():
    model = tiny_model("llama")
    profile = profile_model(model)
    assert profile.l1 is None  # the first pass reads the weights for L2 only
    l1 = profile.norms(1)
    assert profile.norms(1) is l1
    with torch.no_grad():
        q = model.model.layers[0].self_attn.q_proj.weight.detach().reshape(4, 8, -1)
    np.testing.assert_allclose(l1["q"][0], q.abs().sum(-1).double().numpy(), rtol=1e-6)
    with pytest.raises(InputError, match="no L1"):
        NormProfile(l2=profile.l2).norms(1)


def test_profile_does_not_change_the_model():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_model(model)
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k


def _reference_norms(rows: torch.Tensor) -> dict[int, np.ndarray]:
    """L1 and L2 of rows [units, d, width] in float64 from a contiguous copy: the plain definition."""
    r = rows.detach().double().contiguous()  # [units, d, width]
    return {1: r.abs().sum(-1).numpy(), 2: r.square().sum(-1).sqrt().numpy()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_row_norms_every_path_matches_the_definition(dtype, strided):
    # strided: O's head view, o[h, j, :] = W_O[:, h*d + j], whose last axis steps over whole rows
    torch.manual_seed(0)
    H, d, D = 6, 5, 40
    if strided:
        rows = torch.randn(D, H * d).to(dtype).t().reshape(H, d, D)  # [H, d, D], stride(-1) = H*d
        assert rows.stride(-1) != 1
    else:
        rows = torch.randn(H * d, D).to(dtype).reshape(H, d, D)  # [H, d, D] contiguous
    expected = _reference_norms(rows)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for ords in [(2,), (1,), (2, 1), (1, 2)]:
        # chunk_elements below one unit (d * D = 200) forces one head per chunk; 1 << 22 takes all at once
        for chunk in (7, 2 * d * D, 1 << 22):
            got = row_norms(rows, ords, chunk)
            assert sorted(got) == sorted(ords)
            for o in ords:
                want_dtype = torch.float64 if dtype == torch.float64 else torch.float32
                assert got[o].dtype == want_dtype and got[o].shape == (H, d)
                np.testing.assert_allclose(got[o].numpy(), expected[o], rtol=tol, err_msg=f"ord {o}, chunk {chunk}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("d", [5, SUM_BLOCK, 3 * SUM_BLOCK])
def test_row_norms_the_same_bits_for_every_piece_size(dtype, strided, d):
    # The streamed profile cuts a layer into cache-sized pieces of rows (Q/K/V) or blocks of ROW_BLOCK
    # rows x SUM_BLOCK-multiple columns of W_O (O), across head boundaries, where the in-memory one takes
    # 4M elements: each norm, bit for bit the same. Chunks: one row / one block at a time, 7 rows (ragged
    # last piece), 2 blocks, half a head, the streaming default; d = 5 puts head boundaries inside O's
    # blocks; D = 1000 leaves a ragged last block of W_O's rows (1000 = 31 x 32 + 8).
    torch.manual_seed(1)
    H, D = 3, 1000  # a long last axis: torch's sums run their cascades and vector tails
    if strided:
        rows = torch.randn(D, H * d).to(dtype).view(D, H, d).permute(1, 2, 0)  # [H, d, D], o[h, j, :] = W_O[:, h*d + j]
    else:
        rows = torch.randn(H * d, D).to(dtype).view(H, d, D)  # [H, d, D] contiguous
    whole = row_norms(rows, (2, 1), IN_MEMORY_CHUNK)
    for chunk in (1, 7 * D, 2 * SUM_BLOCK * D, d * D // 2, STREAM_CHUNK):
        for ords in [(2, 1), (2,), (1,)]:
            got = row_norms(rows, ords, chunk, {})
            for o in ords:
                assert torch.equal(got[o], whole[o]), f"ord {o}, chunk {chunk}: {(got[o] - whole[o]).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("units_d", [9 * 64, 32 * 128])  # SmolLM2's H*d, an 8B model's
def test_row_norms_the_same_bits_on_one_thread_and_on_several(dtype, strided, units_d):
    # the in-memory profile runs on torch's threads (its sums may split columns between threads), the
    # streamed one on one thread: a layer big enough for torch to split its reductions, bit for bit
    from analysis.core.threads import torch_threads
    torch.manual_seed(2)
    D = 2048
    if strided:
        rows = torch.randn(D, units_d).to(dtype).t().reshape(units_d // 64, 64, D)  # [units, d, D], stride(-1) = units*d
    else:
        rows = torch.randn(units_d, D).to(dtype).view(units_d // 64, 64, D)
    with torch_threads(4):
        many = row_norms(rows, (2, 1), IN_MEMORY_CHUNK, {})
    with torch_threads(1):
        one = row_norms(rows, (2, 1), STREAM_CHUNK, {})
    for o in (1, 2):
        assert torch.equal(many[o], one[o]), f"ord {o}: {(many[o] - one[o]).abs().max()}"


def test_head_norms_reject_bad_orders():
    from analysis.arch.adapters import HeadWeights
    hw = HeadWeights(q=torch.ones(2, 3, 4), k=torch.ones(1, 3, 4), v=torch.ones(1, 3, 4), o=torch.ones(2, 3, 4))
    assert head_norms(hw, (1,))[1]["q"].tolist() == [[4.0] * 3] * 2
    with pytest.raises(InputError, match="norm order"):
        head_norms(hw, (3,))


def _zscores(profile: NormProfile, ord: int, scope: str) -> np.ndarray:
    """Every row's exact z-score (n - mean) / std, for z values that sit exactly on a row."""
    out = []
    for p, n in profile.norms(ord).items():
        mean, std = profile.stats(ord, scope)[p]
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(((n - mean[:, None, None]) / std[:, None, None]).ravel())
    z = np.concatenate(out)
    return z[np.isfinite(z) & (z >= 0) & (z <= 10)]


@pytest.mark.parametrize("scope", ["layer", "model"])
@pytest.mark.parametrize("ord", [1, 2])
def test_excess_sums_equal_the_sums_of_the_row_excess(scope, ord):
    # The indexed fast path must agree with summing `excess` per head / group, including a z that
    # lands exactly on a row's z-score (that row's excess is 0 either way) and the zero pattern.
    from analysis.score.scoring import head_and_group_sums
    from tests._scoring_fixtures import random_profile

    for profile in (hand_profile(l1_scale=2.0), random_profile(seed=3), constant_profile(0.3)):
        on_a_row = _zscores(profile, ord, scope)[:5].tolist()
        for z in [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 10.0, *on_a_row]:
            own, group = profile.excess_sums(z, ord=ord, scope=scope)
            want_own, want_group = head_and_group_sums(profile.excess(z, ord=ord, scope=scope))
            np.testing.assert_allclose(own, want_own, rtol=1e-12, atol=1e-12, err_msg=f"z={z}")
            np.testing.assert_allclose(group, want_group, rtol=1e-12, atol=1e-12, err_msg=f"z={z}")
            assert np.array_equal(own == 0, want_own == 0) and np.array_equal(group == 0, want_group == 0)


def test_excess_sums_validate_z():
    with pytest.raises(InputError, match="negative"):
        hand_profile().excess_sums(-1.0)


# -- the std convention: population (ddof 0, default) or sample (ddof 1, torch's Tensor.std) ----

def test_sample_std_is_torchs_default_std():
    import torch

    from analysis.measure.profiles import STD_DDOF, NormProfile

    rng = np.random.default_rng(4)
    l2 = {p: rng.gamma(4.0, 0.25, size=(3, units, 5)) for p, units in (("q", 4), ("k", 2), ("v", 2), ("o", 4))}
    profile = NormProfile(l2=l2)
    for p, norms in l2.items():
        rows = torch.from_numpy(norms).reshape(3, -1)                      # [L, rows]
        mean, sample = profile.stats(2, "layer", "sample")[p]
        _, population = profile.stats(2, "layer", "population")[p]
        np.testing.assert_allclose(sample, rows.std(dim=1).numpy(), rtol=1e-12)              # ddof 1
        np.testing.assert_allclose(population, rows.std(dim=1, correction=0).numpy(), rtol=1e-12)
        n = rows.shape[1]
        np.testing.assert_allclose(sample, population * np.sqrt(n / (n - 1)), rtol=1e-12)
        model_sample = profile.stats(2, "model", "sample")[p][1]
        np.testing.assert_allclose(model_sample, np.full(3, rows.reshape(-1).std().item()), rtol=1e-12)
    assert profile.stats(2, "layer") is profile.stats(2, "layer", "population") and STD_DDOF["sample"] == 1
    for z in (0.5, 1.5, 2.5):                                 # the bucketed index path (z >= 1) and the dense one
        own, group = profile.excess_sums(z, std="sample")
        dense = {p: np.maximum(n - profile.thresholds(z, std="sample")[p][:, None, None], 0) for p, n in l2.items()}
        np.testing.assert_allclose(own, dense["q"].sum(-1) + dense["o"].sum(-1), atol=1e-12)
        np.testing.assert_allclose(group, dense["k"].sum(-1) + dense["v"].sum(-1), atol=1e-12)
    with pytest.raises(InputError, match="population, sample"):
        profile.thresholds(1.0, std="unbiased")


def test_sample_std_puts_more_heads_in_the_bulk_on_smollm2(smollm2):
    from analysis.score.scoring import MPGScorer

    profile = profile_model(smollm2.model, adapter=smollm2.adapter)
    population = MPGScorer(z=2.5).score(profile)
    sample = MPGScorer(z=2.5, std="sample").score(profile)
    assert (population.zero_count, sample.zero_count) == (107, 110)       # DESIGN.md's numbers
    assert population.params["std"] == "population" and sample.params["std"] == "sample"


# -- pruned heads left out of the populations (the iterative pipeline's rescoring) ----------

def _balanced_pruned(n_layers: int, n_heads: int, group_size: int, seed: int = 0) -> np.ndarray:
    """One query head per KV group pruned in every layer: surgery keeps a uniform layout."""
    rng = np.random.default_rng(seed)
    pruned = np.zeros((n_layers, n_heads), dtype=bool)                      # [L, H]
    for layer in range(n_layers):
        for group in range(n_heads // group_size):
            pruned[layer, group * group_size + rng.integers(group_size)] = True
    return pruned


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_excluding_pruned_heads_scores_like_the_surviving_rows_alone(scope):
    """MP on the zeroed full-shape model with the pruned heads excluded == MP of a profile that holds
    only the surviving heads' rows (what the physically pruned model has), head by head; without
    the exclusion the zero rows pull the mean and std and the scores differ."""
    import copy

    from analysis.arch.head_gates import zero_heads
    from analysis.score.scoring import get_scorer
    from analysis.compress.surgery import HeadLayout

    model = tiny_model("llama", num_hidden_layers=3)                       # H = 4, Hkv = 2
    pruned = _balanced_pruned(3, 4, 2)
    full = profile_model(model)
    layout = HeadLayout.from_mask(pruned, full_geometry(model), "llama")
    kept = np.asarray(layout.heads)                                        # [L, 2]
    survivors = NormProfile(l2={"q": np.take_along_axis(full.l2["q"], kept[:, :, None], 1),
                                "o": np.take_along_axis(full.l2["o"], kept[:, :, None], 1),
                                "k": full.l2["k"], "v": full.l2["v"]})     # q/o [L, 2, d], k/v [L, 2, d]
    zeroed = profile_model(zero_heads(copy.deepcopy(model), pruned))
    scorer = get_scorer("mp", z=0.5, scope=scope)
    expected = scorer.score(survivors).scores                              # [L, 2] (G' = 1)
    got = np.take_along_axis(scorer.score(zeroed.excluding(pruned)).scores, kept, 1)   # [L, 2]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    plain = np.take_along_axis(scorer.score(zeroed).scores, kept, 1)
    assert not np.allclose(plain, expected)


def full_geometry(model):
    from analysis.arch.adapters import adapter_for
    return adapter_for(model).geometry(model)


def test_excluding_nothing_is_the_same_profile():
    profile = profile_model(tiny_model("qwen2"))
    same = profile.excluding(np.zeros((profile.n_layers, profile.n_heads), dtype=bool))
    for z in (0.0, 1.0, 2.5):
        a, b = profile.excess_sums(z), same.excess_sums(z)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_excluding_a_whole_group_and_a_whole_layer():
    profile = profile_model(tiny_model("llama"))                           # L = 2, H = 4, Hkv = 2
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, :2] = True                                                   # layer 0 loses KV group 0
    pruned[1, :] = True                                                    # layer 1 loses everything
    mean, std = profile.excluding(pruned).stats()["k"]                     # [L] each
    k0 = profile.l2["k"][0, 1]                                             # only group 1's K rows stay
    assert mean[0] == pytest.approx(k0.mean(), rel=1e-12) and std[0] == pytest.approx(k0.std(), rel=1e-12)
    assert mean[1] == 0.0 and std[1] == 0.0                                # nothing left to score against
    with pytest.raises(InputError, match="shape"):
        profile.excluding(np.zeros((3, 4), dtype=bool))
