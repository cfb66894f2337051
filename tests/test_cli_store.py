"""The commands that keep their results on disk: longctx reads its dense side (and a KV plan's side) back the
second time with the same numbers; `cache warm` stores what the Long context page reads, and kv-plan --rows probes
then builds its plan from it without a pass (the plan of the scan's own scores); roles' long detectors and
kv-plan's own rows are one stored result when they ask the same; --refresh measures again; `cache list` and
`cache clear` (by measure, by model); bad input is one line."""
import json

import numpy as np
import pytest

from tests._apptools import long_tiny, results_store  # noqa: F401 (fixtures)
from tests._input_checks import only_error_line, run_captured
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

LENGTH = 320
WINDOW = ("--sinks", 2, "--recent", 16)


def _json(capsys, *argv) -> dict:
    code, out, err = run_captured(capsys, *argv, "--quiet")
    assert code == 0, err
    return json.loads(out)


def test_longctx_reads_its_dense_side_and_a_plans_side_back(long_tiny, results_store, capsys, tmp_path):
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.window import Window
    base = ("longctx", "--model", long_tiny, "--lengths", LENGTH, "--items", 2, "--probe", "passkey")
    first, second = _json(capsys, *base), _json(capsys, *base)
    assert (first["stored"]["dense"], second["stored"]["dense"]) == ("miss", "hit")
    assert first["report"]["cells"] == second["report"]["cells"] and second["estimate_s"] == 0.0
    modes = np.zeros((4, 2), np.int8)
    modes[1, 0], modes[2, 1] = 1, 2
    plan = tmp_path / "kv_plan.json"
    plan.write_text(KVPlan(modes, Window(2, 16), 4, "tiny").to_json())
    cut1, cut2 = _json(capsys, *base, "--kv-plan", plan), _json(capsys, *base, "--kv-plan", plan)
    assert (cut1["stored"], cut2["stored"]) == ({"dense": "hit", "cut": "miss"}, {"dense": "hit", "cut": "hit"})
    assert cut1["report"]["cells"] == cut2["report"]["cells"]
    assert [c["dense_accuracy"] for c in cut1["report"]["cells"]] == [c["dense_accuracy"] for c in
                                                                      first["report"]["cells"]]
    refreshed = _json(capsys, *base, "--kv-plan", plan, "--refresh")
    assert refreshed["stored"] == {"dense": "miss", "cut": "miss"}
    assert refreshed["report"]["cells"] == cut1["report"]["cells"]


def test_warm_then_kv_plan_reads_the_pages_scan(long_tiny, results_store, capsys):
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.score.kvscores import KVScores, plan_from_scores
    from analysis.measure.splits import SCORE_SPLIT
    from analysis.score.longscan import page_rows, stored_scan
    warm = _json(capsys, "cache", "warm", "--model", long_tiny, "--lengths", LENGTH, *WINDOW, "--importance-tokens", 64)
    assert [(r["part"], r["status"]) for r in warm["stored"]] == [("scan", "miss"), ("dense", "miss"),
                                                                  ("importance", "miss")]
    again = _json(capsys, "cache", "warm", "--model", long_tiny, "--lengths", LENGTH, *WINDOW, "--importance-tokens", 64)
    assert [r["status"] for r in again["stored"]] == ["hit", "hit", "hit"]
    out = _json(capsys, "kv-plan", "--model", long_tiny, "--rows", "probes", "--lengths", LENGTH, *WINDOW,
                "--window-share", 0.5, "--prune-share", 0.25, "--prune-tokens", 64)
    assert out["stored"] == {"scan": "hit", "importance": "hit"}
    lm = load_model(str(long_tiny))
    scan, found = stored_scan(lm, page_rows(lm, (LENGTH,), split=SCORE_SPLIT), window=Window(2, 16), compute=False)
    assert found.hit                                        # the scores: a scan of the calibration rows
    dets = {"streaming": scan.streaming(), "retrieval": scan.retrieval()}
    importance = np.asarray(out["scores"]["importance"])
    want = plan_from_scores(lm.geometry, KVScores(dets["streaming"].extras["kv_scores"],
                                                  dets["retrieval"].extras["kv_scores"], importance, dets),
                            window_share=0.5, prune_share=0.25, window=Window(2, 16))
    assert out["plan"]["modes"] == want.as_dict()["modes"]
    listed = _json(capsys, "cache", "list")
    # a scan and its dense side for each split: the scores' calibration rows, the verdicts' test rows
    assert sorted(r["measure"] for r in listed["results"]) == ["kv-importance"] + ["long-dense"] * 2 + ["long-scan"] * 2
    assert _json(capsys, "cache", "clear", "--measure", "long-dense")["removed"] == 2
    assert _json(capsys, "cache", "clear", "--model", "someone-else")["removed"] == 0
    assert _json(capsys, "cache", "clear", "--model", str(long_tiny))["removed"] == 3
    assert results_store.entries() == []


def test_the_same_detector_asked_by_two_commands_is_one_result(long_tiny, results_store, capsys):
    roles = _json(capsys, "roles", "--model", long_tiny, "--detector", "streaming", "--lengths", LENGTH, *WINDOW)
    plan = _json(capsys, "kv-plan", "--model", long_tiny, "--lengths", LENGTH, *WINDOW, "--no-keep-retrieval")
    assert roles["stored"] == {"streaming": "miss"} and plan["stored"] == {"streaming": "hit"}
    again = _json(capsys, "roles", "--model", long_tiny, "--detector", "streaming", "--lengths", LENGTH, *WINDOW)
    assert again["stored"] == {"streaming": "hit"}
    assert again["detectors"]["streaming"]["scores"] == roles["detectors"]["streaming"]["scores"]
    assert len(results_store.entries()) == 1


def test_bad_input_is_one_line(long_tiny, results_store, capsys, monkeypatch):
    from analysis.core import placement
    monkeypatch.setattr(placement, "fast_bfloat16", lambda device_type="cpu", flags=None: False)
    for argv, words in ((("cache", "warm", "--model", long_tiny, "--measure", "long-scan"), "--measure is for"),
                        (("cache", "warm", "--model", long_tiny, "--items", 0), "--items"),
                        (("cache", "warm", "--model", long_tiny, "--precision", "bfloat16"), "no fast bfloat16"),
                        (("longctx", "--model", long_tiny, "--lengths", LENGTH, "--precision", "bfloat16"), "no fast bfloat16"),
                        (("kv-plan", "--model", long_tiny, "--precision", "bfloat16", "--lengths", LENGTH), "float32"),
                        (("kv-plan", "--model", long_tiny, "--rows", "probes", "--precision", "bfloat16"),
                         "no fast bfloat16")):
        code, out, err = run_captured(capsys, *argv)
        assert code == 2 and out == "" and words in only_error_line(err), (argv, err)
    assert results_store.entries() == []
