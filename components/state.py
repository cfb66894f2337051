"""The app's view state: the ONE module that owns session-state keys and the URL's query parameters.

The shared view is five fields, kept in `st.session_state` under "hs.<field>" and mirrored into
the URL's query parameters on every run so a view can be shared and reloaded:

    model     built-in name, Hugging Face id or local folder   (?model=smollm2-135m)
    scorer    scorer name                                     (?scorer=mp)
              until the link or the user picks one, the loaded model's default
              (analysis.score.scoring.default_scorer: MP-G on GQA models, MP on MHA)
    z         MP threshold multiplier, 0 .. Z_MAX             (?z=2.0)
    sparsity  fraction of heads to prune, 0 .. 0.95             (?sparsity=0.3)
    page      the page's url path                             (?page=prune)

On a session's first run the URL is read once (bad values are replaced by the default and
reported with how to fix them). Widgets never own these values: a widget gets its own key,
seeded from the canonical value when it (re)appears, and the page writes the widget's value
back with `set` - so values survive switching pages (Streamlit drops the keys of widgets that
are not shown). trust_remote_code and the placement (device, dtype, accelerate offload) are
session-only and never read from a URL; `load_options()` is both, the cache key of the loaded
model (`components/cache.py`).

Other keys this module owns: the stop flag of long work, `remember`/`recall` slots that keep
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
from analysis.core.placement import Placement
from analysis.measure.profiles import DEFAULT_Z, Z_MAX

DEFAULT_SCORER = "mp-g"  # the default model is GQA; `follow_model_scorer` adapts it to the loaded model
DEFAULT_SPARSITY = 0.3
SPARSITY_MAX = 0.95  # analysis.score.masks refuses 1.0 (every head pruned)
PREFIX = "hs."
WIDGET_PREFIX = "hs.w."
_URL_READ = PREFIX + "url_read"
_STOP = PREFIX + "stop"
_MEMO = PREFIX + "memo."
_NOTES = PREFIX + "url_notes"
_TRUST = PREFIX + "trust"
_PLACEMENT = PREFIX + "placement"
_SCORER_CHOSEN = PREFIX + "scorer_chosen"
_STOPPED = PREFIX + "stopped"
_STOP_SEEN = PREFIX + "stop_seen"


TEXT_MAX = 1000  # a model id, folder or page name from a link; longer is not a real one


def _text(raw: str) -> str:
    value = str(raw).strip()
    if not value:
        raise ValueError("it is empty")
    if len(value) > TEXT_MAX or not value.isprintable():
        raise ValueError(f"it is longer than {TEXT_MAX} characters or holds control characters")
    return value


def _number(lo: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError("it is not a number") from None
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ValueError(f"it is outside {lo:g} .. {hi:g}")
        return value
    return parse


@dataclass(frozen=True)
class Field:
    default: Any
    parse: Callable[[str], Any]     # URL text -> value; ValueError says why it is bad
    fmt: Callable[[Any], str] = str


FIELDS: dict[str, Field] = {
    "model": Field(DEFAULT_MODEL, _text),
    "scorer": Field(DEFAULT_SCORER, _text),
    "z": Field(float(DEFAULT_Z), _number(0.0, float(Z_MAX)), lambda v: f"{float(v):g}"),
    "sparsity": Field(DEFAULT_SPARSITY, _number(0.0, SPARSITY_MAX), lambda v: f"{float(v):g}"),
    "page": Field("", _text),
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
            if name == "scorer":
                ss[_SCORER_CHOSEN] = True
        except ValueError as why:
            notes.append(f"The link's {name}={raw!r} was ignored because {why}; using {field.fmt(field.default)}. "
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

    For a view field the seed is its canonical value; for a local name, `value`."""
    key = _widget(name)
    if key not in st.session_state:
        st.session_state[key] = get(name) if name in FIELDS else value
    return key


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
    """Forget a widget's own value so it is seeded again from the canonical one."""
    st.session_state.pop(_widget(name), None)


def follow_url_page(current, pages: dict) -> None:
    """On the first run, a `?page=` naming another page switches to it (keeping the parameters)."""
    ss = st.session_state
    if ss.get(PREFIX + "page_followed"):
        return
    ss[PREFIX + "page_followed"] = True
    wanted = str(get("page") or "")
    if wanted and wanted in pages and pages[wanted].url_path != current.url_path:
        st.switch_page(pages[wanted], query_params=dict(st.query_params))


# -- the scorer: the model's default until someone picks one -----------------------------------

def follow_model_scorer(default: str) -> None:
    """Use the loaded model's default scorer while neither the link nor the user has chosen one."""
    if st.session_state.get(_SCORER_CHOSEN) or get("scorer") == default:
        return
    set("scorer", default)
    reset_widget("scorer")


def choose_scorer(name: str) -> None:
    """The user picked `name`: from now on it is kept when the model changes."""
    if name != get("scorer"):
        st.session_state[_SCORER_CHOSEN] = True
    set("scorer", name)


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


def should_stop() -> bool:
    return bool(st.session_state.get(_STOP, False))


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


def remember_mask(model: str, scorer: str, params: dict, sparsity: float, policy: dict) -> None:
    """Keep the Prune page's mask settings, so other pages build the same mask."""
    remember("mask", dict(model=model, scorer=scorer, params=params, sparsity=sparsity, policy=policy))


def mask_settings(model: str, scorer: str) -> tuple[dict, dict] | None:
    """(params, policy) last set on the Prune page for this model and scorer, else None (copies)."""
    last = recall("mask") or {}
    if last.get("model") == model and last.get("scorer") == scorer:
        return dict(last["params"]), dict(last["policy"])
    return None


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
