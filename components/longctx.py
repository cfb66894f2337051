"""Long context in the app: the per-head KV plan (full / window / prune per KV head, analysis.arch.kvplan),
what it costs at a context (KV memory, predicted speed: analysis.compress.cost), its file, and the
Walkthrough's real head (where its attention goes over a long text: analysis.measure.longheads.last_rows).

Pages call one function each: the Long context page `window_inputs` (the context and the window, one
analysis.arch.window.Window), `plan_grid`, `fill_buttons`, `plan_file`, `plan_view`, `memory_chart`; the Export
page `export_section`; the Walkthrough `walkthrough_section`. The plan itself is view state
(components/state.py: fields `kv`, `plan`, `sinks`, `recent`, `context`), so a link reproduces it and every page
reads the same one (`current_plan`; the Long context page hands it the window its boxes show).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from analysis.arch.kvplan import KV_PLAN_FILE, MODES, KVPlan
from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS, Window
from analysis.core.errors import InputError

from . import cache, charts, explain, figures, longstate, state, views
from .errors import show_exception, shown_errors
from .state import ModelKey

MIB = 2 ** 20
PLAN_MAP_TITLE = "The plan, layer by layer"
CURVE_CONTEXTS = (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)
GRID_ROW_PX, GRID_MAX_PX = 35, 460



# -- the view: context, window, plan ----------------------------------------------------------------

def _too_long(lm) -> None:
    """A link's context, sinks or recent beyond the model's limit: one line each, and the limit instead."""
    limit = longstate.context_limit(lm)
    for name, what in (("context", "context"), ("sinks", "number of sink tokens"), ("recent", "window")):
        value = state.get(name)
        if value is not None and int(value) > limit:
            st.warning(f"The link's {what} of {int(value):,} tokens is longer than this model reads ({limit:,} "
                       f"tokens); using {limit:,}.")
            state.set(name, limit)
            state.reset_widget(name)


def window_inputs(lm) -> tuple[int, Window]:
    """The context, sinks and recent boxes (view fields) -> (context, Window): the context stops at the model's
    limit, the window starts at 1 (a window of 0 reads nothing)."""
    _too_long(lm)
    limit = longstate.context_limit(lm)
    context, window = longstate.view_window(lm)
    sinks, recent = window.sinks, window.recent
    c1, c2, c3 = st.columns(3)
    context = int(c1.number_input(
        "Context length (tokens)", 1, limit, step=max(1, min(1024, limit // 8)),
        key=state.widget_key("context", value=context),
        help=f"The context the KV memory and the predicted speed are computed at. This model reads at most "
             f"{limit:,} tokens (its config's max_position_embeddings)."))
    sinks = int(c2.number_input(
        "Sink tokens", 0, limit, step=1, key=state.widget_key("sinks", value=sinks),
        help="The first tokens every windowed head keeps (attention sinks: many heads park attention there)."))
    recent = int(c3.number_input(
        "Window (recent tokens)", 1, limit, step=max(1, min(64, limit // 8)), key=state.widget_key("recent", value=recent),
        help="The latest tokens a windowed head keeps, the current one included (at least 1: a window of 0 "
             "reads nothing; prune the head instead)."))
    defaults = {"context": min(state.DEFAULT_CONTEXT, limit), "sinks": min(DEFAULT_SINKS, limit),
                "recent": min(DEFAULT_RECENT, limit)}
    for name, value in (("context", context), ("sinks", sinks), ("recent", recent)):
        state.set(name, None if value == defaults[name] else value)
    return context, Window(sinks, recent)


def _shape(lm) -> tuple[int, int]:
    return lm.geometry.n_layers, lm.geometry.n_kv_heads


def current_modes(lm, *, notes: bool = True) -> np.ndarray:
    """modes [L, Hkv] of the view's plan; a plan that does not fit this model is dropped (one line)."""
    try:
        return state.kv_modes(state.get("kv"), _shape(lm))
    except ValueError as why:
        if notes:
            st.warning(f"The KV plan in the link or session does not fit this model: {why}. Starting from every "
                       "KV head full.")
        state.set("kv", None)
        state.set("plan", None)
        state.new_kv_editor()
        return np.zeros(_shape(lm), np.int8)


