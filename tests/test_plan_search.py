"""The plan search (analysis/score/plansearch.py): a KV plan chosen whole against calibration answers.

Oracles: the block search on a loss whose cost per head is known (planted expensive heads are never windowed while
the budget holds, every other head is, in the prior's order); a window that covers the rows gives exactly dense's
loss (a window >= context == full); the plan's loss equals the answers' NLL of `applied(plan)` computed by hand;
a stop keeps the plan so far only when asked; bad input is one line before any pass.
"""
import re

import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import applied
from analysis.arch.models import LoadedModel
from analysis.arch.window import Window
from analysis.core.errors import CancelledError, InputError
from analysis.score import plansearch as P

from ._tiny import tiny_model

GEO = HeadGeometry(n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8, hidden=64)     # 16 KV heads


def _planted(costs: np.ndarray, rows: int = 3):
    """evaluate(windowed) -> NLL [rows]: dense 1.0 per row plus the summed cost of the windowed heads."""
    calls = []

    def evaluate(windowed):
        calls.append(np.asarray(windowed).copy())
        return np.full(rows, 1.0 + float(costs[np.asarray(windowed, bool)].sum()))
    return evaluate, calls


def test_the_block_search_never_windows_a_planted_head_while_the_budget_holds():
    costs = np.zeros((4, 4))
    costs[1, 2] = costs[3, 0] = 5.0                            # two heads whose windowing loses the answer
    prior = np.arange(16, dtype=float).reshape(4, 4)            # the order: L0KV0, L0KV1, ...
    search = P.GreedyPlanSearch(target=0.5, context=1024, window=Window(4, 60), block=4, budget=0.5)
    need = search.needed(GEO)
    assert need == int(np.ceil(0.5 / (1 - 64 / 1024) * 16 - 1e-9))            # 9 of 16
    evaluate, calls = _planted(costs)
    chosen, within, trace = search.choose(evaluate, np.ones(3), prior, GEO)
    chosen = chosen.reshape(4, 4)
    assert within and chosen.sum() == need
    assert not chosen[1, 2] and not chosen[3, 0]
    expected = [i for i in range(16) if i not in (6, 12)][:need]             # the prior's order, planted ones skipped
    assert sorted(np.flatnonzero(chosen.ravel())) == expected
    assert any(not t["kept"] and t["heads"] == ["L1KV2"] for t in trace)     # found alone by halving its block
    assert len(calls) == len(trace) and len(calls) < 16                      # fewer evaluations than heads


def test_over_budget_the_cheapest_refused_heads_are_added_and_the_result_says_so():
    costs = np.full((4, 4), 1.0)
    costs[0, :] = [3.0, 2.0, 4.0, 5.0]
    search = P.GreedyPlanSearch(target=0.8, context=1024, window=Window(4, 60), block=2, budget=0.5)
    evaluate, _ = _planted(costs)
    chosen, within, _ = search.choose(evaluate, np.ones(3), np.zeros((4, 4)), GEO)
    assert not within and chosen.sum() == search.needed(GEO)


def test_the_search_on_a_tiny_model_reaches_its_target_and_its_loss_is_the_plans_own():
    model = tiny_model("llama", vocab_size=128, num_hidden_layers=3, max_position_embeddings=256)
    adapter = adapter_for(model)
    loaded = LoadedModel(model=model, tokenizer=None, name="tiny", kind="causal-lm", adapter=adapter,
                         geometry=adapter.geometry(model), source="in-process")
    gen = torch.Generator().manual_seed(0)
    rows = [P.AnswerRow(torch.randint(4, 128, (96,), generator=gen), 90) for _ in range(3)]
    window = Window(2, 16)
    result = P.GreedyPlanSearch(target=0.6, context=96, window=window, block=2, budget=10.0).search(loaded, rows)
    assert result.plan.windowed.sum() == P.heads_for_ratio(0.6, 96, window, 6) and result.kv_ratio <= 0.6
    assert result.within_budget and not result.partial and result.plan.notes
    with torch.no_grad(), applied(model, result.plan):                         # the plan's loss by hand
        by_hand = []
        for row in rows:
            logits = model(input_ids=row.ids[None]).logits[0, row.answer - 1:-1].double()          # [k, V]
            by_hand.append(float(torch.nn.functional.cross_entropy(logits, row.targets, reduction="sum")))
    np.testing.assert_allclose(result.plan_nll, by_hand, rtol=1e-5)          # float32 logits, summed in float64
    cover = P.PlanLoss(model, rows, Window(2, 200), loaded.geometry)         # a window >= the rows == full
    dense, _ = cover.of(None)
    every, _ = cover.of(np.ones((3, 2), bool))
    np.testing.assert_array_equal(dense, every)


