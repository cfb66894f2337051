"""Cached calls into `analysis/`: the model by name, its norm profile once, scores by parameters.

- `load(key)`: `st.cache_resource`, one shared LoadedModel per `state.ModelKey` (the model's name,
  trust_remote_code and the placement: device, dtype, device_map, max_memory, offload folder; or
  weights only), so a model loaded in bfloat16 or offloaded is another entry. Every cached call
  per model takes the same key first. Nobody mutates it: masks are
  hooks inside `analysis.arch.head_gates.head_mask`, surgery builds a twin that shares the untouched
  weights and only reads them (distillation un-shares its student first).
- `profile(key)`: `st.cache_resource`, the row norms, computed once per model. Moving z
  or the sparsity never recomputes them (everything z-dependent is an array op on this).
- `scores(key, scorer, params)`: `st.cache_data`, keyed by the model key, the scorer and its
  parameters (a sorted tuple of pairs).

Arguments starting with "_" (progress and stop callbacks) are not part of a cache key.
Progress inside a cached function writes to a bar created outside it; `progress_bar` turns off
Streamlit's element capture for those writes so cache hits do not replay stale bars.
"""
from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import streamlit as st

from analysis.arch.kvplan import KVPlan
from analysis.core.errors import CancelledError, HeadscopeError
from analysis.core.progress import check_stop
from analysis.core.progress import Progress

from . import jobs, shell, state
from .errors import show_exception
from .state import ModelKey

try:  # Streamlit internal: lets a progress bar outside a cached function be updated from inside it
    from streamlit.runtime.scriptrunner_utils.script_run_context import in_cached_function as _in_cached
except Exception:  # noqa: BLE001
    _in_cached = None
try:  # a thread of ours that redraws the bar needs the run's context (Streamlit's documented helpers)
    from streamlit.runtime.scriptrunner import add_script_run_ctx as _add_ctx
    from streamlit.runtime.scriptrunner import get_script_run_ctx as _script_ctx
except Exception:  # noqa: BLE001
    _add_ctx = _script_ctx = None


# Streamlit hashes a cached call's arguments on every call; a ModelKey (a dataclass holding a Placement)
# went through its generic pickling hasher, several ms per call on a key press. Its repr is unique and cheap.
KEY_HASH = {ModelKey: repr, KVPlan: KVPlan.to_json}   # a plan by its contents


def params_key(params: dict) -> tuple:
    """A hashable, order-independent cache key for a parameter dict."""
    return tuple(sorted((k, v) for k, v in params.items()))


# -- progress ----------------------------------------------------------------------------------

TICK_S = 1.0              # the bar's time words are redrawn this often while work runs


@contextmanager
def progress_bar(label: str, job: jobs.Job | None = None):
    """Yields a `progress(fraction, message)` callback drawing a bar; the bar is removed afterwards.

    With a `job` (components/jobs.py) the bar also says the time so far and the time left (from this
    machine's measured pace, then from the job's own), or its place in the model's queue while it waits,
    redrawn every TICK_S by a ticker thread (issue 33: an estimate froze for 4 minutes, a bar sat at
    "started" with nothing moving): between two reports of a long batch the words still move."""
    slot = st.empty()
    bar = slot.progress(0.0, text=label)
    drawing = threading.Lock()
    board = jobs.board() if job is not None else None

    def draw() -> None:
        if job is None:
            return
        if job.started is None and job.model:
            text = f"{label}: {board.waiting_words(job)}"
        else:
            left = job.left_s()
            when = f"{jobs.seconds_words(job.elapsed())} so far" + (
                f", about {jobs.seconds_words(left)} left" if left is not None else ", time left not known yet")
            text = f"{label}: {job.message or 'started'} ({when})"
        with drawing:
            bar.progress(min(max(job.fraction, 0.0), 1.0), text=text)

    def report(fraction: float, message: str) -> None:
        token = _in_cached.set(False) if _in_cached is not None else None
        try:
            if job is not None:
                board.update(job, fraction, message)
                draw()
            else:
                with drawing:
                    bar.progress(min(max(float(fraction), 0.0), 1.0), text=f"{label}: {message}")
        finally:
            if token is not None:
                _in_cached.reset(token)

    done = threading.Event()
    ticker = None
    if job is not None and _script_ctx is not None:
        ctx = _script_ctx()

        def tick() -> None:
            while not done.wait(TICK_S):
                try:
                    draw()
                except Exception:  # noqa: BLE001 - the run ended under it: stop redrawing
                    return

        if ctx is not None:
            ticker = threading.Thread(target=tick, daemon=True, name="headscope-progress")
            _add_ctx(ticker, ctx)
            ticker.start()
    try:
        yield report
    finally:
        done.set()
        if ticker is not None:
            ticker.join(timeout=2 * TICK_S)
        slot.empty()


