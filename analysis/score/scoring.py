"""Head scorers: one interface, every criterion (docs/DEFINITIONS.md).

A scorer is constructed with its parameters and has one verb, `score(target, ...)`, which
returns a `HeadScores`: a [L, H] float array (higher = more important, pruned last), the
scorer's name and parameters, what it cost (forward / backward passes over calibration
sequences, seconds), and the plain-magnitude tie-break the mask code uses.

`target` is a `NormProfile` (weight-only scorers: MP, MP-G, Magnitude, Random), an in-memory
model (`nn.Module`), or a `LoadedModel` (which also brings the tokenizer and the model kind
the calibration scorers need).

Head-level aggregation shared by every criterion: a head collects its own Q rows and O
columns, plus the K/V rows of its KV group (MP-G alone divides the group part by G).

Weight-only:   MP, MP-G, Magnitude (L1/L2), Random (seeded permutation).
Calibration:   Wanda-Head and SparseGPT-Head (forward passes; input statistics from pre-hooks
               on the adapter's projection modules), Gradient-Head, head-gate importance
               (Michel et al.) and its integrated variant (Captum IntegratedGradients over the
               gates), which need a language-model loss. Hybrid = min-max(Magnitude) +
               min-max(MP) + min-max(Wanda). The ablation oracle wraps a precomputed [L, H]
               loss-increase array from the evaluation sweep.

Multi-process (`score(..., team=...)`, analysis.core.distributed): a calibration scorer's batches are
split over the processes of a launch; each batch's statistics (input sums, X^T X, gradients,
gate gradients, attributions) are computed on one process exactly as in a single run, gathered,
and summed in batch order, so the scores are the single-process ones. (SparseGPT's X^T X and
Gradient-Head's weight gradients are weight-sized per batch: the gather moves one such set per batch.)

The registry (`SCORERS`, filled by `register_scorer`; analysis.score.scorer_registry, re-exported here)
is what the CLI, the app and scripts/results.py read: a scorer's name, label, constructor parameters
and needs_calibration, declared there without importing this module (torch); each class here sets only
its `name` and takes the rest from its declaration.

Device and precision: calibration batches go to the model's input device and run in its dtype;
input statistics (sums of squares, X^T X) are formed in float32 and accumulated in float64 on the
CPU, and the per-layer weight arithmetic reads the weights (offloaded ones too, through the
adapter) onto the CPU in float64. Gradient-Head refuses an offloaded model (its weights are
reloaded on every pass, so they have no gradient to read).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterator

import numpy as np
import torch
from torch import nn

from analysis.arch.hooks import attached
from analysis.measure.ablation import FastAblation, head_ablation
from analysis.arch.adapters import Adapter, HeadWeights, adapter_for, input_device, is_offloaded
from analysis.measure.attribution import gate_loss_fn, integrated_gate_gradients
from analysis.core.distributed import SOLO, Team
from analysis.core.errors import SEED_MAX, InputError, UnsupportedModelError, check_seed, check_whole_number  # noqa: F401 (SEED_MAX, check_seed: re-exported)
from analysis.core.params import Param, bind  # noqa: F401 (Param: re-exported)
from analysis.core.registry import take_declared
from analysis.score.scorer_registry import (  # noqa: F401 (the registry and the declarations: re-exported)
    A_KV, A_Q, BATCH_SIZE, CALIBRATION, DAMPING, DECLARED_FIELDS, N_SEQUENCES, N_STEPS, NORMALIZATIONS, NORMALIZE, NORMALIZED, ORD,
    SCOPE, SCORERS, SEED, SEQ_LEN, STD, Z, ScorerSpec, check_normalize, default_scorer, get_scorer, register_scorer,
    scorer_class, scorer_declarations, scorer_label, scorer_parameters, weight_only_scorers)
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import head_mask
from analysis.measure.loss import LM_KINDS, lm_sequence_losses
from analysis.measure.tokens import calibration_ids
from analysis.score.masks import tie_order_of
from analysis.arch.models import model_kind
from analysis.measure.profiles import NormProfile, head_and_group_sums, profile_model
from analysis.core.progress import Progress, ShouldStop, tick
from analysis.core.text import calibration_text


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class ScoringCost:
    """What a scorer spent. Passes are counted per calibration sequence (batch-size independent)."""

    forward_passes: int = 0
    backward_passes: int = 0
    calibration_sequences: int = 0
    calibration_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(forward_passes=self.forward_passes, backward_passes=self.backward_passes,
                    calibration_sequences=self.calibration_sequences,
                    calibration_tokens=self.calibration_tokens, seconds=round(self.seconds, 4))


@dataclass
class HeadScores:
    """Scores [L, H] (higher = more important) with metadata; see the module docstring."""

    name: str
    scores: np.ndarray  # [L, H] float64
    params: dict = field(default_factory=dict)
    cost: ScoringCost = field(default_factory=ScoringCost)
    tiebreak: np.ndarray | None = None  # [L, H] plain magnitude, breaks ties in the ranking
    tie_order: np.ndarray | None = field(default=None, repr=False, compare=False)  # [L*H] its sort, if cached

    def __post_init__(self) -> None:
        self.scores = np.asarray(self.scores, dtype=np.float64)
        if self.scores.ndim != 2:
            raise InputError(f"head scores must be a [layers, heads] array; got shape {self.scores.shape}.")
        if self.tiebreak is not None:
            self.tiebreak = np.asarray(self.tiebreak, dtype=np.float64)
            if self.tiebreak.shape != self.scores.shape:
                raise InputError(f"tie-break shape {self.tiebreak.shape} != score shape {self.scores.shape}.")

    @property
    def zero_count(self) -> int:
        """Heads with score exactly 0 (for MP: "in the bulk"; the tie-break orders them)."""
        return int(np.count_nonzero(self.scores == 0))

    def as_dict(self) -> dict:
        return dict(name=self.name, params=self.params, cost=self.cost.as_dict(),
                    zero_score_heads=self.zero_count, scores=self.scores.tolist())


# ---------------------------------------------------------------------------------------------
# Pure head-level aggregation
# ---------------------------------------------------------------------------------------------


def mp_combine(own: np.ndarray, group: np.ndarray) -> np.ndarray:
    """MP from own [L, H] and group [L, Hkv] sums: own + the full sum of the head's KV group. [L, H]."""
    G = own.shape[1] // group.shape[1]
    return own + np.repeat(group, G, axis=1)  # [L, H]


