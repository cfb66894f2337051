"""The retrieval-aware score of a KV head: how much of the needle answer's log-probability windowing it alone
loses (issue 45; DuoAttention's criterion, Xiao et al. 2024, measured head by head instead of trained).

The streaming score (analysis.measure.longheads) asks how much a KV head's *output* changes under the window
on plain text; a head whose output barely changes there can still be the one that carries a needle from far
back to the answer. This score asks the answer directly:

- rows: the retrieval score's needle items (`longheads.needle_items` of the calibration split, apart from every
  verdict's rows: [BOS], built-in text with a needle
  sentence at a depth, the question, the needle's content as the answer, teacher-forced), kept only when the
  window hides the whole needle from every answer row (`hidden_needles`: a needle the window still reads
  measures nothing about retrieval);
- for every (layer l, KV head j): the model runs with that KV head alone reading only the plan's window
  (analysis.arch.spans.windowed, the KV plan's own mechanism), every other head full; the answer's
  log-probability is log p(a_1 .. a_k | row) = sum_t log p(a_t | row, a_<t), teacher-forced;
- score[l, j] = mean over rows of (dense answer log-probability - windowed), in nats. Higher = windowing this
  head loses the answer = keep it full; 0 = the answer does not notice; ln 2 (the threshold) = windowing the
  head alone halves the answer's probability.

Cost: L x Hkv + 1 forward passes per row, made cheaper by prefix reuse (`method="fast"`): windowing a head of
layer l changes nothing before layer l, so one dense pass captures every layer's call
(analysis.measure.ablation.probe_calls) and each windowed head replays only layers l .. L-1 (`ablation.replay`),
its KV heads' layer outputs stacked into one batch; the final norm and LM head (`ablation.tail_chain`) read
only the answer rows. Work per row: L + Hkv * L (L + 1) / 2 layer passes, i.e. 1 + Hkv (L + 1) / 2 forward
passes instead of 1 + L * Hkv. `method="naive"` (the reference, and the fallback for a model whose tail
cannot be replayed) runs one whole forward per KV head. Stop is checked after every replayed layer.

Shapes: scores per KV head [L, Hkv]; per row [L, Hkv, n]; the detector's map [L, H] shows each query head
its KV head's score.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from analysis.arch.adapters import adapter_for, input_device
from analysis.arch.spans import windowed
from analysis.arch.window import Window, window_of
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.ablation import _input_of, apply_chain, call_batch_paths, probe_calls, replay, tail_chain
from analysis.measure.evaluation import context_length
from analysis.measure.headmaps import Detection, gates_array, masked, zero_pruned
from analysis.measure.long_options import (DEFAULT_DEPTHS, DEFAULT_NEEDLES, MAX_BATCH, MAX_NEEDLES,
                                           RETRIEVAL_AWARE_BATCH, RETRIEVAL_AWARE_LENGTHS, RETRIEVAL_AWARE_THRESHOLD)
from analysis.measure.longheads import (NeedleItem, _logits_kwargs, check_depths, check_lengths, default_lengths,
                                        needle_items, whole_model)
from analysis.measure.loss import token_nll
from analysis.measure.splits import SCORE_SPLIT

METHODS = ("fast", "naive")
TAIL_TOKENS = 8                      # tokens of the short pass that finds the tail (final norm, LM head)
WHAT = "Retrieval-aware scores"


def hidden_needles(items: list[NeedleItem], window: Window) -> list[NeedleItem]:
    """The items whose whole needle a windowed head cannot read from any answer row (Window.reads: neither a
    sink nor among the recent tokens of the row)."""
    window = window_of(window)
    return [it for it in items
            if not window.reads(it.rows, torch.arange(it.needle_start, it.needle_end)).any()]


@dataclass(frozen=True)
class WindowedAnswers:
    """What windowing each KV head alone does to the needle answers (module docstring)."""
    delta: np.ndarray            # [L, Hkv, n] dense answer log-probability - windowed, per row (nats)
    dense: np.ndarray            # [n] the dense model's answer log-probabilities
    accuracy: np.ndarray         # [n] the dense model's teacher-forced top-1 accuracy on each answer's tokens
    method: str                  # "fast" (prefix reuse) | "naive" (one whole forward per KV head)
    layer_passes: int            # layer forward passes run, summed over rows (the cost; / L = forward passes)
    seconds: float

    @property
    def scores(self) -> np.ndarray:
        """[L, Hkv] mean over rows of the log-probability lost."""
        return self.delta.mean(-1)


def _one_head(shape: tuple[int, int], layer: int, head: int) -> np.ndarray:
    """[L, Hkv] bool with only (layer, head) windowed."""
    rows = np.zeros(shape, dtype=bool)
    rows[layer, head] = True
    return rows


def _answers(chain, hidden: torch.Tensor, chunk: list[NeedleItem], reps: int) -> tuple[np.ndarray, np.ndarray]:
    """(answer log-probabilities [reps, n], top-1 accuracy [reps, n]) from the last layer's output hidden
    [reps*n, T, D] (variant-major), the tail applied to each row's answer rows only."""
    n = len(chunk)
    logprob, accuracy = np.zeros((reps, n)), np.zeros((reps, n))
    for v in range(reps):
        for i, item in enumerate(chunk):
            rows = item.rows.to(hidden.device)                           # [k]
            logits = apply_chain(chain, hidden[v * n + i, rows])         # [k, V]
            logprob[v, i], accuracy[v, i] = _scored(logits, item.targets.to(logits.device))
    return logprob, accuracy


