"""The predicted cost of a KV plan counted without a twin (analysis/compress/plan_speed.py) against its
oracles: analysis.compress.kvspeed.planned_flops on what really runs (the dense model for the full plan, the
physically pruned twin with its mapped windows for any plan: kvruntime.kv_plan_model), a window at least
as long as the context is the full plan, and the KV bytes are the plan's own."""
import numpy as np
import pytest

from analysis.arch.adapters import adapter_for
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan
from analysis.arch.window import Window
from analysis.compress.kvruntime import kv_plan_model
from analysis.compress.kvspeed import planned_flops
from analysis.compress.plan_speed import kv_curve, predict
from analysis.compress.speed import forward_flops
from analysis.core.errors import InputError
from tests._tiny import tiny_model

CONTEXT = 48


@pytest.fixture(scope="module")
def llama():
    m = tiny_model("llama", num_hidden_layers=3)
    m.set_attn_implementation("sdpa")
    return m, adapter_for(m).geometry(m)


def _twin_flops(model, plan, context):
    """(prefill, decode) FLOPs of the twin that runs `plan`, by kvspeed's own count."""
    km = kv_plan_model(model, plan)
    kw = dict(window=plan.window, context=context, layout=km.layout)
    return (planned_flops(km.model, km.windowed, tokens=context, logits=1, **kw).total,
            planned_flops(km.model, km.windowed, tokens=1, **kw).total, km)


def test_the_full_plan_is_the_dense_model(llama):
    m, g = llama
    p = predict(m, KVPlan.full(g), CONTEXT)
    assert p.dense == p.plan
    none = np.zeros((g.n_layers, g.n_kv_heads), bool)                 # no windowed KV head
    assert p.dense.prefill_flops == planned_flops(m, none, window=Window(0, 1), tokens=CONTEXT, context=CONTEXT,
                                                  logits=1).total
    assert p.dense.decode_flops == planned_flops(m, none, window=Window(0, 1), tokens=1, context=CONTEXT).total
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
    prefill, decode, km = _twin_flops(m, plan, CONTEXT)
    p = predict(m, plan, CONTEXT)
    assert (p.plan.prefill_flops, p.plan.decode_flops) == (prefill, decode)
    assert p.plan.weight_bytes == 4 * (forward_flops(km.model, 1, 1, layout=km.layout).matmul // 2)
    assert p.plan.kv_bytes == plan.kv_bytes(CONTEXT, head_dim=g.head_dim) == km.kv_bytes(CONTEXT)
    assert p.ratio("prefill_flops") > 1


def test_a_window_holding_the_context_is_full(llama):
    m, g = llama
    modes = np.full((g.n_layers, g.n_kv_heads), WINDOW, np.int8)
    wide = predict(m, KVPlan(modes, Window(8, CONTEXT - 8), n_heads=g.n_heads), CONTEXT)
    assert wide.plan == wide.dense
    p = predict(m, KVPlan(modes, Window(2, 6), n_heads=g.n_heads), CONTEXT)
    assert p.plan.weight_bytes == p.dense.weight_bytes              # a window removes no weight
    assert p.ratio("kv_bytes") == pytest.approx(CONTEXT / 8)


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
