"""Prune page: z, sparsity, scorer and policy -> the live mask heatmap, what it removes, its perplexity,
and the z sweep. Scores, masks and summaries come from analysis/; this page only wires and draws."""
import json

import numpy as np
import streamlit as st

from analysis.measure import evaluation

from analysis.score import scoring

from analysis.score import sweep
from components import cache, charts, controls, explain, figures, numbers, shell, state, views, weights
from components import probes as probes_ui
from components.errors import show_exception, shown_errors

shell.ensure_app()

# why "Tokens scored" differs from "Tokens to use", by model kind
SCORED_HELP = {
    "causal-lm": "One less than the tokens used: each token is predicted from the ones before it, so the first "
                 "token has nothing to be predicted from.",
    "masked-lm": "The token positions whose pseudo-likelihood is scored: each is masked in turn.",
    "encoder": "Token positions of the text, with the tokenizer's special tokens.",
}

def _threshold_caption(base_params: dict, scorer: str) -> None:
    if "z" not in base_params:
        st.caption(f"{controls.label(scorer)} has no threshold: z does not change its scores.")
    elif "std" in base_params:
        st.caption(f"Threshold tau = mean + z * std with the {scoring.STD.shown(base_params['std'])} std "
                   f"(change it under 'Scorer parameters').")


st.title("Prune")
lm = cache.model_or_stop()
g = lm.geometry
if not scoring.scorer_class(state.get("scorer")).needs_calibration if state.get("scorer") in scoring.SCORERS else False:
    cache.profile_or_stop()          # with its progress bar, on the full run: a key press then only reads it

c1, c2, c3 = st.columns([1.25, 1.2, 1.05])   # the longest scorer and policy labels fit at 1280x800
scorer = controls.scorer_choice(c1, group_size=g.group_size)
policy = controls.policy_controls(c2)
with c3.expander("Scorer parameters and KV policy", expanded=False):
    base_params = controls.scorer_params(scorer, state.get("z"))
    kv_policy = numbers.kv_policy_choice()
    _threshold_caption(base_params, scorer)
    flops_len = int(st.number_input("Sequence length for the FLOP count", 1, 1_000_000, step=64,
                                    key=state.widget_key("prune.flops_len", value=512)))


@st.fragment
def live_mask(scorer: str, base_params: dict, policy: str, kv_policy: str, flops_len: int) -> None:
    """z and sparsity -> the mask grid and its numbers, and every section below that depends on the view.

    A fragment: a key press on z or the sparsity reruns only this part, so the grid redraws
    without the whole page. Everything the grid and its numbers show is computed first, from one
    (scores, plan), and drawn after, in one burst of elements: the numbers and the grid never show
    different masks. The grid is HTML (`charts.mask_grid`), which the browser swaps in place; a
    plotly chart would be built anew (Plotly.newPlot) on every key press. The perplexity check, the
    z sweep and the teaching text are drawn in the same fragment from the same (scores, plan)
    (`view_sections`): a result kept from another view is never left under the new mask (issue 33:
    it was, while only the sliders' part reran). The grid sits beside the sliders (right column),
    so at 1280x800 a slider move is seen; notes fold below it."""
    left, right = st.columns([2, 3], gap="medium")
    z, sparsity = _sliders(left)
    params = {**base_params, "z": float(z)} if "z" in base_params else dict(base_params)
    head_scores = _live_scores(left, scorer, params)
    if head_scores is None:
        return
    plan = None
    with shown_errors("Building the mask"):
        plan = views.plan_of(lm, head_scores, sparsity, policy)
        shown = _mask_view(plan, head_scores, scorer, kv_policy, flops_len, sparsity)
        pack = _pack_parts(plan, head_scores, scorer)
        _draw_mask_view(shown, left, right, scorer, flops_len, pack,
                        zero_label=f"Heads with score 0 at z = {z:g}" if "z" in params else "Heads with score 0")
    if plan is not None:
        view_sections(plan, params, policy, scorer, z, sparsity, pack)


def _sliders(left) -> tuple[float, float]:
    """The view's z and sparsity sliders (view fields, mirrored into the URL)."""
    z = left.slider("Threshold z", 0.0, float(state.Z_MAX), step=0.05, key=state.widget_key("z"),
                    help="tau = mean + z * std of each population of row norms (MP, MP-G, Hybrid).")
    state.set("z", z)
    sparsity = left.slider("Sparsity (fraction of heads pruned)", 0.0, state.SPARSITY_MAX, step=controls.SPARSITY_STEP,
                           key=state.widget_key("sparsity"))
    state.set("sparsity", sparsity)
    return z, sparsity


