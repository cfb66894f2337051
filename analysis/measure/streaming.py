"""Streaming profiler: MP / MP-G row norms straight from safetensors files, no model built.

`profile_checkpoint(folder)` reads config.json (for the architecture and the head geometry),
finds the attention tensors of every layer by the names the adapter gives
(`Adapter.tensor_suffixes`, matched by suffix because checkpoints differ in prefix), and reads
them layer by layer through `analysis.arch.checkpoint`, so only one layer's attention weights are
in memory at a time (and half-precision tensors are upcast a few heads at a time). A 7B-70B
checkpoint on disk can be profiled on a laptop; the numbers equal `profile_model`'s.
"""

from __future__ import annotations

from analysis.arch.adapters import adapter_for
from analysis.arch.checkpoint import (checkpoint_folder, layer_tensor_names, load_config, name_prefix, read_tensors,
                                      tensor_files)
from analysis.core.errors import ModelLoadError, first_line
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.profiles import STREAM_CHUNK, NormProfile, check_finite_norms, head_norms, stack_layers


def profile_checkpoint(path, *, progress: Progress | None = None, should_stop: ShouldStop | None = None,
                       trust_remote_code: bool = False) -> NormProfile:
    """Row-norm profile of a safetensors checkpoint, one layer's attention tensors at a time."""
    folder = checkpoint_folder(path)
    config = load_config(folder, trust_remote_code=trust_remote_code)
    adapter = adapter_for(config)
    geometry = adapter.geometry(config)
    names = tensor_files(folder)
    prefix = name_prefix(adapter, names)
    l2_layers, l1_layers, scratch = [], [], {}
    for layer in range(geometry.n_layers):
        check_stop(should_stop, "Profiling")
        roles = layer_tensor_names(adapter, layer, names, prefix)
        tensors = read_tensors(roles, names, geometry)
        try:
            hw = adapter.heads_from_tensors(tensors, geometry)
        except (RuntimeError, ValueError) as err:  # right size, wrong layout (e.g. transposed)
            raise ModelLoadError(f"The attention tensors of layer {layer} in {folder} do not have the layout "
                                 f"config.json describes ({first_line(err)}). Use the config.json that belongs "
                                 f"to these weights.") from None
        norms = head_norms(hw, (2, 1), STREAM_CHUNK, scratch)  # L1 from the same read: no second pass over the file
        for values in norms.values():
            check_finite_norms(values, layer, roles, where=f"the checkpoint {folder}")
        l2_layers.append(norms[2])
        l1_layers.append(norms[1])
        del tensors, hw
        report(progress, (layer + 1) / geometry.n_layers, f"streamed layer {layer + 1}/{geometry.n_layers}")
    return NormProfile(l2=stack_layers(l2_layers), l1=stack_layers(l1_layers), source=str(folder))
