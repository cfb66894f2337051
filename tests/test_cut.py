"""One cut, one window (analysis/arch/cut.py, analysis/arch/window.py; issue 47).

- the Window's formulas against their definitions: the band rule, the ring slot (a bijection onto the ring
  for the tokens kept), kept tokens and `covers` (a window >= the context reads everything);
- a Cut of each kind runs what its own mechanism runs: a mask == head gates, a plan == `applied`, a model
  == itself under its windows;
- a plan's compact cache on the DENSE model (pruned KV heads keep nothing) holds exactly the plan's bytes
  and its greedy decode == the masked dense model with transformers' DynamicCache == the physical twin
  (EXACT in float64);
- `physical` and `exported_cut` compute what the cut computes on the dense model (EXACT in float64).
"""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.cut import Cut
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.arch.kvcache import kv_cache_bytes
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, applied
from analysis.arch.window import Window
from analysis.compress.kvruntime import greedy, kv_plan_model, physical
from analysis.core.errors import InputError
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT


# -- the window ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sinks,recent", [(0, 1), (0, 5), (3, 1), (4, 7)])
def test_the_window_formulas_are_their_definitions(sinks, recent):
    w = Window(sinks, recent)
    T = 40
    q = np.arange(T)
    reads = w.reads(q, q)
    for i in range(T):                                                   # the rule, written out
        for j in range(T):
            assert reads[i, j] == (j <= i and (j < sinks or i - j < recent))
    assert torch.equal(w.reads(torch.arange(T), torch.arange(T)), torch.as_tensor(reads))
    for context in (1, sinks + recent - 1, sinks + recent, sinks + recent + 1, 3 * T):
        last = reads[min(context, T) - 1] if context <= T else None
        assert w.kept(context) == min(context, sinks + recent)
        assert w.covers(context) == (context <= sinks + recent)
        if last is not None:                                             # covers <=> the last query reads all
            assert bool(last[:context].all()) == w.covers(context)
    for length in range(1, T):                                           # the ring: kept tokens -> distinct slots
        kept = [p for p in range(length) if p < sinks or p >= length - recent]
        slots = [w.slot(p) for p in kept]
        assert sorted(slots) == list(range(len(kept)))
        assert np.array_equal(w.slot(np.array(kept)), np.array(slots))   # ints, arrays and tensors alike
        assert torch.equal(w.slot(torch.tensor(kept)), torch.tensor(slots))


@pytest.mark.parametrize("sinks,recent,words", [(1, 0, "reads nothing"), (-1, 3, "sink"), (2.5, 3, "sink"),
                                               (1, "8", "recent"), (True, 3, "sink"), (0, 2**40, "recent")])
def test_a_bad_window_is_one_line(sinks, recent, words):
    with pytest.raises(InputError, match=words):
        Window(sinks, recent)


# -- a cut of each kind ---------------------------------------------------------------------------------

def _model():
    m = tiny_model("llama", dtype=torch.float64)
    m.set_attn_implementation("sdpa")
    return m


PLAN = [[WINDOW, PRUNE], [FULL, WINDOW]]


def test_each_kind_runs_its_own_mechanism():
    m = _model()
    x = tiny_input_ids(2, 20)
    pruned = np.array([[True, False, False, True], [False, False, True, True]])
    plan = KVPlan(np.array(PLAN), Window(2, 5), n_heads=4)
    with torch.no_grad():
        dense = m(x).logits
        with head_mask(m, gates_from_mask(pruned)):
            gated = m(x).logits
        with applied(m, plan):
            planned = m(x).logits
        with Cut.of_mask(pruned).running(m) as run:
            assert run is m and torch.equal(run(x).logits, gated)
        with Cut.of_plan(plan).running(m) as run:
            assert torch.equal(run(x).logits, planned)
        twin = kv_plan_model(m, plan)
        with twin.cut().running(m) as run:                               # a model of its own: the dense is unused
            assert run is twin.model
            assert (run(x).logits - planned).abs().max().item() <= EXACT
        assert torch.equal(m(x).logits, dense)                           # everything restored
    assert Cut.of_mask(pruned).new_cache() is None and not Cut.of_mask(pruned).windowed
    assert Cut.of_plan(plan).windowed and Cut.of_plan(plan).compacts


