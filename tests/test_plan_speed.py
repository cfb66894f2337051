"""The predicted cost of a KV plan (analysis/compress/plan_speed.py) against its oracles: the full plan is
speed.forward_flops of the dense model, a prune-only plan is forward_flops of surgery's pruned twin (the
real smaller model), a window at least as long as the context is the full plan, and the KV bytes are the
plan's own."""
import numpy as np
import pytest

from analysis.arch.adapters import adapter_for
from analysis.compress.plan_speed import kv_curve, predict
from analysis.compress.speed import forward_flops
from analysis.compress.surgery import prune_heads
from analysis.core.errors import InputError
from analysis.score.kvplan import FULL, PRUNE, WINDOW, KVPlan
from tests._tiny import tiny_model

CONTEXT = 48


@pytest.fixture(scope="module")
def llama():
    m = tiny_model("llama", num_hidden_layers=3)
    return m, adapter_for(m).geometry(m)


def test_the_full_plan_is_the_dense_model(llama):
    m, g = llama
    p = predict(m, KVPlan.full(g), CONTEXT)
    assert p.dense == p.plan
    assert p.dense.prefill_flops == forward_flops(m, CONTEXT, CONTEXT).total
    assert p.dense.decode_flops == forward_flops(m, 1, CONTEXT).total
    assert p.dense.kv_bytes == 2 * g.head_dim * 4 * CONTEXT * g.n_layers * g.n_kv_heads
    assert p.ratio("decode_bytes") == 1.0


def test_pruned_kv_heads_are_the_pruned_twin(llama):
    m, g = llama
    modes = np.full((g.n_layers, g.n_kv_heads), FULL, np.int8)
    modes[0, 1] = modes[2, 0] = PRUNE
    plan = KVPlan(modes, n_heads=g.n_heads)
    smaller, layout = prune_heads(m, plan.pruned_heads())
    p = predict(m, plan, CONTEXT)
    assert p.plan.prefill_flops == forward_flops(smaller, CONTEXT, CONTEXT, layout=layout).total
    assert p.plan.decode_flops == forward_flops(smaller, 1, CONTEXT, layout=layout).total
    assert p.plan.weight_bytes == 4 * (forward_flops(smaller, 1, 1, layout=layout).matmul // 2)
    assert p.plan.kv_bytes == plan.kv_bytes(CONTEXT, head_dim=g.head_dim)
    assert p.ratio("prefill_flops") > 1 and p.ratio("kv_bytes") == pytest.approx(6 / 4)


def test_windows_cut_the_scores_to_the_kept_tokens(llama):
    m, g = llama
    modes = np.full((g.n_layers, g.n_kv_heads), WINDOW, np.int8)
    wide = predict(m, KVPlan(modes, sinks=8, recent=CONTEXT - 8, n_heads=g.n_heads), CONTEXT)
    assert wide.plan == wide.dense                                  # the window holds the whole context
    sinks, recent = 2, 6
    p = predict(m, KVPlan(modes, sinks=sinks, recent=recent, n_heads=g.n_heads), CONTEXT)
    dense_scores = forward_flops(m, CONTEXT, CONTEXT).attention_scores
    saved = dense_scores * (1 - (sinks + recent) / CONTEXT)
    assert p.dense.prefill_flops - p.plan.prefill_flops == pytest.approx(saved, rel=1e-12)
    assert p.plan.weight_bytes == p.dense.weight_bytes              # a window removes no weight
    assert p.ratio("kv_bytes") == pytest.approx(CONTEXT / (sinks + recent))


def test_kv_curve_and_refusals(llama):
    m, g = llama
    plan = KVPlan.full(g)
    np.testing.assert_array_equal(kv_curve(plan, [1, 10], head_dim=g.head_dim, dtype_bytes=2),
                                  [plan.kv_bytes(c, head_dim=g.head_dim, dtype_bytes=2) for c in (1, 10)])
    with pytest.raises(InputError, match="context length"):
        predict(m, plan, 0)
    other = KVPlan(np.zeros((g.n_layers + 1, g.n_kv_heads), np.int8), n_heads=g.n_heads)
    with pytest.raises(InputError, match="layers"):
        predict(m, other, CONTEXT)
