"""The scorer registry: every scorer's declaration (name, label, declared parameters, whether it needs
calibration text) and the registry `SCORERS` that the CLI (--scorer choices, one option per parameter,
the weight-only set), the app (scorer list, labels, widgets, URL fields) and scripts/results.py read.

Declarations apart from implementations: this module imports neither torch nor transformers (numpy
only), so the CLI's parser reads every scorer's parameters for free. The built-in scorers are declared
at the bottom, one `ScorerSpec` each, naming the class lazily ("analysis.score.scoring:MPScorer"); the
class is imported the first time the entry itself is read (`SCORERS[name]`, `scorer_class`,
`get_scorer`, `.values()`, `.items()`), and takes its label, parameters and needs_calibration from the
declaration when it is defined (`analysis.score.scoring.Scorer.__init_subclass__`), so each is written
once. A scorer may also be registered as a class (`register_scorer(cls)`, e.g. a quick experiment
or a test): its own attributes are then its declaration. analysis.score.scoring re-exports all of this.

Parameters: each declared once (analysis.core.params.Param). A scorer's constructor and params() are
built from its `parameters`; the CLI's options (cli.common), the URL's fields (components/state.py) and
the app's widgets (components/controls.py) are derived from them.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.params import Param
from analysis.core.registry import Declaration, Registry
from analysis.measure.thresholds import DEFAULT_STD, DEFAULT_Z, SCOPES, STD_DDOF, Z_MAX, check_ord, check_scope, check_std, check_z


def _check_weight(name: str, value: float) -> float:
    value = float(value)
    if not np.isfinite(value) or value < 0:
        raise InputError(f"{name} must be a finite weight >= 0; got {value}.")
    return value


def _check_steps(n_steps) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or int(n_steps) < 1:
        raise InputError(f"Integrated gradients need n_steps >= 1; got {n_steps!r}.")
    return int(n_steps)


def _layer_mean_normalized(scores: np.ndarray) -> np.ndarray:
    """scores [L, H] / each layer's mean score (a layer whose scores are all 0 stays 0): every
    layer's mean becomes 1, so a layer's activation scale no longer decides a global ranking."""
    mean = scores.mean(axis=1, keepdims=True)  # [L, 1]
    return np.divide(scores, mean, out=np.zeros_like(scores), where=mean > 0)  # [L, H]


# normalize option -> [L, H] transform of the raw scores (Wanda-Head, SparseGPT-Head)
NORMALIZATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "none": lambda scores: scores,
    "layer": _layer_mean_normalized,
}


def check_normalize(normalize: str) -> str:
    if normalize not in NORMALIZATIONS:
        raise InputError(f"normalize must be one of {', '.join(NORMALIZATIONS)}; got {normalize!r}.")
    return normalize


Z = Param(DEFAULT_Z, "Threshold z", "MP threshold: tau = mean + z * std of each population of row norms",
          lo=0.0, hi=Z_MAX, step=0.05, check=check_z)
SCOPE = Param("layer", "Population", "threshold population: each projection of each layer (layer), or one "
              "projection across all layers (model)", choices=SCOPES, check=check_scope)
ORD = Param(2, "Norm", "row norm: 2 (L2) or 1 (L1)", choices=(2, 1), names={2: "L2", 1: "L1"}, check=check_ord)
STD = Param(DEFAULT_STD, "Std in the threshold",
            "std in tau = mean + z * std: population (divide by n, ddof 0, the default) or sample (by n - 1, "
            "ddof 1, PyTorch's Tensor.std); at the boundary they move a few heads in or out of the bulk",
            choices=tuple(STD_DDOF),
            names={"population": "population (ddof = 0)", "sample": "sample (ddof = 1, torch.std)"}, check=check_std)
A_Q = Param(1.0, "a_q (own Q/O weight)", "MP-G weight of the Q/O excess", lo=0.0, hi=10.0, step=0.1,
            check=lambda v: _check_weight("a_q", v))
A_KV = Param(1.0, "a_kv (shared K/V weight)", "MP-G weight of the K/V excess", lo=0.0, hi=10.0, step=0.1,
             check=lambda v: _check_weight("a_kv", v))
SEED = Param(0, "Seed", "random scorer seed", lo=0, hi=2**31 - 1, step=1, check=check_seed)
N_SEQUENCES = Param(8, "Calibration sequences", "calibration sequences (calibration scorers)", lo=1, hi=64, step=1,
                    check=lambda v: check_whole_number(v, "n_sequences (calibration sequences)"))
SEQ_LEN = Param(128, "Tokens per sequence", "calibration sequence length", lo=8, hi=1024, step=8,
                check=lambda v: check_whole_number(v, "seq_len (tokens per calibration sequence)", low=2))
BATCH_SIZE = Param(4, help="calibration sequences per forward pass (never changes the scores)", recorded=False,
                   check=lambda v: check_whole_number(v, "batch_size"))
NORMALIZE = Param("none", "Per-layer normalization",
                  "wanda / sparsegpt: 'layer' divides every layer's scores by that layer's mean score (each layer's "
                  "mean becomes 1), so a layer's activation scale no longer decides the global ranking",
                  choices=tuple(NORMALIZATIONS), names={"none": "none (as defined)", "layer": "divide by the layer's mean"},
                  check=check_normalize)
DAMPING = Param(0.01, "Damping", "SparseGPT damping fraction", lo=1e-6, hi=1.0, number_format="%.4f",
                check=lambda v: _check_weight("damping", v))
N_STEPS = Param(4, "Integration steps", "integrated-gradient steps", lo=1, hi=64, step=1, check=_check_steps)
# the ablation oracle's precomputed [L, H] loss increases (an array: no CLI option, no widget, not recorded)
LOSS_INCREASE = Param(None, help="a precomputed [layers, heads] array of loss increases (the ablation sweep's)",
                      recorded=False, check=lambda v: v)
CALIBRATION = {"n_sequences": N_SEQUENCES, "seq_len": SEQ_LEN, "batch_size": BATCH_SIZE}
THRESHOLD = {"z": Z, "scope": SCOPE, "ord": ORD, "std": STD}                 # MP's
NORMALIZED = {**CALIBRATION, "normalize": NORMALIZE}                         # Wanda-Head's


@dataclass(frozen=True)
class ScorerSpec(Declaration):
    """A scorer declared without importing it: what the CLI and the lists read. `cls` names the Scorer
    subclass ("package.module:Class"), which sets only `name` and takes the rest from here."""
    name: str                                          # the CLI / URL name
    label: str                                         # what the app and reports call it
    cls: str                                           # "package.module:Class", imported on first use
    parameters: Mapping[str, Param] = field(default_factory=dict)   # every constructor keyword, declared
    needs_calibration: bool = False                    # runs calibration text (else scores a NormProfile)


# what a declared scorer class takes from its ScorerSpec (analysis.score.scoring.Scorer.__init_subclass__)
DECLARED_FIELDS = ("label", "parameters", "needs_calibration")

SCORERS: Registry = Registry("scorer")


def register_scorer(scorer):
    """Register a Scorer subclass under `cls.name` (its `label`, constructor parameters and
    `needs_calibration` come with it), or a `ScorerSpec` that names one lazily. InputError for a
    missing name/label or a taken name. Returns what it was given (usable as a class decorator)."""
    if isinstance(scorer, ScorerSpec):
        if not scorer.name or not scorer.label:
            raise InputError(f"The scorer declaration {scorer.cls!r} needs a `name` and a `label`.")
        return SCORERS.add(scorer.name, scorer)
    declared = SCORERS.declarations.get(getattr(scorer, "name", ""))
    if not scorer.name or not (scorer.label or (declared is not None and declared.names(scorer))):
        raise InputError(f"{scorer.__name__} needs a `name` and a `label` to be registered as a scorer.")
    SCORERS.add(scorer.name, scorer)
    return scorer


def scorer_declarations(name: str) -> dict[str, Param]:
    """{parameter: Param} of a registered scorer, without importing it when it was declared: a
    ScorerSpec's `parameters`; for a class registered as such, its declared `parameters`, then any other
    constructor keyword with a default (a scorer that declares nothing, e.g. a quick experiment, still
    gets a CLI option typed from the default; it has no label, so the app uses its default)."""
    declared = SCORERS.declaration(name)
    out = dict(declared.parameters)
    if isinstance(declared, ScorerSpec):
        return out
    for n, p in inspect.signature(declared.__init__).parameters.items():
        if n != "self" and n not in out and p.default is not inspect.Parameter.empty:
            out[n] = Param(p.default)
    return out


def scorer_parameters(name: str) -> dict[str, object]:
    """{constructor parameter: default} of a registered scorer (parameters without a default left out)."""
    return {n: p.default for n, p in scorer_declarations(name).items()}


def scorer_label(name: str) -> str:
    """The registered scorer's label (nothing imported)."""
    return SCORERS.declaration(name).label


