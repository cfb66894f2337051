"""Model page: which model is loaded, its family and head geometry, parameter count, load progress,
and where it is loaded (device, dtype, accelerate offload: analysis/core/placement.py)."""
import streamlit as st

from analysis.core.errors import HeadscopeError
from analysis.core.placement import DTYPE_CHOICES, Placement, cuda_count, mps_available
from components import cache, explain, shell, state, weights

shell.ensure_app()

st.title("Model")
st.caption("Pick a model in the sidebar: a built-in (nothing is downloaded), a Hugging Face id that is "
           "in the local cache, or a local folder. Every page uses the model picked here.")


def placement_form() -> None:
    """Device / dtype / offload options; applied together by the form's button (a reload is a new cache entry)."""
    current = state.placement()
    devices = ["auto", "cpu", *(f"cuda:{i}" for i in range(cuda_count())), *(["mps"] if mps_available() else [])]
    devices += [] if current.device in devices else [current.device]
    with st.expander("Device and precision", expanded=current != Placement()):
        with st.form("model.placement"):
            cols = st.columns(2)
            device = cols[0].selectbox("Device", devices, index=devices.index(current.device),
                                       help="auto: the first CUDA GPU if there is one, else the CPU.")
            dtype = cols[1].selectbox("dtype", DTYPE_CHOICES, index=DTYPE_CHOICES.index(current.dtype),
                                      help="auto: float32 on the CPU (the exact reference), bfloat16 on a GPU. "
                                           "Norms, losses and gate gradients are always reduced in float32.")
            cols = st.columns(2)
            max_memory = cols[0].text_input("max_memory (accelerate)", value=current.max_memory or "",
                                            placeholder="0=20GiB,cpu=8GiB",
                                            help="Per-device budgets; the blocks that do not fit go to the CPU, "
                                                 "then to the offload folder.")
            folder = cols[1].text_input("Offload folder (disk)", value=current.offload_folder or "",
                                        help="Weights that fit nowhere else are read from here, one layer at "
                                             "a time (slow, but a model larger than memory loads).")
            applied = st.form_submit_button("Load with these settings")
    if applied:
        try:
            state.set_placement(Placement.of(device, dtype, max_memory=max_memory, offload_folder=folder))
        except HeadscopeError as err:
            st.error(str(err))


weights.weights_only_switch()
if not state.weights_only():
    placement_form()
lm = cache.model_or_stop()
g = lm.geometry
st.subheader(lm.name)
# the words, the long number and the long label in the wider row ("causal-lm" was cut to "causa..."
# in a sixth of the page at 1280x800), the small counts with short labels in the narrow one
cols = st.columns(4)
cols[0].metric("Family", lm.adapter.model_type)
cols[1].metric("Kind", lm.kind)
cols[2].metric("Parameters", f"{cache.param_count(state.model_key()):,}")
cols[3].metric("Query heads per KV head (G)", g.group_size)
cols = st.columns(6)
cols[0].metric("Layers (L)", g.n_layers)
cols[1].metric("Query heads (H)", g.n_heads)
cols[2].metric("KV heads (H_kv)", g.n_kv_heads)
cols[3].metric("head_dim (d)", g.head_dim)
cols[4].metric("Hidden (D)", g.hidden)
cols[5].metric("All heads (L x H)", g.n_total_heads)
if lm.placement is not None:
    st.caption(f"Loaded on {lm.placement.describe()}.")
if state.weights_only():
    st.caption("Open weights only: nothing but config.json and the tensor headers was read. Profiles, Prune, the "
               "Walkthrough and Export work from the streamed profile; pages that run the model say so.")
st.caption(f"Weights from `{lm.source}`. Attention: "
           + ("multi-head (MHA)" if g.group_size == 1 else
              "multi-query (MQA)" if g.n_kv_heads == 1 else f"grouped-query (GQA), G = {g.group_size}")
           + ". The loaded model is shared by all pages and never modified: masks are temporary hooks, "
             "exports work on a copy.")
explain.structured_pruning(policy=state.get("policy"))    # the model's default policy once loaded
explain.model_geometry(g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim)
if g.group_size > 1:
    explain.gqa(g.n_heads, g.n_kv_heads)
