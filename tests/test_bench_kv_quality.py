"""bench/bench_kv_quality.py on a tiny model (seconds, not the benchmark): the plans it reads are the
library's (kvscores.plan_from_scores from the same scores, the cut a KV plan of MP-G's groups), every row's KV
ratio is the plan's, its cells are long_context_report's for that plan on the same rows, 'inside dense's CI'
and the goal line follow from those cells, and the markdown carries its markers; saved scores are read back."""
import argparse
import json

import numpy as np
import pytest

from analysis.arch.cut import Cut
from analysis.arch.window import Window
from analysis.score.kvscores import KVScores, plan_from_scores
from analysis.score.longcontext import KV_QUALITY_MARKERS, long_context_report
from tests._apptools import tiny_model_dir

LENGTH = 320


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from analysis.arch.models import load_model
    return load_model(str(tiny_model_dir(tmp_path_factory.mktemp("kvq"), max_position_embeddings=512)))


def test_rows_are_the_librarys_and_the_goal_follows_from_them(loaded, tmp_path):
    from analysis.measure.probes.longcontext import build_long
    from bench import bench_kv_quality as bench
    g = loaded.geometry
    rng = np.random.default_rng(0)
    shape = (g.n_layers, g.n_kv_heads)
    scores = KVScores(rng.random(shape), rng.random(shape) * 0.2, rng.random(shape), {}, prune_tokens=256)
    args = argparse.Namespace(cut=0.5, window_share=0.5, wider_share=0.75, prune_share=0.25, sinks=2, recent=16)
    plans = bench.plans_of(loaded, scores, args)
    want = plan_from_scores(g, scores, window_share=0.75, window=Window(2, 16), keep_retrieval=True)
    np.testing.assert_array_equal(plans["duo+"].modes, want.modes)
    assert plans["cut"].counts()["prune"] == g.n_layers * g.n_kv_heads // 2 and not plans["cut"].counts()["window"]
    assert all(plan.window == Window(2, 16) for plan in plans.values())

    built = build_long(["passkey"], loaded.tokenizer, loaded.kind, (LENGTH,), depths=(0.1, 0.9), n_items=2)
    dense = long_context_report(loaded, built=built)
    out = {"args": dict(length=LENGTH, probe=["passkey"], depths="0.1,0.9", items=2, threads=1, sinks=2, recent=16,
                        cut=0.5),
           "model": "tiny", "machine": "x", "command": "test", "when": "2026-01-01T00:00", "load": (0.0, 0.0, 0.0),
           "dense": {"seconds": 1.0, "cells": dense.rows(), "all": bench._all(dense)}, "rows": []}
    for name, plan in plans.items():
        rep = long_context_report(loaded, built=built, dense=dense.dense, cut=Cut.of_plan(plan))
        row = bench.row_of(name, plan, rep, LENGTH, 1.0)
        assert row["kv_ratio"] == plan.kv_ratio(LENGTH)
        assert row["cells"] == long_context_report(loaded, built=built, dense=dense.dense, cut=Cut.of_plan(plan)).rows()
        r = bench._all(rep)["passkey"]
        assert row["inside_dense_ci"]["passkey"] == (r["dense_low"] <= r["cut_accuracy"] <= r["dense_high"])
        out["rows"].append(row)
    goal = bench.goal_lines(out)
    met = [r["name"] for r in out["rows"] if r["kv_ratio"] <= bench.GOAL_RATIO and r["inside_dense_ci"]["passkey"]]
    assert all(f"{n} (" in goal[0] for n in met) and len(goal) == 1 + len(out["rows"]) - len(met)
    text = bench.markdown(out)
    assert text.startswith(KV_QUALITY_MARKERS[0]) and text.rstrip().endswith(KV_QUALITY_MARKERS[1])
    assert text.count("| Pass key retrieval | depth 0.1 |") == 1 and text.count(" | passkey") == 0

    saved = tmp_path / "scores.json"
    saved.write_text(json.dumps(dict(sinks=2, recent=16, streaming=scores.streaming.tolist(),
                                     retrieval=scores.retrieval.tolist(), importance=scores.importance.tolist(),
                                     prune_tokens=256)))
    back = bench.scores_of(loaded, str(saved), window=Window(2, 16), log=lambda s: None)
    np.testing.assert_array_equal(back.streaming, scores.streaming)
    np.testing.assert_array_equal(back.importance, scores.importance)
