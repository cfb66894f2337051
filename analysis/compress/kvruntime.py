"""Running a model under a KV plan: the physically pruned twin, its windows, and the compact cache.

`kv_plan_model(model, plan)` is the deployable form of a `analysis.arch.kvplan.KVPlan`:
- the plan's pruned KV heads (and every query head of their groups) are removed by surgery
  (`analysis.compress.surgery.prune_heads(model, plan.pruned_heads())`: whole groups, so no KV head is
  ever copied), giving a smaller twin that shares every untouched tensor with `model`;
- the plan's modes are mapped onto the twin's own KV heads (`HeadLayout.kv_heads[l]` names the
  original KV head each twin head holds; analysis.arch.kvplan.mode_rows): `rows[l]` is one mode per twin KV
  head of layer l (full or window: the pruned ones are gone);
- the twin runs them inside `KVPlanModel.running()` (the spans kernel) with a `CompactCache`
  (analysis.arch.kvcache) that holds only what each head reads, so the KV cache is `plan.kv_bytes`.
`KVPlanModel.cut()` is the same thing as an analysis.arch.cut.Cut (kind "model"), what every report takes.

The twin under its mapped windows computes what the dense model computes under `applied(model, plan)`
(the masked path: gates for the pruned heads, a banded mask for the windows), exactly in float64; a
cached decode with the compact cache computes what the full forward computes under the same windows.

`greedy(model, ids, steps, cache=...)` (analysis.measure.decode, re-exported here) is the decode loop both the
tests and the speed report run.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from torch import nn

from analysis.arch.adapters import adapter_for
from analysis.arch.cut import Cut
from analysis.arch.kvcache import CompactCache, windowed_rows
from analysis.arch.kvplan import KVPlan, mode_rows
from analysis.arch.spans import spans
from analysis.compress.surgery import HeadLayout, prune_heads
from analysis.core.errors import InputError
from analysis.measure.decode import GreedyRun, greedy  # noqa: F401 (the decode loop's home is measure.decode)


@dataclass
class KVPlanModel:
    """A model ready to run a KV plan: the twin, one row of modes per layer (its own KV heads), the plan."""
    model: nn.Module                     # the physically pruned twin (shares untouched tensors with the dense)
    rows: list[np.ndarray]               # [L][Hkv'_l] mode codes (full / window) of the twin's KV heads
    layout: HeadLayout                   # what surgery kept (kv_heads[l]: the original KV head of each twin head)
    plan: KVPlan

    @property
    def windowed(self) -> list[np.ndarray]:
        """[L][Hkv'_l] bool: windowed KV heads of the twin."""
        return windowed_rows(self.rows)

    def cache(self, block: int = 0) -> CompactCache:
        """A fresh compact cache for one prompt and its decode steps (use it inside `running()`)."""
        return CompactCache(self.rows, self.plan.window, block=block)

    @contextmanager
    def running(self) -> Iterator["KVPlanModel"]:
        """Inside the block the twin reads only its windows (the spans kernel); restored after."""
        with spans(self.model, windowed=self.windowed, window=self.plan.window):
            yield self

    def cut(self, info: dict | None = None) -> Cut:
        """This twin as a Cut of the dense model (kind "model", under the plan's windows)."""
        return Cut.of_model(self.model, info=dict(info or {}), plan=self.plan, rows=self.rows)

    def kv_bytes(self, context: int, batch: int = 1) -> int:
        """What its compact cache holds after `context` tokens (the plan's KV bytes in the twin's dtype)."""
        return self.plan.kv_bytes(context, head_dim=self.layout.head_dim, batch=batch,
                                  dtype_bytes=next(self.model.parameters()).element_size())


def _model_of(source) -> nn.Module:
    """A model from a LoadedModel or a model."""
    model = source if isinstance(source, nn.Module) else getattr(source, "model", None)   # a LoadedModel's
    if not isinstance(model, nn.Module):
        raise InputError(f"kv_plan_model needs a model (or a loaded model); got {type(source).__name__}.")
    return model


def kv_plan_model(source, plan: KVPlan) -> KVPlanModel:
    """The twin of `source` (a model or a LoadedModel) without the plan's pruned KV heads, with the plan's
    modes mapped onto its KV heads. `source` is not changed. InputError for a plan of another model."""
    model = _model_of(source)
    adapter = adapter_for(model)
    plan.check_geometry(adapter.geometry(model))
    twin, layout = prune_heads(model, plan.pruned_heads(), adapter=adapter, kv_policy="strict")
    return KVPlanModel(twin, mode_rows(plan, layout.kv_heads), layout, plan)


def physical(cut: Cut | None, source, *, kv_policy: str = "auto") -> Cut | None:
    """The deployable form of a cut of `source` (a model or a LoadedModel): a mask as surgery's physically pruned
    twin, a KV plan as `kv_plan_model`'s twin with its compact cache, a model of its own as it is (None: None).
    The twin computes what the cut computes on the dense model (exact in float64, tested)."""
    if cut is None or cut.kind == "model":
        return cut
    model = _model_of(source)
    if cut.kind == "plan":
        return kv_plan_model(model, cut.plan).cut(dict(cut.info, physical=True))
    twin, _ = prune_heads(model, cut.mask, kv_policy=kv_policy)
    return Cut.of_model(twin, info=dict(cut.info, physical=True, kv_policy=kv_policy, n_pruned=int(cut.mask.sum())))