def current_plan(lm, window: Window | None = None, *, notes: bool = True) -> KVPlan:
    """The view's KVPlan (every KV head full until the Long context page or a link sets one) with `window` (None:
    the view's), with the notes of the scores that made it while it is unedited."""
    window = window or longstate.view_window(lm)[1]
    made = state.recall(state.PLAN_NOTES)
    why = tuple(made[1]) if made and made[0] == state.get("kv") and state.get("plan") == "scores" else ()
    return KVPlan(current_modes(lm, notes=notes), window, lm.geometry.n_heads, lm.name, why)


def plan_is_set() -> bool:
    """Whether the view holds a plan with some KV head not full."""
    return state.get("kv") is not None


def _source_words() -> str:
    return state.PLAN_SOURCES.get(state.get("plan") or ("edited" if plan_is_set() else "full"), "")


# -- the grid ---------------------------------------------------------------------------------------

def _columns(G: int, Hkv: int) -> list[str]:
    return [f"KV {j}" + (f" (q {j * G}-{j * G + G - 1})" if G > 1 else "") for j in range(Hkv)]


def plan_grid(lm) -> np.ndarray:
    """The editable grid (layers x KV heads, a full / window / prune box in each cell) -> modes [L, Hkv];
    an edit becomes the view's plan (source "edited")."""
    g = lm.geometry
    key, base = state.kv_editor()
    try:
        base_modes = state.kv_modes(base, _shape(lm))
    except ValueError:                                      # a base of another model: start a new editor
        state.new_kv_editor()
        key, base = state.kv_editor()
        base_modes = state.kv_modes(base, _shape(lm))
    cols = _columns(g.group_size, g.n_kv_heads)
    frame = pd.DataFrame({c: [MODES[m] for m in base_modes[:, j]] for j, c in enumerate(cols)},
                         index=pd.RangeIndex(g.n_layers, name="layer"))
    config = {c: st.column_config.SelectboxColumn(
        c, options=list(MODES), required=True,
        help=f"KV head {j}" + (f" and its query heads {j * g.group_size}-{j * g.group_size + g.group_size - 1}"
                               if g.group_size > 1 else "") + ": full, window (sinks + recent) or prune.")
        for j, c in enumerate(cols)}
    edited = st.data_editor(frame, key=key, column_config=config, num_rows="fixed", width="stretch",
                            height=min(GRID_MAX_PX, GRID_ROW_PX * (g.n_layers + 1) + 3))
    modes = np.array([[MODES.index(v) if v in MODES else 0 for v in edited[c]] for c in cols], np.int8).T
    text = state.kv_text(modes)
    if text != state.get("kv"):
        state.set("kv", text)
        state.set("plan", "edited")
    return modes


def _fill_full(shape: tuple[int, int]) -> None:
    state.set_plan(np.zeros(shape, np.int8), "full")


def _fill_mask(pruned, geometry) -> None:
    try:
        state.set_plan(KVPlan.from_mask(pruned, geometry).modes, "mask")
    except InputError as err:
        state.remember(state.PLAN_NOTE, str(err))


def _fill_range(shape, layers: tuple[int, int], kv_heads: list[int], mode: str) -> None:
    modes = state.kv_modes(state.get("kv"), shape).copy()
    modes[layers[0]:layers[1] + 1, kv_heads] = MODES.index(mode)
    state.set_plan(modes, "edited")


