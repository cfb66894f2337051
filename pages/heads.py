"""Heads page: the single-head ablation heatmap, role tags, redundancy groups, and one head's
attention pattern on a sentence the user can edit."""
import streamlit as st

from components import cache, charts, controls, explain, shell, state
from components.errors import shown_errors

shell.ensure_app()

st.title("Heads")
lm = cache.model_or_stop()
g = lm.geometry
explain.heads_page()

st.subheader("Single-head ablation")
ablation_mod = cache.optional("ablation")
if ablation_mod is None:
    cache.unavailable("The ablation sweep", "ablation")
else:
    with shown_errors("Single-head ablation"):
        c1, c2 = st.columns([3, 1])
        with c1:
            text = controls.text_source(prefix="heads.ablation")
        tokens = int(c2.number_input("Tokens to use", 16, 4096, step=64,
                                     key=state.widget_key("heads.ablation.tokens", value=256)))
        run_key = (lm.name, text, tokens)
        if st.button(f"Run the ablation sweep ({g.n_total_heads} heads)", key="heads.ablate"):
            result = cache.cached_call(cache.ablation, lm.name, state.trust(), text, tokens,
                                       label="Ablating heads", stoppable=True)
            if result is not None:
                state.remember("heads.ablation", (run_key, result))
        remembered = state.recall("heads.ablation")
        if remembered and remembered[0] == run_key:
            result = remembered[1]
            st.caption(f"Dense {result.metric}: {result.base_loss:.4g} over {result.n_tokens} predictions "
                       f"({result.method} sweep). Red = removing the head hurts; blue = it helps.")
            lim = float(abs(result.head_delta).max()) or 1.0
            fig = charts.layer_head_heatmap(result.head_delta, f"{result.metric} increase when one head is removed",
                                            colorbar=f"Δ {result.metric}", group_size=g.group_size,
                                            colorscale="RdBu_r").update_traces(zmin=-lim, zmax=lim)
            st.plotly_chart(fig, width="stretch", key="heads.ablation_map")
            if result.group_delta is not None:
                st.plotly_chart(charts.layer_head_heatmap(result.group_delta,
                                                          f"{result.metric} increase when a whole KV group is removed",
                                                          colorbar=f"Δ {result.metric}", x_title="KV group",
                                                          colorscale="Reds"),
                                width="stretch", key="heads.group_map")
        elif remembered:
            st.caption("The text or token count changed since the sweep; press the button to run it again.")

st.subheader("Head roles")
roles = cache.optional("roles")
if roles is None:
    cache.unavailable("Head role tags", "roles")

st.subheader("Redundant heads")
redundancy = cache.optional("redundancy")
if redundancy is None:
    cache.unavailable("Redundancy groups", "redundancy")

st.subheader("Attention pattern of one head")
if roles is None:
    cache.unavailable("Attention patterns", "roles")
