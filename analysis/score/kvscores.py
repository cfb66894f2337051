"""The per-KV-head scores a KV plan is made from, and the plan made from them (`headscope kv-plan`).

- **the window score** [L, Hkv], one of `WINDOW_SCORES` (declared once in analysis.measure.long_options; each is
  a long detector of the registry, measured through it): **streaming** (analysis.measure.longheads, the
  default): how much each KV head's output changes when it reads only the plan's own window (sinks + recent)
  instead of everything, on long built-in text; **retrieval-aware** (analysis.measure.retrieval_aware): how
  much of a needle answer's log-probability windowing that KV head alone loses. The lowest are windowed
  (`window_share` of the KV heads); kv_plan.json's notes name the score.
- **retrieval** [L, Hkv]: the highest retrieval score among the KV head's query heads (Wu et al. 2024's
  copy-paste score). A KV head holding a retrieval head (score >= the threshold, 0.1) stays full whatever
  its streaming score (`keep_retrieval`): its query heads copy facts from far back.
- **importance** [L, Hkv], only when the plan prunes (`prune_share` > 0): the loss increase when the whole
  KV group is removed, on the built-in evaluation text at `prune_tokens` tokens (analysis.measure.ablation's
  fast sweep). The lowest are pruned first. Why this one: pruning removes a head at every position, near
  and far, so what it costs shows on ordinary text already, where the sweep is affordable (about L/2
  short forward passes per head); the long-range part of a head's job is what the retrieval score
  guards, and a retrieval head is never pruned (it is kept before anything is chosen).

`plan_kv` is the one planner (any scores [L, Hkv] -> a plan): prune first, then window among the rest, kept
heads full; `plan_from_scores` hands it these scores (the window score it is told), retrieval heads kept, and
notes where each choice came from. Plans from either window score at the same shares hold the same KV bytes:
the score decides which heads are windowed, never how many.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import PRUNE, WINDOW, KVPlan
from analysis.arch.window import Window, window_of
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.core.text import check_max_tokens
from analysis.measure.longheads import (DEFAULT_DEPTHS, DEFAULT_NEEDLES, DEFAULT_QUERIES, RETRIEVAL_THRESHOLD,
                                        RetrievalDetector, per_kv)
from analysis.measure.detector_registry import detector_spec
from analysis.measure.long_options import DEFAULT_PRUNE_TOKENS, DEFAULT_WINDOW_SCORE, WINDOW_SCORES

# docs/results.md section written by scripts/kv_heads_results.py
KV_HEADS_MARKERS = ("<!-- kv-heads:begin -->", "<!-- kv-heads:end -->")


@dataclass
class KVScores:
    """Scores per KV head [L, Hkv] (None: not measured), the detections behind them and the seconds spent. Each
    window score of `WINDOW_SCORES` is the field of its name (dashes as underscores)."""
    streaming: np.ndarray | None = None
    retrieval: np.ndarray | None = None
    importance: np.ndarray | None = None
    detections: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    prune_tokens: int = 0
    retrieval_aware: np.ndarray | None = None

    def window_score(self, name: str = DEFAULT_WINDOW_SCORE) -> np.ndarray:
        """[L, Hkv] the window score `name` (lower = window first); InputError when unknown or not measured."""
        value = getattr(self, _field(check_window_score(name)))
        if value is None:
            raise InputError(f"Windowing by the {name} score needs it; measure it (window_score={name!r}) first.")
        return value

    def with_window_score(self, name: str, values) -> "KVScores":
        """These scores with the window score `name` set to values [L, Hkv]."""
        setattr(self, _field(check_window_score(name)), values)
        return self


def check_window_score(name: str) -> str:
    """`name` when it is one of WINDOW_SCORES; InputError naming them otherwise."""
    if name not in WINDOW_SCORES:
        raise InputError(f"Unknown window score {name!r}; use one of {', '.join(WINDOW_SCORES)}.")
    return name


def _field(name: str) -> str:
    return name.replace("-", "_")


def measure_kv_scores(loaded, *, window: Window = Window(), lengths=None,
                      retrieval_lengths=None, depths=DEFAULT_DEPTHS, needles: int = DEFAULT_NEEDLES,
                      queries: int = DEFAULT_QUERIES, retrieval: bool = True, prune: bool = False,
                      prune_tokens: int = DEFAULT_PRUNE_TOKENS, window_score: str = DEFAULT_WINDOW_SCORE,
                      seed: int = 0, progress: Progress | None = None,
                      should_stop: ShouldStop | None = None) -> KVScores:
    """Measure what a plan needs on `loaded` (model, tokenizer, geometry): the `window_score` (streaming: at
    `lengths` with the `window`; retrieval-aware: needles at `lengths` x `depths` hidden by the `window`), the
    retrieval score at `retrieval_lengths` (default: `lengths`) when `retrieval`, the KV-group ablation at
    `prune_tokens` when `prune`. Every option is checked before the first forward pass."""
    seed = check_seed(seed, "The KV scores' seed")
    model = loaded.model
    check_window_score(window_score)
    options = dict(lengths=lengths, depths=depths, needles=needles, queries=queries, seed=seed, **window.as_dict())
    windowing = detector_spec(window_score).builder(loaded.tokenizer, options)
    retriever = RetrievalDetector(retrieval_lengths or lengths, depths, needles, seed, tokenizer=loaded.tokenizer)
    windowing.passes(model)                                             # lengths vs the context, the rows
    if retrieval:
        retriever.items(model)
    if prune:
        check_max_tokens(prune_tokens, "The tokens of the pruning ablation")
        check_whole_number(prune_tokens, "The tokens of the pruning ablation", low=2)
    steps = [window_score] + (["retrieval"] if retrieval else []) + (["importance"] if prune else [])
    out = KVScores()
    for i, what in enumerate(steps):
        part = scaled(progress, i / len(steps), (i + 1) / len(steps))
        t0 = time.perf_counter()
        if what == "importance":
            out.importance = group_importance(loaded, prune_tokens, progress=part, should_stop=should_stop)
            out.prune_tokens = int(prune_tokens)
        elif what == "retrieval":
            det = out.detections["retrieval"] = retriever.detect(model, progress=part, should_stop=should_stop)
            out.retrieval = det.extras["kv_scores"]
        else:
            det = out.detections[what] = windowing.detect(model, progress=part, should_stop=should_stop)
            out.with_window_score(what, det.extras["kv_scores"])
        out.seconds[what] = time.perf_counter() - t0
    return out


def group_importance(loaded, tokens: int, *, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> np.ndarray:
    """[L, Hkv] loss increase when each whole KV group is removed (the fast ablation sweep of the KV groups alone
    on `tokens` tokens of the built-in calibration text, one sequence: like every score, apart from the rows a
    verdict reads, analysis.measure.splits); MHA: the single-head deltas."""
    from analysis.core.text import calibration_text
    from analysis.measure.ablation import head_ablation
    gqa = loaded.geometry.group_size > 1                 # the groups alone: a quarter of the sweep on SmolLM2
    res = head_ablation(loaded, calibration_text(max_chars=16 * tokens), max_tokens=tokens, seq_len=tokens, heads=not gqa, progress=progress,
                        should_stop=should_stop)
    return np.asarray(res.group_delta if res.group_delta is not None else res.head_delta, dtype=np.float64)


def retrieval_keep(scores: KVScores, threshold: float = RETRIEVAL_THRESHOLD) -> np.ndarray | None:
    """[L, Hkv] bool: KV heads holding a retrieval head (None when retrieval was not measured)."""
    return None if scores.retrieval is None else scores.retrieval >= threshold


def plan_from_scores(geometry: HeadGeometry, scores: KVScores, *, window_share: float = 0.5,
                     prune_share: float = 0.0, keep_retrieval: bool = True,
                     retrieval_threshold: float = RETRIEVAL_THRESHOLD, window: Window = Window(),
                     window_score: str = DEFAULT_WINDOW_SCORE, model: str = "") -> KVPlan:
    """The plan: `prune_share` of the KV heads with the lowest importance pruned, then `window_share` with
    the lowest `window_score` (one of WINDOW_SCORES) windowed, KV heads with a retrieval head kept full
    (`keep_retrieval`). Its notes say which score chose each mode."""
    if prune_share and scores.importance is None:
        raise InputError("Pruning KV heads needs their importance; measure it (prune=True) first.")
    keep = retrieval_keep(scores, retrieval_threshold) if keep_retrieval else None
    if keep_retrieval and keep is None:
        raise InputError("Keeping the retrieval heads needs their retrieval score; measure it (retrieval=True) first.")
    plan = plan_kv(geometry, scores.window_score(window_score), window_share=window_share,
                   prune_scores=scores.importance, prune_share=prune_share, keep=keep, window=window, model=model)
    det = scores.detections.get(window_score)
    lengths = det.extras["lengths"] if det is not None else []
    notes = [f"windowed: the lowest {window_score} scores, under {plan.window.describe()}"
             + (f", measured at {', '.join(map(str, lengths))} tokens" if lengths else "")
             + f" (the {window_score} score: {detector_spec(window_score).title})"]
    if keep is not None:
        notes.append(f"kept full: {int(keep.sum())} KV heads with a retrieval head (score >= {retrieval_threshold:g}): "
                     + (", ".join(f"L{l}KV{j}" for l, j in zip(*np.nonzero(keep))) or "none"))
    if prune_share:
        notes.append(f"pruned: the lowest KV-group ablation loss increases on {scores.prune_tokens} tokens of the "
                     f"built-in calibration text")
    return plan.with_modes(plan.modes, *notes)


def check_plan_options(geometry: HeadGeometry, *, window_share: float, prune_share: float) -> None:
    """The plan's options checked before anything is measured (plan_kv's own checks, on zero scores)."""
    zeros = np.zeros((geometry.n_layers, geometry.n_kv_heads))
    plan_kv(geometry, zeros, window_share=window_share, prune_scores=zeros, prune_share=prune_share)


def plan_kv(geometry: HeadGeometry, window_scores: np.ndarray, *, window_share: float = 0.5,
            prune_scores: np.ndarray | None = None, prune_share: float = 0.0, keep: np.ndarray | None = None,
            window: Window = Window(), model: str = "") -> KVPlan:
    """A plan from scores [L, Hkv]: first the `prune_share` of KV heads with the lowest `prune_scores` are
    pruned (higher = needed more, e.g. the long-context probes' drop), then the `window_share` of KV heads
    with the lowest `window_scores` (a window score: higher = needs the full context) among the rest are
    windowed.
    `keep` [L, Hkv] bool: heads that stay full whatever their scores (e.g. retrieval heads). Ties break
    by (layer, head), so plans are deterministic."""
    shape = (geometry.n_layers, geometry.n_kv_heads)
    s = _scores(window_scores, shape, "window scores")
    keep = np.zeros(shape, bool) if keep is None else np.asarray(keep, bool)
    if keep.shape != shape:
        raise InputError(f"The heads to keep must be [{shape[0]}, {shape[1]}]; got {list(keep.shape)}.")
    for share, what in ((window_share, "window share"), (prune_share, "prune share")):
        if not 0.0 <= float(share) <= 1.0:
            raise InputError(f"The {what} is a fraction of the KV heads, 0 to 1; got {share}.")
    if window_share + prune_share > 1.0 + 1e-12:
        raise InputError(f"Windowing {window_share:.0%} and pruning {prune_share:.0%} of the KV heads is more than all.")
    modes = np.zeros(shape, np.int8)
    n = s.size
    free = ~keep.ravel()
    if prune_share:
        if prune_scores is None:
            raise InputError("Pruning KV heads needs their importance (prune_scores).")
        p = _scores(prune_scores, shape, "prune scores").ravel()
        order = [i for i in np.lexsort((np.arange(n), p)) if free[i]]
        for i in order[:int(np.floor(prune_share * n))]:
            modes.flat[i] = PRUNE
        free &= modes.ravel() != PRUNE
    order = [i for i in np.lexsort((np.arange(n), s.ravel())) if free[i]]
    for i in order[:int(np.floor(window_share * n))]:
        modes.flat[i] = WINDOW
    return KVPlan(modes, window_of(window), geometry.n_heads, model)


def _scores(values, shape, what: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.shape != shape:
        raise InputError(f"The {what} must be [{shape[0]}, {shape[1]}] (layers x KV heads); got {list(a.shape)}.")
    if not np.isfinite(a).all():
        raise InputError(f"The {what} contain NaN or infinity.")
    return a


def kv_heads_summary(scores: KVScores, group_size: int) -> dict:
    """JSON-able numbers of the measured scores (per KV head arrays, the retrieval heads per query head)."""
    out = {name: getattr(scores, _field(name)) for name in WINDOW_SCORES if getattr(scores, _field(name)) is not None}
    out["seconds"] = scores.seconds
    aware = scores.detections.get("retrieval-aware")
    if aware is not None:
        out["retrieval_aware_rows"] = {k: aware.extras[k] for k in ("n_items", "left_out", "answer_accuracy",
                                                                     "dense_logprob", "forward_passes", "method")}
    if scores.retrieval is not None:
        det = scores.detections["retrieval"]
        out.update(retrieval=scores.retrieval, retrieval_heads=[dict(layer=l, head=h, score=s) for l, h, s in
                                                                 det.tagged()],
                   answer_accuracy=det.extras["answer_accuracy"], accuracy_by_length=det.extras["accuracy_by_length"])
    if scores.importance is not None:
        out.update(importance=scores.importance, prune_tokens=scores.prune_tokens)
    return out


__all__ = ["KVScores", "check_window_score", "measure_kv_scores", "group_importance", "plan_kv", "plan_from_scores", "retrieval_keep",
           "check_plan_options", "kv_heads_summary", "KV_HEADS_MARKERS", "per_kv"]
