"""Per-head KV policies: for every (layer, KV head) one of full / window / prune, next to the mask.

- **full**: the head keeps its whole KV cache and reads every earlier token (a retrieval head).
- **window**: it keeps `sinks` first tokens and the `recent` latest ones (a streaming head; the band is
  analysis.arch.spans's rule, one definition), so its cache stops growing at sinks + recent tokens.
- **prune**: the KV head and every query head of its group go (the mask's KV-group rule: a pruned KV
  head is a groups-policy cut of that group; analysis.score.masks).

The unit is the KV head (GQA-aware: its G query heads share its keys and values, so they share its
policy); on MHA models a KV head is a head. `sinks` and `recent` are the plan's own, the same for every
windowed head (DuoAttention's setting).

`KVPlan` is the one record: arrays for the code, `kv_plan.json` for the user (written with an export,
read back with the model's geometry checked: a plan from another model, a head that does not exist or
an unknown policy name is one line). `kv_bytes` is what the KV cache holds at a context; `applied` runs
a model under the plan (head mask for the pruned heads, attention spans for the windowed ones).

Planners turn head scores into a plan (`plan_kv`): the KV heads with the lowest streaming score
(analysis.measure: how much a head's output changes when it sees only sinks + a recent window) are
windowed, the ones that matter least to the long-context probes / retrieval may be pruned; retrieval
heads stay full.
"""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.arch.geometry import HeadGeometry
from analysis.core import schemas
from analysis.core.errors import InputError
from analysis.measure.long_options import DEFAULT_RECENT, DEFAULT_SINKS

MODES = ("full", "window", "prune")
FULL, WINDOW, PRUNE = 0, 1, 2
KV_PLAN_FILE = "kv_plan.json"
KV_PLAN_FORMAT = 1


