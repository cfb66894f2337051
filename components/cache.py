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
from contextlib import contextmanager
from typing import Any, Callable

import streamlit as st

from analysis.core.errors import CancelledError, HeadscopeError
from analysis.core.progress import check_stop
from analysis.core.progress import Progress

from . import state
from .errors import show_exception
from .state import ModelKey

try:  # Streamlit internal: lets a progress bar outside a cached function be updated from inside it
    from streamlit.runtime.scriptrunner_utils.script_run_context import in_cached_function as _in_cached
except Exception:  # noqa: BLE001
    _in_cached = None


def params_key(params: dict) -> tuple:
    """A hashable, order-independent cache key for a parameter dict."""
    return tuple(sorted((k, v) for k, v in params.items()))


# -- progress ----------------------------------------------------------------------------------

@contextmanager
def progress_bar(label: str):
    """Yields a `progress(fraction, message)` callback drawing a bar; the bar is removed afterwards."""
    slot = st.empty()
    bar = slot.progress(0.0, text=label)

    def report(fraction: float, message: str) -> None:
        token = _in_cached.set(False) if _in_cached is not None else None
        try:
            bar.progress(min(max(float(fraction), 0.0), 1.0), text=f"{label}: {message}")
        finally:
            if token is not None:
                _in_cached.reset(token)

    try:
        yield report
    finally:
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

@st.cache_resource(show_spinner=False, max_entries=3)
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


@st.cache_resource(show_spinner=False, max_entries=3)
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
        st.stop()
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
    st.stop()


def profile_or_stop():
    """The current model's norm profile (computed once, with progress); stops the page on failure."""
    if state.weights_only():                    # streaming every layer from disk: progress per layer, stoppable
        prof = cached_call(profile, state.model_key(), label="Streaming the row norms from the checkpoint",
                           stoppable=True)
        if prof is None:
            st.stop()
        return prof
    try:
        with progress_bar("Computing row norms") as report:
            return profile(state.model_key(), _progress=report)
    except Exception as err:  # noqa: BLE001
        show_exception(err, "Computing row norms")
    st.stop()


def cached_call(fn: Callable[..., Any], *args, label: str, stoppable: bool = False, **kwargs):
    """Call a cached function with a progress bar (and a Stop button); show failures, return None.

    The callbacks go in as `_progress` / `_should_stop`, outside the cache key."""
    slot = stop_button(label) if stoppable else None
    try:
        with progress_bar(label) as report:
            if stoppable:
                return fn(*args, _progress=report, _should_stop=state.stop_check(), **kwargs)
            return fn(*args, _progress=report, **kwargs)
    except Exception as err:  # noqa: BLE001
        show_exception(err, label)
        return None
    finally:
        if slot is not None:
            slot.empty()
            state.clear_stop()


def run_button(button_label: str, *, button_key: str, slot: str, run_key, fn: Callable[..., Any], args: tuple,
               label: str, stale_note: str, view: str = "", **button_kwargs):
    """A button that runs `cached_call(fn, *args)` (stoppable, with progress) and keeps the result in
    session state under `slot` with `run_key`; returns that result on later reruns while `run_key`
    still describes the current inputs. A result for other inputs is never shown: `stale_note` says
    so instead (its "{view}" replaced by `view` as it was when that result was computed), and None
    is returned."""
    if st.button(button_label, key=button_key, **button_kwargs):
        result = cached_call(fn, *args, label=label, stoppable=True)
        if result is not None:
            state.remember_run(slot, run_key, result, view=view)
    result = state.run_result(slot, run_key)
    if result is None and state.last_run(slot) is not None:
        st.caption(stale_note.format(view=state.run_view(slot) or "another view"))
    return result


@st.cache_data(show_spinner=False, max_entries=8)
def param_count(key: ModelKey) -> int:
    """Parameters of the loaded model (shared tensors counted once)."""
    from analysis.arch.models import count_parameters
    return count_parameters(load(key).model)


# -- scores, masks, evaluation -----------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=8)
def has_qkv_bias(key: ModelKey) -> bool:
    """Whether the attention projections carry biases (for the parameter count of a mask)."""
    lm = load(key)
    return lm.adapter.has_qkv_bias(lm.model)


@st.cache_resource(show_spinner=False)
def _model_lock(key: ModelKey) -> threading.RLock:
    return threading.RLock()


LOCK_POLL_S = 0.25


@contextmanager
def exclusive(key: ModelKey, progress: Progress | None = None, should_stop=None):
    """Yields the shared LoadedModel with its lock held, for work that runs or copies it.

    Masks are forward hooks on the shared model, so two runs at once (two sessions, or a rerun
    that Streamlit starts while the interrupted run is still finishing) would see each other's
    gates; every forward pass on a cached model goes through here. Never call another cached
    function while holding the lock (their own per-key locks could then deadlock with it).

    Quirk handled here: with fast reruns, the run a click interrupts keeps its thread (and this
    lock) until its next Streamlit call. A blocking wait would make no Streamlit call either,
    so the new run could not be interrupted by Stop and the page froze on a stale bar; the
    wait polls, reporting progress (a point where Streamlit can interrupt) and the stop flag."""
    lm = load(key)
    lock = _model_lock(key)
    while not lock.acquire(timeout=LOCK_POLL_S):
        check_stop(should_stop, "Waiting for another computation on this model")
        if progress is not None:
            progress(0.0, "waiting for another computation on this model to finish")
    if progress is not None:
        progress(0.0, "started")            # replaces a "waiting" note at once
    try:
        yield lm
    finally:
        lock.release()


