"""The app's view state: the ONE module that owns session-state keys and the URL's query parameters.

The shared view is the fields below, kept in `st.session_state` under "hs.<field>" and mirrored into
the URL's query parameters on every run so a view can be shared and reloaded (a link reproduces
the mask: scorer, its parameters, z, sparsity, policy, kv_policy):

    model     built-in name, Hugging Face id or local folder   (?model=smollm2-135m)
    scorer    scorer name                                     (?scorer=mp)
              until the link or the user picks one, the loaded model's default
              (analysis.score.scoring.default_scorer: MP-G on GQA models, MP on MHA)
    z         MP threshold multiplier, 0 .. Z_MAX             (?z=2.0)
    sparsity  fraction of heads to prune, 0 .. 0.95             (?sparsity=0.3)
    page      the page's url path                             (?page=prune)
    policy    mask policy (analysis.score.masks.POLICIES)     (?policy=groups)
              until the link or the user picks one, the model's default
              (analysis.score.masks.default_policy: groups on GQA models, global on MHA)
    m         min-per-layer's m (only in the URL when set)     (?m=2)
    kv_policy how surgery handles uneven GQA groups           (?kv_policy=auto)
    context, sinks, recent   the Long context page's context length and the window's band
              (only in the URL when set; None = the page's default)   (?context=8192&sinks=4&recent=512)
    plan      where the KV plan came from (PLAN_SOURCES)      (?plan=mask)
    kv        the KV plan itself, one letter per KV head (f full, w window, p prune), layers
              separated by "." (only in the URL while some head is not full)   (?kv=fwf.ppf.fff)
    scope, ord, std, normalize, a_q, a_kv, seed, n_sequences, seq_len, damping, n_steps, ...
              the scorer parameters the app offers (declared with a label: `Scorer.parameters`,
              analysis/core/params.py), from the registry as it is; only in the URL when they
              differ from the scorer's default (None = the scorer's default)   (?ord=1&a_kv=0.5)

On a session's first run the URL is read once (bad values are replaced by the default and
reported with how to fix them). Widgets never own these values: a widget gets its own key,
seeded from the canonical value when it (re)appears, and the page writes the widget's value
back with `set` - so values survive switching pages (Streamlit drops the keys of widgets that
are not shown). Every other control (Export's format and root, token counts, ...) keeps its
value for the session the same way: `widget_key` copies each widget's value at the start of every
run (when the keys of the page just left are still there) and seeds a widget that reappears from
that copy. trust_remote_code and the placement (device, dtype, accelerate offload) are
session-only and never read from a URL; `model_key()` is the model's name with both (and whether
it is open weights only): the one key of the loaded model and of everything cached per model
(`components/cache.py`).

Other keys this module owns: the stop flag and stop count of long work (`stop_check`), `remember`/`recall` slots that keep
a button's result on screen across reruns (`remember_run` / `run_result` / `run_view` for the
(run key, result) pairs of `cache.run_button`, whose run keys start with the model name), and
which calibration scores were computed for which parameters (`mark_scored` / `is_scored`), and the Long
context page's plan (`set_plan`, `adopt_plan`: the grid starts again from a replaced plan) with the names of
the slots and widgets more than one of its sections reads (`PLAN_NOTE`, `LONG_PRECISION`, `PROBE_*`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator

import streamlit as st

from analysis.arch.kvplan import KV_MODES
from analysis.arch.models import DEFAULT_MODEL
from analysis.core.errors import shorten
from analysis.core.params import Choice, Range
from analysis.core.placement import Placement
from analysis.measure.profiles import Z_MAX
from analysis.score import masks, scoring

DEFAULT_SCORER = "mp-g"  # the default model is GQA; `follow_model` adapts it to the loaded model
DEFAULT_SPARSITY = 0.3
DEFAULT_POLICY = masks.default_policy(3)  # the default model has G = 3 (groups); `follow_model` adapts it
SPARSITY_MAX = 0.95  # analysis.score.masks refuses 1.0 (every head pruned)
PREFIX = "hs."
WIDGET_PREFIX = "hs.w."
_URL_READ = PREFIX + "url_read"
_STOP = PREFIX + "stop"
_MEMO = PREFIX + "memo."
_NOTES = PREFIX + "url_notes"
_TRUST = PREFIX + "trust"
_PLACEMENT = PREFIX + "placement"
_STOPPED = PREFIX + "stopped"
_STOP_SEEN = PREFIX + "stop_seen"
_STOP_COUNT = PREFIX + "stop_count"
_CHOSEN = PREFIX + "chosen."        # + field: the link or the user picked it (it no longer follows the model)
_KEPT = PREFIX + "kept."            # + widget name: its value, kept while its page is not shown
_SEEDED = PREFIX + "seeded"         # names of the widgets `widget_key` seeded (whose values are kept)


TEXT_MAX = 1000  # a model id, folder or page name from a link; longer is not a real one


def _text(raw: str) -> str:
    value = str(raw).strip()
    if not value:
        raise ValueError("it is empty")
    if len(value) > TEXT_MAX or not value.isprintable():
        raise ValueError(f"it is longer than {TEXT_MAX} characters or holds control characters")
    return value


@dataclass(frozen=True)
class Field:
    default: Any
    parse: Callable[[str], Any]     # URL text -> value; ValueError says why it is bad
    fmt: Callable[[Any], str] = str
    follows: str = ""               # when not chosen, the value follows the model (what the note says)
    using: str = ""                 # what a bad link value is replaced by, in words (when the default is None)


def _scorer(raw: str) -> str:
    """A registered scorer's name (the registry as it is now: scorers can be registered at run time)."""
    return Choice(tuple(scoring.SCORERS))(_text(raw))


