"""The predicted cost (analysis/compress/cost.py): the one FLOP convention against hand arithmetic, and the app's
prediction of a cut counted without building anything against its oracle, the FLOPs counted on the model that
really runs it (analysis.compress.kvruntime.physical: surgery's twin of a mask under every kv_policy, the plan's twin
with its windowed KV heads), for masks and plans; a window at least as long as the context is the full plan, and the
KV bytes are what the deployed cache holds."""
import numpy as np
import pytest

from analysis.arch.adapters import adapter_for
from analysis.arch.cut import Cut
from analysis.arch.kvcache import windowed_rows
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan
from analysis.arch.window import Window, read_keys
from analysis.compress.cost import cut_flops, forward_flops, kv_bytes, kv_curve, predict
from analysis.compress.kvruntime import kv_plan_model, physical
from analysis.compress.surgery import prune_heads
from analysis.core.errors import InputError
from tests._tiny import tiny_model

CONTEXT = 48


@pytest.fixture(scope="module")
def llama():
    m = tiny_model("llama", num_hidden_layers=3)
    m.set_attn_implementation("sdpa")
    return m, adapter_for(m).geometry(m)


def test_read_keys_is_the_causal_count():
    for tokens, context, cap in ((1, 9, 4), (9, 9, 4), (9, 9, 20), (3, 7, 1), (5, 5, None), (1, 5, None)):
        limit = context if cap is None else cap
        assert read_keys(tokens, context, cap) == sum(min(p + 1, limit) for p in range(context - tokens, context))
    assert Window(2, 3).read_keys(9, 9) == read_keys(9, 9, 5)
    assert read_keys(10, 10) == 55                                 # a prefill: S (S + 1) / 2 pairs


def test_flops_match_hand_arithmetic():
    model = tiny_model("llama")                      # D 32, I 64, H 4, H_kv 2, d 8, L 2, V 128
    D, I, H, Hkv, d, L, V = 32, 64, 4, 2, 8, 2, 128
    S = 10
    pairs = sum(q + 1 for q in range(S))             # causal: query q reads keys 0 .. q
    mlp = 3 * D * I
    dense_layer = D * H * d + 2 * D * Hkv * d + H * d * D + mlp
    want = 2 * S * (L * dense_layer + V * D) + L * 4 * pairs * H * d
    got = forward_flops(model, S, S)
    assert got.total == want
    assert got.attention_projections == 2 * S * L * (dense_layer - mlp)
    assert forward_flops(model, S, S, logits=1).total == want - 2 * (S - 1) * V * D    # the LM head on the last token
    pruned = np.zeros((2, 4), bool)
    pruned[0] = True            # layer 0 emptied
    pruned[1, 2:] = True        # layer 1 loses KV group 1: H' = 2, H_kv' = 1
    smaller, _ = prune_heads(model, pruned)
    layer1 = D * 2 * d + 2 * D * 1 * d + 2 * d * D + mlp
    assert forward_flops(smaller, S, S).total == 2 * S * (mlp + layer1 + V * D) + 4 * pairs * 2 * d
    C = 7                                            # decode: one token over a context of C keys
    assert forward_flops(model, 1, C).attention_scores == L * 4 * C * H * d
    windowed = [[True, False]] * L                   # KV head 0 of each layer on a window of 2 + 3: its 2 query heads
    half = forward_flops(model, 1, 30, windowed=windowed, window=Window(2, 3))
    assert half.matmul == forward_flops(model, 1, 30).matmul
    assert half.attention_scores == L * 4 * d * (2 * 30 + 2 * 5)


def _masks(g):
    rng = np.random.default_rng(0)
    out = {"emptied layer": np.zeros((g.n_layers, g.n_heads), bool), "uneven": rng.random((g.n_layers, g.n_heads)) < .4}
    out["emptied layer"][0] = True
    out["emptied layer"][1, :g.group_size] = True
    return out


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", dict(hidden_size=48, num_attention_heads=6,
                                                                           num_key_value_heads=2)),
                                               ("gpt2", {}), ("phi3", {})])
def test_a_mask_is_counted_as_the_twin_surgery_builds(family, overrides):
    """cut_flops of a mask (surgery's count, no twin built) == forward_flops on the twin, under every kv_policy that
    builds it (expand copies K/V: the twin grows), prefill (all logits or the last) and decode."""
    m = tiny_model(family, **overrides)
    g = adapter_for(m).geometry(m)
    for name, mask in _masks(g).items():
        for kv_policy in ("auto", "expand"):
            twin, _ = prune_heads(m, mask, kv_policy=kv_policy)
            for tokens, context, logits in ((12, 12, None), (12, 12, 1), (1, 20, None)):
                assert cut_flops(m, Cut.of_mask(mask), tokens, context, logits=logits, kv_policy=kv_policy) == \
                    forward_flops(twin, tokens, context, logits=logits), (name, kv_policy, tokens)


