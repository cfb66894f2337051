"""Per-KV-head plans: for every (layer, KV head) one of full / window / prune, next to the mask.

- **full**: the head keeps its whole KV cache and reads every earlier token (a retrieval head).
- **window**: it keeps the plan's `Window` (analysis.arch.window: `sinks` first tokens + `recent` latest
  ones, one rule), so its cache stops growing at sinks + recent tokens (a streaming head).
- **prune**: the KV head and every query head of its group go (the mask's KV-group rule: a pruned KV
  head is a groups-policy cut of that group; analysis.score.masks).

The modes are declared once, here (`KV_MODES`: name, one-letter code, what the head keeps); the schema of
kv_plan.json, the app's grid, its URL letters and its colours all read them from this table.

The unit is the KV head (GQA-aware: its G query heads share its keys and values, so they share its
policy); on MHA models a KV head is a head. The window is the plan's own, the same for every windowed head
(DuoAttention's setting).

`KVPlan` is the one record: arrays for the code, `kv_plan.json` for the user (written with an export,
read back with the model's geometry checked: a plan from another model, a head that does not exist or
an unknown policy name is one line). `kv_bytes` is what the KV cache holds at a context; `applied` runs
a model under the plan (head mask for the pruned heads, attention spans for the windowed ones). The
planners that make a plan from head scores live in analysis.score.kvscores.

Light: numpy and the window only (the CLI's parser and the app's URL read the modes); torch is imported
inside `applied`.
"""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.arch.geometry import HeadGeometry
from analysis.arch.window import Window, window_of
from analysis.core import schemas
from analysis.core.errors import InputError


@dataclass(frozen=True)
class KVMode:
    """One policy a KV head can have: its code in `KVPlan.modes`, name, one-letter code, what it keeps."""
    code: int
    name: str
    letter: str
    keeps: str


KV_MODES: tuple[KVMode, ...] = (
    KVMode(0, "full", "f", "every token"),
    KVMode(1, "window", "w", "sink + recent tokens"),
    KVMode(2, "prune", "p", "nothing (the KV head and its query heads are removed)"),
)
MODES = tuple(m.name for m in KV_MODES)          # ("full", "window", "prune"): index == code
FULL, WINDOW, PRUNE = (m.code for m in KV_MODES)
KV_PLAN_FILE = "kv_plan.json"
KV_PLAN_FORMAT = 1

KV_PLAN_SCHEMA = {
    "type": "object",
    "required": ["n_layers", "n_heads", "n_kv_heads", "sinks", "recent", "modes"],
    "properties": {
        "model": schemas.TEXT, "tool": schemas.TEXT, "format": {"type": "integer", "minimum": 1},
        "n_layers": schemas.count(schemas.MAX_LAYERS), "n_heads": schemas.count(schemas.MAX_HEADS),
        "n_kv_heads": schemas.count(schemas.MAX_HEADS),
        "sinks": {"type": "integer", "minimum": 0, "maximum": 2**31},
        "recent": {"type": "integer", "minimum": 0, "maximum": 2**31},   # 0: refused in words by Window
        "modes": {"type": "array", "minItems": 1, "maxItems": schemas.MAX_LAYERS,
                  "items": {"type": "array", "minItems": 1, "maxItems": schemas.MAX_HEADS,
                            "items": {"enum": list(MODES)}}},
        "counts": {"type": "object"},
        "notes": {"type": "array", "maxItems": 64, "items": schemas.TEXT},
    },
}


