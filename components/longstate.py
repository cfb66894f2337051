"""What the Long context page's sections stand on: the model's context, the probes' settings, the precision, the
long passes measured once and their stored results, and the store's Clear button.

The sections (components/longctx.py: the plan; longscan.py: the fills from the heads' scores; longprobes.py: the
probes; ruler.py: RULER; duo.py: DuoAttention patterns) import this module and never one another; the session keys
they share are named in components/state.py.

One set of dense passes over the rows of the page's long-context probes ("What the plan keeps at long context":
probes, tokens per row, depths, sequences) gives the heads' scores the grid fills from (streaming, retrieval)
and the probes' dense side (analysis.measure.longpass.long_scan); the KV groups' importance is its own short
ablation; the long detectors (retrieval, streaming, retrieval-aware) run on their own rows, shared with the Heads
page. Each is kept on disk by analysis.score.longscan (through analysis.arch.stored.remembered, the one
function the CLI uses too): a result this machine already holds for this model, these settings and this code is
shown at once, without a button (a second visit, a restart, a class warmed by `headscope cache warm`); anything
else is one button with its expected time (rows x this machine's seconds per row, `per_row`, then the measured
pace of earlier runs: components/jobs.py PREDICTED_SECONDS) and a Stop.

The cached calls look in the store before they take the model's lock, so a stored result neither waits behind
another job nor counts as a run of the job's pace. The precision (float32, or bfloat16 where the CPU multiplies
it natively) is one radio for every long pass of the page. A section's own cached call that holds stored results
says so with `@forgotten_with_store`, and the Clear button (`forget_button`) empties it with the store.
"""
from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS, Window
from analysis.measure.long_options import DEFAULT_DEPTHS, PAGE_LENGTH, PAGE_PROBES, PAGE_SEQUENCES, PRECISION_CHOICES

from analysis.measure.splits import TEST

from . import cache, state
from .state import ModelKey

_PRECISION_WORDS = {"float32": "float32 (the reference)", "bfloat16": "bfloat16 (faster on this CPU)"}


# -- the view's context and window, the settings the long passes share ---------------------------------------

def context_limit(lm) -> int:
    """The longest context the model reads (its config's max_position_embeddings or equivalent)."""
    from analysis.measure.evaluation import context_length
    return int(context_length(lm.model))


def view_window(lm) -> tuple[int, Window]:
    """(context, Window) of the view, each number within the model's limit (defaults where unset)."""
    limit = context_limit(lm)
    context = state.get("context") or min(state.DEFAULT_CONTEXT, limit)
    sinks, recent = state.get("sinks"), state.get("recent")
    return min(int(context), limit), Window(min(DEFAULT_SINKS if sinks is None else int(sinks), limit),
                                           min(DEFAULT_RECENT if recent is None else int(recent), limit))


def probe_settings(lm, context: int) -> tuple:
    """(probes, tokens per row, depths, sequences per depth) of the probes section's boxes as last set (the page's
    defaults before), the length clipped to the model's context."""
    limit = context_limit(lm)
    probes = tuple(state.kept(state.PROBE_NAMES, list(PAGE_PROBES)) or PAGE_PROBES)
    length = min(int(state.kept(state.PROBE_LENGTH, min(context, PAGE_LENGTH, limit))), limit)
    depths = tuple(sorted(float(d) for d in (state.kept(state.PROBE_DEPTHS, list(DEFAULT_DEPTHS)) or DEFAULT_DEPTHS)))
    return probes, length, depths, int(state.kept(state.PROBE_SEQUENCES, PAGE_SEQUENCES))


def precision() -> str:
    """The long passes' precision as the radio last said (float32 before)."""
    value = state.kept(state.LONG_PRECISION, "float32")
    return value if value in PRECISION_CHOICES else "float32"


def precision_choice(lm) -> str:
    """The radio of the long passes' precision: bfloat16 offered where the CPU (or GPU) has native kernels."""
    from analysis.core.placement import fast_bfloat16
    fast = fast_bfloat16(lm.device.type)
    value = st.radio("Precision of the long passes", list(PRECISION_CHOICES), horizontal=True,
                     format_func=_PRECISION_WORDS.get, disabled=not fast,
                     key=state.widget_key(state.LONG_PRECISION, value="float32"),
                     help="bfloat16 multiplies the matrices in bfloat16 (AVX-512 BF16 or AMX on a CPU); the heads' "
                          "taps stay float32. What it changes on SmolLM2 (the scores' rank correlation, the top "
                          "heads, the probes' accuracy) and what it saves: docs/results.md, 'Long context in a "
                          "minute'." if fast else
                          "This machine has no native bfloat16 matrix kernels (AVX-512 BF16 or AMX): bfloat16 would "
                          "be slower here than float32.")
    return value if fast and value in PRECISION_CHOICES else "float32"


# -- cached calls -----------------------------------------------------------------------------------------------

_WITH_STORE: dict = {}            # "module.name" -> a cached call whose results come from the store