def stop_button(work: str, label: str = "Stop"):
    """A Stop button in its own slot (returned, to be emptied when the work ends).

    A click reruns the page, which interrupts the work; the flag it sets makes the rerun's
    `should_stop()` true, so work that starts again on that rerun ends at once as cancelled."""
    slot = st.empty()
    slot.button(label, on_click=state.request_stop, args=(work,), key=state.WIDGET_PREFIX + "stop." + work,
                help="Stop the computation that is running; finished results stay cached.")
    return slot


# -- cached calls ------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=3, hash_funcs=KEY_HASH)
def load(key: ModelKey, _progress: Progress | None = None, _should_stop=None):
    """The shared LoadedModel of `key` (never mutate it)."""
    from analysis.arch import models
    if key.weights_only:                        # a checkpoint folder: structure on the meta device, no weights
        return models.open_weights_only(key.name, trust_remote_code=key.trust)
    loaded = models.load_model(key.name, trust_remote_code=key.trust, progress=_progress, should_stop=_should_stop,
                               **key.load_kwargs())
    settle_heap()
    return loaded


def settle_heap() -> None:
    """Collect once, then move every object that exists now out of the garbage collector's scans.

    Streamlit runs a full `gc.collect()` after every script run (its runner.postScriptGC), fragment
    runs included, holding the GIL so no message reaches the browser meanwhile. With a model loaded
    that scan was most of a key press on the Prune page (SmolLM2: 245 ms of a 275 ms fragment run,
    measured on a busy machine; 5 ms after this). A model is kept by `load` until evicted and holds
    no reference cycles (dropping it frees it by reference counting), so nothing frozen is lost."""
    gc.collect()
    gc.freeze()


@st.cache_resource(show_spinner=False, max_entries=3, hash_funcs=KEY_HASH)
def profile(key: ModelKey, _progress: Progress | None = None, _should_stop=None):
    """Row norms of every layer, computed once per model."""
    from analysis.measure import profiles
    lm = load(key)
    if key.weights_only:                        # streamed from the files, one layer at a time
        from analysis.measure.streaming import profile_checkpoint
        return profile_checkpoint(lm.source, progress=_progress, should_stop=_should_stop,
                                  trust_remote_code=key.trust)
    return profiles.profile_model(lm.model, adapter=lm.adapter, source=key.name, progress=_progress,
                                  should_stop=_should_stop)


def model_or_stop():
    """Load the current view's model with a progress bar; on failure show how to fix it and stop.

    A built-in's cold first load (its one-time conversion: seconds to minutes) also gets a Stop
    button; a stopped conversion leaves no cache behind and the next run starts it again."""
    from analysis.arch.models import conversion_pending
    name = state.get("model")
    if not name:
        st.info("Pick a model in the sidebar: a built-in, a Hugging Face id, or a local folder.")
        shell.end_run()
    cold = conversion_pending(name)
    slot = stop_button(f"Loading {name}") if cold else None
    try:
        with progress_bar(f"Loading {name}") as report:
            lm = load(state.model_key(), _progress=report, _should_stop=state.stop_check() if cold else None)
        from analysis.score.masks import default_policy
        from analysis.score.scoring import default_scorer
        state.follow_model("scorer", default_scorer(lm.geometry.group_size))
        state.follow_model("policy", default_policy(lm.geometry.group_size))
        return lm
    except Exception as err:  # noqa: BLE001 - shown: a cancel as a note, a user problem in one line
        show_exception(err, f"Loading {name}")
        if isinstance(err, CancelledError):
            st.button("Load it again", key=state.WIDGET_PREFIX + "load-again",
                      help="Start the one-time conversion again (it starts over from the beginning).")
    finally:
        if slot is not None:
            slot.empty()
            state.clear_stop()
    shell.end_run()