def _policy(raw: str) -> str:
    """A registered mask policy's name (the registry as it is now: policies can be registered at run time)."""
    return Choice(tuple(masks.POLICIES))(_text(raw))


# -- the Long context page's view: the context, the window's band and the KV plan ---------------------
DEFAULT_CONTEXT = 4096         # tokens (at most the model's own limit)
CONTEXT_MAX = 2**20            # what a link may carry; the page's box stops at the model's limit
KV_LETTERS = "".join(m.letter for m in KV_MODES)   # by code: f full, w window, p prune (analysis.arch.kvplan)
KV_TEXT_MAX = 20_000           # letters of a plan in a link (a 126-layer x 16-KV-head model needs ~2,150)
PLAN_SOURCES = {"full": "every KV head full (the dense model)", "mask": "the Prune page's mask",
                "duo": "a DuoAttention pattern (full_attention_heads.tsv)",
                "edited": "edited by hand", "file": "a kv_plan.json file",
                "scores": "the heads' streaming / retrieval / importance scores",
                "frontier": "a plan of the KV frontier (docs/data/plans: chosen on calibration rows)"}


def _kv_text(raw: str) -> str:
    """A KV plan as link text: rows of f / w / p, one per layer, separated by "."."""
    value = str(raw).strip()
    if not value or len(value) > KV_TEXT_MAX:
        raise ValueError(f"it is empty or longer than {KV_TEXT_MAX} characters")
    rows = value.split(".")
    if any(not row or row.strip(KV_LETTERS) for row in rows):             # (`set` is this module's verb)
        raise ValueError("it holds other letters than " + ", ".join(f"{m.letter} ({m.name})" for m in KV_MODES)
                         + " in rows split by '.'")
    if len({len(row) for row in rows}) != 1:
        raise ValueError("its layers list different numbers of KV heads")
    return value


def kv_text(modes) -> str | None:
    """The link text of modes [L, Hkv] (KV_MODES' codes); None when every head is full."""
    import numpy as np
    m = np.asarray(modes)
    if not m.any():
        return None
    return ".".join("".join(KV_LETTERS[int(c)] for c in row) for row in m)


def kv_modes(text: str | None, shape: tuple[int, int]):
    """modes [L, Hkv] int8 of link text (None: all full); ValueError when it is not of `shape`."""
    import numpy as np
    if text is None:
        return np.zeros(shape, np.int8)
    rows = _kv_text(text).split(".")
    if (len(rows), len(rows[0])) != tuple(shape):
        raise ValueError(f"it is a plan of {len(rows)} layers x {len(rows[0])} KV heads, and this model has "
                         f"{shape[0]} x {shape[1]}")
    return np.array([[KV_LETTERS.index(c) for c in row] for row in rows], np.int8)


