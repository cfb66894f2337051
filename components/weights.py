"""Weights only: a safetensors checkpoint folder opened without building the model (issue 22).

The Model page's switch (`weights_only_switch`) makes `state.model_key()` say so; `cache.load`
then returns `analysis.arch.models.open_weights_only` (the model's structure on the meta device),
`cache.profile` streams the row norms from the files (progress per layer, stoppable), and the
weight-only scorers, masks, counts, the Walkthrough and the Export page (streamed pruned / stock / gguf
export, `analysis.compress.export.streamed`) work from that. A page or section that runs the model
(activations: perplexity, ablation, roles, Compare's curves, Pipeline) calls `needs_model`: one line
that says so, and a button that loads the model with disk offload instead.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import streamlit as st

from analysis.arch.checkpoint import INDEX_FILE
from analysis.core.placement import Placement

from . import shell, state


def is_checkpoint_folder(name: str) -> bool:
    """Whether `name` is a local folder holding config.json and safetensors weights."""
    folder = Path(str(name)).expanduser()
    try:
        return (folder / "config.json").is_file() and ((folder / INDEX_FILE).is_file()
                                                       or any(folder.glob("*.safetensors")))
    except OSError:
        return False


def weights_only_switch() -> None:
    """Model page: the switch that opens a checkpoint folder weights only (shown for folders only)."""
    name = str(state.get("model") or "")
    if not is_checkpoint_folder(name):
        return
    on = st.toggle("Weights only: read the checkpoint's files, never build the model",
                   key=state.widget_key(f"weights_only.{name}", value=state.weights_only()),
                   help="For a model larger than memory: the profile is streamed one layer at a time, MP / MP-G, "
                        "masks and their counts need nothing else, and the export cuts the files tensor by tensor. "
                        "Pages that run the model (perplexity, ablation, roles, curves, pipeline) need it loaded.")
    if on != state.weights_only():
        state.set_weights_only(on)
        st.rerun()


def offload_folder(name: str) -> str:
    """Where a model loaded with disk offload keeps the weights that fit nowhere else."""
    return str(Path(tempfile.gettempdir()) / "headscope-offload" / Path(name).name)


def _load_with_offload() -> None:
    state.set_weights_only(False)
    state.set_placement(Placement.of("auto", "auto", device_map="auto",
                                     offload_folder=offload_folder(str(state.get("model")))))


def needs_model(lm, what: str, *, stop: bool = True) -> bool:
    """When the checkpoint is open weights only and `what` runs the model: say so in one line with the
    button that loads it, then end the run (stop=False: return True instead, for a fragment that still
    draws what needs no activations). False: the model is loaded."""
    if not state.weights_only():
        return False
    st.info(f"{what} runs the model (activations); this checkpoint is open weights only. Load the model "
            f"(with disk offload, for one larger than memory) to use it.", icon=":material/memory:")
    st.button("Load the model with disk offload", key=state.WIDGET_PREFIX + "weights_only.load." + what,
              on_click=_load_with_offload)
    if stop:
        shell.end_run()
    return True


STREAMED_HELP = "streamed from the checkpoint's files (weights only): the model is never built"


def export_formats(all_formats) -> list[str]:
    """The export formats the current model can be written in (weights only: the streamed ones)."""
    if not state.weights_only():
        return list(all_formats)
    from analysis.compress.export.streamed import streamed_formats
    return [f for f in all_formats if f in streamed_formats()]


def export_streamed(lm, fmt: str, pruned, root, name: str, *, record, kv_policy: str, overwrite: bool, progress,
                    should_stop, **options):
    """The Export page's export for a checkpoint open weights only (same checks as `export.export`)."""
    from analysis.compress.export import check_export_name, resolve_under
    from analysis.compress.export.streamed import export_checkpoint
    target = resolve_under(root, name)
    check_export_name(name)
    return export_checkpoint(fmt, lm.source, pruned, target, record=record, kv_policy=kv_policy, overwrite=overwrite,
                             trust_remote_code=state.trust(), progress=progress, should_stop=should_stop, **options)
