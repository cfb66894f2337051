"""kv_plan.json in an export folder: a KV plan written with the model it runs on, and read back with it.

`export_to(..., kv_plan=plan)` (and the streamed export) write the plan next to the weights:
- in the ORIGINAL head slots (`KVPlan.as_dict`: one mode per original KV head, what `read_kv_plan` reads),
- plus, for a physical format (the file holds the cut), `file`: for each layer of the file, the original KV
  head each of its KV heads holds (`HeadLayout.kv_heads`, as in head_layout.json) and that head's mode,
  i.e. the plan in the file's own head numbering (what a runtime applies to the file's heads).

The mask and the plan describe one cut: every KV head the plan prunes must be removed by the mask (its
whole group), and a group the mask removes is written as pruned (`plan_for_export`). An export given a plan
and no mask cuts the plan's own pruned heads.

Which runtimes honour the windows is each format's `kv_windows` line (analysis.compress.export.formats):
headscope's PyTorch runtime for the PyTorch formats (analysis.compress.export.planned.load_planned(folder):
the model, its windows on the file's heads, the compact cache), none for ONNX Runtime and llama.cpp (they
run every head full; the file still holds the cut).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from analysis.arch.geometry import HeadGeometry
from analysis.compress.surgery import HeadLayout
from analysis.core.errors import InputError
from analysis.arch.kvplan import KV_PLAN_FILE, MODES, PRUNE, KVPlan, read_kv_plan


def plan_for_export(plan: KVPlan, pruned, geometry: HeadGeometry) -> tuple[KVPlan, np.ndarray, list[str]]:
    """(the plan as the export writes it, the mask [L, H] the export cuts, notes). pruned None: the plan's
    own pruned heads. InputError for a plan of another model or one that prunes KV heads the mask keeps."""
    plan.check_geometry(geometry)
    L, Hkv, G = geometry.n_layers, geometry.n_kv_heads, geometry.group_size
    mask = plan.pruned_heads() if pruned is None else np.asarray(pruned, dtype=bool)
    if mask.shape != (L, geometry.n_heads):
        raise InputError(f"The mask must be [{L}, {geometry.n_heads}] (layers x heads); got {list(mask.shape)}.")
    emptied = mask.reshape(L, Hkv, G).all(-1)                           # [L, Hkv] groups the mask removes
    kept = plan.pruned_kv & ~emptied
    if kept.any():
        l, j = map(int, np.argwhere(kept)[0])
        raise InputError(f"The KV plan prunes {int(kept.sum())} KV heads the mask keeps (e.g. layer {l}, KV head {j}); "
                         f"export with the plan alone (its own cut) or with a mask that removes them.")
    notes = []
    added = emptied & ~plan.pruned_kv
    if added.any():
        modes = plan.modes.copy()
        modes[added] = PRUNE
        plan = plan.with_modes(modes, f"{int(added.sum())} KV heads the mask removes written as pruned")
        notes.append(f"kv_plan.json: {int(added.sum())} KV heads the mask removes are written as pruned.")
    return plan, mask, notes


def kv_plan_record(plan: KVPlan, layout: HeadLayout | None) -> dict:
    """kv_plan.json's content: the plan in the original slots, and (physical cut) the file's heads."""
    data = plan.as_dict()
    if layout is not None:
        data["file"] = {"kv_heads": [list(map(int, kv)) for kv in layout.kv_heads],
                        "modes": [[MODES[int(plan.modes[l, g])] for g in kv] for l, kv in enumerate(layout.kv_heads)]}
    return data


def write_kv_plan(folder: Path, plan: KVPlan, layout: HeadLayout | None) -> None:
    (Path(folder) / KV_PLAN_FILE).write_text(json.dumps(kv_plan_record(plan, layout), indent=1), encoding="utf-8")


def has_kv_plan(folder) -> bool:
    """Whether the folder holds a kv_plan.json entry, a broken link included (its reader then says what is
    wrong: a plan is never silently dropped)."""
    import os
    return os.path.lexists(Path(folder) / KV_PLAN_FILE)


def read_export_plan(folder, *, geometry: HeadGeometry | None = None, layout: HeadLayout | None = None) -> KVPlan:
    """The KVPlan of an export folder (InputError when it has none, or when its heads are not the folder's
    head_layout.json's: a plan copied from another export)."""
    folder = Path(folder)
    if not has_kv_plan(folder):
        raise InputError(f"{folder} has no {KV_PLAN_FILE}; export it with a KV plan (export --kv-plan FILE).")
    plan = read_kv_plan(folder, geometry=geometry)
    if layout is not None:
        if (layout.n_layers, layout.n_heads, layout.n_kv_heads) != (plan.n_layers, plan.n_heads, plan.n_kv_heads):
            raise InputError(f"{KV_PLAN_FILE} in {folder} is for another model than its head_layout.json; export again.")
        if any(plan.pruned_kv[l, np.asarray(kv, dtype=np.int64)].any() for l, kv in enumerate(layout.kv_heads)):
            raise InputError(f"{KV_PLAN_FILE} in {folder} prunes KV heads its model keeps: it is another export's plan. "
                             f"Export again with the plan.")
    return plan