@dataclass(frozen=True)
class KVPlan:
    """modes [L, Hkv] (KV_MODES' codes), the window of the windowed heads, and the model it was made for."""
    modes: np.ndarray
    window: Window = field(default_factory=Window)
    n_heads: int = 0                    # query heads per layer of the model (0: H = Hkv, MHA)
    model: str = ""
    notes: tuple = field(default_factory=tuple)

    def __post_init__(self):
        m = np.asarray(self.modes)
        if m.ndim != 2 or not m.size:
            raise InputError(f"A KV plan is one row of policies per layer; got shape {list(m.shape)}.")
        if not np.isin(m, [k.code for k in KV_MODES]).all():
            raise InputError(f"A KV plan holds only {', '.join(MODES)}.")
        object.__setattr__(self, "modes", m.astype(np.int8))
        object.__setattr__(self, "window", window_of(self.window))
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
    def windowed(self) -> np.ndarray:
        """[L, Hkv] bool: windowed KV heads."""
        return self.modes == WINDOW

    @property
    def pruned_kv(self) -> np.ndarray:
        """[L, Hkv] bool: pruned KV heads."""
        return self.modes == PRUNE

    @property
    def is_full(self) -> bool:
        """Every KV head full: the dense model."""
        return not self.modes.any()

    def pruned_heads(self) -> np.ndarray:
        """[L, H] bool: the query heads the plan prunes (every head of a pruned KV head's group)."""
        return np.repeat(self.pruned_kv, self.group_size, axis=1)

    def counts(self) -> dict[str, int]:
        return {m.name: int((self.modes == m.code).sum()) for m in KV_MODES}

    def kept_tokens(self, context: int) -> np.ndarray:
        """[L, Hkv] tokens each KV head holds in its cache after `context` tokens."""
        per_mode = np.array([context, self.window.kept(context), 0])          # by code: full, window, prune
        return per_mode[self.modes]

    def kv_bytes(self, context: int, *, head_dim: int, dtype_bytes: int = 4, batch: int = 1) -> int:
        """Bytes of the KV cache (keys and values) at `context` tokens."""
        return int(2 * head_dim * dtype_bytes * batch * self.kept_tokens(context).sum())

    def kv_ratio(self, context: int) -> float:
        """kv_bytes / the dense model's at `context` (the dtype and head size cancel)."""
        return float(self.kept_tokens(context).sum() / (context * self.modes.size))

    def describe(self) -> str:
        c = self.counts()
        return (f"{c['full']} full, {c['window']} windowed ({self.window.describe()}), {c['prune']} pruned of "
                f"{self.modes.size} KV heads")

    def with_modes(self, modes: np.ndarray, *notes: str) -> "KVPlan":
        """The same plan (window, model) with other modes, the notes added."""
        return KVPlan(modes, self.window, self.n_heads, self.model, self.notes + tuple(notes))

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
                    n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, **self.window.as_dict(),
                    modes=[[MODES[c] for c in row] for row in self.modes.tolist()], counts=self.counts(),
                    notes=list(self.notes))

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    @classmethod
    def from_dict(cls, data, *, geometry: HeadGeometry | None = None) -> "KVPlan":
        fix = "write the plan again (headscope kv-plan, or the app's Long context page)"
        if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] > KV_PLAN_FORMAT:
            raise InputError(f"{KV_PLAN_FILE} has format {data['format']}; this headscope reads up to {KV_PLAN_FORMAT}.")
        schemas.check(data, KV_PLAN_SCHEMA, KV_PLAN_FILE, fix)
        L, Hkv = data["n_layers"], data["n_kv_heads"]
        rows = data["modes"]
        if len(rows) != L or any(len(r) != Hkv for r in rows):
            bad = next((i for i, r in enumerate(rows) if len(r) != Hkv), len(rows))
            raise InputError(f"{KV_PLAN_FILE} says {L} layers x {Hkv} KV heads but lists "
                             + (f"{len(rows)} layers" if len(rows) != L else f"{len(rows[bad])} heads in layer {bad}")
                             + f"; {fix}.")
        modes = np.array([[MODES.index(m) for m in r] for r in rows], dtype=np.int8)
        plan = cls(modes, Window(data["sinks"], data["recent"]), data["n_heads"], data.get("model", ""),
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
            try:
                path = path / KV_PLAN_FILE if path.is_dir() else path
            except OSError:                           # a name the file system refuses (too long, ...): the reader says so
                pass
            text = read_file_text(path, schemas.MAX_JSON_CHARS, what="The KV plan file", fix=fix)
        data = schemas.load_json_text(text, "The KV plan file", fix)
        if not isinstance(data, dict):
            raise InputError(f"The KV plan file must hold a JSON object; {fix}.")
    return KVPlan.from_dict(data, geometry=geometry)


def mode_rows(plan: KVPlan, kept_kv=None) -> list[np.ndarray]:
    """[L][Hkv_l] int8 mode codes per layer: the plan's own rows, or (kept_kv: per layer the original KV head
    each of a pruned twin's KV heads holds, analysis.compress.surgery.HeadLayout.kv_heads) the rows of the
    twin's own KV heads. InputError if a twin keeps a KV head the plan prunes (the layout is not the plan's)."""
    if kept_kv is None:
        return [row.copy() for row in plan.modes]
    rows = []
    for l, kept in enumerate(kept_kv):
        kept = np.asarray(kept, dtype=np.int64)
        if plan.pruned_kv[l, kept].any():
            raise InputError(f"Layer {l} of the pruned model keeps KV heads the KV plan prunes; the plan is not this "
                             f"export's. Use the plan written with it.")
        rows.append(plan.modes[l, kept].copy())
    return rows


@contextmanager
def applied(model, plan: KVPlan | None, *, adapter=None, compact: bool = False):
    """Inside the block `model` (of the plan's geometry) runs under `plan`: its pruned heads gated off
    (analysis.arch.head_gates), its windowed KV heads on the window (analysis.arch.spans). compact: the spans
    kernel is on even without a window, so a compact cache (analysis.arch.kvcache.CompactCache of the plan's
    rows) can serve the block. None: the model as it is."""
    from analysis.arch.adapters import adapter_for
    from analysis.arch.head_gates import gates_from_mask, head_mask
    from analysis.arch.spans import spans
    if plan is None:
        yield model
        return
    adapter = adapter or adapter_for(model)
    plan.check_geometry(adapter.geometry(model))
    with ExitStack() as stack:
        if plan.pruned_kv.any():
            stack.enter_context(head_mask(model, gates_from_mask(plan.pruned_heads()), adapter=adapter))
        if plan.windowed.any() or (compact and not plan.is_full):
            stack.enter_context(spans(model, windowed=plan.windowed, window=plan.window))
        yield model
