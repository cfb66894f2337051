"""An export folder read back as a cut: its weights, under its kv_plan.json when it has one.

`load_planned(folder)` is a PyTorch export with its plan as a ready `analysis.compress.kvruntime.KVPlanModel`
(the model, the plan's modes on the file's own KV heads, the compact cache). `cut_of_folder(folder, loaded)`
is what every report takes for "an export folder" (analysis.arch.cut.Cut, kind "model"): the folder's model
checked against the dense model it is compared with (the vocabulary), in that model's dtype, run under its
plan's windows when the folder has a kv_plan.json. A plan is never dropped: a kv_plan.json that cannot be read
(a broken link, another export's plan, malformed) is refused in one line, not ignored; an ONNX or GGUF folder
(its runtime runs every head full) is refused with the reason.
"""
from __future__ import annotations

from pathlib import Path

from analysis.arch.cut import Cut
from analysis.arch.kvplan import mode_rows, read_kv_plan
from analysis.compress.export.kvfile import has_kv_plan, read_export_plan
from analysis.compress.export.pruned import has_layout, load_pruned, read_layout
from analysis.core.errors import InputError

FORMATS_READ = "the pruned, stock and zeroed formats"


def _check_folder(folder) -> Path:
    folder = Path(folder)
    try:
        is_dir = folder.is_dir()
    except OSError:                                # a name the file system refuses (too long, ...)
        is_dir = False
    if not is_dir:
        raise InputError(f"{str(folder)[:200]} is not a folder; give an export folder ({FORMATS_READ}).")
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} holds no PyTorch model (config.json); an ONNX or GGUF export runs in its own "
                         f"runtime, which runs every head full. headscope reads {FORMATS_READ} back.")
    return folder


def load_planned(folder, *, dtype=None, trust_remote_code: bool = False):
    """A PyTorch export folder with its kv_plan.json as a ready `analysis.compress.kvruntime.KVPlanModel`:
    pruned / stock exports through `load_pruned` (their heads mapped by head_layout.json, the weights in the
    dtype they were written in), a zeroed export (full shapes) loaded (`dtype`, default float32) and cut as
    the plan says. Run it inside `.running()` with `.cache()`."""
    from analysis.compress.kvruntime import KVPlanModel, kv_plan_model
    folder = _check_folder(folder)
    if has_layout(folder):
        layout = read_layout(folder)
        plan = read_export_plan(folder, layout=layout)
        model = load_pruned(folder, trust_remote_code=trust_remote_code)
        return KVPlanModel(model, mode_rows(plan, layout.kv_heads), layout, plan)
    from analysis.arch.models import load_model
    plan = read_export_plan(folder)                   # the file's own checks before any weights are read
    loaded = load_model(str(folder), dtype=dtype or "float32", trust_remote_code=trust_remote_code)
    return kv_plan_model(loaded.model, plan.check_geometry(loaded.geometry))


def exported_cut(loaded, pruned, plan=None, *, kv_policy: str = "auto") -> Cut:
    """The cut an export of the mask `pruned` [L, H] with the KV plan `plan` writes, built in memory: no plan, the
    mask itself (gates on the dense model); with a plan, surgery's twin without the mask's heads, under the plan's
    windows on its own KV heads (what `load_planned` reads back from the folder; the plan written as the export
    writes it: analysis.compress.export.kvfile.plan_for_export). InputError when the plan prunes KV heads the mask
    keeps."""
    import numpy as np
    if plan is None:
        return Cut.of_mask(np.asarray(pruned, dtype=bool))
    from analysis.compress.export.kvfile import plan_for_export
    from analysis.compress.surgery import prune_heads
    plan, mask, _ = plan_for_export(plan, pruned, loaded.geometry)
    twin, layout = prune_heads(loaded.model, mask, adapter=loaded.adapter, kv_policy=kv_policy)
    return Cut.of_model(twin, info=dict(n_pruned=int(mask.sum()), exported=True), plan=plan,
                        rows=mode_rows(plan, layout.kv_heads))


def cut_of_folder(folder, loaded, *, trust_remote_code: bool = False) -> Cut:
    """The export folder's model as a cut of `loaded` (the dense model it is compared with): under its
    kv_plan.json when it has one, checked against `loaded`'s vocabulary, cast to `loaded`'s dtype."""
    folder = _check_folder(folder)
    info = dict(export=str(folder))
    if has_kv_plan(folder):
        planned = load_planned(folder, trust_remote_code=trust_remote_code)
        model, plan, rows = planned.model, planned.plan, planned.rows
    else:
        plan = rows = None
        if has_layout(folder):
            model = load_pruned(folder, trust_remote_code=trust_remote_code)
        else:
            from analysis.arch.models import load_model
            model = load_model(str(folder), trust_remote_code=trust_remote_code).model
    if model.get_input_embeddings().weight.shape[0] != loaded.model.get_input_embeddings().weight.shape[0]:
        raise InputError(f"The export in {folder} has another vocabulary than the model {loaded.name}; compare it "
                         f"with the model it was exported from.")
    dtype = loaded.placement.dtype if loaded.placement else next(loaded.model.parameters()).dtype
    model = model.to(dtype).eval()
    return Cut.of_model(model, info=info, plan=plan, rows=rows)


__all__ = ["load_planned", "cut_of_folder", "exported_cut", "read_kv_plan"]