# The view's own fields; z is the threshold scorers' declared `z` (analysis.score.scoring.Z), shared by them.
VIEW_FIELDS: dict[str, Field] = {
    "model": Field(DEFAULT_MODEL, _text),
    "scorer": Field(DEFAULT_SCORER, _scorer, follows="the model's default scorer"),
    "z": Field(float(scoring.Z.default), scoring.Z.parse, scoring.Z.text),
    "sparsity": Field(DEFAULT_SPARSITY, Range(0.0, SPARSITY_MAX), lambda v: f"{float(v):g}"),
    "page": Field("", _text),
    "policy": Field(DEFAULT_POLICY, _policy, follows="the model's default policy"),
    "m": Field(None, Range(0, 1024, integer=True)),
    "kv_policy": Field(masks.KV_POLICIES[0], Choice(masks.KV_POLICIES)),
    "context": Field(None, Range(1, CONTEXT_MAX, integer=True), using=f"{DEFAULT_CONTEXT:,} tokens (at most the "
                                                                       "model's)"),
    "sinks": Field(None, Range(0, CONTEXT_MAX, integer=True), using="the default"),
    "recent": Field(None, Range(1, CONTEXT_MAX, integer=True), using="the default"),
    "plan": Field(None, Choice(tuple(PLAN_SOURCES)), using="the plan as it is"),
    "kv": Field(None, _kv_text, using="every KV head full"),
}


@lru_cache(maxsize=8)
def _scorer_fields(scorers: tuple) -> dict[str, Field]:
    """A field per scorer parameter the app offers (declared with a label; None = the scorer's default):
    the link and the widget (components/controls.py) read the same declaration, so they accept the
    same values. The first scorer declaring a name gives its bounds."""
    out: dict[str, Field] = {}
    for cls in scorers:
        for name, declared in scoring.scorer_declarations(cls.name).items():
            if declared.offered and name not in VIEW_FIELDS:
                out.setdefault(name, Field(None, declared.parse, declared.text))
    return out


class _Fields(Mapping):
    """Every view field: VIEW_FIELDS, then the scorer parameters of the registry as it is now."""

    def _all(self) -> dict[str, Field]:
        return {**VIEW_FIELDS, **_scorer_fields(tuple(scoring.SCORERS.values()))}

    def __getitem__(self, name: str) -> Field:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


FIELDS: Mapping[str, Field] = _Fields()


def _key(name: str) -> str:
    if name not in FIELDS:
        raise KeyError(f"unknown view field {name!r}; known: {', '.join(FIELDS)}")
    return PREFIX + name


def init() -> None:
    """Call once per run, first thing: seed defaults, and on the session's first run read the URL."""
    ss = st.session_state
    for name, field in FIELDS.items():
        ss.setdefault(_key(name), field.default)
    _age_stop()
    _keep_widget_values()
    if ss.get(_URL_READ):
        return
    ss[_URL_READ] = True
    notes = []
    for name, field in FIELDS.items():
        if name not in st.query_params:
            continue
        raw = st.query_params[name]
        try:
            ss[_key(name)] = field.parse(raw)
            if field.follows:
                ss[_CHOSEN + name] = True
        except ValueError as why:
            using = field.follows or field.using or (
                "the scorer's default" if field.default is None else field.fmt(field.default))
            notes.append(f"The link's {name}={shorten(repr(raw), 80)} was ignored because {why}; using {using}. "
                         f"Fix the `{name}=` part of the URL or pick a value with the controls.")
    ss[_NOTES] = notes


def url_notes() -> list[str]:
    """Problems found in the URL on the first run (shown once by app.py, then cleared)."""
    return st.session_state.pop(_NOTES, [])


def get(name: str) -> Any:
    return st.session_state.get(_key(name), FIELDS[name].default)


def set(name: str, value: Any) -> None:  # noqa: A001 - the verb of this module
    """Store a view value and mirror it into the URL (written only when it changes)."""
    st.session_state[_key(name)] = value
    if value is None:                   # "the default": not in the URL
        if name in st.query_params:
            del st.query_params[name]
        return
    text = FIELDS[name].fmt(value)
    if st.query_params.get(name) != text:
        st.query_params[name] = text


