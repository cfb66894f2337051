"""Model page: which model is loaded, its family and head geometry, parameter count, load progress."""
import streamlit as st

from components import cache, explain, shell, state

shell.ensure_app()

st.title("Model")
st.caption("Pick a model in the sidebar: a built-in (nothing is downloaded), a Hugging Face id that is "
           "in the local cache, or a local folder. Every page uses the model picked here.")
explain.structured_pruning()

lm = cache.model_or_stop()
g = lm.geometry
st.subheader(lm.name)
cols = st.columns(6)
cols[0].metric("Family", lm.adapter.model_type)
cols[1].metric("Kind", lm.kind)
cols[2].metric("Layers (L)", g.n_layers)
cols[3].metric("Query heads (H)", g.n_heads)
cols[4].metric("KV heads (H_kv)", g.n_kv_heads)
cols[5].metric("head_dim (d)", g.head_dim)
cols = st.columns(4)
cols[0].metric("Hidden (D)", g.hidden)
cols[1].metric("Heads in total (L x H)", g.n_total_heads)
cols[2].metric("Query heads per KV head (G)", g.group_size)
cols[3].metric("Parameters", f"{cache.param_count(lm.name, state.trust()):,}")
st.caption(f"Weights from `{lm.source}`. Attention: "
           + ("multi-head (MHA)" if g.group_size == 1 else
              "multi-query (MQA)" if g.n_kv_heads == 1 else f"grouped-query (GQA), G = {g.group_size}")
           + ". The loaded model is shared by all pages and never modified: masks are temporary hooks, "
             "exports work on a copy.")
explain.model_geometry(g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim)
if g.group_size > 1:
    explain.gqa(g.n_heads, g.n_kv_heads)
