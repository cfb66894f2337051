"""The Long context page's fills from the heads' own scores (analysis.score.kvscores.plan_from_scores): window the
share of KV heads lowest on a window score, keep the KV heads that hold a retrieval head full, prune the least
important share; and the buttons that measure those scores.

The streaming and retrieval scores come from the page's shared scan of the probes' rows (components/longstate.py:
`scan`, which also gives the probes' dense side), the retrieval-aware score from the long detector shared with the
Heads page (`longstate.long_detection`), the importance from a short KV-group ablation (`longstate.importance`);
each is kept on disk, shown at once when this machine holds it, else one button with its expected time and a Stop.
The page calls `score_fills`; the plan it makes becomes the view's (`state.set_plan`).
"""
from __future__ import annotations

import streamlit as st

from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.measure.long_options import PAGE_IMPORTANCE_TOKENS
from analysis.measure.splits import SCORE_SPLIT

from . import cache, longstate, state
from .errors import shown_errors

IMPORTANCE_TOKENS = PAGE_IMPORTANCE_TOKENS      # tokens of the KV-group ablation that ranks what a plan prunes


def _long_scores(lm, name: str, options: dict):
    """The button and the result (a Detection, or None) of one long detector, computed by the same cached call
    as the Heads page's (so a score measured there with these options is read here, and the other way round)."""
    from analysis.measure.detectors import get_detector
    passes = get_detector(name, lm.tokenizer, **options).passes(lm.model)
    opts = tuple(sorted(options.items()))
    return cache.run_button(f"Measure the {name} scores ({len(passes)} pass{'es' if len(passes) > 1 else ''} of "
                            f"{passes[0]:,} tokens)", button_key=f"long.scores.{name}", slot=f"long.scores.{name}",
                            run_key=(lm.name, name, opts), fn=longstate.long_detection,
                            args=(state.model_key(), name, opts), label=f"Measuring the {name} scores",
                            kind="long-detectors", work=longstate.long_work(passes),
                            stale_note="The window or the length changed since ({view}); press the button again.",
                            view=", ".join(f"{k} {v}" for k, v in opts))


def _fill_scores(geometry, model: str, window_score: str, windowing, retrieval, importance, window_share: float,
                 prune_share: float, keep_retrieval: bool, window: Window) -> None:
    """windowing, retrieval: the detectors' Detections (the window score's; retrieval may be None); importance
    [L, Hkv] or None."""
    from analysis.score.kvscores import KVScores, plan_from_scores
    dets = {name: d for name, d in ((window_score, windowing), ("retrieval", retrieval)) if d is not None}
    scores = KVScores(retrieval=None if retrieval is None else retrieval.extras["kv_scores"], importance=importance,
                      detections=dets, prune_tokens=IMPORTANCE_TOKENS if importance is not None else 0
                      ).with_window_score(window_score, windowing.extras["kv_scores"])
    try:
        plan = plan_from_scores(geometry, scores, window_share=window_share, prune_share=prune_share,
                                keep_retrieval=keep_retrieval, window=window, window_score=window_score, model=model)
    except InputError as err:
        state.remember(state.PLAN_NOTE, str(err))
        return
    state.set_plan(plan.modes, "scores")
    state.remember(state.PLAN_NOTES, (state.get("kv"), plan.notes))


def _window_options(name: str, length: int, window: Window) -> dict:
    """The options a window score is measured with on this page: its length and the page's window (and two needles
    per depth for the retrieval-aware rows, as the retrieval score's)."""
    return dict(lengths=(length,), **window.as_dict(), **({"needles": 2} if name == "retrieval-aware" else {}))