def sync_url() -> None:
    """Write every view field into the URL (called each run: page switches may drop parameters)."""
    for name in FIELDS:
        set(name, get(name))


def _widget(name: str) -> str:
    """A view field's widget key is per page: two pages' z sliders are different widgets.

    Quirk handled here: with ONE key shared by the z sliders of Profiles, Prune and Compare, a
    direct sidebar switch between two of them made the browser's frontend hand the arriving
    slider its minimum (0.00), which was then written back into the canonical value and the URL.
    A key of its own per page is absent on arrival (Streamlit drops keys of widgets not shown),
    so it is seeded from the canonical value."""
    if name in FIELDS:
        return f"{WIDGET_PREFIX}{get('page') or '_'}.{name}"
    return WIDGET_PREFIX + name


def widget_key(name: str, *, value: Any = None) -> str:
    """Key for the widget that edits view field `name` (or any page-local name), seeded when absent.

    For a view field the seed is its canonical value (`value` while that is None, e.g. a scorer
    parameter at its default); for a local name, the value it had when its page was last shown, else
    `value`."""
    key = _widget(name)
    ss = st.session_state
    if key not in ss:
        if name in FIELDS:
            ss[key] = value if get(name) is None else get(name)
        else:
            ss[key] = ss.get(_KEPT + name, value)
    if name not in FIELDS:
        ss.setdefault(_SEEDED, {})[name] = True
    return key


def kept(name: str, default: Any = None) -> Any:
    """The value of page-local widget `name` wherever it was last shown (e.g. Export's root, read by
    the Pipeline page), else `default`."""
    ss = st.session_state
    return ss.get(_widget(name), ss.get(_KEPT + name, default))


def _keep_widget_values() -> None:
    """Called by init: copy every seeded widget's value while its key still exists (the keys of the
    page just left are dropped at the end of this run), so `widget_key` can seed it when it reappears."""
    ss = st.session_state
    for name in ss.get(_SEEDED, ()):
        key = _widget(name)
        if key in ss:
            ss[_KEPT + name] = ss[key]


def unseeded_widget_key(name: str) -> str:
    """Key for a widget whose value cannot be set through session state (a file uploader)."""
    return _widget(name)


def following_widget_key(name: str, default: str) -> str:
    """Key for a text widget whose default follows other settings until the user edits it.

    While the widget still shows the default it got last run, a new default replaces it (the
    export folder name follows the format, scorer and sparsity); a value the user typed stays."""
    key = widget_key(name, value=default)
    last = _MEMO + "default." + name
    ss = st.session_state
    if ss.get(last) is not None and ss[key] == ss[last]:
        ss[key] = default
    ss[last] = default
    return key


def reset_widget(name: str) -> None:
    """Forget a widget's own value so it is seeded again from the canonical one (or its default)."""
    st.session_state.pop(_widget(name), None)
    st.session_state.pop(_KEPT + name, None)


def follow_url_page(current, pages: dict) -> None:
    """On the first run, a `?page=` naming another page switches to it (keeping the parameters)."""
    ss = st.session_state
    if ss.get(PREFIX + "page_followed"):
        return
    ss[PREFIX + "page_followed"] = True
    wanted = str(get("page") or "")
    if wanted and wanted in pages and pages[wanted].url_path != current.url_path:
        st.switch_page(pages[wanted], query_params=dict(st.query_params))


# -- scorer and policy: the model's default until someone picks one ------------------------------

def follow_model(name: str, default: Any) -> None:
    """Use the loaded model's default for field `name` (scorer, policy) while neither the link nor
    the user has chosen one."""
    if st.session_state.get(_CHOSEN + name) or get(name) == default:
        return
    set(name, default)
    reset_widget(name)


def choose(name: str, value: Any) -> None:
    """The user picked `value` for `name` (scorer, policy): from now on it is kept when the model changes."""
    if value != get(name):
        st.session_state[_CHOSEN + name] = True
    set(name, value)


# -- trust_remote_code (session only) ----------------------------------------------------------

def trust() -> bool:
    return bool(st.session_state.get(_TRUST, False))


def set_trust(value: bool) -> None:
    st.session_state[_TRUST] = bool(value)


