"""Prune page: z, sparsity, scorer and policy -> the live mask heatmap, what it removes, its perplexity,
and the z sweep. Scores, masks and summaries come from analysis/; this page only wires and draws."""
import json

import numpy as np
import streamlit as st

from analysis import evaluation, masks, scoring, sweep
from components import cache, charts, controls, explain, shell, state
from components.errors import shown_errors

shell.ensure_app()

st.title("Prune")
lm = cache.model_or_stop()
g = lm.geometry

c1, c2, c3 = st.columns([1.2, 2, 2])
scorer = controls.scorer_choice(c1)
z = c2.slider("Threshold z", 0.0, float(state.Z_MAX), step=0.05, key=state.widget_key("z"),
              help="tau = mean + z * std of each population of row norms (MP, MP-G, Hybrid).")
state.set("z", z)
sparsity = c3.slider("Sparsity (fraction of heads pruned)", 0.0, state.SPARSITY_MAX, step=controls.SPARSITY_STEP,
                     key=state.widget_key("sparsity"))
state.set("sparsity", sparsity)
with st.expander("Scorer parameters and mask policy", expanded=False):
    cols = st.columns(3)
    params = controls.scorer_params(scorer, z, where=cols[0])
    policy = controls.policy_controls(cols[1])
    flops_len = int(cols[2].number_input("Sequence length for the FLOP count", 1, 1_000_000, step=64,
                                         key=state.widget_key("prune.flops_len", value=512)))
if "z" not in params:
    st.caption(f"{controls.label(scorer)} has no threshold: z does not change its scores.")

key = cache.params_key(params)
cls = scoring.scorer_class(scorer)
head_scores = None
if cls.needs_calibration and not state.is_scored(lm.name, scorer, key):
    st.info(f"{controls.label(scorer)} runs calibration text through the model, which takes a while.")
    if st.button(f"Compute {controls.label(scorer)} scores", type="primary", key="prune.compute"):
        head_scores = cache.cached_call(cache.scores, lm.name, state.trust(), scorer, key,
                                        label=f"Scoring with {controls.label(scorer)}", stoppable=True)
        if head_scores is not None:
            state.mark_scored(lm.name, scorer, key)
else:
    head_scores = cache.cached_call(cache.scores, lm.name, state.trust(), scorer, key,
                                    label=f"Scoring with {controls.label(scorer)}", stoppable=cls.needs_calibration)
if head_scores is None:
    st.stop()

with shown_errors("Building the mask"):
    plan = masks.plan_mask(head_scores, sparsity, group_size=g.group_size, **policy)
    summary = masks.summarize_mask(plan, head_scores, head_dim=g.head_dim, hidden=g.hidden, seq_len=flops_len,
                                   bias=cache.has_qkv_bias(lm.name, state.trust()))
    cols = st.columns(5)
    cols[0].metric("Pruned heads", f"{summary.n_pruned} / {summary.n_heads}")
    cols[1].metric(f"Heads with score 0 at z = {z:g}" if "z" in params else "Heads with score 0",
                   summary.zero_score_heads,
                   help="Heads in the bulk (no outlier row). The tie-break (plain magnitude, then layer/head) "
                        "decides which of them go first.")
    cols[2].metric("KV heads removed", f"{summary.kv_heads_removed} / {summary.kv_heads}")
    cols[3].metric("Attention params removed", f"{summary.params_removed:,}",
                   f"{100 * summary.params_removed_fraction:.1f}% of attention", delta_color="off")
    cols[4].metric("Attention FLOPs removed", f"{summary.attention_flops_removed:.3g}",
                   f"{100 * summary.flops_removed_fraction:.1f}% at {flops_len} tokens", delta_color="off")
    if summary.empty_layers:
        st.warning(f"Layers {summary.empty_layers} lose every head. Use the min-per-layer policy to keep some.")

    left, right = st.columns([3, 1])
    left.plotly_chart(charts.mask_heatmap(plan.pruned, head_scores.scores, score_name=controls.label(scorer),
                                          group_size=g.group_size), width="stretch", key="prune.mask")
    right.plotly_chart(charts.head_bars(np.asarray(summary.pruned_per_layer), title="Pruned heads per layer",
                                        y_title="heads", x_title="layer", height=charts.layer_height(g.n_layers)),
                       width="stretch", key="prune.per_layer")

    scores_csv = "layer,head,score,pruned\n" + "\n".join(
        f"{l},{h},{head_scores.scores[l, h]:.8g},{int(plan.pruned[l, h])}" for l, h in np.ndindex(*plan.pruned.shape))
    d1, d2, d3 = st.columns(3)
    d1.download_button("Scores and mask (CSV)", scores_csv, file_name=f"{scorer}_scores.csv", mime="text/csv",
                       key="prune.dl.csv")
    d2.download_button("Scores (JSON)", json.dumps(head_scores.as_dict(), indent=1),
                       file_name=f"{scorer}_scores.json", mime="application/json", key="prune.dl.json")
    d3.download_button("Mask summary (JSON)", json.dumps(summary.as_dict(), indent=1),
                       file_name=f"{scorer}_mask_summary.json", mime="application/json", key="prune.dl.summary")
    state.remember_mask(lm.name, scorer, params, sparsity, policy)

