"""The capability probes in the app (analysis.measure.probes, analysis.score.domains): the "What this cut
breaks" panel (Prune and Export pages), the heads behind each probe and the domain comparison (Heads
page), and the capabilities of a pipeline run's stages (Pipeline page). Pages call one function each;
the cached calls, tables and folded explanations live here.
"""
from __future__ import annotations

import numpy as np
import streamlit as st

from components import cache, charts, explain, state
from components.errors import shown_errors
from components.state import ModelKey

SEED = 0



# -- cached calls ---------------------------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=4)
def probe_items(key: ModelKey, seed: int = SEED):
    """(built items, skipped probe -> reason) of every probe that applies to the model (the tokenizer only)."""
    from analysis.measure.probes.breaks import build_applicable
    return build_applicable(cache.load(key), None, options={"seed": seed})


def probe_tokens(key: ModelKey, seed: int = SEED) -> int:
    """The prompt tokens of every probe that applies to the model (0: none builds): what a pipeline's
    report runs on the dense model and on each round, for its time estimate."""
    from analysis.core.errors import InputError
    from analysis.measure.probes.breaks import prompt_tokens
    try:
        built, _ = probe_items(key, seed)
    except InputError:
        return 0
    return prompt_tokens(built)


@st.cache_data(show_spinner=False, max_entries=4)
def dense_probes(key: ModelKey, seed: int = SEED, _progress=None, _should_stop=None):
    """(built items, skipped probe -> reason, dense scores) of every probe that applies to the model."""
    from analysis.measure.probes.breaks import dense_scores
    built, skipped = probe_items(key, seed)                       # before taking the lock (cache.exclusive)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return built, skipped, dense_scores(lm, built, seed=seed, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def cut_probes(key: ModelKey, pruned, plan=None, seed: int = SEED, _progress=None, _should_stop=None):
    """analysis.measure.probes.breaks.cut_report of the page's cut: the mask pruned [L, H], with the KV plan the
    export writes when there is one (analysis.compress.export.planned.exported_cut; dense side cached once per
    model: the first check measures it first, stoppable and with its own progress; every later cut reuses it)."""
    from analysis.compress.export.planned import exported_cut
    from analysis.measure.probes.breaks import cut_report
    dense_progress = None if _progress is None else (lambda f, m: _progress(f, f"the dense model (once per model): {m}"))
    built, skipped, dense = dense_probes(key, seed, _progress=dense_progress,   # before taking the lock
                                         _should_stop=_should_stop)             # (cache.exclusive)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return cut_report(lm, exported_cut(lm, pruned, plan), built=built, skipped=skipped, dense=dense, seed=seed,
                          progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8)
def probe_map(key: ModelKey, probe: str, seed: int = SEED, _progress=None, _should_stop=None):
    """The per-head map of one probe (analysis.measure.probes.circuit.probe_map, the fast sweep)."""
    from analysis.measure.probes.circuit import probe_map as run
    built, _ = probe_items(key, seed)
    spec, _, items = built[probe]
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return run(lm.model, spec, items, seed=seed, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=4)
def domains(key: ModelKey, a, b, sparsity: float, tokens: int, _progress=None, _should_stop=None):
    """analysis.score.domains.compare_domains of the text sets a, b."""
    from analysis.score.domains import compare_domains
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return compare_domains(lm, a, b, sparsity=sparsity, max_tokens=tokens, progress=_progress,
                               should_stop=_should_stop)


# -- What this cut breaks ----------------------------------------------------------------------------

def _acc(row: dict, side: str) -> str:
    return f"{row[f'{side}_accuracy']:.2f} [{row[f'{side}_low']:.2f}, {row[f'{side}_high']:.2f}]"


def show_lost(warnings: list[str], where=st) -> None:
    """One red line naming the lost capabilities (nothing when none), like a growing model's."""
    if warnings:
        where.error("This cut LOSES a capability: " + "; ".join(warnings) + ". Check another mask, a lower "
                    "sparsity, or recover it (Pipeline page).", icon=":material/warning:")