@st.cache_data(show_spinner=False, max_entries=256)
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


@st.cache_data(show_spinner=False, max_entries=32)
def evaluate_masks(key: ModelKey, pruned, text: str | None, max_tokens: int,
                   _progress=None, _should_stop=None):
    """`analysis.measure.evaluation.evaluate` of the masks pruned [B, L, H] on `text` (None = built-in)."""
    from analysis.measure import evaluation
    with exclusive(key, _progress, _should_stop) as lm:
        return evaluation.evaluate(lm, text, pruned=pruned, max_tokens=max_tokens, progress=_progress,
                                   should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16)
def z_sweep(key: ModelKey, sparsity: float, options: tuple, max_tokens: int,
            _progress=None, _should_stop=None):
    """`analysis.score.sweep.sweep_z` at one sparsity; options: params_key of scorer/scope/ord/a_q/a_kv/policy."""
    from analysis.score import sweep
    prof = profile(key)
    with exclusive(key, _progress, _should_stop) as lm:
        calib, held_out, metric, higher = sweep.split_evaluators(lm, max_tokens=max_tokens)
        return sweep.sweep_z(prof, sparsity, calib, held_out, metric=metric, higher_is_better=higher,
                             evaluate_all=True, progress=_progress, should_stop=_should_stop, **dict(options))


@st.cache_data(show_spinner=False, max_entries=16)
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


@st.cache_data(show_spinner=False, max_entries=8)
def ablation(key: ModelKey, text: str | None, max_tokens: int, _progress=None, _should_stop=None):
    """`analysis.measure.ablation.head_ablation`: the loss change when each head alone is removed."""
    from analysis.measure import ablation as ablation_mod
    with exclusive(key, _progress, _should_stop) as lm:
        return ablation_mod.head_ablation(lm, text, max_tokens=max_tokens, progress=_progress,
                                          should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8)
def head_roles(key: ModelKey, text: str | None, max_tokens: int, _progress=None, _should_stop=None):
    """`analysis.measure.roles.head_roles` on `text` (None = built-in evaluation text)."""
    from analysis.measure import roles
    with exclusive(key, _progress, _should_stop) as lm:
        return roles.head_roles(lm, text, max_tokens=max_tokens, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8)
def head_redundancy(key: ModelKey, text: str | None, max_tokens: int, kind: str, threshold: float,
                    ablation_delta=None, _progress=None, _should_stop=None):
    """`analysis.measure.redundancy.head_redundancy` (with single-head effects for the redundant flag)."""
    from analysis.measure import redundancy
    with exclusive(key, _progress, _should_stop) as lm:
        return redundancy.head_redundancy(lm, text, ablation_delta=ablation_delta, kind=kind, threshold=threshold,
                                          max_tokens=max_tokens, progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=16)
def attention_pattern(key: ModelKey, sentence: str, max_tokens: int = 64):
    """(tokens, probabilities [L, H, T, T]) of every head on one sentence (analysis.measure.roles)."""
    from analysis.measure import evaluation
    from analysis.measure import roles
    with exclusive(key) as lm:
        ids = evaluation.token_ids(lm.tokenizer, sentence, max_tokens=max_tokens)      # [T]
        probs = roles.attention_probabilities(lm.model, ids.unsqueeze(0))[0]           # [L, H, T, T]
        tokens = [lm.tokenizer.decode([int(i)]) for i in ids]
    return tokens, probs.numpy()


@st.cache_data(show_spinner=False, max_entries=8)
def head_attribution(key: ModelKey, text: str | None, max_tokens: int, n_steps: int,
                     _progress=None, _should_stop=None):
    """`analysis.measure.attribution.head_attribution`: Captum integrated gradients over the head gates."""
    from analysis.measure import attribution
    with exclusive(key, _progress, _should_stop) as lm:
        return attribution.head_attribution(lm, text, max_tokens=max_tokens, seq_len=max_tokens, n_steps=n_steps,
                                            progress=_progress, should_stop=_should_stop)


@st.cache_data(show_spinner=False, max_entries=8)
def forward_rate(key: ModelKey, batch: int = 2, tokens: int = 128) -> float:
    """Tokens per second of a forward pass on batch x tokens on this machine (a warm-up, then the median
    of three): the Pipeline page's time estimate is built on it."""
    import statistics
    import time

    import torch
    from analysis.arch.adapters import input_device
    with exclusive(key) as lm:
        ids = torch.randint(0, int(lm.model.config.vocab_size), (batch, tokens), device=input_device(lm.model))
        times = []
        with torch.no_grad():
            for _ in range(4):
                t0 = time.perf_counter()
                lm.model(input_ids=ids)
                times.append(time.perf_counter() - t0)
    return batch * tokens / max(statistics.median(times[1:]), 1e-6)


@st.cache_data(show_spinner=False, max_entries=8)
def speed_report(key: ModelKey, pruned, prefill: tuple, repeats: int, kv_policy: str = "auto",
                 _progress=None, _should_stop=None):
    """`analysis.compress.speed.measure`: size, FLOPs and latency of dense vs masked vs physically pruned."""
    from analysis.compress import speed
    with exclusive(key, _progress, _should_stop) as lm:
        return speed.measure(lm.model, pruned, kv_policy=kv_policy, prefill=prefill, repeats=repeats,
                             progress=_progress, should_stop=_should_stop)
