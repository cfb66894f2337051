"""bench/bench_kv_frontier.py's own rules (no model run): the per-ratio window, the score plans it builds."""
import numpy as np
import pytest

from analysis.arch.adapters import adapter_for
from analysis.arch.kvplan import WINDOW
from analysis.arch.window import Window
from analysis.core.errors import InputError
from bench.bench_kv_frontier import recent_for, score_plan, window_for
from tests._tiny import tiny_model


def test_the_window_is_the_default_unless_the_ratio_is_given_a_shorter_one():
    recents = recent_for("0.33:128, 0.25:64")
    assert recents == {0.33: 128, 0.25: 64} and recent_for("") == {}
    assert window_for(0.5, recents) == Window() and window_for(0.33, recents) == Window(recent=128)
    with pytest.raises(InputError, match="ratio:recent"):
        recent_for("0.33-128")


class _Loaded:
    def __init__(self, model):
        self.geometry, self.name = adapter_for(model).geometry(model), "tiny"


def test_score_plans_window_the_lowest_scores_and_duo_keeps_the_retrieval_heads():
    loaded = _Loaded(tiny_model("llama"))
    g = loaded.geometry
    shape = (g.n_layers, g.n_kv_heads)
    streaming = np.arange(np.prod(shape), dtype=float).reshape(shape)       # the lowest: layer 0 first
    retrieval = np.zeros(shape)
    retrieval.flat[0] = 1.0                                                 # the lowest streaming head retrieves
    scores = {"streaming": streaming, "retrieval": retrieval, "retrieval-aware": -streaming}
    window = Window(2, 8)
    duo = score_plan(loaded, "duo+", 0.5, 64, scores, window, 64)
    aware = score_plan(loaded, "retrieval-aware", 0.5, 64, scores, window, 64)
    assert duo.modes.flat[0] != WINDOW and (duo.modes == WINDOW).any()      # kept full: it holds a retrieval head
    assert aware.modes.flat[-1] == WINDOW and aware.modes.flat[0] != WINDOW
    assert duo.window == window and aware.kv_ratio(64) <= 0.5 + 1e-9
    assert any("calibration" in n for n in duo.notes) and any("retrieval head" in n for n in duo.notes)


def _config(tool: str, held: float, score: float, change_highs: tuple) -> dict:
    rec = dict(kv_bytes_prompt=held * 1000)
    cells = [dict(task=f"t{i}", change=-0.05, change_low=-0.2, change_high=h) for i, h in enumerate(change_highs)]
    cells.append(dict(task="average", cut_score=score, cut_low=score - 0.05, cut_high=score + 0.05,
                      change=-0.02, change_low=-0.1, change_high=min(change_highs)))
    return dict(tool=tool, costs={"t0": [rec]}, cells=cells)


def test_the_goal_is_said_from_the_cells():
    from bench.bench_kv_frontier import goal_lines
    dense = dict(costs={"t0": [dict(kv_bytes_prompt=1000)]})
    configs = {"search@0.5": _config("headscope", 0.497, 0.90, (0.04, 0.01)),
               "prior@0.5": _config("headscope", 0.497, 0.88, (0.04, -0.01)),         # one cell lost
               "search@0.33": _config("headscope", 0.33, 0.70, (0.0, -0.1)),
               "kvpress:snapkv@0.33": _config("kvpress", 0.329, 0.13, (-0.7, -0.7)),
               "kvpress:duo(search@0.33)": _config("kvpress", 0.33, 0.95, (0.0, 0.0))}     # our plan, not a press
    met, above = goal_lines(dict(entry=dict(dense=dense, configs=configs)))
    assert "**met** by search@0.5 " in met and "prior" not in met
    assert "search@0.33 (0.700" in above and "**above** kvpress's best there, kvpress:snapkv@0.33" in above
    configs["search@0.5"] = _config("headscope", 0.497, 0.90, (0.04, -0.02))
    configs["kvpress:streaming@0.33"] = _config("kvpress", 0.33, 0.75, (-0.1, -0.1))
    missed, below = goal_lines(dict(entry=dict(dense=dense, configs=configs)))
    assert "**missed**; closest search@0.5" in missed and "on t1" in missed
    assert "**not above** kvpress's best there, kvpress:streaming@0.33 (0.750)" in below


def test_config_names_give_their_method_and_target():
    from bench.bench_kv_frontier import method_of
    assert method_of("search@0.5") == ("search", 0.5)
    assert method_of("kvpress:snapkv+q@0.33") == ("kvpress:snapkv+q", 0.33)
    assert method_of("kvpress:duo(search@0.33)") == ("kvpress:duo", 0.33)
