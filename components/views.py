"""Page logic shared by several pages: the scores and the mask of the current view.

Pages are thin (widgets, cached calls, render); what two pages must compute the same way lives
here, on top of `cache` (cached calls), `controls` (scorer defaults and labels) and `state`:
`needs_computing` / `scores_of` (a scorer's cached scores; a calibration scorer's only once a
button computed them), `plan_of` (the view's policy and m), and `view_mask`, the whole current view.
"""
from __future__ import annotations

import streamlit as st

from analysis.score import masks, scoring

from . import cache, controls, state
from .errors import show_exception


def needs_computing(lm, scorer: str, params: dict) -> bool:
    """Whether `scorer` runs calibration text and its scores for `params` were not computed yet (a button
    computes them: long work is never started by a slider)."""
    return scoring.scorer_class(scorer).needs_calibration and not state.is_scored(
        lm.name, scorer, cache.params_key(params))


def scores_of(lm, scorer: str, params: dict, *, stoppable: bool = False, quiet: bool = False):
    """HeadScores of `scorer` at `params` on the current model (cached; progress, and Stop when
    `stoppable`), or None after showing why. Marks calibration scores as computed. `quiet`: no progress
    bar (a weight-only scorer on a key press: array arithmetic on the cached profile, milliseconds; the
    bar's three elements cost more than the scores)."""
    key = cache.params_key(params)
    if quiet:
        try:
            return cache.scores(state.model_key(), scorer, key)
        except Exception as err:  # noqa: BLE001 - shown in one line, as cached_call would
            show_exception(err, f"Scoring with {controls.label(scorer)}")
            return None
    head_scores = cache.cached_call(cache.scores, state.model_key(), scorer, key,
                                    label=f"Scoring with {controls.label(scorer)}", stoppable=stoppable)
    if head_scores is not None and scoring.scorer_class(scorer).needs_calibration:
        state.mark_scored(lm.name, scorer, key)
    return head_scores


def plan_of(lm, head_scores, sparsity: float, policy: str) -> masks.MaskPlan:
    """The mask of `head_scores` at `sparsity` under `policy` (with the view's m where it takes one)."""
    return masks.plan_mask(head_scores, sparsity, group_size=lm.geometry.group_size, policy=policy,
                           min_per_layer=controls.min_per_layer())


def view_mask(lm, *, explain: bool = True):
    """The mask of the current view: scorer, its parameters, z, sparsity and policy, all view fields
    (set on the Prune page or by the link; the scorer's defaults where nobody set them).

    Returns (head_scores, plan, params, policy), or None after showing why there is no mask
    (`explain=False`: without showing it, for a page that has shown it already)."""
    scorer, z, sparsity = state.get("scorer"), float(state.get("z")), float(state.get("sparsity"))
    if scorer not in scoring.SCORERS:
        st.error(f"Unknown scorer {scorer!r}; pick one on the Prune page.")
        return None
    params, policy = controls.current_params(scorer, z), controls.current_policy()
    if needs_computing(lm, scorer, params):
        if explain:
            st.info(f"{controls.label(scorer)} needs calibration: compute its scores on the Prune page first.")
        return None
    head_scores = scores_of(lm, scorer, params)
    if head_scores is None:
        return None
    try:
        plan = plan_of(lm, head_scores, sparsity, policy)
    except Exception as err:  # noqa: BLE001
        if explain:
            show_exception(err, "Building the mask")
        return None
    return head_scores, plan, params, policy
