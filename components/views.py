"""Page logic shared by several pages: the mask of the current view.

Pages are thin (widgets, cached calls, render); what two pages must compute the same way lives
here, on top of `cache` (cached calls), `controls` (scorer defaults and labels) and `state`.
"""
from __future__ import annotations

import streamlit as st

from analysis.score import masks

from analysis.score import scoring

from . import cache, controls, state
from .errors import show_exception


def view_mask(lm, *, explain: bool = True):
    """The mask of the current view: scorer, its parameters, z, sparsity and policy, all view fields
    (set on the Prune page or by the link; the scorer's defaults where nobody set them).

    Returns (head_scores, plan, params, policy), or None after showing why there is no mask
    (`explain=False`: without showing it, for a page that has shown it already)."""
    scorer, z, sparsity = state.get("scorer"), float(state.get("z")), float(state.get("sparsity"))
    cls = scoring.SCORERS.get(scorer)
    if cls is None:
        st.error(f"Unknown scorer {scorer!r}; pick one on the Prune page.")
        return None
    params, policy = controls.current_params(scorer, z), controls.current_policy()
    key = cache.params_key(params)
    if cls.needs_calibration and not state.is_scored(lm.name, scorer, key):
        if explain:
            st.info(f"{controls.label(scorer)} needs calibration: compute its scores on the Prune page first.")
        return None
    head_scores = cache.cached_call(cache.scores, lm.name, state.load_options(), scorer, key,
                                    label=f"Scoring with {controls.label(scorer)}")
    if head_scores is None:
        return None
    try:
        plan = masks.plan_mask(head_scores, sparsity, group_size=lm.geometry.group_size, **policy)
    except Exception as err:  # noqa: BLE001
        if explain:
            show_exception(err, "Building the mask")
        return None
    return head_scores, plan, params, policy
