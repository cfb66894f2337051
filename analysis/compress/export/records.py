"""mask.json: everything needed to rebuild and explain a mask (`MaskRecord`), written into every
export folder and read back by `read_mask_json` / `mask_from_json` (checked against
analysis.core.schemas.MASK_SCHEMA with exact types, then the cross-field rules).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from analysis.arch.adapters import adapter_for
from analysis.arch.geometry import HeadGeometry
from analysis.core import schemas
from analysis.core.atomic import os_problem
from analysis.core.errors import InputError

TOOL = "headscope"
TOOL_VERSION = "0.1.0"
MASK_FORMAT = 1
MASK_FILE = "mask.json"


def _finite_table(values, shape, what: str) -> list[list[float]] | None:
    if values is None:
        return None
    arr = np.asarray(values, dtype=np.float64)
    if arr.shape != shape:
        raise InputError(f"{what} must have shape {list(shape)}; got {list(arr.shape)}.")
    if not np.isfinite(arr).all():
        raise InputError(f"{what} contain NaN or infinity; score the heads again before exporting.")
    return arr.tolist()


@dataclass
class MaskRecord:
    """Everything needed to rebuild and explain a mask (the contents of mask.json)."""
    model: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    kept: list[list[int]]                       # [L][kept query heads]
    scorer: str | None = None
    scorer_params: dict = field(default_factory=dict)
    z: float | None = None
    sparsity: float | None = None
    policy: str | None = None
    kv_policy: str | None = None                # surgery's kv_policy (auto / expand / strict); None: not cut
    scores: list[list[float]] | None = None     # [L][H], higher = more important
    tiebreak: list[list[float]] | None = None   # [L][H], the ranking's tie-break
    tool: str = TOOL
    tool_version: str = TOOL_VERSION
    format: int = MASK_FORMAT

    def pruned(self) -> np.ndarray:
        """The boolean mask [L, H] (True = pruned)."""
        mask = np.ones((self.n_layers, self.n_heads), dtype=bool)   # [L, H]
        for layer, kept in enumerate(self.kept):
            mask[layer, kept] = False
        return mask

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict) -> "MaskRecord":
        """Validate (analysis.core.schemas.MASK_SCHEMA: exact types and ranges, then the cross-field rules)."""
        fix = "export the mask again"
        if isinstance(data, dict) and _strict_int(data.get("format")) and data["format"] > MASK_FORMAT:
            raise InputError(f"mask.json has format {data['format']}; this headscope reads up to {MASK_FORMAT}. "
                             f"Update headscope.")
        schemas.check(data, schemas.MASK_SCHEMA, "mask.json", fix)
        record = cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        L, H = record.n_layers, record.n_heads
        if len(record.kept) != L or any(h >= H for row in record.kept for h in row):
            raise InputError(f"mask.json lists kept heads that do not fit {L} layers x {H} heads; {fix}.")
        if H % record.n_kv_heads:
            raise InputError(f"mask.json says {H} heads in {record.n_kv_heads} KV groups, which does not divide; "
                             f"{fix}.")
        for name in ("scores", "tiebreak"):
            table = getattr(record, name)
            if table is not None and (len(table) != L or any(len(row) != H for row in table)
                                      or not np.isfinite(np.asarray(table, dtype=np.float64)).all()):
                raise InputError(f"mask.json's {name} must be {L} rows of {H} finite numbers; {fix}.")
        return record

    def check_geometry(self, geometry: HeadGeometry) -> None:
        """InputError unless this mask was made for a model of `geometry`'s shape."""
        mine = (self.n_layers, self.n_heads, self.n_kv_heads)
        theirs = (geometry.n_layers, geometry.n_heads, geometry.n_kv_heads)
        if mine != theirs:
            raise InputError(f"mask.json is for {mine[0]} layers x {mine[1]} heads ({mine[2]} KV heads), but the model "
                             f"has {theirs[0]} x {theirs[1]} ({theirs[2]} KV heads); use the mask exported for this "
                             f"model.")