def test_a_stopped_search_keeps_the_plan_so_far_only_when_asked():
    search = P.GreedyPlanSearch(target=0.5, context=1024, window=Window(4, 60), block=2, budget=1.0)
    n = {"calls": 0}

    def evaluate(windowed):
        n["calls"] += 1
        if n["calls"] == 3:
            raise CancelledError("The plan search was cancelled; start it again to get a result.")
        return np.ones(3)
    with pytest.raises(P._Stopped) as stop:
        search.choose(evaluate, np.ones(3), np.zeros((4, 4)), GEO)
    assert stop.value.chosen.sum() == 4                         # two blocks of 2 kept before the stop


@pytest.mark.parametrize("target", [0, -0.1, 1.5, float("nan"), "half", True])
def test_a_kv_target_outside_0_to_1_is_one_line(target):
    with pytest.raises(InputError) as err:
        P.GreedyPlanSearch(target=target)
    assert "\n" not in str(err.value) and "KV target" in str(err.value)


def test_a_target_no_window_reaches_and_an_unknown_search_are_one_line():
    with pytest.raises(InputError, match="prune heads too"):
        P.GreedyPlanSearch(target=0.1, context=1024, window=Window(4, 252)).needed(GEO)
    with pytest.raises(InputError, match="frees nothing"):
        P.GreedyPlanSearch(target=0.5, context=200, window=Window(4, 252)).needed(GEO)
    with pytest.raises(InputError, match="Unknown plan search"):
        P.plan_search("annealing")
    with pytest.raises(InputError, match="calibration rows"):
        P.GreedyPlanSearch().search(LoadedModel(model=None, tokenizer=None, name="x", kind="causal-lm",
                                                adapter=None, geometry=GEO, source="x"), [])



def test_the_command_refuses_in_one_line_before_the_model_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from analysis.cli import common
    from tests._input_checks import one_error_line, run_captured
    monkeypatch.setattr(common, "load_source", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
    out = tmp_path / "plan.json"
    for argv, words in ((["--kv-target", "0"], "KV target"), (["--kv-target", "1.5"], "KV target"),
                        (["--kv-target", "0.5", "--tasks", "ruler_qa_squad"], "download"),
                        (["--kv-target", "0.5", "--cal-length", "1000"], "RULER length"),
                        (["--kv-target", "0.5", "--cal-samples", "0"], "--cal-samples"),
                        (["--kv-target", "0.5", "--block", "0"], "block")):
        code, _, err = run_captured(capsys, "plan-search", *argv, "--out", out, "--quiet")
        assert code == 2 and re.search(words, one_error_line(err), re.I), (argv, err)
        assert not out.exists()


def test_every_search_is_declared_where_the_parser_reads_it():
    from analysis.measure.long_options import PLAN_SEARCHES
    assert tuple(P.PLAN_SEARCHES) == PLAN_SEARCHES


def test_a_plan_measured_once_is_read_back_not_run_again():
    """The search's result is its last kept plan: PlanLoss reads it back instead of another pass over the rows."""
    model = tiny_model("llama", vocab_size=128, num_hidden_layers=2, max_position_embeddings=256)
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(1)
    rows = [P.AnswerRow(torch.randint(4, 128, (64,), generator=gen), 60)]
    loss = P.PlanLoss(model, rows, Window(2, 16), adapter.geometry(model))
    windowed = np.array([[True, False], [False, False]])
    first = loss.of(windowed)
    again = loss.of(windowed.copy())
    assert loss.evaluations == 1 and np.array_equal(first[0], again[0])
    loss.of(None)
    assert loss.evaluations == 2