@pytest.mark.parametrize("plan", [PLAN, [[PRUNE, FULL], [FULL, FULL]], [[PRUNE, PRUNE], [WINDOW, FULL]]])
def test_a_plan_generates_with_its_own_bytes_on_the_dense_model(plan):
    m = _model()
    x = tiny_input_ids(2, 12)
    kv = KVPlan(np.array(plan), Window(1, 4), n_heads=4)
    cut = Cut.of_plan(kv)
    head_dim = adapter_for(m).geometry(m).head_dim
    with torch.no_grad():
        with applied(m, kv):
            reference = greedy(m, x, 9)                                   # the masked dense model, DynamicCache
        with cut.running(m) as run:
            compact = greedy(run, x, 9, cache=cut.new_cache(), kv_bytes=kv_cache_bytes)
        twin = kv_plan_model(m, kv)
        with twin.running():
            deployed = greedy(twin.model, x, 9, cache=twin.cache(), kv_bytes=kv_cache_bytes)
    assert torch.equal(compact.tokens, reference.tokens) and torch.equal(deployed.tokens, reference.tokens)
    assert (compact.logits - reference.logits).abs().max().item() <= EXACT
    assert (deployed.logits - reference.logits).abs().max().item() <= EXACT
    want = [kv.kv_bytes(12 + i, head_dim=head_dim, dtype_bytes=8, batch=2) for i in range(9)]
    assert compact.kv_bytes == want == deployed.kv_bytes                 # the promise is the memory held


def test_a_window_that_covers_the_context_is_the_dense_model():
    m = _model()
    x = tiny_input_ids(2, 16)
    window = Window(3, 18)
    assert window.covers(16 + 6 - 1) and not window.covers(16 + 6)      # every token the 6 steps feed, no more
    cut = Cut.of_plan(KVPlan(np.full((2, 2), WINDOW), window, n_heads=4))
    with torch.no_grad():
        dense = greedy(m, x, 6)
        with cut.running(m) as run:
            windowed = greedy(run, x, 6, cache=cut.new_cache())
    assert torch.equal(windowed.tokens, dense.tokens)
    assert (windowed.logits - dense.logits).abs().max().item() <= EXACT


def test_physical_and_exported_cuts_compute_the_cut():
    from analysis.arch.models import LoadedModel
    from analysis.compress.export.planned import exported_cut
    m = _model()
    x = tiny_input_ids(2, 18)
    geometry = adapter_for(m).geometry(m)
    loaded = LoadedModel(m, None, "tiny", "causal-lm", adapter_for(m), geometry, "tiny")
    pruned = np.array([[True, True, False, True], [False, False, False, False]])   # group 0 of layer 0 emptied
    plan = KVPlan(np.array([[FULL, WINDOW], [WINDOW, FULL]]), Window(1, 6), n_heads=4)
    with torch.no_grad():
        with head_mask(m, gates_from_mask(pruned)):
            gated = m(x).logits
        with physical(Cut.of_mask(pruned), m).running(m) as run:
            assert (run(x).logits - gated).abs().max().item() <= EXACT
        both = exported_cut(loaded, pruned, plan)                        # the mask + the plan, as exported
        assert both.kind == "model" and both.plan.pruned_kv[0, 0]        # the emptied group written as pruned
        with head_mask(m, gates_from_mask(pruned)), applied(m, KVPlan(plan.modes, plan.window, n_heads=4)):
            want = m(x).logits
        with both.running(m) as run:
            assert (run(x).logits - want).abs().max().item() <= EXACT
    with pytest.raises(InputError, match="prunes 1 KV heads the mask keeps"):
        exported_cut(loaded, np.zeros((2, 4), bool), KVPlan(np.array([[PRUNE, FULL], [FULL, FULL]]), n_heads=4))


def test_a_cut_of_another_model_is_one_line():
    m = _model()
    geometry = adapter_for(m).geometry(m)
    with pytest.raises(InputError, match="mask is"):
        Cut.of_mask(np.zeros((3, 4), bool)).check(geometry)
    with pytest.raises(InputError, match="KV plan is for"):
        Cut.of_plan(KVPlan(np.zeros((3, 2), np.int8), n_heads=4)).check(geometry)
    with pytest.raises(InputError, match="both the plan and the modes"):
        Cut.of_model(m, plan=KVPlan(np.zeros((2, 2), np.int8), n_heads=4))


def test_every_report_refuses_a_cut_that_is_not_a_cut():
    """A bare mask (or a plan) where a report takes `cut=` is one line naming the constructor, not a traceback
    from deep inside the report."""
    from analysis.arch.cut import checked
    m = _model()
    geometry = adapter_for(m).geometry(m)
    assert checked(None, geometry) is None
    for wrong in (np.zeros((2, 4), bool), KVPlan(np.zeros((2, 2), np.int8), n_heads=4)):
        with pytest.raises(InputError, match=r"Cut\.of_mask\(pruned\)"):
            checked(wrong, geometry)
    with pytest.raises(InputError, match="Give the cut"):
        checked(None, geometry, required=True)
