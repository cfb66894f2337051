"""`headscope kv-plan` and the long detectors in `roles` (analysis/cli/kvplan.py, analysis/score/kvscores.py).

- the plan written to --out reads back with the model's geometry; KV heads holding a retrieval head stay
  full; the summary on stdout says what the file holds;
- bad input (a window of 0, a context longer than the model's, shares over 1, a folder as --out, a bad
  list) is one line, exit 2, nothing written;
- `roles --versus-mpg` with the long detectors gives an AUC row for both roles;
- plan_from_scores on scores written by hand: prune the least important, window the lowest streaming
  scores, never touch a retrieval head.
"""
import json

import numpy as np
import pytest

from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, read_kv_plan
from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.measure.headmaps import Detection
from analysis.score.kvscores import KVScores, plan_from_scores
from tests._apptools import long_tiny  # noqa: F401 - a fixture
from tests._input_checks import run_captured


def test_kv_plan_writes_a_plan_that_keeps_retrieval_heads_full(long_tiny, tmp_path, capsys):
    out = tmp_path / "kv_plan.json"
    code, stdout, err = run_captured(capsys, "kv-plan", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--lengths", "256", "--needles", "1", "--depths", "0.5", "--sinks", "2", "--recent", "16",
                             "--window-share", "0.5", "--prune-share", "0.25", "--prune-tokens", "32",
                             "--retrieval-threshold", "0.05", "--out", str(out))
    assert code == 0, err
    summary = json.loads(stdout)
    plan = read_kv_plan(out, geometry=HeadGeometry(4, 4, 2, 8, 32))
    assert plan.window == Window(2, 16) and plan.counts() == summary["plan"]["counts"]
    assert plan.counts()["prune"] == 2                                     # floor(0.25 * 8)
    retrieval = np.array(summary["scores"]["retrieval"])                   # [L, Hkv]
    assert (plan.modes[retrieval >= 0.05] == FULL).all()
    streaming = np.array(summary["scores"]["streaming"])
    windowed, free = plan.windowed, (retrieval < 0.05) & ~plan.pruned_kv
    if windowed.any() and (free & ~windowed).any():                      # the lowest free ones are windowed
        assert streaming[windowed].max() <= streaming[free & ~windowed].min()
    assert summary["kv_ratio"]["256"] == pytest.approx(plan.kv_ratio(256))
    assert summary["out"] == str(out) and set(summary["scores"]["seconds"]) == {"streaming", "retrieval", "importance"}


def test_kv_plan_without_retrieval_does_not_measure_it(long_tiny, capsys):
    code, stdout, err = run_captured(capsys, "kv-plan", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--lengths", "64", "--sinks", "1", "--recent", "8", "--no-keep-retrieval")
    assert code == 0, err
    summary = json.loads(stdout)
    assert "retrieval" not in summary["scores"] and summary["plan"]["counts"]["window"] == 4
    assert summary["out"] is None


@pytest.mark.parametrize("args, words", [
    (("--recent", "0"), "reads nothing"),
    (("--lengths", "1024"), "longer than this model reads"),
    (("--window-share", "0.8", "--prune-share", "0.5"), "more than all"),
    (("--window-share", "1.5"), "fraction"),
    (("--lengths", "2k"), "comma-separated"),
    (("--depths", "0.5,1.5"), "depth"),
    (("--needles", "0"), "--needles"),
])
def test_kv_plan_refuses_bad_input_in_one_line(long_tiny, tmp_path, capsys, args, words):
    out = tmp_path / "kv_plan.json"
    code, stdout, err = run_captured(capsys, "kv-plan", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--out", str(out), *args)
    assert code == 2 and stdout == "" and not out.exists()
    assert err.count("\n") == 1 and words in err, err


def test_kv_plan_checks_out_before_any_work(tmp_path, capsys):
    code, _, err = run_captured(capsys, "kv-plan", "--model", "no-such-model-anywhere", "--out", str(tmp_path))
    assert code == 2 and "folder" in err


def test_roles_versus_mpg_has_both_long_roles(long_tiny, capsys):
    code, stdout, err = run_captured(capsys, "roles", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--detector", "retrieval", "--detector", "streaming", "--lengths", "200",
                             "--needles", "1", "--depths", "0.5", "--recent", "16", "--versus-mpg",
                             "--permutations", "200")
    assert code == 0, err
    data = json.loads(stdout)
    assert list(data["detectors"]) == ["retrieval", "streaming"]
    assert data["detectors"]["retrieval"]["lengths"] == [200]
    assert data["detectors"]["streaming"]["recent"] == 16
    assert [r["role"] for r in data["versus_mpg"]["roles"]] == ["retrieval", "streaming"]


def test_plan_from_scores_by_hand():
    geo = HeadGeometry(2, 4, 2, 8, 32)
    streaming = np.array([[0.1, 0.9], [0.2, 0.3]])
    retrieval = np.array([[0.5, 0.0], [0.0, 0.0]])                        # L0KV0 holds a retrieval head
    importance = np.array([[0.0, 5.0], [1.0, 2.0]])
    det = Detection("streaming", np.repeat(streaming, 2, 1), 0.5, extras=dict(lengths=[2048]))
    scores = KVScores(streaming, retrieval, importance, {"streaming": det}, prune_tokens=256)
    plan = plan_from_scores(geo, scores, window_share=0.5, prune_share=0.25, window=Window(4, 256))
    # L0KV0 kept (retrieval, though least important and most streaming); L1KV0 pruned (least important of
    # the rest); then the two lowest streaming scores among L0KV1 (0.9) and L1KV1 (0.3) -> L1KV1, L0KV1
    assert plan.modes.tolist() == [[FULL, WINDOW], [PRUNE, WINDOW]]
    assert any("L0KV0" in n for n in plan.notes) and any("256 tokens" in n for n in plan.notes)
    with pytest.raises(InputError, match="importance"):
        plan_from_scores(geo, KVScores(streaming, retrieval), prune_share=0.25)
    with pytest.raises(InputError, match="retrieval score"):
        plan_from_scores(geo, KVScores(streaming))
