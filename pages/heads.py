"""Heads page: the single-head ablation heatmap, role tags, redundancy groups, and one head's
attention pattern on a sentence the user can edit."""
import numpy as np
import streamlit as st

from analysis.measure import attribution

from analysis.measure import redundancy

from analysis.measure import roles
from analysis.core.text import WIKI_ATTRIBUTION
from components import cache, charts, controls, explain, figures, numbers, shell, state, taxonomy, weights
from components import probes as probes_ui
from components.errors import shown_errors

shell.ensure_app()

st.title("Heads")
lm = cache.model_or_stop()
weights.needs_model(lm, "The Heads page")
g = lm.geometry
explain.heads_page()

def ablation_extras(result) -> None:
    """The ablation as a CSV, and the view's scorer against it: one point per head, with their rank
    correlation and a sentence that says what the scatter shows (computed from it)."""
    from analysis.measure.attribution import rank_correlation
    from analysis.score import scoring
    from components import views
    delta = result.head_delta                                                     # [L, H]
    scorer = state.get("scorer")
    scores = None
    if scorer in scoring.SCORERS and not views.needs_computing(lm, scorer, controls.current_params(scorer, state.get("z"))):
        hs = views.scores_of(lm, scorer, controls.current_params(scorer, state.get("z")), quiet=True)
        scores = None if hs is None else hs.scores                                 # [L, H]
    header = "layer,head,ablation_delta" + (f",{scorer}_score" if scores is not None else "")
    st.download_button("Ablation results (CSV)", lambda: header + "\n" + "\n".join(
        f"{l},{h},{delta[l, h]:.8g}" + (f",{scores[l, h]:.8g}" if scores is not None else "")
        for l in range(delta.shape[0]) for h in range(delta.shape[1])) + "\n",
                       file_name="ablation.csv", mime="text/csv", key="heads.ablation_csv", on_click="ignore")
    if scores is None:
        st.caption(f"{controls.label(scorer)} needs calibration: compute its scores on the Prune page to see it "
                   "against the ablation.")
        return
    rho = rank_correlation(scores, delta)
    label = controls.label(scorer)
    figures.chart(charts.score_vs_effect(scores, delta, x_title=f"{label} score (higher = kept first)",
                                         y_title=f"Δ {result.metric} when the head alone is removed",
                                         title=f"{label} score vs measured ablation loss (Spearman {rho:.2f})",
                                         group_size=g.group_size), "heads.ablation_scatter")
    order = np.argsort(scores.ravel(), kind="stable")                            # [L*H] prune-first order
    k = max(1, scores.size // 10)
    first, rest = delta.ravel()[order[:k]], delta.ravel()[order[k:]]
    st.markdown(f"Spearman rank correlation {rho:.2f}: " + (
        "the heads the scorer ranks high do tend to hurt more when removed" if rho > 0.3 else
        "the scorer's ranking says little about what removing a head costs" if rho > -0.3 else
        "the scorer tends to keep the heads whose removal costs least") +
        f". The {k} heads it would prune first cost {first.mean():+.4g} on average when removed alone, the "
        f"others {rest.mean():+.4g}.")


st.subheader("Single-head ablation")
run_key = None              # the ablation's settings; the sections below use its result only while they hold
with shown_errors("Single-head ablation"):
    text, tokens = controls.text_and_tokens(prefix="heads.ablation", tokens_key="heads.ablation.tokens",
                                            default=128, most=4096)
    st.caption(f"Every one of the {g.n_total_heads} heads is removed in turn, each costing at least one pass "
               "through the output layer: on a CPU this takes minutes for a real model. Fewer tokens are faster.")
    run_key = (lm.name, text, tokens)
    result = cache.run_button(f"Run the ablation sweep ({g.n_total_heads} heads)", button_key="heads.ablate",
                              slot="heads.ablation", run_key=run_key, fn=cache.ablation,
                              args=(state.model_key(), text, tokens), label="Ablating heads",
                              kind="ablation", work=tokens * g.n_total_heads,
                              stale_note="The text or token count changed since the sweep; press the button to run it again.")
    if result is not None:
        if lm.kind == "encoder":        # the dense model is the reference: its 1 - fidelity is 0 by definition
            dense = (f"Reference: the dense model's pooled embedding, on {result.n_tokens} token positions (the "
                     "text's tokens plus the tokenizer's special tokens); each cell is the fidelity lost, "
                     f"{result.metric}, when that head alone is removed")
        else:
            dense = (f"Dense {result.metric}: {round(float(result.base_loss), 12) + 0.0:.4g} over "
                     f"{result.n_tokens} predictions")
        st.caption(f"{dense} ({result.method} sweep). Red = removing the head hurts; blue = it helps.")
        lim = float(abs(result.head_delta).max()) or 1.0
        fig = charts.layer_head_heatmap(result.head_delta, f"{result.metric} increase when one head is removed",
                                        colorbar=f"Δ {result.metric}", group_size=g.group_size,
                                        colorscale="RdBu_r").update_traces(zmin=-lim, zmax=lim)
        figures.chart(fig, "heads.ablation_map")
        if result.group_delta is not None:
            figures.chart(charts.layer_head_heatmap(result.group_delta,
                                                      f"{result.metric} increase when a whole KV group is removed",
                                                      colorbar=f"Δ {result.metric}", x_title="KV group",
                                                      colorscale="Reds"), "heads.group_map")
        ablation_extras(result)

st.subheader("Integrated-gradients attribution (Captum)")
if lm.kind != "causal-lm":
    st.caption(f"Attribution integrates the language-model loss of a causal LM; this model is {numbers.kind_words(lm.kind)}. "
               "Use the single-head ablation above instead.")
else:
    with shown_errors("Head attribution"):
        c1, c2 = st.columns(2)
        ig_tokens = int(c1.number_input("Tokens of the built-in evaluation text", 8, 1024, step=16,
                                        key=state.widget_key("heads.ig.tokens", value=64)))
        ig_steps = int(c2.number_input("Integration steps", 2, 128, step=2, key=state.widget_key("heads.ig.steps", value=16)))
        ig_key = (lm.name, ig_tokens, ig_steps)
        result = cache.run_button("Attribute the loss to the heads", button_key="heads.attribute",
                                  slot="heads.attribution", run_key=ig_key, fn=cache.head_attribution,
                                  args=(state.model_key(), None, ig_tokens, ig_steps),
                                  label="Integrating gradients", kind="attribution", work=ig_tokens * ig_steps,
                                  stale_note="The settings changed since the last run; press the button again.")
        if result is not None:
            st.caption(f"Gates go from 0 (every head off, loss {result.loss_baseline:.4g}) to 1 (dense, loss "
                       f"{result.loss_dense:.4g}) in {result.n_steps} steps; attributions sum to the loss change "
                       f"up to {result.convergence_delta:+.3g} (Captum's convergence delta).")
            figures.chart(charts.layer_head_heatmap(result.importance, "Importance = loss increase the head's gate "
                                                      "prevents", colorbar="importance", group_size=g.group_size), "heads.ig_map")
            last_ablation = state.run_result("heads.ablation", run_key)
            if last_ablation is not None:
                rho = attribution.rank_correlation(result.importance, last_ablation.head_delta)
                st.metric("Spearman rank correlation with the ablation oracle", f"{rho:.3f}")
            else:
                st.caption("Run the ablation sweep above (with its current settings) to compare this ranking with "
                           "the real loss increases.")

# the ablation of the settings shown above, never one of other settings (issue 33: a stale one was used here)
last_ablation = state.run_result("heads.ablation", run_key)
ablation_delta = None if last_ablation is None else last_ablation.head_delta  # [L, H], shown beside roles

st.subheader("Head roles")
with shown_errors("Head roles"):
    tokens = int(st.number_input("Tokens of the built-in evaluation text", 16, 4096, step=64,
                                 key=state.widget_key("heads.roles.tokens", value=256)))
    st.caption(WIKI_ATTRIBUTION)
    result = cache.run_button("Tag head roles from their attention patterns", button_key="heads.roles",
                              slot="heads.roles", run_key=(lm.name, tokens), fn=cache.head_roles,
                              args=(state.model_key(), None, tokens), label="Tagging heads", kind="roles", work=tokens,
                              stale_note="The settings changed since the last run; press the button again.")
    if result is not None:
        primary, strength = result.primary()
        figures.chart(charts.category_heatmap(primary, list(roles.ROLES), strength,
                                                title="Primary role of each head", group_size=g.group_size), "heads.roles_map")
        rows = result.table(ablation_delta)
        st.caption(f"{len(rows)} tags over {g.n_total_heads} heads (a head can have several); thresholds "
                   + ", ".join(f"{k} >= {v:g}" for k, v in result.thresholds.items())
                   + (". Ablation effect from the sweep above." if ablation_delta is not None else
                      ". Run the ablation sweep above to see each tagged head's effect beside it."))
        st.dataframe(rows, hide_index=True, height=240)

taxonomy.section(lm)   # what heads do: induction, duplicate-token, copying, DLA; does MP find them?
taxonomy.long_section(lm)   # retrieval and streaming heads: long contexts, each on its own button
probes_ui.heads_section(lm)   # the heads behind each capability probe; domains

st.subheader("Redundant heads")
with shown_errors("Head redundancy"):
    c1, c2, c3 = st.columns(3)
    kind = c1.radio("Similarity of", ["output", "pattern"], horizontal=True,
                    format_func={"output": "outputs", "pattern": "attention patterns"}.get,
                    key=state.widget_key("heads.red.kind", value="output"))
    threshold = c2.slider("Near-duplicate above", 0.5, 1.0, step=0.01,
                          key=state.widget_key("heads.red.threshold", value=float(redundancy.DEFAULT_THRESHOLD)))
    red_tokens = int(c3.number_input("Tokens", 16, 2048, step=64, key=state.widget_key("heads.red.tokens", value=256)))
    red_key = (lm.name, kind, threshold, red_tokens, run_key if ablation_delta is not None else None)
    result = cache.run_button("Find redundant heads", button_key="heads.redundancy", slot="heads.redundancy",
                              run_key=red_key, fn=cache.head_redundancy,
                              args=(state.model_key(), None, red_tokens, kind, float(threshold),
                                    ablation_delta), label="Comparing heads", kind="redundancy", work=red_tokens,
                              stale_note="The settings changed since the last run; press the button again.")
    if result is not None:
        figures.chart(charts.layer_head_heatmap(result.nearest, "Similarity to the most similar other head",
                                                  colorbar="cosine", group_size=g.group_size), "heads.nearest")
        st.markdown(f"**{len(result.groups)} near-duplicate groups** (similarity >= {result.threshold:g}):")
        for group in result.groups[:20]:
            st.markdown("- " + ", ".join(f"L{l}H{h}" for l, h in group))
        if result.redundant is not None:
            flagged = [f"L{l}H{h}" for l, h in zip(*result.redundant.nonzero())]
            st.markdown(f"**Redundant** (a twin at >= {result.threshold:g} and |ablation effect| <= "
                        f"{result.effect_threshold:g}): {', '.join(flagged) or 'none'}")
        else:
            st.caption("Run the ablation sweep above (same model) to flag which near-duplicates are redundant.")

st.subheader("Attention pattern of one head")
with shown_errors("Attention pattern"):
    c1, c2 = st.columns(2)
    layer = min(c1.slider("Layer", 0, g.n_layers - 1, key=state.widget_key("heads.layer", value=0)), g.n_layers - 1)
    head = min(c2.slider("Head", 0, g.n_heads - 1, key=state.widget_key("heads.head", value=0)), g.n_heads - 1)
    sentence = st.text_input("Sentence (edit it)", key=state.widget_key(
        "heads.sentence", value="The cat sat on the mat, and then the cat saw the dog on the mat."))
    tokens_, probs = cache.attention_pattern(state.model_key(), sentence)
    figures.chart(charts.attention_heatmap(probs[layer, head], tokens_,
                                             title=f"Layer {layer}, head {head}" +
                                                   (f" (KV group {head // g.group_size})" if g.group_size > 1 else "")), "heads.pattern")
