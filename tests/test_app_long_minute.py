"""The Long context page's long passes, measured once (components/longstate.py): one button measures the heads'
scores on the probes' rows and they equal the library's scan of those rows; the probes' run then measures the
plan's side alone (its dense side is the scan's); after a restart (every Streamlit cache cleared) the scores and
the importance are on the page at once, read from the store, with no button, and the plan's side of a plan
run before is read back too; a plan edited afterwards is measured again; the page's clear button removes
every stored result of the model."""
import json

import numpy as np
import pytest

from tests._apptools import downloads, fresh_caches, new_app, no_exception, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")
LIMIT, LENGTH = 512, 320


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-minute"), max_position_embeddings=LIMIT)


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


def _open(model_dir, **params):
    at = new_app(model_dir, page="long_context", sinks=2, recent=16, **params)
    no_exception(at)
    at.number_input(key="hs.w.long.probes.length").set_value(LENGTH).run()
    no_exception(at)
    return at


def _clear_streamlit():
    import streamlit as st
    st.cache_data.clear()
    st.cache_resource.clear()


def test_one_scan_fills_the_scores_and_a_restart_reads_them_back(tiny_long, results, downloads):
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.core.store import Key, Store
    from analysis.measure.evaluation import context_length
    from analysis.measure.longpass import LongScan, long_scan
    from analysis.measure.probes.longcontext import build_long
    at = _open(tiny_long, kv="ww.ff.pw.ff")
    assert not any(b.key == "long.scores.fill" for b in at.button)           # nothing to fill from yet
    for name in ("scan", "importance"):
        at.button(key=f"long.scores.{name}").click().run()
        no_exception(at)
        assert not at.error, [e.value for e in at.error]
    assert any(b.key == "long.scores.fill" for b in at.button)
    lm = load_model(str(tiny_long))
    from analysis.measure.splits import SCORE_SPLIT
    built = build_long(["passkey"], lm.tokenizer, lm.kind, (LENGTH,), depths=(0.1, 0.5, 0.9), n_items=2,
                       limit=context_length(lm.model), split=SCORE_SPLIT)       # the scores' rows: calibration
    want = long_scan(lm.model, built, window=Window(2, 16))
    (entry,) = [e for e in Store(results).entries() if e.measure == "long-scan"]
    stored = Store(results).get(Key(**{k: entry.key[k] for k in ("model", "measure", "settings", "code")}))
    got = LongScan.from_tree(stored.value)
    assert np.array_equal(got.stream_kv, want.stream_kv) and np.array_equal(got.copy, want.copy)

    label = next(b.label for b in at.button if b.key == "long.probes.run")
    assert "dense and plan" in label          # the scores' scan read calibration rows: the probes' dense side is apart
    at.button(key="long.probes.run").click().run()
    no_exception(at)
    first = json.loads(downloads["long_context.json"])
    assert first["cut"]["kind"] == "plan"

    _clear_streamlit()                                                      # a restart: only the disk remembers
    downloads.clear()
    at = _open(tiny_long, kv="ww.ff.pw.ff")
    captions = " ".join(c.value for c in at.caption)
    assert captions.count("Read from this machine's stored results") == 3, captions   # scores, importance, probes
    assert not any(b.key in ("long.scores.scan", "long.scores.importance") for b in at.button)
    assert any(b.key == "long.scores.fill" for b in at.button)
    again = json.loads(downloads["long_context.json"])                       # the plan's report shown at once
    assert again["cells"] == first["cells"]
    assert {e.measure for e in Store(results).entries()} == {"long-scan", "long-dense", "long-cut", "kv-importance"}

    at = _open(tiny_long, kv="wf.ff.pw.ff")                                  # another plan: its own passes
    at.button(key="long.probes.run").click().run()
    no_exception(at)
    assert len([e for e in Store(results).entries() if e.measure == "long-cut"]) == 2

    # a scan and its dense side of the scores' calibration rows and of the probes' test rows, 2 cuts, the importance
    assert "(7, " in next(b.label for b in at.button if b.key == "long.store.clear")
    at.button(key="long.store.clear").click().run()                          # the page's clear: every measure
    no_exception(at)
    assert Store(results).entries() == []
    assert any(b.key == "long.scores.scan" for b in at.button)              # measured again from here on
    assert not any(b.key == "long.store.clear" for b in at.button)


def test_a_class_warmed_by_the_cli_finds_its_results_on_the_page(tiny_long, results, capsys, downloads):
    """`headscope cache warm` with the page's defaults (here: the model's whole 512-token context, the link's window)
    stores what the page then shows at once, with no button and no pass: the CLI and the app share the store."""
    from tests._input_checks import run_captured
    code, out, err = run_captured(capsys, "cache", "warm", "--model", tiny_long, "--sinks", 2, "--recent", 16,
                                  "--quiet")
    assert code == 0, err
    stored = json.loads(out)["stored"]                 # the scores' calibration scan, the probes' dense side, importance
    assert [(r["part"], r["status"]) for r in stored] == [("scan", "miss"), ("dense", "miss"), ("importance", "miss")]
    at = new_app(tiny_long, page="long_context", sinks=2, recent=16)
    no_exception(at)
    captions = " ".join(c.value for c in at.caption)
    assert captions.count("Read from this machine's stored results") == 3, captions   # scores, importance, probes
    assert not any(b.key in ("long.scores.scan", "long.scores.importance") for b in at.button)
    assert "dense is measured" in next(b.label for b in at.button if b.key == "long.probes.run")
    shown = json.loads(downloads["long_context.json"])                          # the dense probes' report, shown
    assert shown["cut"] is None and shown["lengths"] == [512] and len(shown["cells"]) == 4