def forgotten_with_store(fn):
    """Decorator over a cached call whose results come from (or go to) the store: the Clear button empties it."""
    _WITH_STORE[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


@st.cache_resource(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def fingerprint(key: ModelKey) -> str:
    """The model's fingerprint (analysis.arch.stored.model_fingerprint), once per server and model."""
    from analysis.arch.stored import model_fingerprint
    return model_fingerprint(cache.load(key))


@st.cache_resource(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def per_row(key: ModelKey, lengths: tuple, precision: str = "float32", short: int = 256, rows: int = 8) -> dict:
    """length -> this machine's seconds for one row (analysis.measure.probes.longcontext.row_seconds: a forward of
    `rows` x `short` tokens in `precision` and the attention kernel at each length), once per server and model."""
    from analysis.measure.probes.longcontext import row_seconds
    with cache.exclusive(key, what="Timing this machine's long passes") as lm:
        return row_seconds(lm.model, list(lengths), geometry=lm.geometry, precision=precision, short=short, rows=rows)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def long_items(key: ModelKey, probes: tuple, length: int, depths: tuple, n_items: int, split: str = TEST):
    """(name, length) -> (spec, probe, items): the rows the probes read (the tokenizer only; InputError for a
    length above the model's context, a tokenizer that merges digits, ...), of `split`: test rows (the verdicts')
    or calibration rows (the heads' scores', apart from them: analysis.measure.splits)."""
    from analysis.measure.evaluation import context_length
    from analysis.measure.probes.longcontext import build_long
    lm = cache.load(key)
    return build_long(list(probes), lm.tokenizer, lm.kind, (length,), depths=depths, n_items=n_items,
                      limit=context_length(lm.model), split=split)


def built(key: ModelKey, settings: tuple, split: str = TEST) -> dict:
    """The probes' rows of `settings` (probe_settings' tuple) for `split`: `long_items`."""
    probes, length, depths, n_items = settings
    return long_items(key, tuple(probes), int(length), tuple(depths), int(n_items), split)


def stored_scan(key: ModelKey, settings: tuple, window: Window, precision: str, split: str = TEST):
    """(LongScan, Lookup) when this machine holds the scan of `split`'s rows, else (None, Lookup): no model time."""
    from analysis.score.longscan import stored_scan as lookup
    return lookup(cache.load(key), built(key, settings, split), window=window, precision=precision, compute=False,
                  fingerprint=fingerprint(key))


def stored_dense(key: ModelKey, settings: tuple, precision: str):
    """(the probes' dense side or None, Lookup): what any stored scan of these rows left (no model time)."""
    from analysis.score.longscan import stored_dense as lookup
    return lookup(cache.load(key), built(key, settings), precision=precision, compute=False,
                  fingerprint=fingerprint(key))


@forgotten_with_store
@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def scan(key: ModelKey, settings: tuple, window: Window, precision: str, split: str = TEST, _progress=None,
         _should_stop=None):
    """(LongScan, Lookup) of the probes' rows of `split` (the heads' scores read SCORE_SPLIT's; the dense side the
    test rows'): from the store, else measured under the model's lock and stored."""
    from analysis.score.longscan import stored_scan as measured
    found = stored_scan(key, settings, window, precision, split)
    if found[0] is not None:
        return found
    rows = built(key, settings, split)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return measured(lm, rows, window=window, precision=precision, progress=_progress, should_stop=_should_stop,
                        fingerprint=fingerprint(key))


def dense(key: ModelKey, settings: tuple, precision: str, _progress=None, _should_stop=None) -> dict:
    """The probes' dense side (long_context_report's `dense=`): stored, else from a scan with the page's window
    (which stores the heads' scores of these rows as well)."""
    got, _ = stored_dense(key, settings, precision)
    if got is not None:
        return got
    from analysis.score.longscan import dense_of
    sc, _ = scan(key, settings, Window(), precision, _progress=_progress, _should_stop=_should_stop)
    return dense_of(sc, built(key, settings))


@forgotten_with_store
@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def importance(key: ModelKey, tokens: int, precision: str = "float32", _progress=None, _should_stop=None):
    """([L, Hkv] loss increase per removed KV group, Lookup): from the store, else measured and stored."""
    from analysis.score.longscan import stored_importance
    found = stored_importance_lookup(key, tokens, precision)
    if found[0] is not None:
        return found
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return stored_importance(lm, tokens, precision=precision, progress=_progress, should_stop=_should_stop,
                                 fingerprint=fingerprint(key))


@forgotten_with_store
@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def long_detection(key, name: str, options: tuple, _progress=None, _should_stop=None):
    """One long-context detector (retrieval, streaming) on the dense model; options: sorted (name, value). Kept on
    disk (analysis.score.longscan.stored_detections): read back without the model's lock when stored. The Heads
    page's long detectors and the Long context page's window scores share it."""
    from analysis.score.longscan import stored_detections
    found, _ = stored_detections(cache.load(key), [name], dict(options), compute=False)
    if found.get(name) is not None:
        return found[name]
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return stored_detections(lm, [name], dict(options), progress=_progress, should_stop=_should_stop)[0][name]


def long_work(passes: list[int]) -> float:
    """Forward-token units of a long detector's passes: attention grows with the context, so a token of a
    4k pass costs about twice one of a 1k pass here (n * (1 + n / 2048) per pass; components/jobs.py)."""
    return float(sum(n * (1 + n / 2048) for n in passes))


# -- expected times, and the words under a stored result ----------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def per_step(key: ModelKey, lengths: tuple, batch_tokens: int | None = None) -> dict:
    """length -> this machine's seconds for one decode call of the generated answers at that length
    (analysis.measure.probes.longcontext.step_seconds: the probes' batches, or `batch_tokens` = 1 for one row a
    call, RULER's), once per server and model."""
    from analysis.measure.probes.longcontext import BATCH_TOKENS, step_seconds
    with cache.exclusive(key, what="Timing this machine's long passes") as lm:
        return step_seconds(lm.model, list(lengths), geometry=lm.geometry,
                            batch_tokens=BATCH_TOKENS if batch_tokens is None else batch_tokens)


def work_seconds(key: ModelKey, work, precision: str = "float32") -> float:
    """The predicted seconds of a LongWork: its rows x this machine's seconds per row in `precision`, its decode calls
    x the seconds of one (`per_row`, `per_step`)."""
    steps = per_step(key, tuple(sorted(work.steps))) if work.steps else None
    return work.seconds(per_row(key, tuple(sorted(work.rows)), precision), steps)


def scan_seconds(key: ModelKey, rows: dict, precision: str = "float32") -> float:
    """The predicted seconds of one pass over `rows` (the probes' rows and their generated answers' decode calls)."""
    from analysis.measure.probes.longcontext import long_work
    return work_seconds(key, long_work(rows), precision)


def importance_seconds(key: ModelKey, g, tokens: int, precision: str = "float32") -> float:
    """The predicted seconds of the KV groups' ablation (analysis.score.longscan.importance_seconds) at this
    machine's seconds per row of `tokens` tokens, timed in batches of the sweep's own size."""
    from analysis.score.longscan import head_fraction, importance_ablations, importance_seconds as predicted
    tokens = int(tokens)
    timed = per_row(key, (tokens,), precision, short=tokens, rows=importance_ablations(g))
    return predicted(g, tokens, timed[tokens], head_fraction(cache.load(key).model))


def stored_importance_lookup(key: ModelKey, tokens: int, precision: str = "float32"):
    """(importance or None, Lookup): what this machine holds (no model time)."""
    from analysis.score.longscan import stored_importance
    return stored_importance(cache.load(key), tokens, precision=precision, compute=False, fingerprint=fingerprint(key))


def stored_words(found) -> str:
    """The caption under a result read from the store (a Lookup): when it was measured and in how long."""
    about = found.about or {}
    return (f"Read from this machine's stored results (measured {about.get('stored', 'earlier')} in "
            f"{float(about.get('seconds', 0)):.0f} s); `headscope cache clear` removes them.")


# -- clearing ------------------------------------------------------------------------------------------------

def _forget(key: ModelKey) -> None:
    """on_click: remove this model's stored results (every measure) and the server's cached copies of them (every
    call marked `forgotten_with_store`)."""
    from analysis.core.store import Store
    removed = Store().clear(model=fingerprint(key))
    for fn in _WITH_STORE.values():
        fn.clear()
    state.remember("long.forgot", removed)


def forget_button(lm) -> None:
    """What this machine stores for the model (count, size) and a button that clears it (the CLI's `cache clear`)."""
    from analysis.core.store import Store
    key = state.model_key()
    mine = [e for e in Store().entries() if e.key.get("model") == fingerprint(key)]
    forgot = state.recall("long.forgot")
    if forgot is not None:
        st.caption(f"Removed {forgot} stored result{'s' if forgot != 1 else ''} of this model.")
        state.forget("long.forgot")
    if not mine:
        return
    size = sum(e.bytes for e in mine)
    st.button(f"Clear this model's stored results ({len(mine)}, {size / 1024:,.0f} KiB)", key="long.store.clear",
              on_click=_forget, args=(key,),
              help="The long-context results this machine keeps for this model (heads' scores, probes, plans, "
                   "importance; `headscope cache list`): removed for every session; the next run measures again.")


# -- the measured results kept with the project (docs/data) ------------------------------------------------------

DATA = Path(__file__).resolve().parents[1] / "docs" / "data"
MAP_FILE = DATA / "ruler_dense_map.json"


@st.cache_data(show_spinner=False)
def _read(path: str, mtime: float) -> dict | None:
    """The JSON at `path` (None when absent or unreadable); `mtime` keys the cache to the file's version."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def project_json(path: Path) -> dict | None:
    """A JSON result kept with the project (docs/data/...), read once per version of the file; None when absent."""
    return _read(str(path), path.stat().st_mtime) if path.is_file() else None


def dense_map(model: str):
    """The shipped dense map (analysis.measure.densemap.DenseMap) when it was measured on `model`, else None."""
    from analysis.core.errors import HeadscopeError
    from analysis.measure.densemap import DenseMap
    data = project_json(MAP_FILE)
    if data is None or data.get("model") != model:
        return None
    try:
        return DenseMap.from_dict(data)
    except HeadscopeError:
        return None
