"""A cut of a dense model, as one value every report takes: a head mask, a per-KV-head plan, or a model of its own.

A report (perplexity, capability probes, long-context probes, RULER and the harness, speed, the pipeline's
judge) compares the dense model with one cut. The three kinds:

- **mask**: `mask` [L, H] bool, the pruned query heads, on the dense model through the head gates (the one
  masking mechanism, analysis.arch.head_gates: the same function as surgery's pruned model);
- **plan**: a `KVPlan` (analysis.arch.kvplan: per KV head full / window / prune) on the dense model: pruned
  KV heads gated off, windowed heads on their window (`applied`, the masked path); generation runs with the
  plan's compact cache (`new_cache`: pruned KV heads keep nothing, windowed ones a ring), so the memory the
  plan promises is the memory the cache holds (`kv_cache_bytes(cache) == plan.kv_bytes`);
- **model**: a model of its own (an export folder's weights, surgery's twin, a recovered student), run under
  its KV plan's windows when it has one (`rows`: the modes of its own KV heads, analysis.arch.kvplan.mode_rows).

    with cut.running(dense_model) as model:     # the module to call; everything restored after
        cache = cut.new_cache()                  # one per prompt and its decode steps (None: the model's own)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)

Reports that measure several masks in one batched pass read `cut.mask` of a mask cut directly; every report
starts with `checked(cut, geometry)`. Building a Cut from user input (a mask.json, a kv_plan.json, an export
folder with its plan) is the CLI's `cut_from` and the app's view, both through
analysis.compress.export.planned.cut_of_folder for folders: one check, one meaning.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import KVPlan, applied
from analysis.core.errors import InputError

KINDS = ("mask", "plan", "model")


@dataclass(frozen=True, eq=False)
class Cut:
    """One cut (module docstring). Build with `of_mask`, `of_plan` or `of_model`."""
    kind: str
    info: dict = field(default_factory=dict)   # what the cut is, for reports (sources, sparsity, ...): JSON-able
    mask: np.ndarray | None = None             # [L, H] bool pruned query heads (mask kind; a plan's pruned groups)
    plan: KVPlan | None = None                 # plan kind, or the plan a model of its own runs under
    model: object = None                       # model kind: the nn.Module to run
    rows: list | None = None                   # model kind with a plan: [L][Hkv_l] modes of its own KV heads

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def of_mask(cls, pruned, info: dict | None = None) -> "Cut":
        mask = np.asarray(pruned, dtype=bool)
        if mask.ndim != 2:
            raise InputError(f"A head mask is [layers, heads]; got shape {list(mask.shape)}.")
        return cls("mask", dict(info or {}), mask=mask)

    @classmethod
    def of_plan(cls, plan: KVPlan, info: dict | None = None) -> "Cut":
        if not isinstance(plan, KVPlan):
            raise InputError(f"A plan cut takes a KVPlan; got {type(plan).__name__}.")
        return cls("plan", dict(info or {}), mask=plan.pruned_heads(), plan=plan)

    @classmethod
    def of_model(cls, model, info: dict | None = None, *, plan: KVPlan | None = None, rows=None) -> "Cut":
        if model is None:
            raise InputError("A model cut needs the model.")
        if (plan is None) != (rows is None):
            raise InputError("A model under a KV plan needs both the plan and the modes of its own KV heads.")
        rows = None if rows is None else [np.asarray(r, dtype=np.int8).reshape(-1) for r in rows]
        return cls("model", dict(info or {}), plan=plan, model=model, rows=rows)

    # ---- what it is -------------------------------------------------------------------------------------
    @property
    def windowed(self) -> bool:
        """Whether some KV head reads only a window (rows must then start at token 0: no left padding)."""
        return self.plan is not None and bool(self.plan.windowed.any())

    @property
    def compacts(self) -> bool:
        """Whether generation runs with a compact cache (a plan that is not all full)."""
        return self.plan is not None and not self.plan.is_full

    def check(self, geometry: HeadGeometry) -> "Cut":
        """InputError unless the cut fits a dense model of this geometry (a model of its own is checked by
        whoever loaded it)."""
        if self.kind == "mask" and self.mask.shape != (geometry.n_layers, geometry.n_heads):
            raise InputError(f"The mask is {list(self.mask.shape)} but the model has {geometry.n_layers} layers x "
                             f"{geometry.n_heads} heads; give a mask of this model.")
        if self.kind == "plan":
            self.plan.check_geometry(geometry)
        return self

    def describe(self) -> str:
        if self.kind == "mask":
            return f"a mask pruning {int(self.mask.sum())} of {self.mask.size} heads"
        if self.kind == "plan":
            return f"a KV plan: {self.plan.describe()}"
        return "a model of its own" + ("" if self.plan is None else f" under its KV plan ({self.plan.describe()})")

    def as_dict(self) -> dict:
        """What reports write about the cut: kind, description, the info it was made with, and its counts."""
        out = dict(kind=self.kind, describe=self.describe(), **self.info)
        if self.kind == "mask":
            out["n_pruned"] = int(self.mask.sum())
        if self.plan is not None:
            out.update(kv_plan=self.plan.counts(), **self.plan.window.as_dict())
        return out

    def key(self) -> str:
        """A digest of what the cut computes (mask / plan contents; a model cut: the model object), for caches."""
        h = hashlib.sha1(self.kind.encode())
        if self.mask is not None:
            h.update(np.packbits(self.mask).tobytes() + str(self.mask.shape).encode())
        if self.plan is not None:
            h.update(self.plan.modes.tobytes() + repr(self.plan.window).encode())
        if self.model is not None:
            h.update(str(id(self.model)).encode())
        return h.hexdigest()[:16]

    # ---- running ----------------------------------------------------------------------------------------
    @contextmanager
    def running(self, dense, *, adapter=None) -> Iterator:
        """Inside the block: the module to call for this cut (the dense model under the gates or the plan, or
        the cut's own model under its windows), with the spans kernel on whenever `new_cache` gives a compact
        cache. `dense` is never changed; everything is restored in finally."""
        if self.kind == "mask":
            from analysis.arch.head_gates import gates_from_mask, head_mask
            with head_mask(dense, gates_from_mask(self.mask), adapter=adapter):
                yield dense
        elif self.kind == "plan":
            with applied(dense, self.plan, adapter=adapter, compact=True):
                yield dense
        elif self.plan is None:
            yield self.model
        else:
            from analysis.arch.kvcache import windowed_rows
            from analysis.arch.spans import spans
            with spans(self.model, windowed=windowed_rows(self.rows), window=self.plan.window):
                yield self.model

    def new_cache(self, *, block: int = 0):
        """A fresh KV cache for one prompt and its decode steps, used inside `running()`: the plan's compact
        cache (analysis.arch.kvcache.CompactCache), else None (the model's own DynamicCache)."""
        if not self.compacts:
            return None
        from analysis.arch.kvcache import CompactCache
        rows = self.rows if self.kind == "model" else list(self.plan.modes)
        return CompactCache(rows, self.plan.window, block=block)


def running(cut: Cut | None, dense, *, adapter=None):
    """`cut.running(dense)`, or the dense model as it is for no cut (None)."""
    return nullcontext(dense) if cut is None else cut.running(dense, adapter=adapter)


def checked(cut, geometry: HeadGeometry, *, required: bool = False) -> Cut | None:
    """What every report does with its `cut=` first: None passes (unless `required`), a Cut is checked against
    the dense model's geometry, anything else (a bare mask, a plan) is one line naming the constructor."""
    if cut is None and not required:
        return None
    if not isinstance(cut, Cut):
        raise InputError(f"Give the cut as an analysis.arch.cut.Cut (Cut.of_mask(pruned), Cut.of_plan(plan) or "
                         f"Cut.of_model(model)); got {type(cut).__name__}.")
    return cut.check(geometry)