def weight_only_scorers() -> tuple[str, ...]:
    """Names of the registered scorers that need no calibration text (they score a NormProfile)."""
    return tuple(name for name, d in SCORERS.declared().items() if not d.needs_calibration)


def scorer_class(name: str):
    """The registered scorer class (imported now if it was only declared); InputError naming the choices."""
    return SCORERS.of(name)


def get_scorer(name: str, **params):
    """Instantiate a registered scorer by name; InputError naming the choices otherwise."""
    return scorer_class(name)(**params)


def default_scorer(group_size: int) -> str:
    """The scorer a fresh session or a command without --scorer uses, by G = H / Hkv: MP-G on GQA/MQA
    models (G > 1: it does not count a shared KV group's excess G times), MP on MHA (equal there)."""
    return "mp-g" if int(group_size) > 1 else "mp"


# The built-in scorers, in the order the CLI and the app list them (docs/DEFINITIONS.md defines each).
# A new scorer: its class in analysis/score/scoring.py (or a module of its own) setting only `name`, and
# one declaration here (docs/ARCHITECTURE.md, "How to add a scorer").
_IMPL = "analysis.score.scoring"
for _spec in (
    ScorerSpec("mp", "MP (Magnitude Profile)", f"{_IMPL}:MPScorer", THRESHOLD),
    ScorerSpec("mp-g", "MP-G (GQA-aware MP)", f"{_IMPL}:MPGScorer", {**THRESHOLD, "a_q": A_Q, "a_kv": A_KV}),
    ScorerSpec("magnitude", "Magnitude", f"{_IMPL}:MagnitudeScorer", {"ord": ORD}),
    ScorerSpec("random", "Random (floor)", f"{_IMPL}:RandomScorer", {"seed": SEED}),
    ScorerSpec("wanda", "Wanda-Head", f"{_IMPL}:WandaHeadScorer", NORMALIZED, needs_calibration=True),
    ScorerSpec("sparsegpt", "SparseGPT-Head", f"{_IMPL}:SparseGPTHeadScorer", {**NORMALIZED, "damping": DAMPING},
               needs_calibration=True),
    ScorerSpec("gradient", "Gradient-Head", f"{_IMPL}:GradientHeadScorer", CALIBRATION, needs_calibration=True),
    ScorerSpec("gate", "Head-gate importance", f"{_IMPL}:HeadGateScorer", CALIBRATION, needs_calibration=True),
    ScorerSpec("gate-ig", "Head-gate, integrated gradients", f"{_IMPL}:IntegratedGateScorer",
               {**CALIBRATION, "n_steps": N_STEPS}, needs_calibration=True),
    ScorerSpec("hybrid", "Hybrid (Magnitude + MP + Wanda)", f"{_IMPL}:HybridScorer",
               {**CALIBRATION, "z": Z, "scope": SCOPE, "std": STD}, needs_calibration=True),
    ScorerSpec("ablation", "Ablation oracle (real loss increase)", f"{_IMPL}:AblationOracle",
               {**CALIBRATION, "batch_size": dataclasses.replace(BATCH_SIZE, default=16),
                "loss_increase": LOSS_INCREASE}, needs_calibration=True),
):
    register_scorer(_spec)
del _spec
