"""Heads page, "What heads do": the field's head taxonomy (analysis.measure.detectors), direct logit
attribution per token, and the "Does MP find the specialized heads?" panel
(analysis.score.specialization); then "Heads for long contexts": the detectors registered with long=True
(retrieval, streaming), each on its own button with its expected time and a Stop, its map and its MP-G AUC. Kept in one module beside the page's other sections: its cached
calls and its figures. Each detector's map title, help line and folded "how to read this" text come
from its record (analysis.measure.detectors.DETECTORS), so a registered detector gets its tab.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from analysis.core.errors import InputError
from components import cache, charts, controls, explain, figures, longstate, numbers, state
from components.errors import shown_errors


# -- cached calls ---------------------------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def detections(key, names: tuple, text: str | None, max_tokens: int, _progress=None,
               _should_stop=None):
    """analysis.measure.detectors.detect_heads for `names` on the dense model (text: None = built-in)."""
    from analysis.measure.detectors import detect_heads
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return detect_heads(lm, list(names), text, max_tokens=max_tokens, progress=_progress,
                            should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def sentence_dla(key, sentence: str):
    """(tokens, per-token head DLA [T-1, L, H], parts) of one sentence."""
    from analysis.measure.dla import logit_parts
    from analysis.measure.evaluation import token_ids
    with cache.exclusive(key) as lm:
        ids = token_ids(lm.tokenizer, sentence, max_tokens=64)
        parts = logit_parts(lm.model, ids[None])
        tokens = [lm.tokenizer.decode([int(t)]) for t in ids]
    return tokens, parts.heads[0], parts


# -- figures -----------------------------------------------------------------------------------------

def token_heads_heatmap(per_token: np.ndarray, tokens: list[str], *, top: int = 12) -> go.Figure:
    """Per-token DLA of the `top` heads with the largest mean |DLA| (rows) over the predicted tokens."""
    T1, L, H = per_token.shape
    flat = per_token.reshape(T1, L * H)                                # [T-1, L*H]
    pick = np.argsort(-np.abs(flat).mean(0))[:top]
    values = flat[:, pick].T                                           # [top, T-1]
    lim = float(np.abs(values).max()) or 1.0
    labels = [f"L{i // H}H{i % H}" for i in pick]
    x = [f"{i}:{t!r}" for i, t in enumerate(tokens[1:1 + T1])]
    fig = go.Figure(go.Heatmap(z=values, x=x, y=labels, colorscale="RdBu_r", zmin=-lim, zmax=lim,
                               colorbar=dict(title="logit"),
                               hovertemplate="%{y} predicting %{x}<br>%{z:.3f} logits<extra></extra>"))
    fig.update_layout(title="Direct logit attribution per predicted token (strongest heads)",
                      xaxis_title="predicted token", yaxis_title="head", yaxis_autorange="reversed")
    return fig


def role_scatter(mpg_scores: np.ndarray, strength: np.ndarray, threshold: float, role: str) -> go.Figure:
    """MP-G score (x) vs role strength (y), one point per head, role heads highlighted."""
    L, H = strength.shape
    has = strength >= threshold
    text = np.array([[f"L{l}H{h}" for h in range(H)] for l in range(L)])
    fig = go.Figure()
    for flag, name, color in ((False, "no role", "#95a5a6"), (True, f"{role} head", "#c0392b")):
        m = has == flag
        fig.add_trace(go.Scatter(x=mpg_scores[m], y=strength[m], mode="markers", name=name, text=text[m],
                                 marker=dict(color=color, size=7),
                                 hovertemplate="%{text}<br>MP-G %{x:.4g}<br>strength %{y:.3f}<extra></extra>"))
    fig.add_hline(y=threshold, line_dash="dot", annotation_text="role threshold")
    fig.update_layout(title=f"MP-G score vs {role} strength", xaxis_title="MP-G score (z = 2)",
                      yaxis_title=f"{role} score")
    return fig


def _roles(names) -> list[str]:
    """The names of role tags among `names` (a signed effect such as DLA is not a role tag)."""
    from analysis.measure.detectors import DETECTORS
    return [n for n in names if not DETECTORS[n].signed]


def primary_detector(results: dict) -> tuple[np.ndarray, np.ndarray]:
    """(tag [L, H] "" when none, strength [L, H]): the role whose score passes its threshold by the
    largest factor (DLA is an effect, not a role tag, and is left out)."""
    roles = [results[n] for n in _roles(results)]
    L, H = roles[0].scores.shape
    tag, strength, best = np.full((L, H), "", dtype=object), np.zeros((L, H)), np.zeros((L, H))
    for r in roles:
        ratio = r.scores / r.threshold
        take = r.has_role & (ratio > best)
        tag[take], strength[take], best[take] = r.name, r.scores[take], ratio[take]
    return tag, strength


# -- sections ------------------------------------------------------------------------------------------

def section(lm) -> None:
    """The "What heads do" section: detector heatmaps, role tags, DLA per token, MP-G panel."""
    from analysis.measure.detectors import DETECTORS, default_detectors
    g = lm.geometry
    st.subheader("What heads do: induction, duplicate-token, copying, direct logit attribution")
    decoder = lm.kind == "causal-lm"
    names = tuple(default_detectors(lm.kind))
    skipped = [n for n, spec in DETECTORS.items() if not spec.long and n not in names]
    if skipped:
        st.info(f"This model is a {lm.kind}: it has no unembedding, so {', '.join(skipped)} do not apply. "
                "The attention-pattern detectors run.")
    with shown_errors("Head detectors"):
        tokens = int(st.number_input("Tokens of the built-in evaluation text (previous-token, DLA)", 16, 2048,
                                     step=64, key=state.widget_key("heads.taxonomy.tokens", value=128)))
        result = cache.run_button("Run the head detectors", button_key="heads.taxonomy", slot="heads.taxonomy",
                                  run_key=(lm.name, names, tokens), fn=detections,
                                  args=(state.model_key(), names, None, tokens),
                                  label="Detecting head roles", kind="detectors", work=tokens,
                                  stale_note="The settings changed since the last run; press the button again.")
        if result is not None:
            _show_detections(result, g)
            if decoder:
                _sentence_dla(lm)
            _specialization(lm, result)


def _show_detections(result: dict, g) -> None:
    from analysis.measure.detectors import DETECTORS
    tag, strength = primary_detector(result)
    roles = _roles(result)
    figures.chart(charts.category_heatmap(tag, roles, strength, title="Strongest detected role of each head",
                                            group_size=g.group_size), "heads.taxonomy_tags")
    rows = [dict(layer=l, head=h, role=name, score=round(s, 4), threshold=r.threshold)
            for name, r in result.items() for l, h, s in r.tagged()]
    st.caption(f"{len(rows)} tags; thresholds " + ", ".join(f"{n} >= {r.threshold:g}" for n, r in result.items()))
    st.dataframe(rows, hide_index=True, height=200)
    ind = result.get("induction")
    if ind is not None and "icl_score" in ind.extras:
        e = ind.extras
        st.metric("In-context-learning score (loss on copy 1 minus copy 2)", f"{e['icl_score']:.3f} nats",
                  help=f"first copy {e['loss_first_copy']:.3f}, second copy {e['loss_second_copy']:.3f} nats")
    tabs = st.tabs(list(result))
    for tab, (name, r) in zip(tabs, result.items()):
        spec = DETECTORS[name]
        with tab:
            if spec.signed:                     # red helps, blue hurts: a diverging scale around 0
                lim = float(np.abs(r.scores).max()) or 1.0
                fig = charts.layer_head_heatmap(r.scores, spec.title, colorbar=r.unit,
                                                group_size=g.group_size, colorscale="RdBu_r")
                fig.update_traces(zmin=-lim, zmax=lim)
            else:
                fig = charts.layer_head_heatmap(r.scores, spec.title, colorbar=r.unit,
                                                group_size=g.group_size)
            figures.chart(fig, f"heads.taxonomy.{name}")
            st.caption(spec.help)
            explain.fold(name, spec.about)


def _sentence_dla(lm) -> None:
    from analysis.measure.detectors import DETECTORS
    sentence = st.text_input("Sentence for the per-token view (edit it)", key=state.widget_key(
        "heads.dla.sentence", value="The cat sat on the mat. The cat sat on the mat."))
    with shown_errors("Direct logit attribution"):
        tokens, per_token, parts = sentence_dla(state.model_key(), sentence)
        figures.chart(token_heads_heatmap(per_token, tokens), "heads.dla_tokens")
        gap = float(np.abs(parts.total() - parts.logit).max())
        st.caption(f"Heads + embeddings + MLPs + biases rebuild the correct-token logit to within {gap:.1e}.")
        explain.fold("direct logit attribution per token", DETECTORS["dla"].about)


def _specialization(lm, result: dict) -> None:
    from analysis.score.specialization import pruned_roles, role_tests, strengths_of
    from components import views
    st.markdown("#### Does MP find the specialized heads?")
    with shown_errors("MP-G versus roles"):
        scores = cache.mpg(state.model_key(), 2.0)
        strengths = strengths_of(result)
        tests = role_tests(scores.scores, strengths, n_permutations=10_000, seed=0)
        st.dataframe([dict(role=t.role, heads_with_role=t.n_with_role, auc=round(t.auc, 3),
                           p_value=round(t.p_value, 4), mean_mpg_with=t.mean_score_with,
                           mean_mpg_without=t.mean_score_without) for t in tests], hide_index=True)
        st.caption(f"MP-G (z = 2) scores {scores.zero_count} of {scores.scores.size} heads exactly 0. AUC > 0.5: "
                   "heads with the role score higher (MP keeps them); < 0.5: MP prunes them first. p: two-sided, "
                   "10,000 seeded permutations of the role labels.")
        role = st.selectbox("Scatter for role", list(strengths), key=state.widget_key("heads.mpg.role",
                                                                                      value=list(strengths)[0]))
        if role in strengths:
            s, thr = strengths[role]
            figures.chart(role_scatter(scores.scores, s, thr, role), "heads.mpg_scatter")
        mask = views.view_mask(lm, explain=False)
        if mask is None:
            st.caption("Set a mask on the Prune page to see which roles its pruned heads had.")
        else:
            _, plan, _, _ = mask
            st.markdown(f"Roles of the heads the current mask ({controls.label(state.get('scorer'))}, sparsity "
                        f"{plan.sparsity:g}) prunes:")
            numbers.wide_table([{k: v for k, v in row.items() if k != "heads"} | dict(heads=", ".join(row["heads"]))
                                for row in pruned_roles(plan.pruned, strengths)])
        explain.fold("does MP find the specialized heads?", """