def mpg_combine(own: np.ndarray, group: np.ndarray, a_q: float = 1.0, a_kv: float = 1.0) -> np.ndarray:
    """MP-G from own [L, H] and group [L, Hkv] sums: a_q * own + a_kv * group / G. [L, H]."""
    G = own.shape[1] // group.shape[1]
    return a_q * own + a_kv * np.repeat(group, G, axis=1) / G  # [L, H]


def mp_aggregate(rows: dict[str, np.ndarray]) -> np.ndarray:
    """MP of per-row values: own + the full group sum of the head's KV group. Returns [L, H]."""
    return mp_combine(*head_and_group_sums(rows))


def combine_projection_scores(q: np.ndarray, k: np.ndarray, v: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Per-head q,o [H] and per-group k,v [Hkv] contributions -> [H] (group part repeated)."""
    G = q.shape[0] // k.shape[0]
    return q + o + np.repeat(k + v, G)  # [H]


def min_max(x: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] over all heads; a constant array maps to zeros."""
    lo, hi = float(np.min(x)), float(np.max(x))
    return np.zeros_like(x) if hi == lo else (x - lo) / (hi - lo)


# ---------------------------------------------------------------------------------------------
# Targets and calibration data
# ---------------------------------------------------------------------------------------------


@dataclass
class Subject:
    """A model to score: module, adapter, geometry, kind ("causal-lm" | "masked-lm" | "encoder")."""

    model: nn.Module
    adapter: Adapter
    geometry: HeadGeometry
    kind: str
    tokenizer: object = None
    team: Team = SOLO          # the processes that split the calibration batches (analysis.core.distributed)


def as_subject(target) -> Subject:
    """LoadedModel or nn.Module -> Subject; InputError for a bare NormProfile."""
    if isinstance(target, Subject):
        return target
    if isinstance(target, NormProfile):
        raise InputError("This scorer needs the model itself (it runs calibration text through it), "
                         "not only its weight profile. Pass the loaded model.")
    model = target if isinstance(target, nn.Module) else getattr(target, "model", None)  # LoadedModel.model
    if not isinstance(model, nn.Module):
        raise InputError(f"Cannot score a {type(target).__name__}; pass a loaded model or a NormProfile.")
    if target is model:
        adapter = adapter_for(model)
        return Subject(model, adapter, adapter.geometry(model), model_kind(model), None)
    return Subject(model, target.adapter, target.geometry, target.kind, target.tokenizer)


def as_profile(target) -> NormProfile:
    """NormProfile as is; a model (or LoadedModel) is profiled once through its adapter."""
    if isinstance(target, NormProfile):
        return target
    subject = as_subject(target)
    return profile_model(subject.model, adapter=subject.adapter)


def check_calibration(ids) -> torch.Tensor:
    """Validate a calibration batch: integer tensor [n, T] with T >= 2."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.is_floating_point():
        raise InputError(f"Calibration ids must be an integer tensor [sequences, tokens] with at least 2 "
                         f"tokens; got shape {list(ids.shape)}.")
    return ids.long()


def require_lm(subject: Subject) -> None:
    """UnsupportedModelError unless the subject has an LM head (the loss-gradient scorers need one)."""
    if subject.kind not in LM_KINDS:
        raise UnsupportedModelError(
            f"This scorer needs a language-model loss, and a {subject.kind!r} model has no LM head. "
            "Use MP, MP-G, Magnitude, Wanda-Head, SparseGPT-Head or Random for this model.")


def sequence_losses(subject: Subject, ids: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """Mean token NLL of each sequence of ids [B, T] -> [B] (keeps the graph; `analysis.measure.loss`)."""
    require_lm(subject)
    return lm_sequence_losses(subject.model, subject.kind, ids, seed=seed,
                              mask_token_id=getattr(subject.tokenizer, "mask_token_id", None))


def batches(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Split ids [n, T] into consecutive [<=batch_size, T] chunks."""
    return list(torch.split(ids, max(1, int(batch_size)), dim=0))


# ---------------------------------------------------------------------------------------------
# The scorer interface
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Parameters: each declared once (analysis.core.params.Param), in analysis.score.scorer_registry with
# every scorer's declaration (Z, SCOPE, ..., CALIBRATION are imported from there).
# ---------------------------------------------------------------------------------------------


class Scorer:
    """Base class. Subclasses set `name`, `label` and `parameters` (name -> Param), implement `_compute`.

    A scorer declared in analysis.score.scorer_registry (a `ScorerSpec` naming this class) sets only
    `name`: its label, parameters and needs_calibration are copied from the declaration when the class
    is defined (`__init_subclass__`), so each is written once. The constructor takes the declared
    parameters as keywords (each checked by its declaration) and keeps them as attributes; `params()`
    returns the recorded ones."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""            # what the app and reports call it
    needs_calibration: ClassVar[bool] = False
    needs_gradients: ClassVar[bool] = False
    parameters: ClassVar[dict[str, Param]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        take_declared(cls, SCORERS, DECLARED_FIELDS)

    def __init__(self, **params):
        for name, value in bind(self.parameters, params, f"The {self.name!r} scorer").items():
            setattr(self, name, value)

    def params(self) -> dict:
        """The parameters, as recorded in HeadScores.params."""
        return {name: getattr(self, name) for name, param in self.parameters.items() if param.recorded}

    def score(self, target, *, calibration=None, progress: Progress | None = None,
              should_stop: ShouldStop | None = None, team: Team | None = None) -> HeadScores:
        """Score every head of `target`. `calibration`: token ids [n, T] (else built from the
        built-in calibration split with the LoadedModel's tokenizer). `team`: the processes of a
        launch that split a calibration scorer's batches (weight-only scorers need no splitting)."""
        if team is not None and team.is_distributed and self.needs_calibration:
            target = dataclasses.replace(as_subject(target), team=team)
        start = time.perf_counter()
        cost = ScoringCost()
        scores, tiebreak = self._compute(target, calibration, cost, progress, should_stop)
        cost.seconds = time.perf_counter() - start
        return HeadScores(self.name, scores, self.params(), cost, tiebreak, self._tie_order(target, tiebreak))

    def _tie_order(self, target, tiebreak) -> np.ndarray | None:
        """The tie-break's sort, where a scorer can cache it (weight-only scorers, per profile)."""
        return None

    def _compute(self, target, calibration, cost, progress, should_stop) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError


class CalibrationScorer(Scorer):
    """Shared parameters and plumbing of scorers that run calibration text through the model."""

    needs_calibration = True
    parameters = CALIBRATION

    def _calibration(self, subject: Subject, calibration, cost: ScoringCost) -> torch.Tensor:
        if calibration is None:
            ids = calibration_ids(subject.tokenizer, self.n_sequences, self.seq_len)
        else:
            ids = check_calibration(calibration)
        cost.calibration_sequences = int(ids.shape[0])
        cost.calibration_tokens = int(ids.numel())
        return ids

    def _compute(self, target, calibration, cost, progress, should_stop):
        subject = as_subject(target)
        ids = self._calibration(subject, calibration, cost)
        scores = self._calibrate(subject, ids, cost, progress, should_stop)
        return scores, magnitude_tiebreak(subject)

    def _calibrate(self, subject, ids, cost, progress, should_stop) -> np.ndarray:
        raise NotImplementedError


def magnitude_tiebreak(subject: Subject) -> np.ndarray:
    """Plain L2 magnitude [L, H] of a model, the tie-break for data-driven scores."""
    return mp_aggregate(profile_model(subject.model, adapter=subject.adapter).l2)


# ---------------------------------------------------------------------------------------------
# Weight-only scorers
# ---------------------------------------------------------------------------------------------


class MPScorer(Scorer):
    """Magnitude Profile: sum of row-norm excesses over the head's Q/O and its group's K/V rows."""

    name = "mp"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def combine(self, own: np.ndarray, group: np.ndarray) -> np.ndarray:
        return mp_combine(own, group)

    def aggregate(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        return self.combine(*head_and_group_sums(rows))

    def _compute(self, target, calibration, cost, progress, should_stop):
        profile = as_profile(target)
        scores = self.combine(*profile.excess_sums(self.z, ord=self.ord, scope=self.scope, std=self.std))  # [L, H]
        # The tie-break (same sums without the threshold) and its sort do not depend on z: once per profile.
        tiebreak = profile.memo(("tiebreak", *self._tiebreak_key()),
                                lambda: self.aggregate(profile.norms(self.ord)))  # [L, H]
        return scores, tiebreak

    def _tiebreak_key(self) -> tuple:
        return self.name, tuple(sorted((k, v) for k, v in self.params().items() if k not in ("z", "scope", "std")))

    def _tie_order(self, target, tiebreak):
        return as_profile(target).memo(("tie-order", *self._tiebreak_key()),
                                       lambda: tie_order_of(tiebreak, tiebreak.size))  # [L*H]


class MPGScorer(MPScorer):
    """MP-G (GQA-aware): a_q * own excess + a_kv * group excess / G."""

    name = "mp-g"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def combine(self, own, group):
        return mpg_combine(own, group, self.a_q, self.a_kv)


class MagnitudeScorer(Scorer):
    """Sum of the L2 (or L1) norms of the head's Q rows, O columns and its group's K/V rows."""

    name = "magnitude"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def _compute(self, target, calibration, cost, progress, should_stop):
        profile = as_profile(target)
        scores = mp_aggregate(profile.norms(self.ord))  # [L, H]
        return scores, scores


class RandomScorer(Scorer):
    """A seeded random permutation of 0 .. L*H-1: the floor every scorer must beat."""

    name = "random"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def _compute(self, target, calibration, cost, progress, should_stop):
        L, H = _grid(target)
        ranks = np.random.default_rng(self.seed).permutation(L * H)  # [L*H]
        return ranks.reshape(L, H).astype(np.float64), None


def _grid(target) -> tuple[int, int]:
    """(L, H) of a profile or model."""
    if isinstance(target, NormProfile):
        return target.n_layers, target.n_heads
    g = as_subject(target).geometry
    return g.n_layers, g.n_heads


class AblationOracle(Scorer):
    """The real loss increase when each head alone is removed (analysis.measure.ablation's sweep).

    Either wraps a precomputed [L, H] loss-increase array (`loss_increase`, e.g. from the
    Heads page's sweep), or runs the sweep on the calibration split: the fast single-head
    sweep on calibration ids for causal LMs, the batched-mask sweep of `head_ablation` for
    masked LMs and encoders. Forward passes are counted as masked full passes, one per
    removed head plus the dense one, per calibration sequence (the fast sweep shares prefixes
    and does less work than that).
    """

    name = "ablation"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def __init__(self, loss_increase=None, **params):
        super().__init__(**params)
        self.calibration = CalibrationScorer(**{name: getattr(self, name) for name in CALIBRATION})
        self.loss_increase = None
        if loss_increase is not None:
            self.loss_increase = np.asarray(loss_increase, dtype=np.float64)  # [L, H]
            if self.loss_increase.ndim != 2 or not np.isfinite(self.loss_increase).all():
                raise InputError("The ablation oracle needs a finite [layers, heads] array of loss increases "
                                 "(run the ablation sweep first).")

    def params(self) -> dict:
        return {"precomputed": True} if self.loss_increase is not None else super().params()

    def _compute(self, target, calibration, cost, progress, should_stop):
        if self.loss_increase is None:
            return self._sweep(as_subject(target), calibration, cost, progress, should_stop), None
        if target is not None and _grid(target) != self.loss_increase.shape:
            raise InputError(f"The ablation sweep has shape {self.loss_increase.shape} but the model has "
                             f"{_grid(target)} heads; rerun the sweep on this model.")
        return self.loss_increase.copy(), None

    def _sweep(self, subject, calibration, cost, progress, should_stop) -> np.ndarray:
        cal = self.calibration
        if subject.kind == "causal-lm":
            ids = cal._calibration(subject, calibration, cost)
            result = FastAblation(cal.batch_size, groups=False).sweep(
                subject.model, ids, progress=progress, should_stop=should_stop, team=subject.team)
        else:
            if subject.tokenizer is None:
                raise InputError("The ablation sweep of a non-causal model needs its tokenizer; pass the "
                                 "LoadedModel from load_model(...).")
            need = cal.n_sequences * cal.seq_len
            result = head_ablation(subject, calibration_text(max_chars=need * 12), max_tokens=need,
                                   seq_len=cal.seq_len, groups=False, batch_size=cal.batch_size,
                                   progress=progress, should_stop=should_stop, team=subject.team)
            cost.calibration_tokens = int(result.n_tokens)
        n_seq = max(1, cost.calibration_sequences or cal.n_sequences)
        cost.forward_passes = n_seq * (1 + subject.geometry.n_total_heads)
        return np.asarray(result.head_delta, dtype=np.float64)  # [L, H]


# ---------------------------------------------------------------------------------------------
# Input-statistics scorers (forward passes only)
# ---------------------------------------------------------------------------------------------


@dataclass
class InputStats:
    """Per layer: attention input (Q/K/V's input) and O's input statistics.

    att / out: sums of squares [D] / [H*d] (full=False) or X^T X [D, D] / [H*d, H*d] (full=True).
    """

    att: list
    out: list
    tokens: int = 0


@contextmanager
def collect_inputs(subject: Subject, full: bool) -> Iterator[InputStats]:
    """Forward pre-hooks on each layer's Q (or fused QKV) and O projections accumulating input stats."""
    L = subject.geometry.n_layers
    stats = InputStats(att=[None] * L, out=[None] * L)

    def make_hook(layer: int, slot: str):
        def hook(module, args):
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).float()  # [tokens, width]
            acc = (x.T @ x) if full else (x * x).sum(dim=0)  # [width, width] or [width]
            table = getattr(stats, slot)
            acc = acc.cpu().double()  # accumulated on the CPU in float64, whatever the device
            table[layer] = acc if table[layer] is None else table[layer] + acc
            if slot == "att" and layer == 0:
                stats.tokens += x.shape[0]
        return hook

    with attached() as hooks:
        for layer in range(L):
            mods = subject.adapter.projection_modules(subject.model, layer)
            hooks.before(mods["q"] if "q" in mods else mods["qkv"], make_hook(layer, "att"))
            hooks.before(mods["o"], make_hook(layer, "out"))
        yield stats


def run_forward(subject: Subject, ids: torch.Tensor, batch_size: int, cost: ScoringCost,
                progress: Progress | None, should_stop: ShouldStop | None, full: bool) -> InputStats:
    """Forward the calibration ids [n, T] in batches under `collect_inputs`.

    In a launch (subject.team) each process forwards its own batches; every batch's statistics
    are gathered and added in batch order, the order one process adds them in."""
    chunks = batches(ids, batch_size)
    if not subject.team.is_distributed:
        with collect_inputs(subject, full) as stats, torch.no_grad():
            for i, chunk in enumerate(chunks):
                tick(progress, should_stop, i / len(chunks), f"calibration batch {i + 1}/{len(chunks)}", "Scoring")
                subject.model(input_ids=chunk.to(input_device(subject.model)))
                cost.forward_passes += int(chunk.shape[0])
    else:
        def one(i: int) -> tuple[list, list, int]:
            tick(progress, should_stop, i / len(chunks), f"calibration batch {i + 1}/{len(chunks)}", "Scoring")
            with collect_inputs(subject, full) as part, torch.no_grad():
                subject.model(input_ids=chunks[i].to(input_device(subject.model)))
            return part.att, part.out, part.tokens

        # the gathered statistics stay where collect_inputs keeps them: float64 on the CPU
        stats = InputStats(*subject.team.fold(one, len(chunks), _add_input_stats, what="the calibration statistics"))
        cost.forward_passes += int(ids.shape[0])
    tick(progress, should_stop, 1.0, "calibration done", "Scoring")
    return stats


def _add_input_stats(acc: tuple | None, part: tuple) -> tuple:
    """(att, out, tokens) of the batches so far + one batch's, as collect_inputs' hooks add them."""
    if acc is None:
        return part
    att, out, tokens = acc
    return ([a + p for a, p in zip(att, part[0])], [a + p for a, p in zip(out, part[1])], tokens + part[2])


class NormalizedCalibrationScorer(CalibrationScorer):
    """A calibration scorer whose [L, H] scores can be divided by each layer's mean (normalize="layer")."""

    parameters = NORMALIZED

    def _compute(self, target, calibration, cost, progress, should_stop):
        scores, tiebreak = super()._compute(target, calibration, cost, progress, should_stop)
        return NORMALIZATIONS[self.normalize](scores), tiebreak


class WandaHeadScorer(NormalizedCalibrationScorer):
    """sum |W_ij| * ||X_j||_2 over the head's Q/K/V rows (X = attention input) and O columns
    (X = O's input, the per-head attention output); normalize="layer" divides by the layer's mean."""

    name = "wanda"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        stats = run_forward(subject, ids, self.batch_size, cost, progress, should_stop, full=False)
        rows = []
        for layer in range(subject.geometry.n_layers):
            hw = subject.adapter.read_heads(subject.model, layer, subject.geometry).map(torch.Tensor.cpu)
            x_att = stats.att[layer].sqrt()  # [D]
            x_out = stats.out[layer].sqrt().reshape(subject.geometry.n_heads, -1)  # [H, d]
            rows.append(wanda_layer(hw, x_att, x_out))
        return np.stack(rows)  # [L, H]


def wanda_layer(hw: HeadWeights, x_att: torch.Tensor, x_out: torch.Tensor) -> np.ndarray:
    """Wanda-Head of one layer. x_att [D] input norms of Q/K/V; x_out [H, d] input norms of O."""
    w = {p: getattr(hw, p).double().abs() for p in ("q", "k", "v", "o")}  # q/o [H, d, *], k/v [Hkv, d, D]
    q, k, v = ((w[p] * x_att).sum(dim=(1, 2)) for p in ("q", "k", "v"))  # [H], [Hkv], [Hkv]
    o = (w["o"].sum(dim=2) * x_out).sum(dim=1)  # [H]
    return combine_projection_scores(q.numpy(), k.numpy(), v.numpy(), o.numpy())


class SparseGPTHeadScorer(NormalizedCalibrationScorer):
    """OBS saliency w_ij^2 / [H^-1]_jj^2, H = X^T X / tokens + damping * mean(diag) * I, per head;
    normalize="layer" divides by the layer's mean."""

    name = "sparsegpt"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        stats = run_forward(subject, ids, self.batch_size, cost, progress, should_stop, full=True)
        rows = []
        for layer in range(subject.geometry.n_layers):
            hw = subject.adapter.read_heads(subject.model, layer, subject.geometry).map(torch.Tensor.cpu)
            h_att = inverse_hessian_diag(stats.att[layer] / stats.tokens, self.damping)  # [D]
            h_out = inverse_hessian_diag(stats.out[layer] / stats.tokens, self.damping)  # [H*d]
            rows.append(sparsegpt_layer(hw, h_att, h_out.reshape(subject.geometry.n_heads, -1)))
        return np.stack(rows)  # [L, H]


def inverse_hessian_diag(xtx: torch.Tensor, damping: float) -> torch.Tensor:
    """diag((X^T X + lambda I)^-1) for xtx [n, n], lambda = damping * mean(diag) (1e-8 if zero)."""
    diag_mean = float(xtx.diagonal().mean())
    lam = damping * diag_mean if diag_mean > 0 else 1e-8
    eye = torch.eye(xtx.shape[0], dtype=xtx.dtype)  # [n, n]
    chol = torch.linalg.cholesky(xtx + lam * eye)  # [n, n] lower: H = C C^T
    # H^-1 = C^-T C^-1, so diag(H^-1)_j = sum_i (C^-1)_ij^2: one triangular solve, no full inverse
    chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)  # [n, n]
    return (chol_inv * chol_inv).sum(dim=0)  # [n]


def sparsegpt_layer(hw: HeadWeights, hinv_att: torch.Tensor, hinv_out: torch.Tensor) -> np.ndarray:
    """SparseGPT-Head of one layer. hinv_att [D]; hinv_out [H, d] (diagonals of inverse Hessians)."""
    w2 = {p: getattr(hw, p).double() ** 2 for p in ("q", "k", "v", "o")}
    q, k, v = ((w2[p] / hinv_att**2).sum(dim=(1, 2)) for p in ("q", "k", "v"))  # [H], [Hkv], [Hkv]
    o = (w2["o"] / hinv_out[..., None] ** 2).sum(dim=(1, 2))  # [H]
    return combine_projection_scores(q.numpy(), k.numpy(), v.numpy(), o.numpy())


# ---------------------------------------------------------------------------------------------
# Loss-gradient scorers
# ---------------------------------------------------------------------------------------------


@contextmanager
def weights_requiring_grad(params: list[nn.Parameter]) -> Iterator[None]:
    """Temporarily let `params` require grad (restored in finally); grads go through autograd.grad."""
    before = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in zip(params, before):
            p.requires_grad_(flag)


class GradientHeadScorer(CalibrationScorer):
    """sum |w_ij * g_ij| over the head's Q/K/V rows and O columns, g = d(mean LM loss)/dw."""

    name = "gradient"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)
    needs_gradients = True

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        if is_offloaded(subject.model):
            raise UnsupportedModelError("Gradient-Head needs the weights' gradients, and this model's weights are "
                                        "offloaded (accelerate reloads them for every pass). Load it without "
                                        "--offload-folder / --max-memory, or use the head-gate scorer.")
        L = subject.geometry.n_layers
        roles = [subject.adapter.projection_modules(subject.model, layer) for layer in range(L)]
        weights = [(layer, role, mod.weight) for layer in range(L) for role, mod in roles[layer].items()]
        chunks = batches(ids, self.batch_size)

        def batch_grads(i: int) -> list[torch.Tensor]:
            tick(progress, should_stop, i / len(chunks), f"gradient batch {i + 1}/{len(chunks)}", "Scoring")
            loss = sequence_losses(subject, chunks[i]).sum() / ids.shape[0]  # mean over all sequences
            return [g.double() for g in torch.autograd.grad(loss, [w for _, _, w in weights])]

        def add(acc, part):
            acc = [torch.zeros_like(w, dtype=torch.float64) for _, _, w in weights] if acc is None else acc
            for a, g in zip(acc, part):
                a += g.to(a.device)
            return acc

        with weights_requiring_grad([w for _, _, w in weights]), torch.enable_grad():
            grads = subject.team.fold(batch_grads, len(chunks), add, what="the gradient statistics")
        cost.forward_passes += int(ids.shape[0])
        cost.backward_passes += int(ids.shape[0])
        rows = []
        for layer in range(L):
            saliency = {f"{role}.weight": (w.detach().double() * g).abs()
                        for (lay, role, w), g in zip(weights, grads) if lay == layer}
            hw = subject.adapter.heads_from_tensors(saliency, subject.geometry)  # |w*g| head-major
            q, k, v, o = (getattr(hw, p).sum(dim=(1, 2)).cpu().numpy() for p in ("q", "k", "v", "o"))
            rows.append(combine_projection_scores(q, k, v, o))
        tick(progress, should_stop, 1.0, "gradients done", "Scoring")
        return np.stack(rows)  # [L, H]