def score_fills(lm, window: Window) -> None:
    """Fill the grid from the heads' own scores: window the share of KV heads lowest on the chosen window score
    (streaming: the output change under this page's window; retrieval-aware: the needle answers' log-probability
    lost when the KV head alone reads it), keep the KV heads that hold a retrieval head full, prune the least
    important share (KV-group ablation). The streaming and retrieval scores come from one pass over calibration rows
    of the probes (components/longstate.scan with SCORE_SPLIT: apart from the rows the probes' verdicts read), the
    retrieval-aware score from its own calibration rows at the probes' length, the importance from the calibration
    text; every score is kept on disk and shown at once when this machine holds it."""
    from analysis.measure.detector_registry import detector_spec
    from analysis.measure.long_options import DEFAULT_WINDOW_SCORE, WINDOW_SCORES
    g = lm.geometry
    with st.expander("Fill from the heads' scores (streaming or retrieval-aware, retrieval, importance)",
                     expanded=False):
        st.caption("The streaming and retrieval scores, read from one pass over calibration rows of the long-context "
                   "probes below (their probes, tokens per row, depths and sequences, and the precision there, with "
                   "other keys and the other half of the built-in text, so a plan is never chosen on the rows it is "
                   "judged on), at this page's window; the importance from a short ablation on the calibration text.")
        windowing = retrieval = importance = None
        window_score = st.radio(
            "Window the KV heads lowest on", WINDOW_SCORES, horizontal=True,
            key=state.widget_key("long.scores.by", value=DEFAULT_WINDOW_SCORE),
            format_func=lambda name: f"the {name} score",
            help="; ".join(f"{name}: {detector_spec(name).help}" for name in WINDOW_SCORES) + ".")
        with shown_errors("Measuring the heads' scores"):
            context = longstate.view_window(lm)[0]
            streaming, retrieval = heads_scores(lm, window, context)
            windowing = streaming
            if window_score != "streaming":                   # its own rows, at the probes' length
                length = longstate.probe_settings(lm, context)[1]
                windowing = _long_scores(lm, window_score, _window_options(window_score, length, window))
        with shown_errors("Measuring the KV groups' importance"):
            importance = importance_scores(lm, IMPORTANCE_TOKENS)
        if windowing is None:
            st.caption(f"Measure the {window_score} scores to fill the grid from them.")
            return
        c1, c2 = st.columns(2)
        share = c1.slider(f"Window the lowest on the {window_score} score (% of KV heads)", 0, 100, step=5,
                          key=state.widget_key("long.scores.window", value=50))
        prune = c2.slider("Prune the least important (% of KV heads)", 0, 100, step=5,
                          key=state.widget_key("long.scores.prune", value=0), disabled=importance is None,
                          help=None if importance is not None else "Measure the KV groups' importance first.")
        keep = st.checkbox("Keep KV heads with a retrieval head full", disabled=retrieval is None,
                           key=state.widget_key("long.scores.keep", value=True),
                           help="A KV head one of whose query heads copies at least 10 % of a needle (Wu et al. "
                                "2024) stays full whatever its window score." if retrieval is not None else
                           "Measure the retrieval scores first.")
        st.button(f"Fill the grid: window {share} % by the {window_score} score, prune "
                  f"{prune if importance is not None else 0} %"
                  + (", retrieval heads full" if keep and retrieval is not None else ""), key="long.scores.fill",
                  on_click=_fill_scores, type="primary",
                  args=(g, lm.name, window_score, windowing, retrieval, importance, share / 100,
                        (prune / 100) if importance is not None else 0.0,
                        bool(keep) and retrieval is not None, window))


# -- the scores' buttons ---------------------------------------------------------------------------

def heads_scores(lm, window: Window, context: int):
    """(streaming Detection, retrieval Detection) measured with `window` on calibration rows of the probes section's
    probes (other keys, the other half of the built-in text: apart from the rows the probes' verdicts read;
    analysis.measure.splits.SCORE_SPLIT), stored: shown at once; else a button with its expected time; or
    (None, None) before they are measured."""
    key = state.model_key()
    settings = longstate.probe_settings(lm, context)
    prec = longstate.precision()
    rows = longstate.built(key, settings, SCORE_SPLIT)
    n_rows = sum(items.ids.shape[0] for (_, _, items) in rows.values())
    probes, length = settings[0], settings[1]
    where = (f"{n_rows} calibration rows of {length:,} tokens of the probes below ({', '.join(probes)}: other keys, the "
             f"other half of the text than the rows they are judged on), with this page's window, in {prec}")
    found = longstate.stored_scan(key, settings, window, prec, SCORE_SPLIT)
    run_key = (key, settings, window, prec, SCORE_SPLIT)
    if found[0] is not None:
        state.remember_run("long.scores.scan", run_key, found, view=where)
        st.caption(f"The heads' scores on {where}. " + longstate.stored_words(found[1]))
        result = found
    else:
        result = cache.run_button(
            f"Measure the heads' scores ({where})",
            button_key="long.scores.scan", slot="long.scores.scan", run_key=run_key, fn=longstate.scan,
            args=(key, settings, window, prec, SCORE_SPLIT), label="Measuring the heads' scores", kind="long-scan",
            work=longstate.scan_seconds(key, rows, prec), view=where,
            stale_note="The probes' rows, the window or the precision changed since ({view}); press the button "
                       "again.")
    if result is None:
        return None, None
    sc = result[0]
    return sc.streaming(), sc.retrieval()


def importance_scores(lm, tokens: int = PAGE_IMPORTANCE_TOKENS):
    """[L, Hkv] KV groups' importance: stored, shown at once; else a button."""
    key = state.model_key()
    g = lm.geometry
    prec = longstate.precision()
    found = longstate.stored_importance_lookup(key, tokens, prec)
    if found[0] is not None:
        st.caption(f"The KV groups' importance (ablation on {tokens} tokens, {prec}). " + longstate.stored_words(found[1]))
        return found[0]
    result = cache.run_button(
        f"Measure the KV groups' importance (ablation on {tokens} tokens, {prec})",
        button_key="long.scores.importance", slot="long.scores.importance", run_key=(key, tokens, prec),
        fn=longstate.importance, args=(key, tokens, prec), label="Removing each KV group", kind="kv-importance",
        work=longstate.importance_seconds(key, g, tokens, prec), stale_note="({view})", view="another model or precision")
    return None if result is None else result[0]