def _scored(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(summed log-probability of targets [k] under logits [k, V] in float64, top-1 accuracy)."""
    logprob = -float(token_nll(logits, targets).double().sum())
    return logprob, float((logits.argmax(-1) == targets).double().mean())


class _Work:
    """Layer passes done / to do, for progress."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = max(total, 1), 0, progress

    def add(self, passes: int, message: str) -> None:
        self.done += passes
        report(self.progress, self.done / self.total, message)


def _fast_chunk(model, adapter, x: torch.Tensor, chunk: list[NeedleItem], window: Window, batch_size: int,
                work: _Work, should_stop: ShouldStop | None):
    """(dense [n], accuracy [n], delta [L, Hkv, n]) of one batch of rows x [n, T] by prefix reuse; None when the
    model's tail cannot be replayed."""
    chain = tail_chain(model, x[:, :min(x.shape[1], TAIL_TOKENS)], adapter)
    if chain is None:
        return None
    blocks = adapter.layers(model)
    geo = adapter.geometry(model)
    L, Hkv, n = geo.n_layers, geo.n_kv_heads, x.shape[0]
    check_stop(should_stop, WHAT)
    calls = probe_calls(model, blocks, x)                               # every layer's call; the last does not run
    batched = call_batch_paths(model, calls, x[:, :min(x.shape[1], TAIL_TOKENS)])
    inputs = [_input_of(*call) for call in calls]                      # L x [n, T, D]

    def each(j: int) -> None:
        check_stop(should_stop, WHAT)

    dense_out = replay(blocks, calls, batched, inputs[L - 1], 1, L - 1)  # [n, T, D]
    dense, accuracy = (a[0] for a in _answers(chain, dense_out, chunk, 1))
    work.add(L * n, "retrieval-aware scores: the dense pass")
    delta = np.zeros((L, Hkv, n))
    per_pass = max(1, batch_size // n)                                  # KV heads windowed per replay
    for layer in range(L):
        for start in range(0, Hkv, per_pass):
            heads = range(start, min(start + per_pass, Hkv))
            outs = []
            for j in heads:
                with windowed(model, _one_head((L, Hkv), layer, j), window):
                    outs.append(replay(blocks, calls, batched, inputs[layer], 1, layer, layer + 1))   # [n, T, D]
            check_stop(should_stop, WHAT)
            hidden = replay(blocks, calls, batched, torch.cat(outs), len(outs), layer + 1, each=each)  # [r*n, T, D]
            logprob, _ = _answers(chain, hidden, chunk, len(outs))      # [r, n]
            delta[layer, start:start + len(outs)] = dense[None] - logprob
            work.add(len(outs) * (L - layer) * n, f"retrieval-aware scores: layer {layer + 1}/{L}, KV head "
                                                  f"{heads[-1] + 1}/{Hkv}")
    return dense, accuracy, delta


def _last_logits(model, x: torch.Tensor, chunk: list[NeedleItem]) -> list[torch.Tensor]:
    """One whole forward of x [n, T] (whatever spans are active) -> each row's answer logits [k, V]."""
    T = x.shape[1]
    keep = T - min(int(it.rows[0]) for it in chunk)
    logits = model(x, **_logits_kwargs(model, keep)).logits            # [n, keep or T, V]
    first = T - logits.shape[1]
    return [logits[i, it.rows.to(logits.device) - first] for i, it in enumerate(chunk)]   # n x [k, V]


def _naive_chunk(model, adapter, x: torch.Tensor, chunk: list[NeedleItem], window: Window, work: _Work,
                 should_stop: ShouldStop | None):
    """(dense [n], accuracy [n], delta [L, Hkv, n]): one whole forward per windowed KV head (the reference)."""
    geo = adapter.geometry(model)
    L, Hkv, n = geo.n_layers, geo.n_kv_heads, x.shape[0]

    def scored(logits: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        pairs = [_scored(lg, it.targets.to(lg.device)) for lg, it in zip(logits, chunk)]
        return np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])

    check_stop(should_stop, WHAT)
    dense, accuracy = scored(_last_logits(model, x, chunk))
    work.add(L * n, "retrieval-aware scores: the dense pass")
    delta = np.zeros((L, Hkv, n))
    for layer in range(L):
        for j in range(Hkv):
            check_stop(should_stop, WHAT)
            with windowed(model, _one_head((L, Hkv), layer, j), window):
                logprob, _ = scored(_last_logits(model, x, chunk))
            delta[layer, j] = dense - logprob
            work.add(L * n, f"retrieval-aware scores (naive): layer {layer + 1}/{L}, KV head {j + 1}/{Hkv}")
    return dense, accuracy, delta


def layer_passes(geo, n_rows: int, method: str) -> int:
    """Layer forward passes the score runs on n_rows rows (module docstring)."""
    L, Hkv = geo.n_layers, geo.n_kv_heads
    per_row = L + Hkv * L * (L + 1) // 2 if method == "fast" else L * (1 + L * Hkv)
    return n_rows * per_row


def _chunks(items: list[NeedleItem], batch_size: int) -> list[list[NeedleItem]]:
    """Items of one length together, at most batch_size per forward pass, in the items' order."""
    by_length: dict[int, list] = {}
    for it in items:
        by_length.setdefault(int(it.ids.numel()), []).append(it)
    return [rows[i:i + batch_size] for rows in by_length.values() for i in range(0, len(rows), batch_size)]


def windowed_answers(model, items: list[NeedleItem], *, window: Window, gates=None,
                     batch_size: int = RETRIEVAL_AWARE_BATCH, method: str = "fast", progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> WindowedAnswers:
    """For every (layer, KV head) of `model`: each item's answer log-probability lost when that KV head alone
    reads only `window` (module docstring), under the head mask `gates` if given. batch_size: rows per forward
    pass (needle rows x KV heads windowed)."""
    if not items:
        raise InputError("The retrieval-aware score needs at least one needle row.")
    if method not in METHODS:
        raise InputError(f"Unknown method {method!r}; use {' or '.join(METHODS)}.")
    window = window_of(window)
    batch_size = check_whole_number(batch_size, "The batch size (rows per pass)", low=1, high=MAX_BATCH)
    adapter, geo = whole_model(model, "The retrieval-aware score")
    g = gates_array(model, gates)
    device = input_device(model)
    t0 = time.perf_counter()
    chunks = _chunks(items, batch_size)
    work = _Work(layer_passes(geo, len(items), method), progress)
    dense, accuracy, delta, used = [], [], [], set()
    with torch.no_grad(), masked(model, g):
        for chunk in chunks:
            x = torch.stack([it.ids for it in chunk]).to(device)        # [n, T]
            out = _fast_chunk(model, adapter, x, chunk, window, batch_size, work, should_stop) if method == "fast" \
                else None
            if out is None:
                work.total += layer_passes(geo, len(chunk), "naive") - layer_passes(geo, len(chunk), method)
                out = _naive_chunk(model, adapter, x, chunk, window, work, should_stop)
                used.add("naive")
            else:
                used.add("fast")
            dense.append(out[0])
            accuracy.append(out[1])
            delta.append(out[2])
    return WindowedAnswers(np.concatenate(delta, axis=-1), np.concatenate(dense), np.concatenate(accuracy),
                           "fast" if used == {"fast"} else "naive", work.done, time.perf_counter() - t0)


class RetrievalAwareDetector:
    """Retrieval-aware window score per KV head (module docstring); verb: detect."""
    name = "retrieval-aware"
    threshold = RETRIEVAL_AWARE_THRESHOLD
    unit = "nats of the needle answer lost"

    def __init__(self, lengths=None, depths=DEFAULT_DEPTHS, needles: int = DEFAULT_NEEDLES,
                 window: Window = Window(), seed: int = 0, batch_size: int = RETRIEVAL_AWARE_BATCH,
                 method: str = "fast", tokenizer=None):
        self.lengths = None if lengths is None else check_lengths(lengths)
        self.depths = check_depths(depths)
        self.needles = check_whole_number(needles, "The number of needles", low=1, high=MAX_NEEDLES)
        self.window = window_of(window)
        self.seed = check_seed(seed)
        self.batch_size = check_whole_number(batch_size, "The batch size (rows per pass)", low=1, high=MAX_BATCH)
        if method not in METHODS:
            raise InputError(f"Unknown method {method!r}; use {' or '.join(METHODS)}.")
        self.method = method
        self.tokenizer = tokenizer

    def resolved_lengths(self, model) -> tuple[int, ...]:
        """The lengths it reads on `model`: the ones given (checked against its context) or the defaults that fit."""
        limit = context_length(model)
        return check_lengths(self.lengths, limit) if self.lengths else default_lengths(RETRIEVAL_AWARE_LENGTHS, limit)

    def built(self, model) -> tuple[list[NeedleItem], int]:
        """(the rows whose needle the window hides, how many rows it left out: the window reads their needle)."""
        if self.tokenizer is None:
            raise InputError("The retrieval-aware score builds its rows with the model's tokenizer; this model has "
                             "none.")
        lengths = self.resolved_lengths(model)
        every = needle_items(self.tokenizer, lengths, self.depths, needles=self.needles, seed=self.seed,
                             split=SCORE_SPLIT)
        kept = hidden_needles(every, self.window)
        if not kept:
            raise InputError(f"At {', '.join(map(str, lengths))} tokens the window ({self.window.describe()}) still "
                             f"reads every needle from its answer, so windowing cannot hide one; use a longer context, "
                             f"a smaller window or smaller depths.")
        return kept, len(every) - len(kept)

    def items(self, model) -> list[NeedleItem]:
        return self.built(model)[0]

    def passes(self, model) -> list[int]:
        """The forward-pass equivalents `detect` runs (layer passes / L), each of its row's tokens (for time
        estimates)."""
        geo = adapter_for(model).geometry(model)
        return [it.length for it in self.items(model)
                for _ in range(round(layer_passes(geo, 1, self.method) / geo.n_layers))]

    @classmethod
    def for_options(cls, tokenizer, options: dict) -> "RetrievalAwareDetector":
        """The detector's builder (its record's `build`): the shared options it takes (lengths, depths, needles,
        seed, sinks, recent), and the tokenizer."""
        taken = {k: v for k, v in options.items() if k in ("lengths", "depths", "needles", "seed")}
        window = Window(**{k: options[k] for k in ("sinks", "recent") if options.get(k) is not None})
        return cls(tokenizer=tokenizer, window=window, **taken)

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        whole_model(model, "The retrieval-aware score", layout)
        items, left_out = self.built(model)
        res = windowed_answers(model, items, window=self.window, gates=gates, batch_size=self.batch_size,
                               method=self.method, progress=progress, should_stop=should_stop)
        geo = adapter_for(model).geometry(model)
        kv = res.scores                                                 # [L, Hkv]
        scores = zero_pruned(np.repeat(kv, geo.group_size, axis=1), gates_array(model, gates))   # [L, H]
        extras = dict(lengths=sorted({it.length for it in items}), depths=sorted({it.depth for it in items}),
                      needles=self.needles, seed=self.seed, **self.window.as_dict(), n_items=len(items),
                      left_out=left_out, kv_scores=kv, item_deltas=res.delta, dense_logprob=res.dense,
                      answer_accuracy=float(res.accuracy.mean()), method=res.method,
                      forward_passes=res.layer_passes / geo.n_layers, seconds=res.seconds)
        return Detection(self.name, scores, self.threshold, self.unit, extras)


__all__ = ["RetrievalAwareDetector", "WindowedAnswers", "windowed_answers", "hidden_needles", "layer_passes",
           "METHODS"]
