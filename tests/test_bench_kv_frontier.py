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