def profile_or_stop():
    """The current model's norm profile (computed once, with progress); stops the page on failure."""
    if state.weights_only():                    # streaming every layer from disk: progress per layer, stoppable
        prof = cached_call(profile, state.model_key(), label="Streaming the row norms from the checkpoint",
                           stoppable=True)
        if prof is None:
            shell.end_run()
        return prof
    try:
        with progress_bar("Computing row norms") as report:
            return profile(state.model_key(), _progress=report)
    except Exception as err:  # noqa: BLE001
        show_exception(err, "Computing row norms")
    shell.end_run()


@contextmanager
def tracked(label: str, *, key: ModelKey | None = None, kind: str = "", work: float = 0.0, call: str = "",
            stoppable: bool = False):
    """A long job of this session: a progress bar with the time so far and left (the pace of `kind` on
    this model, `work` units), its place in the model's queue while it waits (`exclusive` reads it), a
    Stop button when `stoppable`. Yields (progress, should_stop); the measured pace is recorded when the
    block ends without an error and the job took the model's lock (a cache hit records nothing)."""
    board = jobs.board()
    if (kind and kind not in jobs.PREDICTED_SECONDS and key is not None and not key.weights_only
            and not board.knows("forward", repr(key))):
        forward_rate(key)            # this machine's forward speed on the model: the prior of every estimate
    job = board.add(jobs.Job(label, model=repr(key) if key is not None else "", call=call, kind=kind, work=work))
    token = jobs.CURRENT.set(job)
    slot = stop_button(label) if stoppable else None
    should_stop = state.stop_check() if stoppable else None
    try:
        with progress_bar(label, job) as report:
            yield report, should_stop
        if job.started is not None:
            board.record(kind, job.model, work, job.elapsed())
    finally:
        jobs.CURRENT.reset(token)
        board.remove(job)
        if slot is not None:
            slot.empty()
            state.clear_stop()


def _wait_for_same(call: str, label: str, stoppable: bool) -> None:
    """While another session (or this session's interrupted run) computes the very same cached call,
    wait for it with its progress: the result is computed once and then read from the cache."""
    board = jobs.board()
    other = board.running_call(call)
    if other is None:
        return
    should_stop = state.stop_check() if stoppable else None
    with progress_bar(label) as report:
        while other is not None:
            check_stop(should_stop, label)
            left = other.left_s()
            report(other.fraction, "the same computation is running (started by another session or an earlier "
                                   f"run): {other.message or 'waiting for the model'}"
                                   + (f", about {jobs.seconds_words(left)} left" if left is not None else ""))
            time.sleep(LOCK_POLL_S)
            other = board.running_call(call)


def cached_call(fn: Callable[..., Any], *args, label: str, stoppable: bool = False, kind: str = "",
                work: float = 0.0, **kwargs):
    """Call a cached function with a progress bar (and a Stop button); show failures, return None.

    The callbacks go in as `_progress` / `_should_stop`, outside the cache key. The same call running
    elsewhere is waited for (`_wait_for_same`); `kind` / `work` give the time estimate (components/jobs.py)."""
    call = jobs.call_key(fn, args + tuple(sorted(kwargs.items())))
    key = args[0] if args and isinstance(args[0], ModelKey) else None
    try:
        _wait_for_same(call, label, stoppable)
        with tracked(label, key=key, kind=kind, work=work, call=call, stoppable=stoppable) as (report, should_stop):
            if stoppable:
                return fn(*args, _progress=report, _should_stop=should_stop, **kwargs)
            return fn(*args, _progress=report, **kwargs)
    except Exception as err:  # noqa: BLE001
        show_exception(err, label)
        return None