def cut_panel(lm, pruned: np.ndarray, *, where: str, plan=None) -> None:
    """The 'What this cut breaks' panel for the mask pruned [L, H] and the KV plan written with it (None: the mask
    alone; where: a key prefix, e.g. "prune")."""
    from analysis.measure.probes.registry import applicable
    st.markdown("#### What this cut breaks (capability probes)")
    if not applicable(lm.kind):
        st.caption("No capability probe applies to this model: every probe reads predicted tokens, and this "
                   "encoder has no language-model head (all-MiniLM-L6-v2 has none).")
        return
    with shown_errors("Capability probes"):
        run_key = (state.model_key(), np.asarray(pruned, bool).tobytes(), None if plan is None else plan.to_json())
        what = "this cut" if plan is None else "this cut and its KV plan"
        rep = cache.run_button(f"Check what {what} breaks", button_key=f"{where}.probes", slot=f"{where}.probes",
                               run_key=run_key, fn=cut_probes, args=(state.model_key(), np.asarray(pruned, bool), plan),
                               label="Running the probes",
                               stale_note="The mask or its plan changed since the last check; press the button to "
                                          "check this one.")
        if rep is not None:
            show_lost(rep.warnings())
            st.dataframe([{"probe": r["label"], "items": r["n_items"], "dense accuracy": _acc(r, "dense"),
                           "cut accuracy": _acc(r, "cut"),
                           "logit diff (dense -> cut)": f"{r['dense_logit_diff']:.2f} -> {r['cut_logit_diff']:.2f}",
                           "": "LOST" + (" (at chance)" if r["at_chance"] else "") if r["lost"] else ""}
                          for r in rep.rows()], hide_index=True, width="stretch")
            notes = [f"{name}: {why}" for name, why in rep.skipped.items()]
            rejected = [f"{c.label}: " + ", ".join(f"{n} {what}" for what, n in c.rejected.items())
                        for c in rep.changes if c.rejected]
            if notes:
                st.caption("Not measured: " + " ".join(notes))
            if rejected:
                st.caption("Left out because the tokenizer splits them: " + "; ".join(rejected) + ".")
        explain.fold("what the probes measure", HOW_TO_READ_BREAKS)


HOW_TO_READ_BREAKS = """
Perplexity averages over all text and can hide a lost skill. Each probe is a small set of items built
offline from templates and word lists: a prompt, the correct next token and a contrast (IOI: who
receives the drink; agreement: *are* vs *is* after "The keys to the cabinet"; anaphor: *herself* vs
*himself*; copying: continue a repeated random sequence; code: close the open bracket or quote in real
Python source; successor: *Thursday* after "Monday, Tuesday, Wednesday,"). **Accuracy** is the share of
items whose correct token gets the higher logit (chance 0.5), **logit difference** the mean margin. The
brackets are 95 % bootstrap intervals over the items' sequences; dense and cut read the same items. A
capability is **lost** when the cut's interval lies entirely below the dense accuracy.
"""


# -- Heads page: the heads behind each probe, domains -----------------------------------------------

def heads_section(lm) -> None:
    """Heads page: per-probe head maps (with the detectors' roles and MP-G), then domains."""
    from analysis.measure.probes.registry import PROBES, applicable
    g = lm.geometry
    st.subheader("The heads behind each capability")
    if not applicable(lm.kind):
        st.caption("No capability probe applies to this model (no language-model head).")
    else:
        with shown_errors("Probe maps"):
            built, skipped = probe_items(state.model_key())
            names = list(built)
            if skipped:
                st.caption("Not available for this tokenizer or context: " + " ".join(skipped.values()))
            probe = st.selectbox("Probe", names, format_func=lambda n: PROBES[n].label,   # fits at 1280x800
                                 key=state.widget_key("heads.probe", value=names[0]))
            probe = probe if probe in names else names[0]
            st.caption(PROBES[probe].help)
            result = cache.run_button(f"Map the heads behind {PROBES[probe].label}", button_key="heads.probe_map",
                                      slot="heads.probe_map", run_key=(state.model_key(), probe),
                                      fn=probe_map, args=(state.model_key(), probe),
                                      label="Ablating each head on the probe",
                                      stale_note="The probe changed since the last map; press the button again.")
            if result is not None:
                _show_map(lm, result, g)
    domains_section(lm)


