"""Compare page: several scorers at one sparsity - their masks side by side, mask overlap (Jaccard),
score rank correlation (Spearman), and metric-vs-sparsity curves."""
import numpy as np
import streamlit as st

from analysis.measure import evaluation
from analysis.score import curves

from analysis.score import masks

from analysis.measure.attribution import rank_correlation
from analysis.core.text import WIKI_ATTRIBUTION
from components import cache, charts, controls, explain, figures, shell, state, views, weights
from components.errors import shown_errors

COMPACT_TICKS = 4   # head labels under each of the side-by-side masks (about 110 px of plot each)

shell.ensure_app()

st.title("Compare scorers")
lm = cache.model_or_stop()
g = lm.geometry

names = controls.scorer_names()
chosen = st.multiselect("Scorers", names, format_func=controls.label,
                        key=state.widget_key("compare.scorers", value=[n for n in ("mp", "mp-g", "magnitude", "random")
                                                                          if n in names]),
                        help="Every scorer chosen here is compared at the same sparsity, z and policy.")
c2, c3, c4 = st.columns([1, 1, 1.3])
z = c2.slider("Threshold z", 0.0, float(state.Z_MAX), step=0.05, key=state.widget_key("z"))
state.set("z", z)
sparsity = c3.slider("Sparsity", 0.0, state.SPARSITY_MAX, step=controls.SPARSITY_STEP, key=state.widget_key("sparsity"))
state.set("sparsity", sparsity)
policy = controls.policy_controls(c4)
if len(chosen) < 2:
    st.info("Pick at least two scorers to compare.")
    shell.end_run()

results = {}
for name in chosen:
    params = controls.default_params(name, z)
    if views.needs_computing(lm, name, params):
        if st.button(f"Compute {controls.label(name)} (calibration text; takes a while)", key=f"compare.compute.{name}"):
            if views.scores_of(lm, name, params, stoppable=True) is not None:
                st.rerun()
        continue
    hs = views.scores_of(lm, name, params)
    if hs is not None:
        results[name] = (cache.params_key(params), hs)
st.caption("Each scorer runs with its default parameters (z from the slider); tune one scorer on the Prune page.")
if len(results) < 2:
    st.info("At least two scorers need scores before they can be compared.")
    shell.end_run()

with shown_errors("Comparing masks"):
    plans = {n: views.plan_of(lm, hs, sparsity, policy) for n, (_, hs) in results.items()}
    labels = [controls.label(n) for n in plans]
    n_pruned = next(iter(plans.values())).n_pruned
    st.subheader(f"Masks at sparsity {sparsity:g} ({n_pruned} of {g.n_total_heads} heads pruned; red = pruned)")
    cols = st.columns(min(len(plans), 4))     # a quarter of the page: 12 head labels overlapped at 1280x800
    for i, (name, plan) in enumerate(plans.items()):
        figures.chart(charts.mask_heatmap(plan.pruned, results[name][1].scores, score_name=controls.label(name),
                                title=f"{controls.label(name)}<br><sup>{plan.n_pruned} pruned</sup>", group_size=g.group_size,
                                max_x_ticks=COMPACT_TICKS), f"compare.mask.{name}", where=cols[i % len(cols)])

    jaccard = np.array([[masks.jaccard(plans[a].pruned, plans[b].pruned) for b in plans] for a in plans])
    rho = np.array([[rank_correlation(results[a][1].scores, results[b][1].scores) if a != b else 1.0
                     for b in results] for a in results])
    left, right = st.columns(2)
    figures.chart(charts.matrix_heatmap(jaccard, labels, title="Mask overlap (Jaccard)", zmin=0, zmax=1), "compare.jaccard", where=left)
    figures.chart(charts.matrix_heatmap(np.nan_to_num(rho), labels, title="Score rank correlation (Spearman)",
                                             zmin=-1, zmax=1), "compare.spearman", where=right)
explain.comparison()

weights.needs_model(lm, "Quality vs sparsity")
st.subheader("Quality vs sparsity")
c1, c2 = st.columns(2)
max_s = c1.slider("Up to sparsity", 0.1, 0.9, step=0.1, key=state.widget_key("compare.max_s", value=0.5))
tokens = int(c2.number_input("Tokens of the built-in evaluation text", 16, 4096, step=64,
                             key=state.widget_key("compare.tokens", value=256)))
st.caption(WIKI_ATTRIBUTION)
levels = tuple(float(x) for x in curves.sparsity_levels(max_s, 0.1))
curve_key = (lm.name, tuple((n, results[n][0]) for n in results), policy, controls.min_per_layer(), levels, tokens)
if st.button("Compute the curves", key="compare.curves"):
    curves = {}
    for name, (key, _) in results.items():
        curve = cache.cached_call(cache.sparsity_curve, state.model_key(), name, key,
                                  policy, controls.min_per_layer(), levels, tokens, label=f"Curve of {controls.label(name)}",
                                  stoppable=True, kind="curve", work=len(levels) * tokens)
        if curve is None:
            break
        curves[name] = curve
    else:
        state.remember_run("compare.curves", curve_key, curves)
curves = state.run_result("compare.curves", curve_key)
if curves is not None:
    metric = next(iter(curves.values())).metric
    figures.chart(charts.curves({controls.label(n): (c.sparsities, c.values) for n, c in curves.items()},
                                  title=f"{metric} vs sparsity", x_title="sparsity", y_title=metric,
                                  log_y=charts.log_axis(metric), marker_x=sparsity,
                                  colors={controls.label(n): controls.scorer_color(n) for n in curves}), "compare.curve_chart")
    # what the curves show, in one sentence computed from their numbers (not a fixed text)
    st.markdown(explain.curves_sentence({controls.label(n): (c.sparsities, c.values) for n, c in curves.items()},
                                        metric=metric, higher_is_better=evaluation.evaluator_class(lm.kind).higher_is_better,
                                        floor=controls.label("random") if "random" in curves else None))
    skipped = sorted({x for c in curves.values() for x, _ in c.skipped})
    if skipped:
        st.caption(f"Left out: sparsities {', '.join(f'{x:g}' for x in skipped)}, which the "
                   f"{policy} policy cannot build (it prunes in fixed steps). "
                   f"{next(c.skipped[0][1] for c in curves.values() if c.skipped)}")
elif state.last_run("compare.curves") is not None:
    st.caption("The settings changed since the curves were computed; press the button again.")