st.subheader("Check this mask")
with shown_errors("Reading the text"):
    text, max_tokens = controls.text_and_tokens(prefix="prune", tokens_key="prune.max_tokens", default=256, most=8192)
    check = (lm.name, scorer, key, sparsity, cache.params_key(policy), text, max_tokens)
    metric_name = evaluation.evaluator_class(lm.kind).label
    dense_and_masked = np.stack([np.zeros_like(plan.pruned), plan.pruned])   # [2, L, H]
    result = cache.run_button(f"Check {metric_name} against the dense model", button_key="prune.check",
                              slot="prune.check", run_key=check, fn=cache.evaluate_masks,
                              args=(lm.name, state.trust(), dense_and_masked, text, max_tokens),
                              label="Evaluating",
                              stale_note="The settings changed since the last check; press the button to check this mask.")
    if result is not None:
        dense, pruned_value = float(result.values[0]), float(result.values[1])
        m1, m2, m3 = st.columns(3)
        m1.metric(f"Dense {result.metric}", f"{dense:.4g}")
        m2.metric(f"Masked {result.metric}", f"{pruned_value:.4g}", f"{pruned_value - dense:+.4g}",
                  delta_color="normal" if result.higher_is_better else "inverse")
        m3.metric("Tokens scored", result.n_tokens)
explain.evaluation()

st.subheader("z sweep")
if scorer not in sweep.SWEEP_SCORERS:
    st.caption(f"The z sweep applies to threshold scorers ({', '.join(sweep.SWEEP_SCORERS)}); pick one above.")
else:
    sweep_tokens = int(st.number_input("Tokens per split", 16, 4096, step=64,
                                       key=state.widget_key("prune.sweep_tokens", value=256)))
    options = cache.params_key(dict(scorer=scorer, **{k: v for k, v in params.items() if k != "z"}, **policy))
    sweep_key = (lm.name, sparsity, options, sweep_tokens)
    zs = cache.run_button(f"Sweep z at sparsity {sparsity:g}", button_key="prune.sweep", slot="prune.sweep",
                          run_key=sweep_key, fn=cache.z_sweep,
                          args=(lm.name, state.trust(), sparsity, options, sweep_tokens), label="Sweeping z",
                          stale_note="The settings changed since the last sweep; press the button to sweep again.")
    if zs is not None:
        series = {"calibration split": (zs.zs, zs.calibration)}
        if np.isfinite(zs.evaluation).any():
            series["evaluation split"] = (zs.zs, zs.evaluation)
        st.plotly_chart(charts.curves(series, title=f"{zs.metric} vs z at sparsity {zs.sparsity:g} "
                                                    f"(suggested z = {zs.suggested_z:g})",
                                      x_title="z", y_title=zs.metric, log_y=charts.log_axis(zs.metric),
                                      marker_x=z), width="stretch",
                        key="prune.sweep_chart")
        st.plotly_chart(charts.curves({"heads with score 0": (zs.zs, zs.zero_score_heads)},
                                      title="Heads in the bulk (score 0) vs z", x_title="z", y_title="heads",
                                      marker_x=z), width="stretch", key="prune.zero_chart")
        if st.button(f"Use the suggested z = {zs.suggested_z:g}", key="prune.use_z"):
            state.set("z", float(zs.suggested_z))
            state.reset_widget("z")
            st.rerun()

explain.structured_pruning()
explain.mp_score(z=z, n_zero=head_scores.zero_count if "z" in params else None, n_heads=g.n_total_heads)
explain.gqa(g.n_heads, g.n_kv_heads)
explain.scorers()
