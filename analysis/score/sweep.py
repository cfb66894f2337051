"""z sweeps: how the MP / MP-G threshold z changes the mask and the model's quality.

For a fixed head sparsity, each z gives MP(-G) scores (an array operation on the cached
`NormProfile`), a mask (analysis.score.masks), the number of heads in the bulk (score 0), and the
model's metric on the *calibration* split. Different z often give the same mask; each
distinct mask is evaluated once, and all of them in one batched call. The suggested z is the
best on the calibration split (ties: the one closest to the default 2.0, then the smaller);
the *evaluation* split's metric is reported beside it, so the choice is not judged on the
text it was picked on.

Evaluation is injected: `MaskEvaluator(pruned [B, L, H] bool) -> values [B]`. `split_evaluators`
builds the two callbacks for a LoadedModel from `analysis.measure.evaluation.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from analysis.core.distributed import Team
from analysis.core.errors import InputError
from analysis.measure.evaluation import evaluate, metric_of
from analysis.score.masks import plan_mask
from analysis.measure.profiles import DEFAULT_Z, NormProfile, check_z
from analysis.core.progress import Progress, ShouldStop, tick
from analysis.score.scoring import MPGScorer, MPScorer
from analysis.core.text import calibration_text, check_max_tokens, evaluation_text

MaskEvaluator = Callable[[np.ndarray], np.ndarray]
SWEEP_SCORERS = {"mp": MPScorer, "mp-g": MPGScorer}


def z_grid(start: float = 0.5, stop: float = 3.0, step: float = 0.25) -> np.ndarray:
    """start, start + step, ... <= stop, each a valid z (rounded against float drift)."""
    if not step > 0 or stop < start:
        raise InputError(f"A z grid needs step > 0 and stop >= start; got {start}, {stop}, {step}.")
    n = int(np.floor((stop - start) / step + 1e-9))
    return np.array([check_z(round(start + i * step, 10)) for i in range(n + 1)])  # [Z]


@dataclass(frozen=True)
class ZSweep:
    """Result of `sweep_z`; every array is [Z], aligned with `zs`."""

    sparsity: float
    zs: np.ndarray
    zero_score_heads: np.ndarray
    n_pruned: np.ndarray
    mask_id: np.ndarray  # index of the distinct mask each z produced
    calibration: np.ndarray
    evaluation: np.ndarray  # NaN where not evaluated
    suggested_z: float
    suggested_evaluation: float
    metric: str
    higher_is_better: bool

    def rows(self) -> list[dict]:
        """One dict per z, for tables / JSON / CSV."""
        return [dict(z=float(z), zero_score_heads=int(zero), n_pruned=int(k), mask_id=int(m),
                     calibration=float(c), evaluation=None if np.isnan(e) else float(e),
                     suggested=bool(z == self.suggested_z))
                for z, zero, k, m, c, e in zip(self.zs, self.zero_score_heads, self.n_pruned, self.mask_id,
                                               self.calibration, self.evaluation)]

    def as_dict(self) -> dict:
        return dict(sparsity=self.sparsity, metric=self.metric, higher_is_better=self.higher_is_better,
                    suggested_z=self.suggested_z, suggested_evaluation=self.suggested_evaluation,
                    rows=self.rows())


def suggest(zs: np.ndarray, values: np.ndarray, higher_is_better: bool = False) -> int:
    """Index of the best value; ties go to the z closest to DEFAULT_Z, then the smaller z."""
    values = np.asarray(values, dtype=np.float64)  # [Z]
    if not np.isfinite(values).any():
        raise InputError("Every z gave a non-finite metric; the model diverges at this sparsity. "
                         "Lower the sparsity.")
    score = np.where(np.isfinite(values), values if higher_is_better else -values, -np.inf)  # [Z]
    best = np.flatnonzero(score == score.max())
    return int(min(best, key=lambda i: (abs(zs[i] - DEFAULT_Z), zs[i])))


def sweep_z(profile: NormProfile, sparsity: float, evaluate_calibration: MaskEvaluator,
            evaluate_evaluation: MaskEvaluator | None = None, *, zs=None, scorer: str = "mp-g",
            scope: str = "layer", ord: int = 2, a_q: float = 1.0, a_kv: float = 1.0, std: str = "population",
            policy: str = "global", min_per_layer: int = 1, higher_is_better: bool = False,
            metric: str = "perplexity", evaluate_all: bool = False,
            progress: Progress | None = None, should_stop: ShouldStop | None = None) -> ZSweep:
    """Metric vs z at a fixed sparsity; see the module docstring.

    evaluate_all: also run the evaluation split for every distinct mask (else only the suggested one).
    """
    if scorer not in SWEEP_SCORERS:
        raise InputError(f"A z sweep needs a threshold scorer: {', '.join(SWEEP_SCORERS)}; got {scorer!r}.")
    zs = z_grid() if zs is None else np.array([check_z(z) for z in np.atleast_1d(zs)], dtype=np.float64)
    if zs.size == 0:
        raise InputError("The z sweep needs at least one z value.")
    extra = dict(a_q=a_q, a_kv=a_kv) if scorer == "mp-g" else {}
    plans, zero = [], []
    for z in zs:
        scores = SWEEP_SCORERS[scorer](z=z, scope=scope, ord=ord, std=std, **extra).score(profile)
        plans.append(plan_mask(scores, sparsity, group_size=profile.group_size, policy=policy,
                               min_per_layer=min_per_layer))
        zero.append(scores.zero_count)
    distinct: dict[bytes, int] = {}
    mask_id = np.array([distinct.setdefault(p.pruned.tobytes(), len(distinct)) for p in plans])  # [Z]
    masks = np.stack([plans[int(np.flatnonzero(mask_id == i)[0])].pruned for i in range(len(distinct))])  # [U, L, H]
    tick(progress, should_stop, 0.05, f"{len(zs)} z values -> {len(masks)} distinct masks; evaluating", "The z sweep")
    calib = np.asarray(evaluate_calibration(masks), dtype=np.float64)  # [U]
    tick(progress, should_stop, 0.7, "calibration split done", "The z sweep")
    best = suggest(zs, calib[mask_id], higher_is_better)
    evaluation = np.full(len(zs), np.nan)  # [Z]
    if evaluate_evaluation is not None:
        chosen = np.arange(len(masks)) if evaluate_all else np.array([mask_id[best]])
        values = np.asarray(evaluate_evaluation(masks[chosen]), dtype=np.float64)  # [len(chosen)]
        for u, value in zip(chosen, values):
            evaluation[mask_id == u] = value
    tick(progress, should_stop, 1.0, "z sweep done", "The z sweep")
    return ZSweep(float(sparsity), zs, np.array(zero), np.array([p.n_pruned for p in plans]), mask_id,
                  calib[mask_id], evaluation, float(zs[best]), float(evaluation[best]), metric, higher_is_better)


def split_evaluators(loaded, *, max_tokens: int = 512, window: int | None = None,
                     batch_size: int = 8, team: Team | None = None,
                     progress: Progress | None = None) -> tuple[MaskEvaluator, MaskEvaluator, str, bool]:
    """(calibration evaluator, evaluation evaluator, metric name, higher_is_better) for a LoadedModel.

    Each evaluator runs `analysis.measure.evaluation.evaluate` on the first `max_tokens` tokens of its
    built-in split, every mask of the batch in the same forward passes; with a `team` the processes
    of a launch split those passes (the values are the single-process ones, analysis.core.distributed).
    `progress`: each window batch reported, as `sweep_z` spans them (calibration 0.05-0.7, evaluation
    0.7-1.0), so a long sweep says how far it is between its own steps.
    """
    chars = max(4096, 12 * check_max_tokens(max_tokens, "max_tokens (--max-tokens)"))
    texts = {"calibration": calibration_text(max_chars=chars), "evaluation": evaluation_text(max_chars=chars)}

    spans = {"calibration": (0.05, 0.7), "evaluation": (0.7, 1.0)}

    def make(split: str) -> MaskEvaluator:
        def run(pruned: np.ndarray) -> np.ndarray:
            n = np.asarray(pruned).reshape(-1, *np.asarray(pruned).shape[-2:]).shape[0]
            told = None if progress is None else (lambda f, m: progress(
                spans[split][0] + (spans[split][1] - spans[split][0]) * f, f"{split} split, {n} masks: {m}"))
            return evaluate(loaded, texts[split], pruned=pruned, max_tokens=max_tokens, window=window,
                            batch_size=batch_size, team=team, progress=told).values
        return run

    metric, higher_is_better = metric_of(loaded.kind)
    return make("calibration"), make("evaluation"), metric, higher_is_better