# -- placement: device, dtype, offload (session only) -------------------------------------------

@dataclass(frozen=True)
class ModelKey:
    """What a loaded model is cached by (`cache.load` and every cached call per model): the name, and how
    it is loaded. Frozen and hashable; a checkpoint opened weights only is its own entry."""
    name: str
    trust: bool = False                      # trust_remote_code
    placement: Placement = Placement()       # device, dtype, accelerate placement
    weights_only: bool = False               # a checkpoint folder opened without building the model

    def load_kwargs(self) -> dict:
        """analysis.arch.models.load_model's placement keywords."""
        p = self.placement
        return dict(device=p.device, dtype=p.dtype, device_map=p.device_map, max_memory=p.max_memory,
                    offload_folder=p.offload_folder)


def placement() -> Placement:
    """The placement picked on the Model page (default: device auto, dtype auto)."""
    return st.session_state.get(_PLACEMENT) or Placement()


def set_placement(value: Placement) -> None:
    st.session_state[_PLACEMENT] = value


def model_key() -> ModelKey:
    """The current model's cache key: its name, trust_remote_code and the placement; for a checkpoint
    opened weights only, the name and trust_remote_code (no placement: nothing is loaded)."""
    if weights_only():
        return ModelKey(get("model"), trust(), weights_only=True)
    return ModelKey(get("model"), trust(), placement())


# -- stopping long work ------------------------------------------------------------------------

def request_stop(work: str = "") -> None:
    """on_click of a Stop button: the rerun it triggers interrupts the work; the flag ends it.

    The flag lives for the click's own rerun (work started again in that run ends at once as
    cancelled) and is cleared at the start of the next run, so the next press runs normally.
    `work` is remembered for one `stopped_note`."""
    st.session_state[_STOP] = True
    st.session_state[_STOPPED] = work
    st.session_state[_STOP_COUNT] = st.session_state.get(_STOP_COUNT, 0) + 1


def should_stop() -> bool:
    return bool(st.session_state.get(_STOP, False))


def stop_check() -> Callable[[], bool]:
    """The `should_stop` for work that starts now: true in a Stop press's own rerun, and once any Stop
    is pressed after this call, however many runs later.

    Quirk handled here: with fast reruns, the run a Stop press interrupts keeps its thread (and the
    model's lock) until its next Streamlit call, which a long batch can delay by many seconds; the
    flag alone lives only until the next run (a press of another button clears it), so that thread
    never saw it and held the lock. The stop count never goes back, so the old thread's check
    between batches sees the press and ends, and the next run gets the lock at once."""
    ss = st.session_state
    start = ss.get(_STOP_COUNT, 0)
    return lambda: bool(ss.get(_STOP, False)) or ss.get(_STOP_COUNT, 0) > start


def clear_stop() -> None:
    st.session_state[_STOP] = False


def _age_stop() -> None:
    """Called by init: a stop flag set before the previous run has done its job; clear it."""
    ss = st.session_state
    if ss.pop(_STOP_SEEN, False):
        ss[_STOP] = False
    elif ss.get(_STOP):
        ss[_STOP_SEEN] = True


def stopped_note() -> str | None:
    """Once, on the run after a Stop: the note that says what was stopped (then forgotten)."""
    work = st.session_state.pop(_STOPPED, None)
    if work is None:
        return None
    return (f"Stopped: {work or 'the computation'}. Nothing partial was kept; results finished before "
            "the stop stay cached. Press its button to run it again.")


# -- results kept across reruns ----------------------------------------------------------------

def remember(slot: str, value: Any) -> None:
    """Keep a value (e.g. the parameters of the last button-triggered computation) for later runs."""
    st.session_state[_MEMO + slot] = value


def recall(slot: str, default: Any = None) -> Any:
    return st.session_state.get(_MEMO + slot, default)


def forget(slot: str) -> None:
    st.session_state.pop(_MEMO + slot, None)


def remember_run(slot: str, run_key: tuple, result: Any, *, view: str = "") -> None:
    """Keep a button-run's result with the key of the inputs it was computed for (model name first),
    and `view`, the words that say which view that was (for the note shown once it is stale)."""
    remember(slot, (run_key, result))
    remember(slot + ".view", view)