class HeadGateScorer(CalibrationScorer):
    """Michel et al. (2019): sum over calibration sequences of |dL/d gate_h| at gates = 1."""

    name = "gate"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)
    needs_gradients = True

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        g = subject.geometry
        chunks = batches(ids, self.batch_size)

        def batch_gate_grads(i: int) -> torch.Tensor:
            chunk = chunks[i]
            tick(progress, should_stop, i / len(chunks), f"gate-gradient batch {i + 1}/{len(chunks)}", "Scoring")
            gates = torch.ones(chunk.shape[0], g.n_layers, g.n_heads, requires_grad=True)  # [B, L, H]
            with head_mask(subject.model, gates, adapter=subject.adapter):
                losses = sequence_losses(subject, chunk)  # [B]
            (grad,) = torch.autograd.grad(losses.sum(), gates)  # [B, L, H]
            return grad.abs().sum(dim=0).double()  # [L, H]

        with torch.enable_grad():
            total = subject.team.fold(batch_gate_grads, len(chunks), _add_lh(g), what="the gate gradients")
        cost.forward_passes += int(ids.shape[0])
        cost.backward_passes += int(ids.shape[0])
        tick(progress, should_stop, 1.0, "gate gradients done", "Scoring")
        return (total / ids.shape[0]).numpy()


