"""A KV plan on the physically pruned twin (analysis/compress/kvruntime.py, issue 41).

- the twin (pruned groups removed by surgery) under its mapped windows == the dense model under
  `applied(model, plan)` (gates + the masked band), EXACT in float64, including a layer the plan empties; the
  same twin as a Cut (`.cut()`, `physical(Cut.of_plan(plan), model)`) runs the same function;
- greedy decode of the twin with its compact cache == greedy decode of the masked dense model with
  transformers' DynamicCache (tokens equal, logits EXACT), and the cache's real bytes == plan.kv_bytes at
  every step;
- a plan from another model is one line.
"""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.cut import Cut
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, applied, mode_rows
from analysis.arch.window import Window
from analysis.compress.kvruntime import greedy, kv_plan_model, physical
from analysis.core.errors import InputError
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT

PLANS = {
    "mixed": [[WINDOW, PRUNE], [FULL, WINDOW]],
    "emptied layer": [[PRUNE, PRUNE], [WINDOW, FULL]],
    "all windowed or pruned": [[WINDOW, WINDOW], [PRUNE, WINDOW]],
    "head cut only": [[FULL, PRUNE], [FULL, FULL]],
}


def _model(family: str):
    m = tiny_model(family, dtype=torch.float64)
    m.set_attn_implementation("sdpa")
    return m


@pytest.mark.parametrize("name", PLANS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_twin_under_its_windows_is_the_masked_dense_model(family, name):
    m = _model(family)
    plan = KVPlan(np.array(PLANS[name]), Window(2, 5), n_heads=4)
    planned = kv_plan_model(m, plan)
    assert [len(r) for r in planned.rows] == [int((np.array(row) != PRUNE).sum()) for row in PLANS[name]]
    assert [r.tolist() for r in planned.rows] == [[c for c in row if c != PRUNE] for row in PLANS[name]]
    assert [r.tolist() for r in planned.windowed] == [[c == WINDOW for c in row if c != PRUNE] for row in PLANS[name]]
    x = tiny_input_ids(2, 24)
    with torch.no_grad():
        with applied(m, plan):
            masked = m(x).logits
            reference = greedy(m, x[:, :10], 8)                        # DynamicCache, the masked band
        with planned.running():
            twin = planned.model(x).logits
            run = greedy(planned.model, x[:, :10], 8, cache=planned.cache(block=4), kv_bytes=lambda c: c.kv_bytes())
        for cut in (planned.cut(), physical(Cut.of_plan(plan), m)):    # the same twin as a cut of the dense model
            with cut.running(m) as model:
                assert model is not m and (model(x).logits - masked).abs().max().item() <= EXACT
    assert (twin - masked).abs().max().item() <= EXACT
    assert torch.equal(run.tokens, reference.tokens)
    assert (run.logits - reference.logits).abs().max().item() <= EXACT
    assert run.kv_bytes == [planned.kv_bytes(10 + i, batch=2) for i in range(8)]
    head_dim = adapter_for(m).geometry(m).head_dim
    assert run.kv_bytes[-1] == plan.kv_bytes(17, head_dim=head_dim, dtype_bytes=8, batch=2)
    assert m.config._attn_implementation == "sdpa"                      # the dense model is untouched


def test_a_plan_from_another_model_or_layout_is_one_line():
    m = _model("llama")
    with pytest.raises(InputError, match="make the plan for this model"):
        kv_plan_model(m, KVPlan(np.zeros((3, 2), np.int8), n_heads=4))
    with pytest.raises(InputError, match="needs a model"):
        kv_plan_model("llama", KVPlan(np.zeros((2, 2), np.int8), n_heads=4))
    plan = KVPlan(np.array(PLANS["mixed"]), Window(2, 5), n_heads=4)
    other = kv_plan_model(m, KVPlan(np.zeros((2, 2), np.int8), n_heads=4)).layout    # keeps every head
    with pytest.raises(InputError, match="not this export's"):
        mode_rows(plan, other.kv_heads)