def _show_map(lm, m, g) -> None:
    lim = float(np.nanmax(np.abs(m.drop))) or 1.0
    fig = charts.layer_head_heatmap(m.drop, f"{m.label}: drop of the mean logit difference when one head is removed",
                                    colorbar="drop", group_size=g.group_size, colorscale="RdBu_r")
    st.plotly_chart(fig.update_traces(zmin=-lim, zmax=lim), width="stretch", key="heads.probe_map_chart")
    st.caption(f"Dense mean logit difference {m.base:.3f} over {m.n_items} items ({m.method} sweep, "
               f"{m.seconds:.1f} s). Red = removing the head hurts the probe; blue = it helps.")
    rows = [dict(head=f"L{l}H{h}", drop=round(d, 4),
                 ci="" if m.drop_ci is None else f"[{m.drop_ci[l, h, 0]:.3f}, {m.drop_ci[l, h, 1]:.3f}]")
            for l, h, d in m.top(10)]
    detections = state.model_result("heads.taxonomy", lm.name)        # the detectors run above, if any
    if detections is not None:
        from analysis.measure.probes.circuit import role_overlap
        roles = {r["role"]: r for r in role_overlap(m, detections, k=10)}
        for row in rows:
            row["roles"] = ", ".join(name for name, r in roles.items() if row["head"] in r["heads"])
    st.dataframe(rows, hide_index=True)
    if detections is None:
        st.caption("Run the head detectors above to see which roles (induction, duplicate-token, ...) these heads have.")
    else:
        st.caption("Roles from the head detectors above. " + "; ".join(
            f"{r['role']}: {r['with_role']} of the top 10 (about {r['expected']:.1f} by chance)" for r in roles.values()))
    from analysis.score.specialization import probe_strengths, role_tests
    scores = cache.mpg(state.model_key(), 2.0)
    t = role_tests(scores.scores, probe_strengths({m.name: m}, 10), n_permutations=10_000, seed=0)[0]
    st.caption(f"Does MP find these heads? ROC AUC of the MP-G score (z = 2) for the probe's top 10 heads: "
               f"{t.auc:.3f} (permutation p {t.p_value:.4f}; > 0.5 = MP keeps them, < 0.5 = MP prunes them first).")


SET_LABELS = {"wikipedia": "Built-in Wikipedia", "python": "Built-in Python source (standard library)",
              "own": "My own text"}


def _text_set(side: str, default: str):
    """One text set's widgets -> a TextSet (InputError shown by the caller for bad own text)."""
    from analysis.score.domains import builtin_text_set, user_text_set
    choice = st.radio(f"Text set {side}", list(SET_LABELS), format_func=SET_LABELS.get, horizontal=True,
                      key=state.widget_key(f"heads.domains.{side}", value=default))
    if choice != "own":
        return builtin_text_set(choice)
    raw = st.text_area(f"Text {side}", height=100, key=state.widget_key(f"heads.domains.{side}.text", value=""),
                       placeholder="Paste text (e.g. in another language), or upload a .txt file.")
    upload = st.file_uploader(f"Or upload text {side} (UTF-8 .txt)", type=["txt"],
                              key=state.unseeded_widget_key(f"heads.domains.{side}.upload"))
    return user_text_set(f"text {side}" + (f" ({upload.name})" if upload is not None else ""),
                         upload.getvalue() if upload is not None else raw)