def _add_lh(g: HeadGeometry) -> Callable:
    """add(acc, part) for per-batch [L, H] float64 sums, starting from zeros as one process does."""
    def add(acc, part):
        acc = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64) if acc is None else acc  # [L, H]
        acc += part
        return acc
    return add


class IntegratedGateScorer(CalibrationScorer):
    """Head-gate attribution integrated from gates 0 to 1 (Captum IntegratedGradients).

    Score = minus the head's attribution of the mean calibration loss: the head's share of the
    loss drop from "every head off" to "every head on". Heads that raise the loss score < 0.
    """

    name = "gate-ig"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)
    needs_gradients = True

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        require_lm(subject)
        g = subject.geometry
        mask_id = getattr(subject.tokenizer, "mask_token_id", None)
        chunks = batches(ids, self.batch_size)

        def batch_attribution(i: int) -> torch.Tensor:
            chunk = chunks[i]
            tick(progress, should_stop, i / len(chunks), f"integrated-gradient batch {i + 1}/{len(chunks)}", "Scoring")
            f = gate_loss_fn(subject.model, chunk, g, kind=subject.kind, mask_token_id=mask_id,
                             adapter=subject.adapter)                   # gates [S, L*H] -> mean loss [S]
            attr, _ = integrated_gate_gradients(f, g, n_steps=self.n_steps, internal_batch_size=1)  # [L, H]
            return attr.double() * chunk.shape[0]                       # [L, H]

        total = subject.team.fold(batch_attribution, len(chunks), _add_lh(g), what="the gate attributions")
        cost.forward_passes += int(ids.shape[0]) * self.n_steps
        cost.backward_passes += int(ids.shape[0]) * self.n_steps
        tick(progress, should_stop, 1.0, "integrated gradients done", "Scoring")
        return (-total / ids.shape[0]).numpy()


class HybridScorer(CalibrationScorer):
    """min-max(Magnitude) + min-max(MP at z) + min-max(Wanda-Head), weights 1.0 each."""

    name = "hybrid"   # label, parameters, needs_calibration: its declaration (score/scorer_registry.py)

    def _calibrate(self, subject, ids, cost, progress, should_stop):
        profile = profile_model(subject.model, adapter=subject.adapter)
        magnitude = mp_aggregate(profile.l2)  # [L, H]
        mp = mp_combine(*profile.excess_sums(self.z, scope=self.scope, std=self.std))  # [L, H]
        wanda = WandaHeadScorer(n_sequences=self.n_sequences, seq_len=self.seq_len, batch_size=self.batch_size)
        wanda_scores = wanda._calibrate(subject, ids, cost, progress, should_stop)  # [L, H]
        return min_max(magnitude) + min_max(mp) + min_max(wanda_scores)