@dataclass(frozen=True)
class KVPlan:
    """modes [L, Hkv] (0 full, 1 window, 2 prune), the window's band, and the model it was made for."""
    modes: np.ndarray
    sinks: int = DEFAULT_SINKS
    recent: int = DEFAULT_RECENT
    n_heads: int = 0                    # query heads per layer of the model (0: H = Hkv, MHA)
    model: str = ""
    notes: tuple = field(default_factory=tuple)

    def __post_init__(self):
        from analysis.arch.spans import check_band
        m = np.asarray(self.modes)
        if m.ndim != 2 or not m.size:
            raise InputError(f"A KV plan is one row of policies per layer; got shape {list(m.shape)}.")
        if not np.isin(m, (FULL, WINDOW, PRUNE)).all():
            raise InputError(f"A KV plan holds only {', '.join(MODES)}.")
        object.__setattr__(self, "modes", m.astype(np.int8))
        sinks, recent = check_band(self.sinks, self.recent)
        object.__setattr__(self, "sinks", sinks)
        object.__setattr__(self, "recent", recent)
        H = self.n_heads or m.shape[1]
        if H % m.shape[1]:
            raise InputError(f"{H} query heads do not split into {m.shape[1]} KV groups.")
        object.__setattr__(self, "n_heads", int(H))

    # ---- what it holds ---------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return int(self.modes.shape[0])

    @property
    def n_kv_heads(self) -> int:
        return int(self.modes.shape[1])

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def window(self) -> np.ndarray:
        """[L, Hkv] bool: windowed KV heads."""
        return self.modes == WINDOW

    @property
    def pruned_kv(self) -> np.ndarray:
        """[L, Hkv] bool: pruned KV heads."""
        return self.modes == PRUNE

    def pruned_heads(self) -> np.ndarray:
        """[L, H] bool: the query heads the plan prunes (every head of a pruned KV head's group)."""
        return np.repeat(self.pruned_kv, self.group_size, axis=1)

    def counts(self) -> dict[str, int]:
        return {name: int((self.modes == code).sum()) for code, name in enumerate(MODES)}

    def kept_tokens(self, context: int) -> np.ndarray:
        """[L, Hkv] tokens each KV head holds in its cache after `context` tokens."""
        per_mode = np.array([context, min(context, self.sinks + self.recent), 0])   # full, window, prune
        return per_mode[self.modes]

    def kv_bytes(self, context: int, *, head_dim: int, dtype_bytes: int = 4, batch: int = 1) -> int:
        """Bytes of the KV cache (keys and values) at `context` tokens."""
        return int(2 * head_dim * dtype_bytes * batch * self.kept_tokens(context).sum())

    def kv_ratio(self, context: int) -> float:
        """kv_bytes / the dense model's at `context` (the dtype and head size cancel)."""
        return float(self.kept_tokens(context).sum() / (context * self.modes.size))

    def describe(self) -> str:
        c = self.counts()
        return (f"{c['full']} full, {c['window']} windowed ({self.sinks} sink + {self.recent} recent tokens), "
                f"{c['prune']} pruned of {self.modes.size} KV heads")

    # ---- checks ------------------------------------------------------------------------------------
    def check_geometry(self, geometry: HeadGeometry) -> "KVPlan":
        """InputError unless the plan was made for a model of this shape."""
        mine = (self.n_layers, self.n_heads, self.n_kv_heads)
        theirs = (geometry.n_layers, geometry.n_heads, geometry.n_kv_heads)
        if mine != theirs:
            raise InputError(f"The KV plan is for {mine[0]} layers x {mine[1]} heads ({mine[2]} KV heads), but the "
                             f"model has {theirs[0]} x {theirs[1]} ({theirs[2]} KV heads); make the plan for this "
                             f"model.")
        return self

    def check_context(self, context: int, limit: int) -> None:
        if context > limit:
            raise InputError(f"A context of {context} tokens is longer than this model reads ({limit}); use at most "
                             f"{limit}.")

    # ---- JSON ----------------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return dict(format=KV_PLAN_FORMAT, tool="headscope", model=self.model, n_layers=self.n_layers,
                    n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, sinks=self.sinks, recent=self.recent,
                    modes=[[MODES[c] for c in row] for row in self.modes.tolist()], counts=self.counts(),
                    notes=list(self.notes))

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    @classmethod
    def from_dict(cls, data, *, geometry: HeadGeometry | None = None) -> "KVPlan":
        fix = "write the plan again (headscope kv-plan, or the app's Long context page)"
        if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] > KV_PLAN_FORMAT:
            raise InputError(f"{KV_PLAN_FILE} has format {data['format']}; this headscope reads up to {KV_PLAN_FORMAT}.")
        schemas.check(data, schemas.KV_PLAN_SCHEMA, KV_PLAN_FILE, fix)
        L, Hkv = data["n_layers"], data["n_kv_heads"]
        rows = data["modes"]
        if len(rows) != L or any(len(r) != Hkv for r in rows):
            bad = next((i for i, r in enumerate(rows) if len(r) != Hkv), len(rows))
            raise InputError(f"{KV_PLAN_FILE} says {L} layers x {Hkv} KV heads but lists "
                             + (f"{len(rows)} layers" if len(rows) != L else f"{len(rows[bad])} heads in layer {bad}")
                             + f"; {fix}.")
        modes = np.array([[MODES.index(m) for m in r] for r in rows], dtype=np.int8)
        plan = cls(modes, data["sinks"], data["recent"], data["n_heads"], data.get("model", ""),
                   tuple(data.get("notes", ())))
        return plan if geometry is None else plan.check_geometry(geometry)

    # ---- constructors ------------------------------------------------------------------------------
    @classmethod
    def full(cls, geometry: HeadGeometry, **kw) -> "KVPlan":
        """Every KV head full: the dense model."""
        return cls(np.zeros((geometry.n_layers, geometry.n_kv_heads), np.int8), n_heads=geometry.n_heads, **kw)

    @classmethod
    def from_mask(cls, pruned, geometry: HeadGeometry, **kw) -> "KVPlan":
        """The plan of a head mask [L, H]: KV groups the mask empties are pruned, the rest full. InputError
        when the mask prunes part of a group (that is a finer cut than a KV plan holds: use the mask)."""
        p = np.asarray(pruned, dtype=bool).reshape(geometry.n_layers, geometry.n_kv_heads, geometry.group_size)
        if (p.any(-1) & ~p.all(-1)).any():
            raise InputError("This mask prunes some query heads of a KV group and keeps others; a KV plan prunes "
                             "whole KV heads (the groups policy). Use the mask itself, or the groups policy.")
        return cls(np.where(p.all(-1), PRUNE, FULL).astype(np.int8), n_heads=geometry.n_heads, **kw)


