"""DuoAttention's attention pattern: the folder a KV plan travels in to DuoAttention and kvpress, and back.

The format is the one DuoAttention (Xiao et al. 2024, github mit-han-lab/duo-attention) writes when it trains
its gates and reads when it deploys them (duo_attn/utils.py: `save_full_attention_heads`, `load_attn_pattern`;
the published patterns under attn_patterns/<model>/<run>/):

- `full_attention_heads.tsv`: one row per layer, one column per KV head, the head's gate alpha (1 = full
  attention, a retrieval head; 0 = streaming: sink + recent tokens). DuoAttention writes it with
  `np.savetxt(path, gates, delimiter="\\t")` ('%.18e' numbers, tab-separated, '\\n' after each row; no header)
  and reads it with `np.loadtxt(path, delimiter="\\t")`, then clips the gates to [0, 1] (trained gates may be a
  little outside: the published Llama-2 pattern holds -5e-4).
- `config.json`: the training run's settings (`vars(args)`); a reader uses only `sink_size` and `recent_size`
  (the published ones: 128 and 256). headscope adds a "headscope" object (the plan's model name, query heads
  per layer and notes) so that a plan written here reads back identical; DuoAttention ignores it.

Gates become heads as DuoAttention's `sparsify_attention_heads(gates, threshold, sparsity)` does: with a
`threshold` a KV head is full when its gate >= threshold (DuoAttention's evaluation default 0.5); with a
`sparsity` s the threshold is np.quantile(gates, s) (s >= 1: every head streaming; s <= 0: none). DuoAttention
first adds uniform noise in [0, 1e-6) to break ties, unseeded; here ties (and gates closer than that noise)
are broken by (layer, KV head), lowest first, so one file always gives one plan: the quantile rule is applied
to the heads' ranks, which gives exactly the count of streaming heads DuoAttention's rule gives on distinct
gates (ceil(s * (N - 1)) of the N KV heads for 0 < s < 1).

Window semantics: DuoAttention trains its streaming heads under the mask "key j is read by query i when
j < sink_size or i - j < recent_size" (duo_attn/patch/streaming_attn.py), the query's own token counted in
the recent ones: headscope's band (analysis.arch.spans) with sinks = sink_size, recent = recent_size, so the
numbers travel unchanged. (DuoAttention's decoding kernel keeps sink_size + recent_size earlier tokens and adds
the new one, one more than the band; kvpress's DuoAttentionPress evicts once after the prefill: docs/PEERS.md.)

A DuoAttention pattern has no "prune": a plan that prunes KV heads is refused, or its pruned heads are
written as full or streaming gates when asked (`pruned=`; meaningful for a model whose pruned heads are
zeroed, e.g. the zeroed export, where their gate changes nothing they compute).

Light to import (numpy and headscope's core only; the KV plan is imported inside the functions that need it)
so kvpress's environment (bench/peers) reads patterns with the same code.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.arch.window import Window
from analysis.core.atomic import path_problem
from analysis.core.errors import InputError, shorten
from analysis.core.files import read_file_text

HEADS_FILE = "full_attention_heads.tsv"
CONFIG_FILE = "config.json"
MAX_HEADS_BYTES = 16 * 2**20          # 4096 layers x 128 KV heads of '%.18e' gates: ~13 MiB
MAX_CONFIG_BYTES = 4 * 2**20          # a training run's settings: a few KiB
DEFAULT_THRESHOLD = 0.5               # duo_attn's evaluation default (--threshold 0.5)
PRUNED_AS = {"refuse": None, "full": 1.0, "window": 0.0}   # what a plan's pruned KV head is written as
_FIX = (f"give a DuoAttention pattern folder ({HEADS_FILE} with one row of tab-separated gates per layer, and "
        f"{CONFIG_FILE} with sink_size and recent_size)")


@dataclass(frozen=True)
class DuoPattern:
    """gates [L, Hkv] float64 in [0, 1] (1 = full), the streaming heads' band, the rest of config.json."""
    gates: np.ndarray
    sink_size: int
    recent_size: int
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        g = np.asarray(self.gates, dtype=np.float64)
        if g.ndim != 2 or not g.size:
            raise InputError(f"A DuoAttention pattern is one row of gates per layer; got shape {list(g.shape)}.")
        if not np.isfinite(g).all():
            raise InputError("A DuoAttention pattern's gates must be numbers; they hold NaN or infinity.")
        object.__setattr__(self, "gates", np.clip(g, 0.0, 1.0))          # as duo_attn's load_attn_pattern
        object.__setattr__(self, "sink_size", _whole(self.sink_size, "sink_size", low=0))
        object.__setattr__(self, "recent_size", _whole(self.recent_size, "recent_size", low=1))
        Window(self.sink_size, self.recent_size)                          # the window's own bounds

    @property
    def window(self) -> Window:
        """The streaming heads' window: sink_size first tokens + recent_size latest (analysis.arch.window)."""
        return Window(self.sink_size, self.recent_size)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.gates.shape[0]), int(self.gates.shape[1])

    def full(self, *, threshold: float | None = None, sparsity: float | None = None) -> np.ndarray:
        """[L, Hkv] bool: the KV heads kept full (see the module docstring; default threshold 0.5)."""
        check_gate_rule(threshold, sparsity)
        if sparsity is None:
            t = DEFAULT_THRESHOLD if threshold is None else _share(threshold, "The gate threshold")
            return self.gates >= t
        s = _share(sparsity, "The DuoAttention sparsity (share of streaming KV heads)")
        n = self.gates.size
        order = np.lexsort((np.arange(n), self.gates.ravel()))           # lowest gate first, ties by (layer, head)
        rank = np.arange(n)
        streaming = n if s >= 1.0 else int((rank < np.quantile(rank, s)).sum()) if s > 0.0 else 0
        full = np.ones(n, bool)
        full[order[:streaming]] = False
        return full.reshape(self.gates.shape)

    def config_dict(self) -> dict:
        return {**self.config, "sink_size": self.sink_size, "recent_size": self.recent_size}


