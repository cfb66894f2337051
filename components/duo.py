"""DuoAttention's patterns on the Long context page: a published pattern for this model (full_attention_heads.tsv:
one gate per layer and KV head, config.json: sink_size / recent_size) read beside the view's plan (where the two
keep the same KV heads full, where not: analysis.compress.export.duo.full_agreement), used as the plan in one
click, and the view's plan downloaded as such a pattern (a zip of the two files) for DuoAttention or kvpress
(docs/PEERS.md). The reading and the rules are analysis.compress.export.duo's; this module draws them.
"""
from __future__ import annotations

import io
import json
import zipfile

import streamlit as st

from analysis.arch.kvplan import KVPlan
from analysis.core.errors import InputError

from . import charts, longstate, state
from .errors import shown_errors

_PATTERN = "long.duo.pattern"          # (file names, the DuoPattern) of the last upload


def _read_upload(key: str, window) -> None:
    """on_change of the uploader: the pattern of the uploaded files (full_attention_heads.tsv, and config.json when
    given, else the page's window), or one line; nothing changes the plan until the user asks."""
    from analysis.compress.export import duo
    files = st.session_state.get(key)
    state.forget(_PATTERN)
    state.forget("long.duo.note")
    if not files:
        return
    by_name = {f.name: f for f in files}
    heads = next((f for n, f in by_name.items() if n.endswith(".tsv")), None)
    config = next((f for n, f in by_name.items() if n.endswith(".json")), None)
    try:
        if heads is None:
            raise InputError(f"Upload {duo.HEADS_FILE} (one row of tab-separated gates per layer), and its "
                             f"{duo.CONFIG_FILE} when you have it.")
        try:
            texts = [f.getvalue().decode("utf-8") if f is not None else None for f in (heads, config)]
        except UnicodeDecodeError:
            raise InputError("The uploaded pattern is not UTF-8 text; upload DuoAttention's own files.") from None
        pattern = duo.pattern_from_texts(texts[0], texts[1], window=window)
    except InputError as err:
        state.remember("long.duo.note", str(err))
        return
    state.remember(_PATTERN, (sorted(by_name), pattern))


def pattern_zip(plan: KVPlan) -> bytes:
    """The plan as DuoAttention's pattern folder, zipped: full_attention_heads.tsv, config.json, kv_plan.json."""
    from analysis.compress.export import duo
    pattern = duo.pattern_from_plan(plan)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(duo.HEADS_FILE, duo.heads_text(pattern.gates))
        z.writestr(duo.CONFIG_FILE, json.dumps(pattern.config_dict(), indent=1) + "\n")
        z.writestr("kv_plan.json", plan.to_json() + "\n")
    return buffer.getvalue()


def duo_section(lm, plan: KVPlan, window) -> None:
    """The expander: upload a pattern, see where it agrees with the view's plan, use it; download the plan as one."""
    from analysis.compress.export import duo
    g = lm.geometry
    with st.expander("DuoAttention patterns (full_attention_heads.tsv)", expanded=False):
        st.caption("A DuoAttention pattern gives every KV head a gate (1: a retrieval head kept full, 0: a streaming "
                   "head on sink + recent tokens). Upload one trained for this model to see where it agrees with "
                   "the plan on the left (e.g. filled from headscope's scores), and use it; or download the plan as "
                   "a pattern for DuoAttention or kvpress's DuoAttentionPress.")
        key = state.unseeded_widget_key("long.duo.upload")
        st.file_uploader(f"Upload {duo.HEADS_FILE} (and its {duo.CONFIG_FILE})", type=["tsv", "json"],
                         accept_multiple_files=True, key=key, on_change=_read_upload, args=(key, window))
        note = state.recall("long.duo.note")
        if note:
            st.warning(note, icon=":material/error:")
        got = state.recall(_PATTERN)
        if got is not None:
            names, pattern = got
            rule = st.radio("A KV head is full when", ("its gate is at least 0.5 (DuoAttention's default)",
                                                       "it is not among the share below with the lowest gates"),
                            key=state.widget_key("long.duo.rule", value="its gate is at least 0.5 "
                                                                         "(DuoAttention's default)"))
            sparsity = None
            if rule.startswith("it is not"):
                sparsity = st.slider("Streaming share (DuoAttention's sparsity)", 0.0, 1.0, step=0.05,
                                     key=state.widget_key("long.duo.sparsity", value=0.5))
            with shown_errors("Reading the DuoAttention pattern"):
                theirs = duo.plan_from_pattern(pattern, g, sparsity=sparsity, model=lm.name)
                agree = duo.full_agreement(theirs, plan)
                counts = agree.as_dict(("pattern", "plan"))["counts"]
                c1, c2, c3 = st.columns(3)
                c1.metric("KV heads full in both", counts["both"])
                c2.metric("Full in one only", counts["only_pattern"] + counts["only_plan"],
                          help=f"{counts['only_pattern']} in the pattern only, {counts['only_plan']} in the plan only.")
                c3.metric("Jaccard of the full heads", f"{agree.jaccard:.2f}")
                st.plotly_chart(charts.kv_agreement_heatmap(agree, group_size=g.group_size,
                                                            names=("the pattern", "the plan")), key="long.duo.map")
                st.button(f"Use the pattern as the plan ({theirs.describe()})", key="long.duo.use",
                          on_click=state.adopt_plan, args=(theirs, "duo", longstate.context_limit(lm)))
        with shown_errors("Writing the plan as a DuoAttention pattern"):
            if plan.pruned_kv.any():
                st.caption("The plan prunes KV heads: a DuoAttention pattern holds only full and streaming heads, so "
                           "it is offered for plans without pruned heads.")
            else:
                st.download_button("Download the plan as a DuoAttention pattern (zip)", pattern_zip(plan),
                                   file_name="duo_pattern.zip", mime="application/zip", key="long.duo.download",
                                   icon=":material/download:")
