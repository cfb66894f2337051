"""Sparsity curves: the metric of a model vs head sparsity for one [L, H] score array, every level's
mask built by a policy of `analysis.score.masks` and all masks evaluated in the same batched passes
(`analysis.measure.evaluation.evaluate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from analysis.arch.adapters import adapter_for
from analysis.core.errors import InputError
from analysis.core.progress import Progress, ShouldStop
from analysis.measure.evaluation import evaluate
from analysis.score.masks import plan_mask


def lowest_scores_mask(scores, sparsity: float) -> np.ndarray:
    """Default mask_fn: `analysis.score.masks.plan_mask`'s global policy, bool [L, H] (True = pruned).

    scores: [L, H] (ties by (layer, head)) or a HeadScores (ties by its tie-break first)."""
    return plan_mask(scores, sparsity).pruned                          # [L, H]


@dataclass(frozen=True)
class SparsityCurve:
    sparsities: np.ndarray   # [S] requested fractions of heads pruned
    n_pruned: np.ndarray     # [S] heads actually pruned by mask_fn
    values: np.ndarray       # [S] metric at each sparsity
    metric: str
    higher_is_better: bool
    skipped: tuple = ()      # (sparsity, why) of levels the mask policy cannot build (left out above)


def sparsity_levels(max_sparsity: float = 0.6, step: float = 0.1) -> np.ndarray:
    """0, step, 2*step, ... up to max_sparsity (inclusive, rounded to avoid float drift)."""
    if not (0 < step <= 1) or not (0 <= max_sparsity < 1):
        raise InputError(f"Sparsity step {step} / maximum {max_sparsity} are invalid: need 0 < step <= 1 "
                         "and 0 <= maximum < 1.")
    n = int(math.floor(max_sparsity / step + 1e-9))
    return np.round(np.arange(n + 1) * step, 10)


def sparsity_curve(loaded, scores, text: str | bytes | None = None, *, sparsities=None,
                   max_sparsity: float = 0.6, step: float = 0.1,
                   mask_fn: Callable[[np.ndarray, float], np.ndarray] | None = None,
                   progress: Progress | None = None, should_stop: ShouldStop | None = None,
                   **eval_options) -> SparsityCurve:
    """The metric of `loaded` vs head sparsity for one [L, H] score array.

    mask_fn(scores, sparsity) -> bool [L, H] (True = pruned) builds each mask (pass
    analysis.score.masks' policy; default: prune the lowest scores); a level where it raises InputError
    (the policy cannot build it) is left out and listed in `skipped`. All masks are evaluated in
    the same batched passes. eval_options go to `evaluate` (max_tokens, window, batch_size, ...)."""
    geometry = adapter_for(loaded.model).geometry(loaded.model)
    s = np.asarray(scores, dtype=np.float64)
    if s.shape != (geometry.n_layers, geometry.n_heads):
        raise InputError(f"Scores must have shape [{geometry.n_layers}, {geometry.n_heads}] (layers x heads); "
                         f"got {list(s.shape)}.")
    levels = sparsity_levels(max_sparsity, step) if sparsities is None else np.asarray(sparsities, dtype=float)
    mask_fn = mask_fn or lowest_scores_mask
    built, skipped = [], []
    for x in levels:        # a policy with a coarse step (balanced-uniform) cannot build every level
        try:
            built.append((float(x), np.asarray(mask_fn(s, float(x)), dtype=bool)))
        except InputError as err:
            skipped.append((float(x), str(err)))
    if not built:
        raise InputError(f"The mask policy cannot build any of the requested sparsities: {skipped[0][1]}")
    levels = np.array([x for x, _ in built])                                          # [S]
    masks = np.stack([m for _, m in built])                                           # [S, L, H]
    ev = evaluate(loaded, text, pruned=masks, progress=progress, should_stop=should_stop, **eval_options)
    return SparsityCurve(levels, masks.reshape(len(levels), -1).sum(1), ev.values, ev.metric,
                         ev.higher_is_better, tuple(skipped))