# ---- files ------------------------------------------------------------------------------------------

def heads_text(gates: np.ndarray) -> str:
    """full_attention_heads.tsv's text, byte for byte what duo_attn's save_full_attention_heads writes."""
    buffer = io.StringIO()
    np.savetxt(buffer, np.asarray(gates, dtype=np.float64), delimiter="\t")
    return buffer.getvalue()


def write_pattern(folder, pattern: DuoPattern, *, plan=None) -> Path:
    """Write the pattern folder (atomic: a new or empty folder only; nothing is left on failure), with the
    plan's kv_plan.json beside the pattern when `plan` is given (DuoAttention ignores it; headscope's
    read_kv_plan(folder) and the kvpress runner's check read it)."""
    from analysis.compress.export.folder import atomic_folder
    target = check_pattern_target(folder)
    with atomic_folder(target) as tmp:
        (tmp / HEADS_FILE).write_text(heads_text(pattern.gates), encoding="utf-8")
        (tmp / CONFIG_FILE).write_text(json.dumps(pattern.config_dict(), indent=1) + "\n", encoding="utf-8")
        if plan is not None:
            from analysis.arch.kvplan import KV_PLAN_FILE
            (tmp / KV_PLAN_FILE).write_text(plan.to_json() + "\n", encoding="utf-8")
    return target


def check_pattern_target(folder) -> Path:
    """ExportError now (before any work) when `folder` is a file or a folder that is not empty."""
    from analysis.compress.export.folder import _check_target
    target = looked_up(folder, "The pattern folder (--to-duo)")
    _check_target(target, overwrite=False)
    return target


def is_pattern_folder(source) -> bool:
    """Whether `source` is a folder holding full_attention_heads.tsv (InputError for a path that cannot even be
    looked up: a name too long, a NUL byte)."""
    return (looked_up(source, "The plan to compare") / HEADS_FILE).is_file()


def looked_up(source, what: str) -> Path:
    """`source` as a Path, InputError when it cannot even be looked up (Path.is_dir() would raise for it)."""
    problem = path_problem(source) or path_problem(Path(source) / HEADS_FILE)
    if problem:
        raise InputError(f"{what} {shorten(str(source), 120)}: {problem[0]}; {problem[1]}.")
    return Path(source)


def read_pattern(source) -> DuoPattern:
    """A DuoPattern from a pattern folder (or its full_attention_heads.tsv; config.json beside it). Every
    problem (missing file, FIFO, huge or binary file, ragged rows, a word or NaN among the gates, a config
    without sink_size / recent_size) is one InputError; the files are read through the capped readers."""
    path = looked_up(source, "The DuoAttention pattern folder")
    folder = path.parent if path.name == HEADS_FILE and not path.is_dir() else path
    if not folder.is_dir():
        raise InputError(f"{shorten(str(folder), 120)} is not a folder; {_FIX}.")
    text = read_file_text(folder / HEADS_FILE, MAX_HEADS_BYTES, what="The DuoAttention gates file", fix=_FIX)
    gates = parse_heads(text)
    config = _read_config(folder / CONFIG_FILE)
    return DuoPattern(gates, _field(config, "sink_size"), _field(config, "recent_size"),
                      {k: v for k, v in config.items() if k not in ("sink_size", "recent_size")})


