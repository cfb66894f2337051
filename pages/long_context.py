"""Long context page: a per-head KV plan (full / window / prune for every KV head of every layer) edited in
a grid beside its heatmap, what it costs at the chosen context (KV memory, predicted prefill and decode
speed, KV memory vs context for dense, the Prune page's mask and the plan), what it keeps (the long-context
probes, dense vs the plan: components/longprobes.py; RULER: components/ruler.py; dense's task x length map and the
KV frontier: components/longmap.py), and its kv_plan.json. The plan
and the context live in the URL (components/state.py); the logic is components/longctx.py (the plan), longscan.py
(the fills from the heads' scores) and duo.py (DuoAttention patterns), all on components/longstate.py."""
import streamlit as st

from components import cache, duo, longctx, longmap, longprobes, longscan, ruler, shell, state

shell.ensure_app()

st.title("Long context")
lm = cache.model_or_stop()
if lm.kind != "causal-lm":
    st.info("Per-head KV plans are about the cache a decoder keeps while it writes; this model is not a causal "
            "language model (it keeps no KV cache). Pick a decoder such as the built-in SmolLM2 in the sidebar.",
            icon=":material/info:")
    shell.end_run()
st.caption("For every KV head of every layer: keep its whole cache (full), only the first sink tokens and a "
           "recent window (window), or prune it; see what that saves at the context you choose.")
context, window = longctx.window_inputs(lm)
longctx.current_modes(lm)                           # a plan that does not fit this model: dropped, one line
left, right = st.columns([1, 1], gap="medium")
with left:
    st.caption("One row per layer, one column per KV head. Keyboard: arrows to a cell, Enter, type or pick "
               "full / window / prune, Enter.")
    modes = longctx.plan_grid(lm)
    longctx.show_note()
    longctx.fill_buttons(lm)
    longscan.score_fills(lm, window)
plan = longctx.current_plan(lm, window, notes=False)
with right:
    longctx.plan_view(lm, plan, context)
with left:
    longctx.plan_file(lm, plan)
    duo.duo_section(lm, plan, window)
st.subheader(f"KV memory and predicted cost at {context:,} tokens")
longctx.memory_chart(lm, plan, context)
longctx.prediction_table(lm, plan, context)
longprobes.probe_section(lm, plan, context)
ruler.ruler_section(lm, plan, context)
longmap.map_section(lm)
longmap.frontier_section(lm, plan)
longctx.how_to_read()
