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
    scope, ord, std, normalize, a_q, a_kv, seed, n_sequences, seq_len, damping, n_steps
              the scorer's parameters; only in the URL when they differ from the scorer's
              default (None = the scorer's default)          (?ord=1&a_kv=0.5)

On a session's first run the URL is read once (bad values are replaced by the default and
reported with how to fix them). Widgets never own these values: a widget gets its own key,
seeded from the canonical value when it (re)appears, and the page writes the widget's value
back with `set` - so values survive switching pages (Streamlit drops the keys of widgets that
are not shown). Every other control (Export's format and root, token counts, ...) keeps its
value for the session the same way: `widget_key` copies each widget's value at the start of every
run (when the keys of the page just left are still there) and seeds a widget that reappears from
that copy. trust_remote_code and the placement (device, dtype, accelerate offload) are
session-only and never read from a URL; `load_options()` is both, the cache key of the loaded
model (`components/cache.py`).

Other keys this module owns: the stop flag and stop count of long work (`stop_check`), `remember`/`recall` slots that keep
a button's result on screen across reruns (`remember_run` / `run_result` / `model_result` for the
(run key, result) pairs of `cache.run_button`, whose run keys start with the model name), and
which calibration scores were computed for which parameters (`mark_scored` / `is_scored`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import streamlit as st

from analysis.arch.models import DEFAULT_MODEL
from analysis.core.errors import shorten
from analysis.core.placement import Placement
from analysis.measure.profiles import DEFAULT_Z, SCOPES, STD_DDOF, Z_MAX
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
class Range:
    """A number in lo .. hi (an integer when `integer`): parses URL text, and bounds the widget."""
    lo: float
    hi: float
    integer: bool = False

    def __call__(self, raw: str) -> float | int:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError("it is not a number") from None
        if not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise ValueError(f"it is outside {self.lo:g} .. {self.hi:g}")
        if self.integer:
            if value != int(value):
                raise ValueError("it is not a whole number")
            return int(value)
        return value


@dataclass(frozen=True)
class Choice:
    """One of `options` (compared as text, returned as the option itself, e.g. the int 1)."""
    options: tuple

    def __call__(self, raw: str) -> Any:
        for option in self.options:
            if str(option) == str(raw).strip():
                return option
        raise ValueError(f"it is not one of {', '.join(map(str, self.options))}")


@dataclass(frozen=True)
class Field:
    default: Any
    parse: Callable[[str], Any]     # URL text -> value; ValueError says why it is bad
    fmt: Callable[[Any], str] = str
    follows: str = ""               # when not chosen, the value follows the model (what the note says)


def _scorer(raw: str) -> str:
    """A registered scorer's name (the registry as it is now: scorers can be registered at run time)."""
    return Choice(tuple(scoring.SCORERS))(_text(raw))


def _num_text(value: Any) -> str:
    return f"{float(value):g}" if isinstance(value, float) else str(value)


# Scorer parameters a link may carry (None = the scorer's default). components/controls.py draws their
# widgets with these options and bounds, so the URL and the widgets accept the same values.
SCORER_PARAMS: dict[str, Field] = {
    "scope": Field(None, Choice(SCOPES)),
    "ord": Field(None, Choice((2, 1))),
    "std": Field(None, Choice(tuple(STD_DDOF))),
    "normalize": Field(None, Choice(tuple(scoring.NORMALIZATIONS))),
    "a_q": Field(None, Range(0.0, 10.0), _num_text),
    "a_kv": Field(None, Range(0.0, 10.0), _num_text),
    "seed": Field(None, Range(0, 2**31 - 1, integer=True)),
    "n_sequences": Field(None, Range(1, 64, integer=True)),
    "seq_len": Field(None, Range(8, 1024, integer=True)),
    "damping": Field(None, Range(1e-6, 1.0), _num_text),
    "n_steps": Field(None, Range(1, 64, integer=True)),
}


FIELDS: dict[str, Field] = {
    "model": Field(DEFAULT_MODEL, _text),
    "scorer": Field(DEFAULT_SCORER, _scorer, follows="the model's default scorer"),
    "z": Field(float(DEFAULT_Z), Range(0.0, float(Z_MAX)), lambda v: f"{float(v):g}"),
    "sparsity": Field(DEFAULT_SPARSITY, Range(0.0, SPARSITY_MAX), lambda v: f"{float(v):g}"),
    "page": Field("", _text),
    "policy": Field(DEFAULT_POLICY, Choice(masks.POLICIES), follows="the model's default policy"),
    "m": Field(None, Range(0, 1024, integer=True)),
    "kv_policy": Field(masks.KV_POLICIES[0], Choice(masks.KV_POLICIES)),
    **SCORER_PARAMS,
}


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
            using = field.follows or ("the scorer's default" if field.default is None else field.fmt(field.default))
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

# How a model is loaded, as a cache key: (trust_remote_code, device, dtype, device_map, max_memory,
# offload_folder), or a bare bool (trust_remote_code, default placement; what tests pass).
LoadHow = tuple | bool


def placement() -> Placement:
    """The placement picked on the Model page (default: device auto, dtype auto)."""
    return st.session_state.get(_PLACEMENT) or Placement()


def set_placement(value: Placement) -> None:
    st.session_state[_PLACEMENT] = value


def load_options() -> LoadHow:
    """What `cache.load` is keyed by: trust_remote_code alone while the placement is the default,
    else (trust_remote_code, device, dtype, device_map, max_memory, offload_folder); for a checkpoint
    opened weights only, (WEIGHTS_ONLY, trust_remote_code)."""
    if weights_only():
        return (WEIGHTS_ONLY, trust())
    p = placement()
    if p == Placement():
        return trust()
    return (trust(), p.device, p.dtype, p.device_map, p.max_memory, p.offload_folder)


def load_parts(how: LoadHow) -> tuple[bool, dict]:
    """(trust_remote_code, load_model placement keywords) of a `load_options()` tuple or a bool."""
    if isinstance(how, bool):
        p = Placement()
        return how, dict(device=p.device, dtype=p.dtype)
    trust_, device, dtype, device_map, max_memory, offload_folder = how
    return bool(trust_), dict(device=device, dtype=dtype, device_map=device_map, max_memory=max_memory,
                              offload_folder=offload_folder)


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


def remember_run(slot: str, run_key: tuple, result: Any) -> None:
    """Keep a button-run's result with the key of the inputs it was computed for (model name first)."""
    remember(slot, (run_key, result))


def last_run(slot: str) -> tuple[tuple, Any] | None:
    """(run key, result) of the last run kept in `slot`, or None."""
    return recall(slot)


def run_result(slot: str, run_key: tuple) -> Any:
    """The result kept in `slot` if it was computed for exactly `run_key`, else None."""
    kept = last_run(slot)
    return kept[1] if kept and kept[0] == run_key else None


def model_result(slot: str, model: str) -> Any:
    """The result kept in `slot` if it was computed on `model` (whatever its other inputs), else None."""
    kept = last_run(slot)
    return kept[1] if kept and kept[0][0] == model else None


def _scored_slot(model: str, scorer: str) -> str:
    return f"scored.{model}.{scorer}"


def mark_scored(model: str, scorer: str, params_key: tuple) -> None:
    """Note that `scorer`'s (calibration) scores on `model` were computed for `params_key`."""
    remember(_scored_slot(model, scorer), params_key)


def is_scored(model: str, scorer: str, params_key: tuple) -> bool:
    """Whether `mark_scored` noted these parameters (so the cached scores can be shown without a click)."""
    return recall(_scored_slot(model, scorer)) == params_key


# -- a checkpoint folder opened weights only (session only) -------------------------------------

WEIGHTS_ONLY = "weights-only"     # first item of load_options() for such a checkpoint (cache.load's key)
_WEIGHTS_ONLY = PREFIX + "weights_only"


def weights_only() -> bool:
    """Whether the current model (a checkpoint folder) is open weights only: no model built."""
    return bool(get("model")) and st.session_state.get(_WEIGHTS_ONLY) == get("model")


def set_weights_only(value: bool) -> None:
    """Open the current model weights only (True) or load it as a model (False)."""
    st.session_state[_WEIGHTS_ONLY] = get("model") if value else None


def is_weights_only_how(how: LoadHow) -> bool:
    return isinstance(how, tuple) and bool(how) and how[0] == WEIGHTS_ONLY