def mask_record(pruned, *, geometry: HeadGeometry, model: str = "", model_type: str = "", scores=None,
                scorer: str | None = None, z: float | None = None, sparsity: float | None = None,
                policy: str | None = None, tiebreak=None, scorer_params: dict | None = None,
                kv_policy: str | None = None) -> MaskRecord:
    """A MaskRecord for `pruned` [L, H]. `scores` may be a [L, H] array or an analysis.score.scoring
    HeadScores (its name, params and tie-break are used unless given)."""
    p = np.asarray(pruned, dtype=bool)
    shape = (geometry.n_layers, geometry.n_heads)
    if p.shape != shape:
        raise InputError(f"Mask must have shape {list(shape)} (layers x heads); got {list(p.shape)}.")
    if hasattr(scores, "scores"):
        scorer = scorer or scores.name
        scorer_params = scorer_params if scorer_params is not None else dict(scores.params)
        tiebreak = tiebreak if tiebreak is not None else scores.tiebreak
        scores = scores.scores
    if z is None and scorer_params and "z" in scorer_params:
        z = scorer_params["z"]
    params = json.loads(json.dumps(scorer_params or {}, default=str))
    return MaskRecord(model=model, model_type=model_type, n_layers=shape[0], n_heads=shape[1],
                      n_kv_heads=geometry.n_kv_heads, kept=[np.flatnonzero(~row).tolist() for row in p],
                      scorer=scorer, scorer_params=params, z=None if z is None else float(z),
                      sparsity=None if sparsity is None else float(sparsity), policy=policy, kv_policy=kv_policy,
                      scores=_finite_table(scores, shape, "Head scores"),
                      tiebreak=_finite_table(tiebreak, shape, "Tie-break values"))


def _strict_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_mask_json(source, *, geometry: HeadGeometry | None = None) -> MaskRecord:
    """A MaskRecord from a dict, JSON text, a mask.json path or an export folder holding one.

    With `geometry`, the mask must be for a model of that shape (InputError otherwise)."""
    fix = "export the mask again"
    if isinstance(source, dict):
        record = MaskRecord.from_dict(source)
    else:
        text = str(source)
        if not text.lstrip().startswith(("{", "[")):
            try:
                path = Path(text)
                path = path / MASK_FILE if path.is_dir() else path
                if path.is_file() and path.stat().st_size > schemas.MAX_JSON_CHARS:
                    raise InputError(f"The mask file {path} is larger than any mask.json; {fix}.")
                text = path.read_text(encoding="utf-8")
            except (OSError, ValueError) as err:   # ValueError: a NUL byte, or not UTF-8
                reason = os_problem(err)[0] if isinstance(err, OSError) else "it is not UTF-8 text or not a path"
                raise InputError(f"Cannot read the mask file {text[:80]!r} ({reason}); give the path of a "
                                 f"mask.json or of an export folder holding one.") from None
        data = schemas.load_json_text(text, "The mask file", fix)
        if not isinstance(data, dict):
            raise InputError(f"The mask file must hold a JSON object; {fix}.")
        record = MaskRecord.from_dict(data)
    if geometry is not None:
        record.check_geometry(geometry)
    return record


def mask_from_json(source, *, geometry: HeadGeometry | None = None) -> np.ndarray:
    """The boolean mask [L, H] (True = pruned) stored in a mask.json (see read_mask_json)."""
    return read_mask_json(source, geometry=geometry).pruned()


def record_for(model, pruned, record: MaskRecord | None) -> MaskRecord:
    """`record` checked to describe `pruned`, or a bare record of it for `model`."""
    if record is not None:
        if record.pruned().shape != np.asarray(pruned).shape or not np.array_equal(record.pruned(),
                                                                                    np.asarray(pruned, bool)):
            raise InputError("The mask record does not describe the mask being exported; build it from the "
                             "same mask (analysis.compress.export.mask_record).")
        return record
    adapter = adapter_for(model)
    return mask_record(pruned, geometry=adapter.geometry(model), model=str(model.config._name_or_path or ""),
                       model_type=adapter.model_type)