def fill_buttons(lm) -> None:
    """Fill the grid at once: every KV head full; from the Prune page's mask (whole KV groups: the groups
    policy); a range of layers and KV heads set to one mode."""
    g = lm.geometry
    row = st.container(horizontal=True)
    row.button("All full", key="long.fill.full", on_click=_fill_full, args=(_shape(lm),),
               help="Every KV head keeps its whole cache: the dense model.")
    view = views.view_mask(lm, explain=False)
    mask_help = ("Prune the KV groups the Prune page's mask empties; every other KV head full. A mask that "
                 "prunes only part of a group is refused: use the groups policy there.")
    if view is None:
        row.button("From the Prune page's mask", key="long.fill.mask", disabled=True,
                   help="The Prune page has no mask yet (a calibration scorer must be computed there first).")
    else:
        pruned = view[1].pruned
        row.button(f"From the Prune page's mask ({int(pruned.sum())} heads)", key="long.fill.mask",
                   on_click=_fill_mask, args=(pruned.copy(), g), help=mask_help)
    with st.expander("Set many KV heads at once", expanded=False):
        c1, c2, c3 = st.columns([2, 2, 1.3])
        top = max(g.n_layers - 1, 0)
        layers = c1.slider("Layers", 0, max(top, 1), key=state.widget_key("long.range.layers", value=(0, top)))
        if g.n_layers == 1:
            layers = (0, 0)
        heads = c2.multiselect("KV heads", list(range(g.n_kv_heads)), key=state.widget_key(
            "long.range.heads", value=list(range(g.n_kv_heads))))
        mode = c3.radio("Set to", list(MODES), key=state.widget_key("long.range.mode", value="window"))
        heads = [h for h in heads if 0 <= h < g.n_kv_heads]
        layers = (min(max(layers[0], 0), top), min(max(layers[1], 0), top))
        st.button(f"Set layers {layers[0]}-{layers[1]}, KV heads {', '.join(map(str, heads)) or '(none)'} to {mode}",
                  key="long.range.apply", on_click=_fill_range, args=(_shape(lm), layers, heads, mode),
                  disabled=not heads)


# -- the file ---------------------------------------------------------------------------------------

def _uploaded(key: str, geometry, limit: int) -> None:
    """on_change of the uploader: a kv_plan.json of this model's shape becomes the plan (with its sinks and
    recent); anything else is one line, and the plan stays as it was."""
    from analysis.core import schemas
    upload = st.session_state.get(key)
    state.forget(state.PLAN_NOTE)
    if upload is None:
        return
    fix = f"upload a {KV_PLAN_FILE} written by headscope for this model"
    try:
        try:
            text = upload.getvalue().decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"The uploaded file is not UTF-8 text; {fix}.") from None
        data = schemas.load_json_text(text, "The uploaded KV plan", fix)
        if not isinstance(data, dict):
            raise InputError(f"The uploaded KV plan must hold a JSON object; {fix}.")
        plan = KVPlan.from_dict(data, geometry=geometry)
    except InputError as err:
        state.remember(state.PLAN_NOTE, f"{upload.name}: {err}")
        return
    state.adopt_plan(plan, "file", limit)
    state.remember("long.file", (upload.name, plan.model))


def plan_file(lm, plan: KVPlan) -> None:
    """Download the plan as kv_plan.json; upload one (checked against this model's shape)."""
    key = state.unseeded_widget_key("long.upload")
    st.download_button(f"Download {KV_PLAN_FILE}", plan.to_json(), file_name=KV_PLAN_FILE, mime="application/json",
                       key="long.download", icon=":material/download:",
                       help="The plan as headscope writes it next to an exported model (and reads back).")
    st.file_uploader(f"Upload a {KV_PLAN_FILE}", type=["json"], key=key, on_change=_uploaded,
                     args=(key, lm.geometry, longstate.context_limit(lm)),
                     help="A plan written by headscope for a model of this shape (layers, heads, KV heads). "
                          "Another model's plan, or one naming a head this model does not have, is refused "
                          "and the grid stays as it is.")
    loaded = state.recall("long.file")
    if state.get("plan") == "file" and loaded and loaded[1] and loaded[1] != lm.name:
        st.caption(f"{loaded[0]} was written for {loaded[1]}; its shape matches {lm.name}.")