def run_view(slot: str) -> str:
    """The words `remember_run` kept for the view of the result in `slot` ("" when none)."""
    return recall(slot + ".view", "")


def last_run(slot: str) -> tuple[tuple, Any] | None:
    """(run key, result) of the last run kept in `slot`, or None."""
    return recall(slot)


def run_result(slot: str, run_key: tuple) -> Any:
    """The result kept in `slot` if it was computed for exactly `run_key`, else None."""
    kept = last_run(slot)
    return kept[1] if kept and kept[0] == run_key else None


def _scored_slot(model: str, scorer: str) -> str:
    return f"scored.{model}.{scorer}"


def mark_scored(model: str, scorer: str, params_key: tuple) -> None:
    """Note that `scorer`'s (calibration) scores on `model` were computed for `params_key`."""
    remember(_scored_slot(model, scorer), params_key)


def is_scored(model: str, scorer: str, params_key: tuple) -> bool:
    """Whether `mark_scored` noted these parameters (so the cached scores can be shown without a click)."""
    return recall(_scored_slot(model, scorer)) == params_key


# -- a checkpoint folder opened weights only (session only) -------------------------------------

_WEIGHTS_ONLY = PREFIX + "weights_only"


def weights_only() -> bool:
    """Whether the current model (a checkpoint folder) is open weights only: no model built."""
    return bool(get("model")) and st.session_state.get(_WEIGHTS_ONLY) == get("model")


def set_weights_only(value: bool) -> None:
    """Open the current model weights only (True) or load it as a model (False)."""
    st.session_state[_WEIGHTS_ONLY] = get("model") if value else None



# -- the Long context page's plan grid (st.data_editor) ---------------------------------------------

_KV_EDITOR = PREFIX + "kv_editor"   # (version, the plan's link text when the current editor was made)


def kv_editor() -> tuple[str, str | None]:
    """(key, base) of the plan grid: the editor's widget key and the plan (link text, None = all full) it
    shows under its edits. A new editor (first shown, shown again after a page switch dropped its key, or
    after `new_kv_editor`) starts from the plan as it is now, with no edits; while it lives its cell edits
    pile up on that base in the browser, so a key press in the grid never remounts it."""
    ss = st.session_state
    version, base = ss.get(_KV_EDITOR, (0, None))
    key = f"{WIDGET_PREFIX}long.grid.{version}"
    if key not in ss:
        base = get("kv")
        ss[_KV_EDITOR] = (version, base)
    return key, base


def new_kv_editor() -> None:
    """The plan was replaced (a fill button, an uploaded file, another model): the next grid starts from it."""
    ss = st.session_state
    version, _ = ss.get(_KV_EDITOR, (0, None))
    ss.pop(f"{WIDGET_PREFIX}long.grid.{version}", None)
    ss[_KV_EDITOR] = (version + 1, None)


# -- the Long context page's plan and the names its sections share ------------------------------------

PLAN_NOTE = "long.note"             # slot: a fill's or an upload's refusal, shown once under the grid
PLAN_NOTES = "long.notes"           # slot: (plan link text, the notes of the plan the heads' scores made)
LONG_PRECISION = "long.precision"   # widget: the precision of every long pass of the page
PROBE_NAMES, PROBE_LENGTH = "long.probes.names", "long.probes.length"          # widgets: the probes section's
PROBE_DEPTHS, PROBE_SEQUENCES = "long.probes.depths", "long.probes.sequences"  # boxes, read by the shared scan


def set_plan(modes, source: str) -> None:
    """modes [L, Hkv] become the view's plan (source: a key of PLAN_SOURCES); the grid starts again from it."""
    set("kv", kv_text(modes))
    set("plan", source)
    new_kv_editor()
    forget(PLAN_NOTE)


def adopt_plan(plan, source: str, limit: int) -> None:
    """A KVPlan from elsewhere (a kv_plan.json, a DuoAttention pattern) becomes the view's plan, with its window
    (each number within the model's limit `limit`). source: a key of PLAN_SOURCES."""
    set_plan(plan.modes, source)
    for name, value in plan.window.as_dict().items():
        set(name, min(int(value), limit))
        reset_widget(name)