def estimate_words(key: ModelKey, kind: str, work: float) -> str:
    """"about 40 s on this machine (measured: the last runs of this job)" -- or from the forward speed, the
    prior, measured first when no job has run on this model yet ("" for a model open weights only)."""
    if not kind or work <= 0 or key.weights_only:
        return ""
    board = jobs.board()
    predicted = kind in jobs.PREDICTED_SECONDS
    if not predicted and not board.knows(kind, repr(key)) and not board.knows("forward", repr(key)):
        forward_rate(key)
    seconds = board.estimate(kind, repr(key), work)
    if seconds is None:
        return ""
    basis = ("this machine's pace on the last runs of this job" if board.knows(kind, repr(key)) else
             "two short timings on this machine: a forward of 8 x 256 tokens and the attention kernel at the "
             "length" + (f"; {jobs.PREDICTED_BOUNDS[kind]}" if kind in jobs.PREDICTED_BOUNDS else "") if predicted else
             "this machine's measured forward speed; the first run measures this job's own pace")
    return f"Expected: about {jobs.seconds_words(seconds)} ({basis})."


def run_button(button_label: str, *, button_key: str, slot: str, run_key, fn: Callable[..., Any], args: tuple,
               label: str, stale_note: str, view: str = "", kind: str = "", work: float = 0.0, **button_kwargs):
    """A button that runs `cached_call(fn, *args)` (stoppable, with progress) and keeps the result in
    session state under `slot` with `run_key`; returns that result on later reruns while `run_key`
    still describes the current inputs. A result for other inputs is never shown: `stale_note` says
    so instead (its "{view}" replaced by `view` as it was when that result was computed), and None
    is returned. `kind` / `work`: the job's estimate, shown under the button (components/jobs.py)."""
    pressed = st.button(button_label, key=button_key, **button_kwargs)
    if kind and isinstance(args[0], ModelKey):
        words = estimate_words(args[0], kind, work)
        if words:
            st.caption(words)
    if pressed:
        result = cached_call(fn, *args, label=label, stoppable=True, kind=kind, work=work)
        if result is not None:
            state.remember_run(slot, run_key, result, view=view)
    result = state.run_result(slot, run_key)
    if result is None and state.last_run(slot) is not None:
        st.caption(stale_note.format(view=state.run_view(slot) or "another view"))
    return result


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def param_count(key: ModelKey) -> int:
    """Parameters of the loaded model (shared tensors counted once)."""
    from analysis.arch.models import count_parameters
    return count_parameters(load(key).model)


# -- scores, masks, evaluation -----------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def stock_sparsities(key: ModelKey) -> list:
    """The sparsities a stock config of this model can describe (its config only: once per model)."""
    from analysis.compress.export import stock_sparsities as of_config
    return of_config(load(key).model.config)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def has_qkv_bias(key: ModelKey) -> bool:
    """Whether the attention projections carry biases (for the parameter count of a mask)."""
    lm = load(key)
    return lm.adapter.has_qkv_bias(lm.model)


@st.cache_resource(show_spinner=False, hash_funcs=KEY_HASH)
def _model_lock(key: ModelKey) -> threading.RLock:
    return threading.RLock()


LOCK_POLL_S = 0.25