def read_kv_plan(source, *, geometry: HeadGeometry | None = None) -> KVPlan:
    """A KVPlan from a dict, JSON text, a kv_plan.json path or a folder holding one (geometry checked if given)."""
    from analysis.core.files import read_file_text
    fix = f"give a {KV_PLAN_FILE} written by headscope, or a folder holding one"
    if isinstance(source, dict):
        data = source
    else:
        text = str(source)
        if not text.lstrip().startswith("{"):
            path = Path(text)
            path = path / KV_PLAN_FILE if path.is_dir() else path
            text = read_file_text(path, schemas.MAX_JSON_CHARS, what="The KV plan file", fix=fix)
        data = schemas.load_json_text(text, "The KV plan file", fix)
        if not isinstance(data, dict):
            raise InputError(f"The KV plan file must hold a JSON object; {fix}.")
    return KVPlan.from_dict(data, geometry=geometry)


@contextmanager
def applied(model, plan: KVPlan | None, *, adapter=None):
    """Inside the block `model` (of the plan's geometry) runs under `plan`: its pruned heads gated off
    (analysis.arch.head_gates), its windowed KV heads on sinks + recent tokens (analysis.arch.spans).
    None: the model as it is."""
    from analysis.arch.adapters import adapter_for
    from analysis.arch.head_gates import gates_from_mask, head_mask
    from analysis.arch.spans import windowed
    if plan is None:
        yield model
        return
    adapter = adapter or adapter_for(model)
    plan.check_geometry(adapter.geometry(model))
    with ExitStack() as stack:
        if plan.pruned_kv.any():
            stack.enter_context(head_mask(model, gates_from_mask(plan.pruned_heads()), adapter=adapter))
        if plan.window.any():
            stack.enter_context(windowed(model, plan.window, sinks=plan.sinks, recent=plan.recent))
        yield model


def plan_kv(geometry: HeadGeometry, streaming: np.ndarray, *, window_share: float = 0.5,
            prune_scores: np.ndarray | None = None, prune_share: float = 0.0, keep: np.ndarray | None = None,
            sinks: int = DEFAULT_SINKS, recent: int = DEFAULT_RECENT, model: str = "") -> KVPlan:
    """A plan from scores [L, Hkv]: first the `prune_share` of KV heads with the lowest `prune_scores` are
    pruned (higher = needed more, e.g. the long-context probes' drop), then the `window_share` of KV heads
    with the lowest `streaming` score (higher = needs the full context) among the rest are windowed.
    `keep` [L, Hkv] bool: heads that stay full whatever their scores (e.g. retrieval heads). Ties break
    by (layer, head), so plans are deterministic."""
    shape = (geometry.n_layers, geometry.n_kv_heads)
    s = _scores(streaming, shape, "streaming scores")
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
    return KVPlan(modes, sinks, recent, geometry.n_heads, model)


def _scores(values, shape, what: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.shape != shape:
        raise InputError(f"The {what} must be [{shape[0]}, {shape[1]}] (layers x KV heads); got {list(a.shape)}.")
    if not np.isfinite(a).all():
        raise InputError(f"The {what} contain NaN or infinity.")
    return a