def test_a_mask_prediction_is_the_twin_that_runs_it(llama):
    m, g = llama
    mask = _masks(g)["emptied layer"]
    twin = physical(Cut.of_mask(mask), m)
    p = predict(m, Cut.of_mask(mask), CONTEXT)
    assert p.cut.prefill_flops == forward_flops(twin.model, CONTEXT, CONTEXT, logits=1).total
    assert p.cut.decode_flops == forward_flops(twin.model, 1, CONTEXT).total
    assert p.cut.weight_bytes == 4 * (forward_flops(twin.model, 1, 1).matmul // 2)
    assert p.cut.kv_bytes == kv_bytes(m, Cut.of_mask(mask), CONTEXT) < p.dense.kv_bytes
    assert p.ratio("prefill_flops") > 1 and p.ratio("decode_bytes") > 1


def test_the_full_plan_is_the_dense_model(llama):
    m, g = llama
    p = predict(m, Cut.of_plan(KVPlan.full(g)), CONTEXT)
    assert p.dense == p.cut
    assert p.dense.prefill_flops == forward_flops(m, CONTEXT, CONTEXT, logits=1).total
    assert p.dense.decode_flops == forward_flops(m, 1, CONTEXT).total
    assert p.dense.kv_bytes == 2 * g.head_dim * 4 * CONTEXT * g.n_layers * g.n_kv_heads
    assert p.ratio("decode_bytes") == 1.0


@pytest.mark.parametrize("modes", [
    [[FULL, PRUNE], [FULL, FULL], [PRUNE, FULL]],                 # pruned KV heads only
    [[WINDOW, FULL], [WINDOW, WINDOW], [FULL, FULL]],             # windows only
    [[WINDOW, PRUNE], [FULL, WINDOW], [PRUNE, FULL]],             # both
])
def test_any_plan_is_the_twin_that_runs_it(llama, modes):
    m, g = llama
    plan = KVPlan(np.array(modes, np.int8), Window(2, 5), n_heads=g.n_heads)
    km = kv_plan_model(m, plan)
    kw = dict(windowed=windowed_rows(km.rows), window=plan.window)
    p = predict(m, Cut.of_plan(plan), CONTEXT)
    assert p.cut.prefill_flops == forward_flops(km.model, CONTEXT, CONTEXT, logits=1, **kw).total
    assert p.cut.decode_flops == forward_flops(km.model, 1, CONTEXT, **kw).total
    assert p.cut.weight_bytes == 4 * (forward_flops(km.model, 1, 1).matmul // 2)
    assert p.cut.kv_bytes == plan.kv_bytes(CONTEXT, head_dim=g.head_dim) == km.kv_bytes(CONTEXT)
    assert p.ratio("prefill_flops") > 1
    assert predict(m, km.cut(), CONTEXT) == p                     # the twin as a model of its own: counted on itself


def test_a_window_holding_the_context_is_full(llama):
    m, g = llama
    modes = np.full((g.n_layers, g.n_kv_heads), WINDOW, np.int8)
    wide = predict(m, Cut.of_plan(KVPlan(modes, Window(8, CONTEXT - 8), n_heads=g.n_heads)), CONTEXT)
    assert wide.cut == wide.dense
    p = predict(m, Cut.of_plan(KVPlan(modes, Window(2, 6), n_heads=g.n_heads)), CONTEXT)
    assert p.cut.weight_bytes == p.dense.weight_bytes              # a window removes no weight
    assert p.ratio("kv_bytes") == pytest.approx(CONTEXT / 8)


def test_kv_curve_and_refusals(llama):
    m, g = llama
    plan = KVPlan.full(g)
    np.testing.assert_array_equal(kv_curve(plan, [1, 10], head_dim=g.head_dim, dtype_bytes=2),
                                  [plan.kv_bytes(c, head_dim=g.head_dim, dtype_bytes=2) for c in (1, 10)])
    with pytest.raises(InputError, match="context length"):
        predict(m, Cut.of_plan(plan), 0)
    other = KVPlan(np.zeros((g.n_layers + 1, g.n_kv_heads), np.int8), n_heads=g.n_heads)
    with pytest.raises(InputError, match="layers"):
        predict(m, Cut.of_plan(other), CONTEXT)
    with pytest.raises(InputError, match="takes a Cut"):
        predict(m, plan, CONTEXT)
    with pytest.raises(InputError, match="measure it"):
        predict(m, physical(Cut.of_mask(_masks(g)["emptied layer"]), m), CONTEXT)