@contextmanager
def exclusive(key: ModelKey, progress: Progress | None = None, should_stop=None, what: str = ""):
    """Yields the shared LoadedModel with its lock held, for work that runs or copies it.

    Masks are forward hooks on the shared model, so two runs at once (two sessions, or a rerun
    that Streamlit starts while the interrupted run is still finishing) would see each other's
    gates; every forward pass on a cached model goes through here. Never call another cached
    function while holding the lock (their own per-key locks could then deadlock with it).

    The lock is taken in the order the jobs asked for it (components/jobs.py's queue per model), so a
    waiting session is told its real place in line and the expected wait (the running job's time left
    from its pace, and the estimates of the jobs ahead). The job is the one `tracked` runs in this
    thread, else one made here, named `what`.

    Quirk handled here: with fast reruns, the run a click interrupts keeps its thread (and this
    lock) until its next Streamlit call. A blocking wait would make no Streamlit call either,
    so the new run could not be interrupted by Stop and the page froze on a stale bar; the
    wait polls, reporting progress (a point where Streamlit can interrupt) and the stop flag."""
    lm = load(key)
    lock = _model_lock(key)
    board = jobs.board()
    job = jobs.CURRENT.get()
    own = job is None or job.model != repr(key)
    if own:
        job = board.add(jobs.Job(what or "another computation", model=repr(key)))
    try:
        if job.started is not None:                 # this thread's job holds it already (re-entrant)
            with lock:
                yield lm
            return
        while not (board.first_in_line(job) and lock.acquire(timeout=LOCK_POLL_S)):
            if not board.first_in_line(job):
                time.sleep(LOCK_POLL_S)
            check_stop(should_stop, "Waiting for another computation on this model")
            if progress is not None:
                progress(0.0, board.waiting_words(job))
        board.start(job)
        if progress is not None:
            progress(0.0, "started")            # replaces a "waiting" note at once
        try:
            yield lm
        finally:
            lock.release()
    finally:
        if own:
            board.remove(job)


@st.cache_data(show_spinner=False, max_entries=256, hash_funcs=KEY_HASH)
def scores(key: ModelKey, scorer: str, params: tuple, _progress=None, _should_stop=None):
    """HeadScores of `scorer` with `params` (a params_key tuple) on the model of `key`.

    Weight-only scorers read the cached norm profile (never the weights again); calibration
    scorers run the model (under its lock)."""
    from analysis.score import scoring
    instance = scoring.get_scorer(scorer, **dict(params))
    if not type(instance).needs_calibration:
        return instance.score(profile(key), progress=_progress, should_stop=_should_stop)
    if key.weights_only:
        raise HeadscopeError(f"The {scorer!r} scorer runs calibration text through the model, and this checkpoint "
                             f"is open weights only: load the model on the Model page, or pick one of "
                             f"{', '.join(scoring.weight_only_scorers())}.")
    with exclusive(key, _progress, _should_stop) as lm:
        return instance.score(lm, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def mpg(key, z: float):
    """MP-G scores at `z` for the "Does MP find the specialized heads?" tests (analysis.score.specialization):
    the Heads page's roles and the capability probes' heads read the same ones."""
    from analysis.score.specialization import mpg_scores
    return mpg_scores(load(key), z)


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=KEY_HASH)
def evaluate_masks(key: ModelKey, pruned, text: str | None, max_tokens: int,
                   _progress=None, _should_stop=None):
    """`analysis.measure.evaluation.evaluate` of the masks pruned [B, L, H] on `text` (None = built-in)."""
    from analysis.measure import evaluation
    with exclusive(key, _progress, _should_stop) as lm:
        return evaluation.evaluate(lm, text, pruned=pruned, max_tokens=max_tokens, progress=_progress,
                                   should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=KEY_HASH)