def show_note() -> None:
    """A fill's or an upload's refusal (kept until the next fill or upload)."""
    note = state.recall(state.PLAN_NOTE)
    if note:
        st.error(note, icon=":material/error:")


# -- what the plan costs ------------------------------------------------------------------------------

def size_words(n: float) -> str:
    """Bytes in words: "67.5 MiB", "1.2 GiB", "96.0 KiB"."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", MIB), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n):,} bytes"


def dtype_bytes(lm) -> int:
    return int(next(lm.model.parameters()).element_size())


def mask_kv_bytes(lm, context: int) -> tuple[int, str] | None:
    """(KV bytes at `context`, words) of the Prune page's mask as surgery builds it, or None (no mask yet)."""
    from analysis.score.masks import surgery_counts
    view = views.view_mask(lm, explain=False)
    if view is None:
        return None
    g = lm.geometry
    counts = surgery_counts(view[1].pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden,
                            kv_policy=state.get("kv_policy"), dtype_bytes=dtype_bytes(lm))
    return counts.kv_cache_bytes_per_token_after * context, f"the Prune page's mask ({int(view[1].pruned.sum())} heads)"


def _speed_metric(where, label: str, speedup: float, help: str) -> None:
    """A predicted speed-up (dense time / the plan's) as "1.96x" with "faster" or "slower" under it (the
    slower side as its own factor: "2.86x" slower, never "0.35x faster")."""
    from analysis.compress.verdict import speed_words
    words = speed_words(speedup)
    if words.startswith("same"):
        where.metric(label, "1.00x", "same as dense", delta_color="off", delta_arrow="off", help=help)
        return
    factor, side = words.split(" ", 1)
    where.metric(label, factor, f"{side} than dense", delta_color="normal" if side == "faster" else "inverse",
                 delta_arrow="up" if side == "faster" else "down", help=help)


def plan_view(lm, plan: KVPlan, context: int) -> None:
    """Beside the grid: the KV memory at the context (MiB and x dense), the predicted speed, the counts and
    the plan as a three-colour heatmap."""
    from analysis.arch.cut import Cut
    from analysis.compress.cost import predict
    from analysis.compress.verdict import speed_words
    g = lm.geometry
    with shown_errors("Predicting the plan's cost"):
        p = predict(lm.model, Cut.of_plan(plan), context, dtype_bytes=dtype_bytes(lm), adapter=lm.adapter)
        c = plan.counts()
        m1, m2 = st.columns(2)
        m1.metric(f"KV cache at {context:,} tokens", size_words(p.cut.kv_bytes),
                  f"{plan.kv_ratio(context):.2f}x dense ({size_words(p.dense.kv_bytes)})", delta_color="off",
                  delta_arrow="off",
                  help=f"Keys and values of every kept token of every KV head, {p.dtype_bytes} bytes a value "
                       "(the model's dtype), batch 1: KVPlan.kv_bytes.")
        m2.metric("Full / window / prune", f"{c['full']} / {c['window']} / {c['prune']}",
                  help=f"KV heads, of {plan.modes.size} ({g.n_layers} layers x {g.n_kv_heads}); a pruned KV head takes "
                       f"its {g.group_size} query head(s) with it.")
        m3, m4 = st.columns(2)
        _speed_metric(m3, "Prefill (predicted)", p.ratio("prefill_flops"),
                      f"Dense FLOPs / the plan's FLOPs for a forward of {context:,} tokens: "
                      f"{speed_words(p.ratio('prefill_flops'))}.")
        _speed_metric(m4, "Decode (predicted)", p.ratio("decode_bytes"),
                      "Bytes a decode step reads (every weight once, the whole KV cache once), dense / the plan: "
                      f"{speed_words(p.ratio('decode_bytes'))}; by FLOPs it would be "
                      f"{speed_words(p.ratio('decode_flops'))}.")
        st.caption(plan.describe() + ".")
        if c["window"] and plan.window.covers(context):
            st.caption(f"At {context:,} tokens the window ({plan.window.describe()}) holds the whole context: "
                       "a windowed head keeps every token there and saves nothing.")
        figures.chart(charts.kv_plan_heatmap(plan.modes, group_size=g.group_size, window=plan.window,
                                             title=PLAN_MAP_TITLE), "long.plan_map",
                      name="kv_plan", title=f"The KV plan: {plan.describe()}")
        st.caption(f"Source: {_source_words()}. The speeds are predicted from counts, not measured: they assume a "
                   "kernel that skips the keys outside a window and a cache that holds only the kept tokens "
                   "(headscope's compact cache does; llama.cpp and ONNX Runtime run every head full).")