The MP paper argues that heads with outlier weight norms (high MP-G score, kept) are the specialized
ones and that typical-norm heads (score 0, pruned first) are redundant. Here every head's MP-G score
is used as a classifier of each role: the ROC AUC is the chance that a head with the role scores
higher than one without it. 0.5 means the weights say nothing about the role. The p-value says how
often shuffled role labels give an AUC at least as far from 0.5. The scatter shows each head's MP-G
score against its role strength; the table below it, which roles the current mask removes.""")


# -- heads for long contexts ----------------------------------------------------------------------------

def _long_options(lm, name: str, spec) -> dict:
    """The widgets of one long detector -> its options (the context clamped to the model's)."""
    from analysis.measure.evaluation import context_length
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS
    from analysis.measure.long_options import WINDOW_SCORES
    limit = context_length(lm.model)
    cols = st.columns(3)
    context = int(cols[0].number_input(f"Context (tokens, at most {limit:,})", 64, max(64, limit), step=256,
                                       key=state.widget_key(f"heads.long.{name}.context",
                                                            value=min(spec.context or 2048, max(64, limit)))))
    options = dict(lengths=(min(context, limit),))
    if name == "retrieval":
        options["needles"] = int(cols[1].number_input("Needles per depth (depths 0.1, 0.5, 0.9)", 1, 16,
                                                      key=state.widget_key("heads.long.retrieval.needles", value=2)))
    elif name in WINDOW_SCORES:
        options["sinks"] = int(cols[1].number_input("Sink tokens", 0, 1024, key=state.widget_key(
            f"heads.long.{name}.sinks", value=DEFAULT_SINKS)))
        options["recent"] = int(cols[2].number_input("Recent tokens (window)", 1, max(1, limit), key=state.widget_key(
            f"heads.long.{name}.recent", value=DEFAULT_RECENT)))
    return options


def _long_summary(name: str, r) -> str:
    n = int(r.has_role.sum())
    if name == "retrieval":
        e = r.extras
        return (f"{n} of {r.scores.size} heads copy at least {r.threshold:g} of the needle (retrieval heads); the model "
                f"writes {e['answer_accuracy']:.0%} of the needle's tokens right itself (teacher-forced top-1) over "
                f"{e['n_items']} items at {', '.join(map(str, e['lengths']))} tokens.")
    kv = r.extras["kv_scores"]
    if name == "retrieval-aware":
        e = r.extras
        return (f"{int((kv >= r.threshold).sum())} of {kv.size} KV heads, each windowed alone to {e['sinks']} sink + "
                f"{e['recent']} recent tokens, lose at least ln 2 nats of the needle answer (half its probability; "
                f"median {float(np.median(kv)):.3f} nats), over {e['n_items']} rows whose needle the window hides "
                f"({e['left_out']} left out: the window reads their needle); the dense model writes "
                f"{e['answer_accuracy']:.0%} of the answers' tokens right itself. The lowest are the heads a KV plan "
                f"windows with `headscope kv-plan --window-score retrieval-aware`.")
    return (f"{int((kv >= r.threshold).sum())} of {kv.size} KV heads change their output by >= {r.threshold:g} under "
            f"{r.extras['sinks']} sink + {r.extras['recent']} recent tokens (median {float(np.median(kv)):.2f}); the "
            f"lowest are the streaming heads a KV plan windows (`headscope kv-plan`).")


def long_section(lm) -> None:
    """The detectors registered with long=True: a button each (expected time, Stop), the map, how to read it,
    and the MP-G AUC of the role."""
    from analysis.measure.detectors import DETECTORS
    from analysis.measure.headmaps import Detection
    from analysis.score.specialization import role_tests
    specs = {n: spec for n, spec in DETECTORS.items() if spec.long}
    if not specs:
        return
    st.subheader("Heads for long contexts: retrieval and streaming")
    st.caption("These read thousands of tokens per forward pass (minutes on a CPU), so they run only on their own "
               "button. Text: the built-in Wikipedia paragraphs (CC BY-SA 4.0).")
    for name, spec in specs.items():
        st.markdown(f"**{spec.title}**")
        if not spec.applies_to(lm.kind):
            st.caption(f"Not for this model: {name} reads a causal language model's attention ({lm.kind}).")
            continue
        with shown_errors(spec.title):
            from analysis.measure.detectors import get_detector
            options = _long_options(lm, name, spec)
            try:
                passes = get_detector(name, lm.tokenizer, **options).passes(lm.model)
            except InputError as err:              # the model's (or the chosen) context is too short for its rows
                st.caption(f"Not at this context: {err}")
                continue
            result = cache.run_button(f"Run the {name} detector ({len(passes)} passes of {passes[0]:,} tokens)",
                                      button_key=f"heads.long.{name}", slot=f"heads.long.{name}",
                                      run_key=(lm.name, name, tuple(sorted(options.items()))), fn=longstate.long_detection,
                                      args=(state.model_key(), name, tuple(sorted(options.items()))),
                                      label=f"Running the {name} detector", kind="long-detectors",
                                      work=longstate.long_work(passes),
                                      stale_note="The settings changed since the last run; press the button again.")
            if result is None:
                continue
            r: Detection = result
            figures.chart(charts.layer_head_heatmap(r.scores, spec.title, colorbar=r.unit,
                                                    group_size=lm.geometry.group_size), f"heads.long.{name}.map")
            st.caption(spec.help)
            st.markdown(_long_summary(name, r))
            test = role_tests(cache.mpg(state.model_key(), 2.0).scores, {name: (r.scores, r.threshold)},
                              n_permutations=10_000, seed=0)[0]
            st.markdown(f"Does MP find them? MP-G (z = 2) ROC AUC for '{name}' heads: "
                        + ("n/a (no head has the role, or every head has it)" if not np.isfinite(test.auc) else
                           f"{test.auc:.3f} (p {test.p_value:.4f}, {test.n_with_role} heads with the role)") + ".")
            explain.fold(name, spec.about)