def domains_section(lm) -> None:
    """Which heads matter more for one text than another; a cut scored on one, evaluated on both."""
    g = lm.geometry
    st.subheader("Domains: which heads matter more for which text")
    with shown_errors("Domains"):
        c1, c2 = st.columns(2)
        with c1:
            a = _text_set("A", "wikipedia")
        with c2:
            b = _text_set("B", "python")
        c1, c2 = st.columns(2)
        sparsity = float(c1.slider("Sparsity of the cuts", 0.05, 0.75, step=0.05,
                                   key=state.widget_key("heads.domains.sparsity", value=0.25)))
        tokens = int(c2.number_input("Tokens of each text (importance)", 32, 2048, step=32,
                                     key=state.widget_key("heads.domains.tokens", value=256)))
        st.caption(" ".join(x for x in (a.attribution, b.attribution) if x))
        key = (state.model_key(), a, b, sparsity, tokens)
        rep = cache.run_button("Compare the two texts", button_key="heads.domains", slot="heads.domains",
                               run_key=key, fn=domains, args=(state.model_key(), a, b, sparsity, tokens),
                               label="Ablating each head on both texts",
                               stale_note="The texts or settings changed since the last run; press the button again.")
        if rep is not None:
            lim = float(np.nanmax(np.abs(rep.difference))) or 1.0
            fig = charts.layer_head_heatmap(rep.difference, f"Loss increase when one head is removed: {b.name} minus "
                                            f"{a.name}", colorbar="Δ loss", group_size=g.group_size,
                                            colorscale="RdBu_r")
            st.plotly_chart(fig.update_traces(zmin=-lim, zmax=lim), width="stretch", key="heads.domains_chart")
            specific = rep.specific()
            if specific:
                st.caption("Heads whose 95 % interval of the difference excludes 0: " + "; ".join(
                    f"{label}: " + (", ".join(f"L{l}H{h}" for l, h, _ in heads[:10]) or "none")
                    for label, heads in specific.items()))
            st.dataframe([{"cut": c["scored_on"] if c["scored_on"] == "dense" else f"scored on {c['scored_on']}",
                           "heads pruned": c["n_pruned"], f"{a.name}": f"{c['ppl_a']:.2f} ({c['ratio_a']:.3f}x)",
                           f"{b.name}": f"{c['ppl_b']:.2f} ({c['ratio_b']:.3f}x)"} for c in rep.cuts],
                         hide_index=True, width="stretch")
            st.caption(f"Held-out text of each set; perplexity (x dense). {rep.answer()}.")
        explain.fold("domains and language-specific heads", HOW_TO_READ_DOMAINS)


HOW_TO_READ_DOMAINS = """
Each head is removed alone and the loss increase is measured on the scoring part of each text set (the
95 % intervals resample its sequences). The map shows B minus A: red heads matter more for B. Then the
heads are ranked by their importance on A, the least important are cut at the chosen sparsity (the
model's default mask policy), and that cut, the one scored on B, and the dense model are evaluated on
the held-out part of both sets. A cut specialized for one domain keeps it close to dense while the
other can degrade. **Language-specific heads** are the same comparison with a text in one language as
A and one in another as B: paste or upload both (UTF-8 text; the app takes at most 8 MiB each).
"""


# -- Pipeline page -------------------------------------------------------------------------------------

def pipeline_capabilities(rep) -> None:
    """The compression report's capability table: each stage against dense, lost capabilities flagged."""
    stages = [s for s in rep.capabilities or () if s["probes"]]
    if not rep.capabilities:
        return
    st.markdown("#### What each stage breaks (capability probes)")
    if not stages:
        st.caption("Not measured: " + "; ".join(f"{k}: {v}" for s in rep.capabilities
                                                 for k, v in s.get("skipped", {}).items()))
        return
    show_lost(rep.capability_warnings)
    dense = stages[0]["probes"]
    table = [{"stage": "dense", **{p["label"]: _acc(p, "dense") for p in dense}}]
    table += [{"stage": s["stage"], **{p["label"]: _acc(p, "cut") + (" LOST" if p["lost"] else "")
                                      for p in s["probes"]}} for s in stages]
    st.dataframe(table, hide_index=True, width="stretch")
    st.caption("Accuracy [95 % CI] of each probe on the same items at every stage; LOST = below dense.")