def prediction_table(lm, plan: KVPlan, context: int) -> None:
    from analysis.arch.cut import Cut
    from analysis.compress.cost import predict
    with shown_errors("Predicting the plan's cost"):
        p = predict(lm.model, Cut.of_plan(plan), context, dtype_bytes=dtype_bytes(lm), adapter=lm.adapter)
        st.dataframe([{**r, "dense": round(r["dense"], 3), "plan": round(r["plan"], 3),
                       "dense / plan": round(r["dense / plan"], 3)} for r in p.rows("plan")], hide_index=True,
                     width="stretch")


def memory_chart(lm, plan: KVPlan, context: int) -> None:
    """KV memory vs context (1k .. 8k, up to the model's limit) for dense, the Prune page's mask and the plan."""
    from analysis.compress.cost import kv_curve
    limit = longstate.context_limit(lm)
    points = [c for c in CURVE_CONTEXTS if c <= limit] or list(np.linspace(1, limit, 8).round().astype(int))
    points = sorted({*points, context})
    g = lm.geometry
    size = dtype_bytes(lm)
    series = {"dense": (points, kv_curve(KVPlan.full(g), points, head_dim=g.head_dim, dtype_bytes=size) / MIB)}
    mask = mask_kv_bytes(lm, 1)
    if mask is not None:
        series[mask[1]] = (points, np.array(points) * mask[0] / MIB)
    series["the plan"] = (points, kv_curve(plan, points, head_dim=g.head_dim, dtype_bytes=size) / MIB)
    colors = {"dense": charts.MEAN_COLOR, "the plan": charts.KV_MODE_COLORS["window"]}
    if mask is not None:
        colors[mask[1]] = charts.PRUNED_COLOR
    figures.chart(charts.curves(series, title="KV cache vs context length", x_title="context (tokens)",
                                y_title="KV cache (MiB)", marker_x=context, colors=colors), "long.memory",
                  name="kv_memory")


HOW_TO_READ = """
At every step a decoder keeps the **keys and values** of every earlier token, for every KV head of every
layer: the **KV cache**. It grows with the context, and a decode step reads all of it, so at long context it
is the memory and much of the time. Three choices per KV head (a GQA model's query heads share their KV
head, so they share its choice):

- **full**: the head keeps every token. Heads that fetch a fact from far back (**retrieval heads**: their
  attention lands on the token they copy) need this.
- **window**: the head keeps the first **sink** tokens and the latest **recent** tokens, so its cache stops
  growing. Many heads (**streaming heads**) look only there anyway: they park spare attention on the first
  tokens (attention sinks) and read the local context. DuoAttention (Xiao et al. 2024) windows these.
- **prune**: the head and its query heads go (as the Prune page's groups policy cuts a KV group).

The **KV memory** is exact for the plan (keys and values of every kept token, the model's dtype, batch 1):
headscope's compact cache holds exactly that when it runs the plan (`load_planned` on an export).
The **predicted speed** is a count, not a timing: prefill by FLOPs (projections, MLPs and the attention scores
over the keys each head reads, causal), decode by the bytes a step reads (every weight and the whole cache
once), which is what bounds a decode step on most hardware. The measured speed of plans against dense is
`bench/bench_kv_policies.py` (docs/results.md); llama.cpp and ONNX Runtime run every head full (Export says so).
"""