def parse_heads(text: str) -> np.ndarray:
    """[L, Hkv] float64 from full_attention_heads.tsv's text (np.loadtxt's reading of it: '#' comments and
    blank lines skipped, tab-separated numbers; one InputError naming the row for anything else)."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0]
        if not body.strip():
            continue
        cells = body.split("\t")
        try:
            row = [float(cell) for cell in cells]
        except ValueError:
            bad = next(c for c in cells if not _is_number(c))
            raise InputError(f"{HEADS_FILE}, line {number}: {shorten(bad.strip() or 'an empty cell', 40)!r} is not a "
                             f"gate (a number); {_FIX}.") from None
        if rows and len(row) != len(rows[0]):
            raise InputError(f"{HEADS_FILE}, line {number} holds {len(row)} gates but the first row {len(rows[0])}: "
                             f"every layer has one gate per KV head; {_FIX}.")
        rows.append(row)
    if not rows:
        raise InputError(f"{HEADS_FILE} holds no gates; {_FIX}.")
    gates = np.array(rows, dtype=np.float64)                      # [L, Hkv]
    if not np.isfinite(gates).all():
        l, g = map(int, np.argwhere(~np.isfinite(gates))[0])
        raise InputError(f"{HEADS_FILE}: the gate of layer {l}, KV head {g} is {gates[l, g]}; a gate is a number "
                         f"from 0 to 1; {_FIX}.")
    return gates


# ---- plans ------------------------------------------------------------------------------------------

def pattern_from_plan(plan, *, pruned: str = "refuse") -> DuoPattern:
    """The DuoAttention pattern of a KVPlan: gate 1 for a full KV head, 0 for a windowed one, sink_size /
    recent_size = the plan's sinks / recent. A pruned KV head: refused (InputError), or written as a full
    (`pruned="full"`) or streaming (`"window"`) gate."""
    from analysis.arch.kvplan import FULL, PRUNE
    if pruned not in PRUNED_AS:
        raise InputError(f"A pruned KV head is written as one of {', '.join(PRUNED_AS)}; got {pruned!r}.")
    modes = plan.modes
    if (modes == PRUNE).any() and PRUNED_AS[pruned] is None:
        raise InputError(f"The KV plan prunes {int((modes == PRUNE).sum())} KV heads, and a DuoAttention pattern only "
                         f"holds full or streaming heads (kvpress cannot drop a head either); write them as full or "
                         f"streaming gates (--duo-pruned full|window) on a model whose pruned heads are zeroed, or "
                         f"use a plan without pruned heads.")
    gates = np.where(modes == FULL, 1.0, 0.0)
    if (modes == PRUNE).any():
        gates[modes == PRUNE] = PRUNED_AS[pruned]
    notes = list(plan.notes) + ([f"pruned KV heads written as {pruned}"] if (modes == PRUNE).any() else [])
    return DuoPattern(gates, plan.window.sinks, plan.window.recent,
                      {"headscope": {"model": plan.model, "n_heads": plan.n_heads, "notes": notes}})


def plan_from_pattern(pattern: DuoPattern, geometry=None, *, n_heads: int | None = None,
                      threshold: float | None = None, sparsity: float | None = None, model: str | None = None):
    """The KVPlan of a pattern: full KV heads (`DuoPattern.full`) full, the rest windowed on sink_size +
    recent_size. `geometry` (a HeadGeometry) checks the layers and KV heads and gives the query heads per
    layer; without it they come from `n_heads`, else from the pattern's "headscope" object (a pattern
    headscope wrote). InputError for a pattern of another geometry."""
    from analysis.arch.kvplan import FULL, WINDOW, KVPlan
    ours = pattern.config.get("headscope") if isinstance(pattern.config.get("headscope"), dict) else {}
    L, Hkv = pattern.shape
    if geometry is not None:
        if (geometry.n_layers, geometry.n_kv_heads) != (L, Hkv):
            raise InputError(f"The DuoAttention pattern is for {L} layers x {Hkv} KV heads, but the model has "
                             f"{geometry.n_layers} x {geometry.n_kv_heads}; use the pattern trained for this model.")
        n_heads = geometry.n_heads
    elif n_heads is not None:
        pass
    elif isinstance(ours.get("n_heads"), int) and not isinstance(ours.get("n_heads"), bool):
        n_heads = ours["n_heads"]
    else:
        raise InputError("This DuoAttention pattern does not say how many query heads a layer has; give the model it "
                         "was trained for.")
    full = pattern.full(threshold=threshold, sparsity=sparsity)
    if ours:
        notes = tuple(str(n) for n in ours.get("notes", ()) if not str(n).startswith("pruned KV heads written as"))
    else:
        rule = (f"sparsity {sparsity}" if sparsity is not None
                else f"gates >= {DEFAULT_THRESHOLD if threshold is None else threshold}")
        notes = (f"from a DuoAttention pattern ({rule} full)",)
    name = model if model is not None else str(ours.get("model", ""))
    return KVPlan(np.where(full, FULL, WINDOW).astype(np.int8), pattern.window, n_heads, name, notes)


@dataclass(frozen=True)
class Agreement:
    """Which KV heads two plans keep full: both, only the first, only the second, neither ([L, Hkv] bool)."""
    both: np.ndarray
    only_first: np.ndarray
    only_second: np.ndarray
    neither: np.ndarray

    @property
    def jaccard(self) -> float:
        """|full in both| / |full in either| (1.0 when neither keeps any head full)."""
        either = int(self.both.sum() + self.only_first.sum() + self.only_second.sum())
        return 1.0 if either == 0 else float(self.both.sum() / either)

    def as_dict(self, names: tuple[str, str] = ("first", "second")) -> dict:
        a, b = names
        heads = {"both": self.both, f"only_{a}": self.only_first, f"only_{b}": self.only_second,
                 "neither": self.neither}
        return {"counts": {k: int(v.sum()) for k, v in heads.items()}, "jaccard_full": self.jaccard,
                "agree": int(self.both.sum() + self.neither.sum()), "of": int(self.both.size),
                "heads": {k: [[int(l), int(g)] for l, g in np.argwhere(v)] for k, v in heads.items() if k != "neither"}}


def full_agreement(first, second) -> Agreement:
    """How two KV plans (e.g. a DuoAttention pattern's and headscope's detectors') agree on full KV heads.
    InputError when they are for different geometries."""
    from analysis.arch.kvplan import FULL
    a, b = first.modes, second.modes
    if a.shape != b.shape:
        raise InputError(f"The plans are for different models: {a.shape[0]} layers x {a.shape[1]} KV heads against "
                         f"{b.shape[0]} x {b.shape[1]}.")
    fa, fb = a == FULL, b == FULL                                   # [L, Hkv] bool
    return Agreement(fa & fb, fa & ~fb, ~fa & fb, ~fa & ~fb)


# ---- small checks -------------------------------------------------------------------------------------

def check_gate_rule(threshold: float | None, sparsity: float | None) -> None:
    """InputError for a threshold or sparsity out of [0, 1], or both given (before any work)."""
    if threshold is not None and sparsity is not None:
        raise InputError("Give a threshold or a sparsity for the DuoAttention gates, not both.")
    if threshold is not None:
        _share(threshold, "The gate threshold")
    if sparsity is not None:
        _share(sparsity, "The DuoAttention sparsity (share of streaming KV heads)")


def pattern_from_texts(heads: str, config: str | None = None, *, window=None) -> DuoPattern:
    """A DuoPattern from the texts of full_attention_heads.tsv and (optionally) config.json, e.g. uploaded files;
    without a config the streaming heads' band is `window` (an analysis.arch.window.Window). One InputError for
    anything malformed, as `read_pattern`."""
    if len(heads) > MAX_HEADS_BYTES or (config is not None and len(config) > MAX_CONFIG_BYTES):
        raise InputError(f"The DuoAttention files are larger than any pattern (at most "
                         f"{MAX_HEADS_BYTES // 2**20} MiB of gates); {_FIX}.")
    gates = parse_heads(heads)
    if config is None:
        if window is None:
            raise InputError(f"Without {CONFIG_FILE} the pattern's sink_size and recent_size are not known; give it, "
                             f"or the window to use.")
        return DuoPattern(gates, window.sinks, window.recent)
    data = _config_of(config)
    return DuoPattern(gates, _field(data, "sink_size"), _field(data, "recent_size"),
                      {k: v for k, v in data.items() if k not in ("sink_size", "recent_size")})


def _read_config(path: Path) -> dict:
    return _config_of(read_file_text(path, MAX_CONFIG_BYTES, what="The DuoAttention config.json", fix=_FIX))


def _config_of(text: str) -> dict:
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InputError(f"{CONFIG_FILE} is nested too deeply to be a DuoAttention config; {_FIX}.") from None
    except ValueError as err:
        raise InputError(f"{CONFIG_FILE} is not valid JSON ({shorten(str(err), 80)}); {_FIX}.") from None
    if not isinstance(data, dict):
        raise InputError(f"{CONFIG_FILE} must hold a JSON object; {_FIX}.")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _field(config: dict, name: str):
    if name not in config:
        raise InputError(f"{CONFIG_FILE} has no {name}; {_FIX}.")
    return config[name]


def _whole(value, name: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or value > 2**31:
        raise InputError(f"{CONFIG_FILE}'s {name} must be a whole number of tokens >= {low}; got "
                         f"{shorten(repr(value), 40)}.")
    return int(value)


def _share(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value) \
            or not 0.0 <= float(value) <= 1.0:
        raise InputError(f"{what} is a number from 0 to 1; got {shorten(repr(value), 40)}.")
    return float(value)


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True
