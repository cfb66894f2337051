"""The iterative compression schedule: score -> prune a step -> recover, until a target or a budget.

`run_pipeline(loaded, config)` works on a full-shape copy of the dense model (the cached model
is never changed) whose pruned heads are zeroed (`head_gates.zero_heads`: the same function as
the head mask and as the physical cut). Each round:
1. rescore the heads on the current (recovered) weights with the configured scorer (MP-G by
   default; calibration scorers run on the current model); weight-only scorers leave the rows of
   the heads already pruned out of their populations (`NormProfile.excluding`: those heads are
   gone, their zero rows must not pull the mean and std); heads already pruned are forced to the
   front of the ranking, so the masks only grow;
2. plan the mask of the round's cumulative head count (`masks.plan_mask`, the chosen policy);
3. zero the new heads on a candidate copy and, with recovery_steps > 0, distill it from the
   dense model under the mask (`distill.distill` with gates: pruned heads get no gradient, so
   they stay zero and the candidate still equals its physical cut);
4. evaluate it on the evaluation text; with a perplexity budget, a round that ends above the
   budget is discarded and the schedule stops with the last model inside it.
One-shot is the same code path with one round and no recovery (`PipelineConfig.one_shot`).

Round r's cumulative count is min(r * floor(step * L * H), floor(target * L * H)), so the last
round prunes exactly floor(target * L * H) heads (the global and min-per-layer policies; uniform
prunes floor(s * H) per layer). `PipelineResult.head_rounds` [L, H] says which round pruned each
head (0 = kept); it goes into head_layout.json of every export (`export_round`).

The `pipeline` CLI command (its options build a PipelineConfig) is analysis/cli/pipeline.py.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from analysis.compress.recover.distill import MAX_STEPS, DistillConfig, DistillResult, distill, with_steps
from analysis.core.errors import InputError, check_whole_number
from analysis.core.text import check_max_tokens
from analysis.arch.cut import Cut
from analysis.measure.evaluation import evaluate
from analysis.arch.head_gates import gates_from_mask, zero_heads
from analysis.score.masks import GQA_POLICIES, POLICIES, default_policy, feasible_counts, heads_to_prune, plan_mask
from analysis.measure.profiles import profile_model
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.score.scoring import get_scorer
from analysis.compress.surgery import prune_heads

DEFAULT_SCORER = "mp-g"


@dataclass(frozen=True)
class PipelineConfig:
    """What the schedule does. step: fraction of all heads pruned per round (>= target: one round).

    policy: the mask policy (analysis.score.masks.POLICIES); None = `masks.default_policy` of the
    model ("groups" on GQA models, which never grows the model; "global" on MHA), fixed by
    `for_model` when the run starts. Recovery per round: recovery_steps optimizer steps, or
    recovery_tokens training tokens (converted with the distillation batch: `steps_per_round`), and
    at most distill.max_seconds of training; distill.eval_every > 0 also measures the held-out
    metric every that many steps (into the round's history)."""
    target_sparsity: float = 0.25
    step: float = 0.10
    recovery_steps: int = 0
    ppl_budget: float | None = None
    scorer: str = DEFAULT_SCORER
    scorer_params: dict = field(default_factory=dict)
    policy: str | None = None
    kv_policy: str = "auto"
    distill: DistillConfig = DistillConfig()
    eval_tokens: int = 512
    recovery_tokens: int | None = None

    def one_shot(self) -> "PipelineConfig":
        """The same target in one round, without recovery."""
        return replace(self, step=self.target_sparsity, recovery_steps=0, recovery_tokens=None)

    def for_model(self, geometry) -> "PipelineConfig":
        """This config with the policy fixed for a model of `geometry` (None -> default_policy)."""
        return self if self.policy is not None else replace(self, policy=default_policy(geometry.group_size))

    def steps_per_round(self) -> int:
        """Distillation steps of each round: recovery_tokens / (batch x seq x grad_accum tokens per
        step), rounded up, when a token budget is given; else recovery_steps."""
        if self.recovery_tokens is None:
            return self.recovery_steps
        d = self.distill
        return math.ceil(self.recovery_tokens / (d.batch_size * d.seq_len * d.grad_accum))

    def validate(self, dense_metric: float | None = None) -> "PipelineConfig":
        if not (0 < self.target_sparsity < 1):
            raise InputError(f"The target sparsity must be between 0 and 1 (exclusive); got {self.target_sparsity!r}.")
        if not (0 < self.step <= 1):
            raise InputError(f"The step (fraction of heads per round) must be in (0, 1]; got {self.step!r}.")
        check_whole_number(self.recovery_steps, "Recovery steps per round", low=0, high=MAX_STEPS)
        check_max_tokens(self.eval_tokens, "Evaluation tokens")
        with_steps(self.distill, 1).validate()         # batch x seq len x accumulation, even without recovery
        per_step = self.distill.batch_size * self.distill.seq_len * self.distill.grad_accum
        check_whole_number(self.recovery_tokens, f"Recovery tokens per round ({per_step:,} per distillation step)",
                           low=0, high=MAX_STEPS * per_step, none_ok=True)
        if self.policy is not None and self.policy not in POLICIES:
            raise InputError(f"Unknown mask policy {self.policy!r}; choose one of {', '.join(POLICIES)}.")
        if self.ppl_budget is not None and not (self.ppl_budget > 0 and math.isfinite(self.ppl_budget)):
            raise InputError(f"The perplexity budget must be a positive number; got {self.ppl_budget!r}.")
        if self.ppl_budget is not None and dense_metric is not None and self.ppl_budget <= dense_metric:
            raise InputError(f"The perplexity budget {self.ppl_budget:g} is not above the dense model's perplexity "
                             f"{dense_metric:.3f}: no pruned model can meet it. Raise the budget.")
        if self.steps_per_round():
            with_steps(self.distill, self.steps_per_round()).validate()
        get_scorer(self.scorer, **self.scorer_params)       # InputError for an unknown scorer
        return self

    def as_dict(self) -> dict:
        """The settings as they run: distill.steps is what each round distills (`steps_per_round`), not
        DistillConfig's own default (report.json said 80 steps when 10 ran)."""
        return asdict(replace(self, distill=with_steps(self.distill, self.steps_per_round())))


def round_counts(target_sparsity: float, step: float, n_heads: int, unit: int = 1) -> list[int]:
    """Cumulative pruned-head counts per round; the last is floor(target * n_heads). unit: the
    policy's step (`policy_unit`): every earlier round prunes a multiple of it, and none lies within
    one unit of the last (whose count the policy rounds to its nearest feasible one)."""
    final = heads_to_prune(target_sparsity, n_heads)
    per = max(1, heads_to_prune(min(step, 1.0), n_heads))
    per = unit * math.ceil(per / unit)
    counts = [c for c in range(per, final, per) if final - c >= unit] + [final]
    return [c for c in counts if c > 0]


def policy_unit(policy: str, geometry) -> int:
    """The head count a GQA policy prunes in steps of (masks.feasible_counts); 1 for the others and on MHA."""
    if policy not in GQA_POLICIES or geometry.group_size == 1:
        return 1
    return int(feasible_counts(policy, geometry.n_layers, geometry.n_heads, geometry.group_size)[1])


@dataclass
class Round:
    """One round of the schedule (metric values on the evaluation text)."""
    index: int                        # 1-based
    n_pruned: int                     # cumulative heads pruned after the round
    sparsity: float                   # n_pruned / (L * H)
    new_heads: list[tuple[int, int]]  # (layer, head) pruned in this round
    metric_cut: float                 # right after the cut
    metric: float                     # after recovery (= metric_cut without recovery)
    accepted: bool                    # False: it broke the budget and was discarded
    seconds: float
    history: list[dict] = field(default_factory=list)   # distillation steps of the round
    accuracy_cut: float | None = None  # next-token top-1 accuracy right after the cut (causal LMs)
    accuracy: float | None = None      # ... after recovery
    recovery_seconds: float = 0.0
    precision: str | None = None       # the distillation's precision ("auto" resolved); None: no recovery

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PipelineResult:
    """The final (full-shape, pruned heads zeroed) model, its mask and what every round did."""
    model: torch.nn.Module
    pruned: np.ndarray                # [L, H] bool
    head_rounds: np.ndarray           # [L, H] int, 0 = kept
    metric: str
    higher_is_better: bool
    dense_metric: float
    rounds: list[Round]
    config: PipelineConfig
    stopped_by_budget: bool = False
    round_models: list[torch.nn.Module] = field(default_factory=list)   # with keep_round_models
    dense_accuracy: float | None = None   # the dense model's next-token top-1 accuracy (causal LMs)

    @property
    def accepted(self) -> list[Round]:
        return [r for r in self.rounds if r.accepted]

    @property
    def final_metric(self) -> float:
        return self.accepted[-1].metric if self.accepted else self.dense_metric

    @property
    def final_accuracy(self) -> float | None:
        return self.accepted[-1].accuracy if self.accepted else self.dense_accuracy

    def smaller(self, kv_policy: str | None = None, *, share: bool = True):
        """(physically pruned model, HeadLayout with the rounds) of the final model. share=True: its
        untouched weights are `self.model`'s (read-only use); share=False to train or edit it."""
        return prune_heads(self.model, self.pruned, kv_policy=kv_policy or self.config.kv_policy,
                           rounds=self.head_rounds, share=share)

    def as_dict(self) -> dict:
        return {"metric": self.metric, "dense": self.dense_metric, "final": self.final_metric,
                "dense_accuracy": self.dense_accuracy, "final_accuracy": self.final_accuracy,
                "n_pruned": int(self.pruned.sum()), "n_heads": int(self.pruned.size),
                "stopped_by_budget": self.stopped_by_budget, "config": self.config.as_dict(),
                "rounds": [r.as_dict() for r in self.rounds], "head_rounds": self.head_rounds.tolist()}


def _measure(loaded, model, text, config: PipelineConfig, should_stop: ShouldStop):
    return evaluate(loaded, text, cut=Cut.of_model(model), max_tokens=config.eval_tokens, should_stop=should_stop)


def _over_budget(value: float, budget: float | None) -> bool:
    return budget is not None and value > budget


def next_mask(loaded, model, previous: np.ndarray, count: int, config: PipelineConfig, calibration=None,
              should_stop: ShouldStop | None = None) -> tuple[np.ndarray, object]:
    """Score `model` (the current weights) and plan the mask of `count` heads that keeps every
    head of `previous` [L, H] pruned. Returns (pruned [L, H], HeadScores)."""
    scorer = get_scorer(config.scorer, **config.scorer_params)
    if scorer.needs_calibration:
        target = replace(loaded, model=model)
    else:   # the zeroed heads are gone: keep their rows out of the MP populations (NormProfile.excluding)
        target = profile_model(model, adapter=loaded.adapter, should_stop=should_stop).excluding(previous)
    scores = scorer.score(target, calibration=calibration, should_stop=should_stop)
    s = np.array(scores.scores, dtype=np.float64)                       # [L, H]
    if previous.any():
        s[previous] = s.min() - 1.0 - np.abs(s).max()                  # already pruned: first in line
    g = loaded.geometry
    plan = plan_mask(s, count / s.size, group_size=g.group_size, tiebreak=scores.tiebreak, policy=config.policy)
    pruned = plan.pruned
    if (previous & ~pruned).any():
        raise InputError(f"The {config.policy!r} policy cannot keep the earlier rounds' heads pruned at this "
                         f"sparsity; use one round (step >= target), or the global or groups policy for "
                         f"iterative pruning.")
    return pruned, scores


def _recover(loaded, candidate, mask, index: int, span, config: PipelineConfig, train_data, eval_text,
             checkpoint_dir, progress, should_stop, on_step):
    """Distill round `index`'s candidate under its mask from the dense model: (the recovered full-shape
    model with the pruned heads zero again, its evaluation, the round's history, the DistillResult)."""
    def step_report(record):
        if on_step is not None:
            on_step({"round": index, **record})

    def sub_progress(fraction, message):
        report(progress, span[0] + span[1] * (0.1 + 0.8 * fraction), f"round {index}: {message}")

    result: DistillResult = distill(
        loaded, candidate, train_data, with_steps(config.distill, config.steps_per_round()),
        gates=gates_from_mask(mask), on_step=step_report, progress=sub_progress, should_stop=should_stop,
        evaluate_fn=lambda m: _measure(loaded, m, eval_text, config, should_stop).value,
        checkpoint_dir=None if checkpoint_dir is None else Path(checkpoint_dir) / f"round-{index}")
    recovered = zero_heads(result.model, mask)    # LoRA merges touch pruned rows: zero them again
    history = [{"round": index, **r} for r in result.history]
    return recovered, _measure(loaded, recovered, eval_text, config, should_stop), history, result


def _round(loaded, model, pruned: np.ndarray, index: int, count: int, n_rounds: int, config: PipelineConfig, *,
           train_data, eval_text, calibration, checkpoint_dir, progress, should_stop, on_step):
    """One round: score the current weights, plan `count` heads, cut, recover (with steps per round),
    measure. Returns (the Round, its full-shape model, its mask [L, H])."""
    began = time.perf_counter()
    span = (index - 1) / n_rounds, 1 / n_rounds                          # this round's share of the progress bar
    report(progress, span[0], f"round {index}/{n_rounds}: scoring {config.scorer}")
    mask, _ = next_mask(loaded, model, pruned, count, config, calibration, should_stop)
    candidate = zero_heads(copy.deepcopy(model), mask)
    cut = _measure(loaded, candidate, eval_text, config, should_stop)
    final, history, recovery_seconds, precision = cut, [], 0.0, None
    if config.steps_per_round():
        candidate, final, history, result = _recover(loaded, candidate, mask, index, span, config, train_data,
                                                     eval_text, checkpoint_dir, progress, should_stop, on_step)
        recovery_seconds, precision = result.seconds, result.precision
    new = [(int(l), int(h)) for l, h in zip(*np.nonzero(mask & ~pruned))]
    done = Round(index, int(mask.sum()), float(mask.sum() / mask.size), new, float(cut.value), float(final.value),
                 not _over_budget(final.value, config.ppl_budget), time.perf_counter() - began, history,
                 cut.accuracy, final.accuracy, recovery_seconds, precision)
    return done, candidate, mask


def run_pipeline(loaded, config: PipelineConfig = PipelineConfig(), *, train_data=None, eval_text=None,
                 calibration=None, checkpoint_dir=None, keep_round_models: bool = False,
                 progress: Progress | None = None, should_stop: ShouldStop | None = None,
                 on_step: Callable[[dict], None] | None = None,
                 on_round: Callable[[Round, torch.nn.Module, np.ndarray], None] | None = None) -> PipelineResult:
    """Run the schedule on a copy of `loaded.model` (a LoadedModel; it is not changed).

    train_data: distillation text or ids [n, T] (None = the built-in calibration split);
    eval_text: the evaluation text (None = the built-in evaluation split); calibration: ids for
    calibration scorers. checkpoint_dir: distillation checkpoints, one subfolder per round.
    on_step(record) after each distillation step (record has "round"); on_round(round, model,
    pruned) after each accepted round, with that round's full-shape model (do not keep it: it is
    the next round's starting point unless keep_round_models). CancelledError on should_stop."""
    geometry = loaded.geometry
    config = config.for_model(geometry).validate()
    dense = _measure(loaded, loaded.model, eval_text, config, should_stop)
    if config.ppl_budget is not None and dense.higher_is_better:
        raise InputError(f"A perplexity budget needs a language model; this {loaded.kind} model is measured by "
                         f"{dense.metric}.")
    config.validate(dense.value)
    counts = round_counts(config.target_sparsity, config.step, geometry.n_total_heads,
                          policy_unit(config.policy, geometry))
    if config.policy == "uniform":
        counts = [geometry.n_layers * heads_to_prune(c / geometry.n_total_heads, geometry.n_heads) for c in counts]
    model = copy.deepcopy(loaded.model)                                  # never the cached model
    model.requires_grad_(False)
    pruned = np.zeros((geometry.n_layers, geometry.n_heads), dtype=bool)  # [L, H]
    head_rounds = np.zeros(pruned.shape, dtype=np.int64)                 # [L, H]
    rounds, kept_models, stopped = [], [], False
    for index, count in enumerate(counts, start=1):
        check_stop(should_stop, "The pipeline")
        done, candidate, mask = _round(loaded, model, pruned, index, count, len(counts), config, train_data=train_data,
                                       eval_text=eval_text, calibration=calibration, checkpoint_dir=checkpoint_dir,
                                       progress=progress, should_stop=should_stop, on_step=on_step)
        rounds.append(done)
        report(progress, index / len(counts), f"round {index}/{len(counts)}: {mask.sum()} heads pruned, "
                                              f"{dense.metric} {done.metric:.3f}")
        if not done.accepted:
            stopped = True
            break
        model, pruned = candidate, mask
        head_rounds[mask & (head_rounds == 0)] = index
        if keep_round_models:
            kept_models.append(copy.deepcopy(model))
        if on_round is not None:
            on_round(done, model, pruned.copy())
    model.eval()
    return PipelineResult(model=model, pruned=pruned, head_rounds=head_rounds, metric=dense.metric,
                          higher_is_better=dense.higher_is_better, dense_metric=float(dense.value), rounds=rounds,
                          config=config, stopped_by_budget=stopped, round_models=kept_models,
                          dense_accuracy=dense.accuracy)


def export_round(fmt: str, model, pruned, head_rounds, root, name: str, *, tokenizer=None, kv_policy="auto",
                 overwrite: bool = False, scores=None, **options):
    """Export a pipeline model (full-shape, pruned heads zeroed) in format `fmt` (`options`: the format's
    own, e.g. gguf_type); the head layout of the formats that have one records which round pruned each head."""
    from analysis.compress.export import export
    rounds = np.where(np.asarray(pruned, bool), np.asarray(head_rounds), 0)
    kwargs = {} if fmt == "zeroed" else {"kv_policy": kv_policy, "rounds": rounds}
    return export(fmt, model, pruned, root, name, tokenizer=tokenizer, overwrite=overwrite, **kwargs, **options)