def _live_scores(left, scorer: str, params: dict):
    """The scores at `params`; a calibration scorer's only once its button has computed them."""
    if not views.needs_computing(lm, scorer, params):
        return views.scores_of(lm, scorer, params, stoppable=scoring.scorer_class(scorer).needs_calibration,
                               quiet=not scoring.scorer_class(scorer).needs_calibration)
    left.info(f"{controls.label(scorer)} runs calibration text through the model, which takes a while.")
    if left.button(f"Compute {controls.label(scorer)} scores", type="primary", key="prune.compute"):
        return views.scores_of(lm, scorer, params, stoppable=True)
    return None


def _mask_view(plan, head_scores, scorer: str, kv_policy: str, flops_len: int, sparsity: float) -> dict:
    """Everything the fragment shows for one (scores, plan), computed before anything is drawn."""
    try:                                    # e.g. kv_policy strict refusing this mask
        summary, summary_error = numbers.summary_of(lm, plan, head_scores, kv_policy, flops_len), None
    except Exception as err:  # noqa: BLE001 - shown below, beside the mask it refused
        summary, summary_error = None, err
    return dict(
        summary=summary, summary_error=summary_error,
        stock=numbers.stock_of(lm, plan.pruned, kv_policy, sparsity) if summary is not None else None,
        grid=charts.mask_grid(plan.pruned, head_scores.scores, score_name=controls.label(scorer),
                              group_size=g.group_size),
        scores_csv="layer,head,score,pruned\n" + "\n".join(
            f"{l},{h},{head_scores.scores[l, h]:.8g},{int(plan.pruned[l, h])}" for l, h in np.ndindex(*plan.pruned.shape)),
        scores_json=json.dumps(head_scores.as_dict(), indent=1),
        summary_json=json.dumps(summary.as_dict(), indent=1) if summary is not None else None)


def _pack_parts(plan, head_scores, scorer: str) -> dict:
    """The lecture pack's figures of this view, each built only when the pack (or its own button) is
    clicked: the mask and the scores; the sections below add theirs."""
    name = controls.label(scorer)
    return {
        "mask": (lambda: charts.mask_heatmap(plan.pruned, head_scores.scores, score_name=name, group_size=g.group_size,
                                             title=f"{plan.n_pruned} of {g.n_total_heads} heads pruned (red)"),
                 f"The mask: which heads the view prunes (red), {plan.n_pruned} of {g.n_total_heads}, layer by layer."),
        "scores": (lambda: charts.layer_head_heatmap(head_scores.scores, f"{name} score of every head",
                                                     colorbar="score", group_size=g.group_size),
                   f"Each head's {name} score (higher = kept first)."),
    }


def _draw_mask_view(shown: dict, left, right, scorer: str, flops_len: int, pack: dict, *, zero_label: str) -> None:
    """Draw what `_mask_view` computed: the grid, the numbers (or why there are none), the downloads."""
    right.html(shown["grid"])
    if shown["summary"] is not None:
        with left:
            numbers.show_summary(shown["summary"], flops_len=flops_len, kind=lm.kind, zero_label=zero_label)
            numbers.show_stock(shown["stock"])
        numbers.show_notes(shown["summary"])
    else:
        with left:
            show_exception(shown["summary_error"], "Counting what surgery builds")
    downloads = st.container(horizontal=True)
    downloads.download_button("Scores and mask (CSV)", shown["scores_csv"], file_name=f"{scorer}_scores.csv",
                              mime="text/csv", key="prune.dl.csv")
    downloads.download_button("Scores (JSON)", shown["scores_json"], file_name=f"{scorer}_scores.json",
                              mime="application/json", key="prune.dl.json")
    if shown["summary_json"] is not None:
        downloads.download_button("Mask summary (JSON)", shown["summary_json"],
                                  file_name=f"{scorer}_mask_summary.json", mime="application/json",
                                  key="prune.dl.summary")
    figures.downloads(pack["mask"][0], f"mask_{scorer}", key="prune.dl.grid", where=downloads, label="Mask ",
                      inline=True)
    figures.pack_button(pack, key="prune.dl.pack", name=f"lecture_pack_{scorer}", where=downloads)


def view_sections(plan, params: dict, policy: str, scorer: str, z: float, sparsity: float, pack: dict) -> None:
    """Everything below the mask that depends on z or the sparsity: the perplexity check and the z sweep.
    Drawn inside the fragment, so a key press that changes the mask also changes (or marks as stale)
    every result shown under it: a result of another view is never shown as this view's (issue 33)."""
    if weights.needs_model(lm, "Checking the mask's perplexity and the z sweep", stop=False):
        return
    _check_section(plan, params, policy, scorer, z, sparsity)
    probes_ui.cut_panel(lm, plan.pruned, where="prune")      # beside the perplexity check: what the cut breaks
    zs = _sweep_section(params, policy, scorer, z, sparsity)
    if zs is not None:
        pack["z sweep"] = (lambda: _sweep_chart(zs, z), f"{zs.metric} of the masks each z gives at sparsity "
                                                        f"{zs.sparsity:g} (suggested z = {zs.suggested_z:g}).")