def how_to_read() -> None:
    explain.fold("KV caches, windows and per-head plans", HOW_TO_READ)


# -- the Export page: the plan next to the model ---------------------------------------------------------

EXPORT_PLAN_TITLE = "The KV plan of the Long context page"


def export_section(lm) -> None:
    """Export page: when the Long context page set a plan, show it, offer its kv_plan.json, and a switch that
    writes it with the export (analysis.compress.export.export_to(..., kv_plan=...); `export_plan`)."""
    if not plan_is_set() or lm.kind != "causal-lm":
        return
    plan = current_plan(lm, notes=False)
    st.markdown(f"**{EXPORT_PLAN_TITLE}**: {plan.describe()}; source: {_source_words()}.")
    c1, c2 = st.columns([2, 1])
    c1.checkbox(f"Write it with the export ({KV_PLAN_FILE} next to the model)", key=state.widget_key(
        "export.with_kv_plan", value=True),
        help="The cut is the mask above; a KV head the plan prunes must be one the mask removes (fill the plan from "
             "the Prune page's mask, or prune those groups there), else the export is refused in one line. Which "
             "runtime honours the windows: each format's note after the export (headscope's PyTorch runtime "
             "does; llama.cpp and ONNX Runtime run every head full).")
    c2.download_button(f"Download {KV_PLAN_FILE}", plan.to_json(), file_name=KV_PLAN_FILE, mime="application/json",
                       key="export.kv_plan", icon=":material/download:")


def export_plan(lm) -> KVPlan | None:
    """The plan the Export page writes with the model (None: no plan set, or its switch is off)."""
    if not plan_is_set() or lm.kind != "causal-lm" or not state.kept("export.with_kv_plan", True):
        return None
    return current_plan(lm, notes=False)


# -- the Walkthrough: sinks, windows and retrieval with a real head -----------------------------------------

WALK_TOKENS = 1024            # the text's length (clipped to the model's limit)
WALK_QUERIES = 8              # the last positions whose attention is shown
NEEDLE = " The secret number of the blue door is 7341."
QUESTION = " Remember the secret number of the blue door? The secret number of the blue door is"
NEEDLE_DEPTH = 0.25


WALK_MIN_FILLER = 64          # tokens of text around the needle, at the least


def walk_needs(tokenizer) -> int:
    """The fewest tokens the walkthrough's text can have (needle, question and some text around them)."""
    return (len(tokenizer(NEEDLE, add_special_tokens=False)["input_ids"])
            + len(tokenizer(QUESTION, add_special_tokens=False)["input_ids"]) + WALK_MIN_FILLER)


def walk_text(tokenizer, n_tokens: int):
    """(ids [T], needle start, needle length): built-in text with a needle sentence at a quarter of the way
    in and its question at the end (the last query positions are the question's)."""
    import torch

    from analysis.measure.haystack import haystack, place, sentence_ends
    needle = tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    if n_tokens < walk_needs(tokenizer):
        raise InputError(f"This model reads {n_tokens} tokens, too few for the example text "
                         f"({walk_needs(tokenizer)} at least).")
    filler = haystack(tokenizer, n_tokens - len(needle) - len(question))
    ends = sentence_ends(tokenizer, filler)
    if ends.numel() and int(ends[-1]) + 1 >= WALK_MIN_FILLER:           # the question starts a sentence
        filler = filler[:int(ends[-1]) + 1]
        ends = ends[ends < filler.numel()]
    placed = place(filler, needle, NEEDLE_DEPTH, ends=ends)
    ids = torch.cat([placed.ids, torch.tensor(question, dtype=torch.long)])       # [T]
    return ids, placed.start, placed.length


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def walk_rows(key: ModelKey, n_tokens: int, window: Window, _progress=None, _should_stop=None):
    """(LastRows of the walkthrough's text, needle start, needle length, tokens)."""
    from analysis.measure.longheads import last_rows
    lm = cache.load(key)
    ids, start, length = walk_text(lm.tokenizer, n_tokens)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        rows = last_rows(lm.model, ids, queries=WALK_QUERIES, window=window, progress=_progress,
                         should_stop=_should_stop)
    return rows, start, length, [lm.tokenizer.decode([int(i)]) for i in ids]


