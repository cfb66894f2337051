"""The retrieval-aware score in the app (issue 45): the Heads page runs it on its own button (context and window
boxes) and its map is the library's; the Long context page's "Fill from the heads' scores" offers it beside the
streaming score (its own rows at the probes' row length, the retrieval score from the page's shared scan), and
the grid it fills is kvscores.plan_from_scores with window_score="retrieval-aware" of the same scores, its
kv_plan.json naming the score."""
import numpy as np
import pytest

from tests._apptools import (downloads, figure_titled, fresh_caches, heatmap_z, long_tiny, new_app,  # noqa: F401
                             no_exception, texts)

pytestmark = pytest.mark.usefixtures("fresh_caches")
COLS = ("KV 0 (q 0-1)", "KV 1 (q 2-3)")
SCORED = 256                     # tokens the scores are measured at here (the character tokenizer's needles need ~170)


def test_the_heads_page_runs_it_on_its_own_button(long_tiny):
    from analysis.arch.models import load_model
    from analysis.measure.detectors import detect_heads
    at = new_app(long_tiny, page="heads")
    no_exception(at)
    at.number_input(key="hs.w.heads.long.retrieval-aware.context").set_value(SCORED).run()
    at.number_input(key="hs.w.heads.long.retrieval-aware.recent").set_value(16).run()
    at.button(key="heads.long.retrieval-aware").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    want = detect_heads(load_model(str(long_tiny)), ["retrieval-aware"],
                        options=dict(lengths=(SCORED,), sinks=4, recent=16))["retrieval-aware"]
    np.testing.assert_allclose(heatmap_z(figure_titled(at, "Retrieval-aware score")).astype(float), want.scores,
                               rtol=0, atol=1e-9)
    assert f"over {want.extras['n_items']} rows whose needle the window hides" in texts(at)


def test_the_long_context_page_fills_the_grid_from_it(long_tiny, downloads, tmp_path, monkeypatch):
    """The retrieval-aware score on its own rows at the probes' row length, the retrieval score from the page's
    shared scan of the probes' rows (components/longstate.py): the grid is plan_from_scores of the same scores."""
    from analysis.arch.kvplan import MODES, read_kv_plan
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.measure.detectors import detect_heads
    from analysis.measure.evaluation import context_length
    from analysis.measure.longpass import long_scan
    from analysis.measure.probes.longcontext import build_long
    from analysis.score.kvscores import KVScores, plan_from_scores
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))    # measured by this test, not read back
    length = 320                                # the passkey rows' length (the character tokenizer's need ~310)
    at = new_app(long_tiny, page="long_context", sinks=2, recent=32)
    no_exception(at)
    at.number_input(key="hs.w.long.probes.length").set_value(length).run()
    at.radio(key="hs.w.long.scores.by").set_value("retrieval-aware").run()
    for name in ("scan", "retrieval-aware"):
        at.button(key=f"long.scores.{name}").click().run()
        no_exception(at)
        assert not at.error, [e.value for e in at.error]
    at.button(key="long.scores.fill").click().run()
    no_exception(at)
    lm = load_model(str(long_tiny))
    window = Window(2, 32)
    aware = detect_heads(lm, ["retrieval-aware"], options=dict(lengths=(length,), needles=2, **window.as_dict()))
    built = build_long(["passkey"], lm.tokenizer, lm.kind, (length,), depths=(0.1, 0.5, 0.9), n_items=2,
                       limit=context_length(lm.model))
    retrieval = long_scan(lm.model, built, tokenizer=lm.tokenizer, window=window).retrieval()
    scores = KVScores(retrieval=retrieval.extras["kv_scores"], detections={"retrieval": retrieval,
                                                                          **aware}).with_window_score(
        "retrieval-aware", aware["retrieval-aware"].extras["kv_scores"])
    want = plan_from_scores(lm.geometry, scores, window_share=0.5, keep_retrieval=True, window=window,
                            window_score="retrieval-aware")
    (editor,) = at.data_editor
    shown = np.array([[MODES.index(v) for v in editor.value[c]] for c in COLS]).T
    np.testing.assert_array_equal(shown, want.modes)
    notes = read_kv_plan(downloads["kv_plan.json"].decode()).notes
    assert notes[0].startswith("windowed: the lowest retrieval-aware scores"), notes