def _view_words(scorer: str, z: float, sparsity: float, policy: str, n_pruned: int | None = None) -> str:
    heads = "" if n_pruned is None else f"{n_pruned} pruned heads, "
    return f"{heads}{controls.label(scorer)}, z = {z:g}, sparsity {sparsity:g}, policy {policy}"


def _check_section(plan, params: dict, policy: str, scorer: str, z: float, sparsity: float) -> None:
    st.subheader("Check this mask")
    key = cache.params_key(params)
    with shown_errors("Reading the text"):
        text, max_tokens = controls.text_and_tokens(prefix="prune", tokens_key="prune.max_tokens", default=256,
                                                    most=8192)
        check = (lm.name, scorer, key, sparsity, policy, controls.min_per_layer(), text, max_tokens)
        metric_name = evaluation.evaluator_class(lm.kind).label
        dense_and_masked = np.stack([np.zeros_like(plan.pruned), plan.pruned])   # [2, L, H]
        shown = _view_words(scorer, z, sparsity, policy, int(plan.pruned.sum()))
        result = cache.run_button(
            f"Check {metric_name} against the dense model", button_key="prune.check", slot="prune.check",
            run_key=check, fn=cache.evaluate_masks, args=(state.model_key(), dense_and_masked, text, max_tokens),
            label="Evaluating", view=shown, kind="evaluate", work=2 * max_tokens,
            stale_note="The settings changed since the last check ({view}); press the button to check this mask.")
        if result is not None:
            st.caption(f"Checked: {shown}, on {max_tokens} tokens.")
            dense, pruned_value = float(result.values[0]), float(result.values[1])
            m1, m2, m3 = st.columns(3)
            m1.metric(f"Dense {result.metric}", f"{dense:.4g}")
            m2.metric(f"Masked {result.metric}", f"{pruned_value:.4g}", f"{pruned_value - dense:+.4g}",
                      delta_color="normal" if result.higher_is_better else "inverse")
            m3.metric("Tokens scored", result.n_tokens, help=SCORED_HELP.get(lm.kind))


def _sweep_chart(zs, z: float):
    series = {"calibration split": (zs.zs, zs.calibration)}
    if np.isfinite(zs.evaluation).any():
        series["evaluation split"] = (zs.zs, zs.evaluation)
    return charts.curves(series, title=f"{zs.metric} vs z at sparsity {zs.sparsity:g} (suggested z = {zs.suggested_z:g})",
                         x_title="z", y_title=zs.metric, log_y=charts.log_axis(zs.metric), marker_x=z)


def _sweep_section(params: dict, policy: str, scorer: str, z: float, sparsity: float):
    """The z sweep of this view (its button, the charts); returns the sweep shown, or None."""
    st.subheader("z sweep")
    if scorer not in sweep.SWEEP_SCORERS:
        st.caption(f"The z sweep applies to threshold scorers ({', '.join(sweep.SWEEP_SCORERS)}); pick one above.")
        return None
    sweep_tokens = int(st.number_input("Tokens per split", 16, 4096, step=64,
                                       key=state.widget_key("prune.sweep_tokens", value=256)))
    options = cache.params_key(dict(scorer=scorer, **{k: v for k, v in params.items() if k != "z"}, policy=policy,
                                    min_per_layer=controls.min_per_layer()))
    sweep_key = (lm.name, sparsity, options, sweep_tokens)
    zs = cache.run_button(f"Sweep z at sparsity {sparsity:g}", button_key="prune.sweep", slot="prune.sweep",
                          run_key=sweep_key, fn=cache.z_sweep,
                          args=(state.model_key(), sparsity, options, sweep_tokens), label="Sweeping z",
                          view=f"{controls.label(scorer)}, sparsity {sparsity:g}, policy {policy}",
                          kind="sweep", work=2 * sweep_tokens * len(sweep.z_grid()),
                          stale_note="The settings changed since the last sweep ({view}); press the button to "
                                     "sweep again.")
    if zs is None:
        return None
    figures.chart(_sweep_chart(zs, z), "prune.sweep_chart")
    figures.chart(charts.curves({"heads with score 0": (zs.zs, zs.zero_score_heads)},
                                  title="Heads in the bulk (score 0) vs z", x_title="z", y_title="heads",
                                  marker_x=z), "prune.zero_chart")
    if st.button(f"Use the suggested z = {zs.suggested_z:g}", key="prune.use_z"):
        state.set("z", float(zs.suggested_z))
        state.reset_widget("z")
        st.rerun()
    return zs


live_mask(scorer, base_params, policy, kv_policy, flops_len)
# the teaching text depends on the policy (a full run), not on z or the sparsity: outside the fragment, so a
# key press does not redraw it (the live metric beside the grid says how many heads score 0 at this z)
explain.evaluation()
explain.structured_pruning(policy=policy)
explain.mp_score(z=None, n_zero=None, n_heads=g.n_total_heads, policy=policy)
explain.gqa(g.n_heads, g.n_kv_heads)
explain.scorers()