def walkthrough_section(lm) -> None:
    """Sinks, windows and retrieval heads with a real head: where one head's attention goes from the end of
    a ~1k-token text, and what a window would change in its output."""
    st.header("6. Long context: attention sinks, windows and retrieval heads")
    if lm.kind != "causal-lm":
        st.markdown("Long context is about what a **decoder** keeps while it writes (its KV cache); this model "
                    "is not a causal language model, so this section needs one (the built-in SmolLM2).")
        return
    from components import weights
    if weights.needs_model(lm, "Reading a head's attention on a long text", stop=False):
        return
    g = lm.geometry
    n_tokens = min(WALK_TOKENS, longstate.context_limit(lm))
    if n_tokens < walk_needs(lm.tokenizer):
        st.markdown(f"This model reads at most {n_tokens} tokens, too few for this section's example text "
                    f"({walk_needs(lm.tokenizer)} tokens): long context needs a model with a longer one, such as "
                    "the built-in SmolLM2 (8,192).")
        return
    view = longstate.view_window(lm)[1]
    window = Window(view.sinks, min(view.recent, max(1, n_tokens // 4)))   # one that leaves something far back
    sinks, recent = window.sinks, window.recent
    st.markdown(f"""
A model that writes token after token keeps, for every head, the keys and values of every earlier token.
Do all heads need all of them? Take a real text of **about {n_tokens:,} tokens** (built-in Wikipedia paragraphs)
with one sentence hidden a quarter of the way in, *"{NEEDLE.strip()}"*, and a question about it at the
end. Below is where one head's attention goes from the last {WALK_QUERIES} positions (the question),
over every earlier token: its **sinks** (the first {sinks} tokens), its **recent window** (the last {recent}),
the **needle**, and everything else.""")
    run_key = (state.model_key(), n_tokens, window)
    result = cache.run_button(f"Read every head's attention on this text (about {n_tokens:,} tokens)",
                              button_key="walk.long.run", slot="walk.long", run_key=run_key, fn=walk_rows,
                              args=(state.model_key(), n_tokens, window), label="Reading the attention",
                              kind="evaluate", work=n_tokens,
                              stale_note="The window changed since ({view}); press the button again.",
                              view=f"{sinks} sinks + {recent} recent tokens")
    if result is None:
        return
    rows, start, length, tokens = result
    on_needle = rows.share(start, start + length)                         # [L, H]
    best = [tuple(int(i) for i in np.unravel_index(j, on_needle.shape)) for j in np.argsort(-on_needle.ravel())[:3]]
    st.caption("The heads that look at the needle most: " + ", ".join(
        f"layer {l} head {h} ({100 * on_needle[l, h]:.0f} %)" for l, h in best) + ". The sliders start at the first.")
    c1, c2 = st.columns(2)
    layer = int(c1.slider("Layer", 0, max(g.n_layers - 1, 1), key=state.widget_key("walk.long.layer", value=best[0][0])))
    head = int(c2.slider("Query head", 0, max(g.n_heads - 1, 1), key=state.widget_key("walk.long.head", value=best[0][1])))
    layer, head = min(layer, g.n_layers - 1), min(head, g.n_heads - 1)
    T = rows.n_tokens
    parts = rows.regions()
    needle = float(on_needle[layer, head])
    first_recent = max(T - recent, sinks)
    regions = {"sinks": (0, min(sinks, T)), "needle": (start, start + length), "recent window": (first_recent, T)}
    figures.chart(charts.attention_over_keys(rows.mass[layer, head], regions=regions, tokens=tokens,
                                             title=f"Layer {layer}, head {head}: attention from the last "
                                                   f"{WALK_QUERIES} tokens over the {T:,} keys"), "walk.long.keys")
    top = rows.top1[layer, head]                                            # [Q]
    hits = int(((top >= start) & (top < start + length)).sum())
    change = float(rows.window_change[layer, head])
    cols = st.columns(5)
    for col, (name, value) in zip(cols, (("On the sinks", parts["sinks"][layer, head]), ("On the needle", needle),
                                         ("In the recent window", parts["recent"][layer, head]),
                                         ("Everything else", max(float(parts["far"][layer, head]) - needle, 0.0)))):
        col.metric(name, f"{100 * float(value):.1f} %")
    cols[4].metric("Change if windowed", f"{100 * change:.1f} %",
                   help="||o - o_window|| / ||o|| of this head's output (before W_O) at the last positions, with "
                        f"only the {sinks} sinks and the {recent} recent tokens kept.")
    words = _head_words(parts, layer, head, needle, hits, change)
    st.markdown(words)
    figures.chart(charts.layer_head_heatmap(rows.window_change, f"Each head's output change under a window ({sinks} "
                                            f"sinks + {recent} recent)",
                                            colorbar="change", group_size=g.group_size, colorscale="Oranges"),
                  "walk.long.change")
    st.caption("Small (pale) cells are heads a window would barely change: streaming heads. The dark ones read "
               "far back: windowing them changes what they write. Pick one with the sliders above.")
    explain.fold("sinks, windows and retrieval heads", WALK_HOW_TO_READ)


def _head_words(parts: dict, layer: int, head: int, needle: float, hits: int, change: float) -> str:
    sinks, recent = float(parts["sinks"][layer, head]), float(parts["recent"][layer, head])
    lines = []
    if sinks >= 0.5:
        lines.append(f"Half or more of its attention ({100 * sinks:.0f} %) sits on the first few tokens, which "
                     "say nothing about the question: an **attention sink**, where the head parks attention it "
                     "does not need.")
    if hits:
        lines.append(f"For {hits} of the last {WALK_QUERIES} positions its strongest key is **in the needle**: it "
                     "looks up the fact from far back, like a **retrieval head**. A window would cut it off.")
    if change < 0.05:
        lines.append(f"Keeping only the sinks and the recent window changes its output by {100 * change:.1f} %: "
                     "a **streaming head**; windowing it saves memory at almost no cost.")
    elif change > 0.2:
        lines.append(f"A window would change its output by {100 * change:.0f} %: it needs the tokens far back, keep it "
                     "**full**.")
    return " ".join(lines) or (f"This head spreads its attention: {100 * sinks:.0f} % on the sinks, "
                               f"{100 * recent:.0f} % in the recent window, {100 * needle:.1f} % on the needle.")


WALK_HOW_TO_READ = """
- **The chart**: one point per earlier token (the key), how much attention this head gives it from the last
  positions (the question), on a log scale so the small values show. The shaded bands are the first tokens
  (sinks), the hidden sentence (needle) and the latest tokens (the recent window).
- **Attention sinks**: softmax attention must add up to 1, so a head with nothing to look at still puts its
  attention somewhere; many heads put it on the very first tokens. Those tokens must stay in the cache, or
  the head's arithmetic changes (Xiao et al. 2023, StreamingLLM).
- **Window**: a head that looks only at the sinks and the recent tokens can drop everything else from its
  cache: its memory stops growing with the context. **Change if windowed** compares its output with and
  without the window on this text: 0 % = it reads nothing else anyway (a streaming head).
- **Retrieval heads** (Wu et al. 2024): a few heads whose strongest attention lands on the token they copy
  from far back; masking them breaks finding a fact in a long text. They must stay full.
- The Long context page sets, head by head, full, window or prune, and shows what the choice saves.
"""