def z_sweep(key: ModelKey, sparsity: float, options: tuple, max_tokens: int,
            _progress=None, _should_stop=None):
    """`analysis.score.sweep.sweep_z` at one sparsity; options: params_key of scorer/scope/ord/a_q/a_kv/policy."""
    from analysis.score import sweep
    prof = profile(key)
    with exclusive(key, _progress, _should_stop) as lm:
        calib, held_out, metric, higher = sweep.split_evaluators(lm, max_tokens=max_tokens, progress=_progress)
        return sweep.sweep_z(prof, sparsity, calib, held_out, metric=metric, higher_is_better=higher,
                             evaluate_all=True, progress=_progress, should_stop=_should_stop, **dict(options))


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=KEY_HASH)
def sparsity_curve(key: ModelKey, scorer: str, params: tuple, policy: str, min_per_layer: int,
                   levels: tuple, max_tokens: int, _progress=None, _should_stop=None):
    """Metric vs sparsity for one scorer, masks from `analysis.score.masks.plan_mask` with `policy`."""
    from analysis.score import curves, masks
    head_scores = scores(key, scorer, params)            # before taking the lock (see exclusive)
    with exclusive(key, _progress, _should_stop) as lm:
        def mask_fn(_, s):
            return masks.plan_mask(head_scores, s, group_size=lm.geometry.group_size, policy=policy,
                                   min_per_layer=min_per_layer).pruned

        return curves.sparsity_curve(lm, head_scores.scores, sparsities=list(levels), mask_fn=mask_fn,
                                     max_tokens=max_tokens, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def ablation(key: ModelKey, text: str | None, max_tokens: int, _progress=None, _should_stop=None):
    """`analysis.measure.ablation.head_ablation`: the loss change when each head alone is removed."""
    from analysis.measure import ablation as ablation_mod
    with exclusive(key, _progress, _should_stop) as lm:
        return ablation_mod.head_ablation(lm, text, max_tokens=max_tokens, progress=_progress,
                                          should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def head_roles(key: ModelKey, text: str | None, max_tokens: int, _progress=None, _should_stop=None):
    """`analysis.measure.roles.head_roles` on `text` (None = built-in evaluation text)."""
    from analysis.measure import roles
    with exclusive(key, _progress, _should_stop) as lm:
        return roles.head_roles(lm, text, max_tokens=max_tokens, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def head_redundancy(key: ModelKey, text: str | None, max_tokens: int, kind: str, threshold: float,
                    ablation_delta=None, _progress=None, _should_stop=None):
    """`analysis.measure.redundancy.head_redundancy` (with single-head effects for the redundant flag)."""
    from analysis.measure import redundancy
    with exclusive(key, _progress, _should_stop) as lm:
        return redundancy.head_redundancy(lm, text, ablation_delta=ablation_delta, kind=kind, threshold=threshold,
                                          max_tokens=max_tokens, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=KEY_HASH)
def attention_pattern(key: ModelKey, sentence: str, max_tokens: int = 64):
    """(tokens, probabilities [L, H, T, T]) of every head on one sentence (analysis.measure.roles)."""
    from analysis.measure import evaluation
    from analysis.measure import roles
    with exclusive(key) as lm:
        ids = evaluation.token_ids(lm.tokenizer, sentence, max_tokens=max_tokens)      # [T]
        probs = roles.attention_probabilities(lm.model, ids.unsqueeze(0))[0]           # [L, H, T, T]
        tokens = [lm.tokenizer.decode([int(i)]) for i in ids]
    return tokens, probs.numpy()


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def head_attribution(key: ModelKey, text: str | None, max_tokens: int, n_steps: int,
                     _progress=None, _should_stop=None):
    """`analysis.measure.attribution.head_attribution`: Captum integrated gradients over the head gates."""
    from analysis.measure import attribution
    with exclusive(key, _progress, _should_stop) as lm:
        return attribution.head_attribution(lm, text, max_tokens=max_tokens, seq_len=max_tokens, n_steps=n_steps,
                                            progress=_progress, should_stop=_should_stop)


FORWARD_PROBE_TOKENS = 64


def forward_rate(key: ModelKey) -> float:
    """Tokens per second of a forward pass of the model on this machine, measured once per model and
    server (a warm-up pass, then the faster of two timed ones, on FORWARD_PROBE_TOKENS tokens, no KV
    cache): the prior of every time estimate (components/jobs.py keeps it
    as the pace "forward", seconds per token, which each finished job then refines for its own kind).

    It was four passes of 2 x 128 tokens with a KV cache, on every first visit: 13 s of a first visit to the Pipeline page on a busy machine (51 s on the issue's fresh 2-core one)."""
    board = jobs.board()
    known = board.estimate("forward", repr(key), 1.0)
    if known is not None:
        return 1.0 / known
    import torch
    from analysis.arch.adapters import input_device
    with exclusive(key, what="Measuring this machine's speed") as lm:
        ids = torch.randint(0, int(lm.model.config.get_text_config().vocab_size), (1, FORWARD_PROBE_TOKENS),
                            generator=torch.Generator().manual_seed(0)).to(input_device(lm.model))   # [1, T]
        times = []
        with torch.no_grad():
            for _ in range(3):
                t0 = time.perf_counter()
                lm.model(input_ids=ids, use_cache=False)
                times.append(time.perf_counter() - t0)
    seconds = max(min(times[1:]), 1e-6)
    board.record("forward", repr(key), FORWARD_PROBE_TOKENS, seconds)
    return FORWARD_PROBE_TOKENS / seconds


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=KEY_HASH)
def speed_report(key: ModelKey, pruned, prefill: tuple, repeats: int, kv_policy: str = "auto",
                 _progress=None, _should_stop=None):
    """`analysis.compress.timing.measure`: size, FLOPs and latency of dense vs masked vs physically pruned."""
    from analysis.arch.cut import Cut
    from analysis.compress import timing
    with exclusive(key, _progress, _should_stop) as lm:
        return timing.measure(lm.model, Cut.of_mask(pruned), kv_policy=kv_policy, prefill=prefill, repeats=repeats,
                              progress=_progress, should_stop=_should_stop)


# formats whose files hold the full-shape weights (a cut saves nothing on disk)
FULL_SHAPE_FORMATS = ("zeroed",)
# a k-quant's nominal GGUF type per weight type, and the type llama.cpp falls back to for rows that are not
# a multiple of its 256-value block (docs/EXPORT.md: SmolLM2's 576-wide rows); the estimate says "about"
KQUANT = {"q4_k_m": ("Q4_K", "Q5_0"), "q5_k_m": ("Q5_K", "Q5_0"), "q6_k": ("Q6_K", "Q8_0"),
          "q4_0": ("Q4_0", "Q4_0"), "q4_1": ("Q4_1", "Q4_1")}


def _unique_bytes(model, dtype=None) -> int:
    """Bytes of the model's tensors, each storage once (tied weights once): its safetensors size, but
    the header; `dtype`: the floating tensors counted as written in it (an export's source dtype)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
    return total


def _gguf_bytes(model, layout, weight_type: str) -> tuple[int, bool]:
    """(tensor bytes of the GGUF file at `weight_type`, exact?): from the file plan (names and shapes);
    a k-quant's size is estimated with its nominal type (llama.cpp quantizes after the plan)."""
    import gguf

    from analysis.compress.export.gguf.writer import plan_gguf
    plan = plan_gguf(model, layout, weight_type)
    sizes = gguf.GGML_QUANT_SIZES
    total, exact = 0, weight_type not in KQUANT
    for t in plan.tensors:
        kind = t.ggml_type
        if not exact and len(t.shape) >= 2:
            nominal, fallback = KQUANT[weight_type]
            block = sizes[gguf.GGMLQuantizationType[nominal]][0]
            kind = nominal if t.shape[-1] % block == 0 else fallback
        block, size = sizes[gguf.GGMLQuantizationType[kind]]
        n = int(np.prod(t.shape))
        total += -(-n // block) * size
    return total, exact


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=KEY_HASH)
def whole_model_change(key: ModelKey, pruned, kv_policy: str, fmt: str, options: tuple,
                       _progress=None, _should_stop=None) -> list[dict]:
    """Before an export: what the cut changes in the WHOLE model, not only in attention -- parameters,
    the file's tensor bytes in `fmt` (GGUF at its weight type too) and the KV cache per token, each dense
    and cut, with the change in percent of the dense model. Built from surgery's own twin of the model
    (no file is written)."""
    from analysis.arch.models import count_parameters
    from analysis.compress.export import get_format
    from analysis.compress.surgery import HeadLayout, prune_heads
    from analysis.score.masks import surgery_counts
    opts = dict(options)
    with exclusive(key, _progress, _should_stop, what="Counting the whole model") as lm:
        g = lm.geometry
        smaller, layout = prune_heads(lm.model, pruned, kv_policy=kv_policy)
        dense_layout = HeadLayout.from_mask(np.zeros_like(pruned), g, lm.adapter.model_type)
        rows = [("parameters", count_parameters(lm.model), count_parameters(smaller), True)]
        written = lm.source_dtype if get_format(fmt).keeps_dtype else None   # what the export writes them in
        if fmt == "gguf":
            wt = opts.get("gguf_type", "f16")
            (before, exact), (after, _) = _gguf_bytes(lm.model, dense_layout, wt), _gguf_bytes(smaller, layout, wt)
            rows.append((f"GGUF file, {wt} (tensor bytes{'' if exact else ', about: llama.cpp picks each tensor'})",
                         before, after, exact))
        elif fmt in FULL_SHAPE_FORMATS:
            size = _unique_bytes(lm.model, written)
            rows.append((f"{fmt} file (full shapes: the cut saves no bytes)", size, size, True))
        elif fmt.startswith("onnx") and fmt != "onnx":
            rows.append((f"{fmt} file (measured when written: INT8 keeps some layers in float)", None, None, False))
        else:
            rows.append((f"{fmt} file (tensor bytes)", _unique_bytes(lm.model, written), _unique_bytes(smaller, written),
                         True))
        if lm.kind != "encoder":
            counts = surgery_counts(pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden,
                                    kv_policy=kv_policy, dtype_bytes=next(lm.model.parameters()).element_size())
            rows.append(("KV cache per token (bytes)", counts.kv_cache_bytes_per_token,
                         counts.kv_cache_bytes_per_token_after, True))
    out = []
    for what, before, after, exact in rows:
        change = None if before is None or after is None else after - before
        out.append({"whole model": what, "dense": before, "cut": after, "change": change,
                    "change, % of the model": None if change is None or not before else 100 * change / before,
                    "exact": exact})
    return out


GENERATE_PROMPTS = ("The capital of Germany is", "Water boils at a temperature of", "The opposite of hot is")


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=KEY_HASH)
def generate_side_by_side(key: ModelKey, pruned, prompts: tuple, new_tokens: int,
                          _progress=None, _should_stop=None) -> list[dict]:
    """Greedy continuations of `prompts` by the dense model and by the cut (its heads gated off on the
    shared model, the same function as the cut: analysis.arch.head_gates), side by side."""
    import torch

    from analysis.arch.adapters import input_device
    from analysis.arch.head_gates import gates_from_mask, head_mask
    from analysis.core.progress import tick
    out = []
    with exclusive(key, _progress, _should_stop, what="Generating") as lm:
        tok = lm.tokenizer
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt").input_ids.to(input_device(lm.model))      # [1, T]
            texts = {}
            for j, (name, mask) in enumerate((("dense", None), ("cut", pruned))):
                tick(_progress, _should_stop, (2 * i + j) / (2 * len(prompts)), f"prompt {i + 1}/{len(prompts)}, {name}")
                with torch.no_grad():
                    if mask is None:
                        new = lm.model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                pad_token_id=tok.eos_token_id)
                    else:
                        with head_mask(lm.model, gates_from_mask(mask), adapter=lm.adapter):
                            new = lm.model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                    pad_token_id=tok.eos_token_id)
                texts[name] = tok.decode(new[0, ids.shape[1]:], skip_special_tokens=True)
            out.append({"prompt": prompt, "dense": texts["dense"], "cut": texts["cut"]})
    return out
