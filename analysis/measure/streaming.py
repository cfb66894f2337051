"""Streaming profiler: MP / MP-G row norms straight from safetensors files, no model built.

`profile_checkpoint(folder)` reads config.json (for the architecture and the head geometry),
finds the attention tensors of every layer by the names the adapter gives
(`Adapter.tensor_suffixes`, matched by suffix because checkpoints differ in prefix), and reads
them layer by layer through `analysis.arch.checkpoint`, so at most two layers' attention weights
are in memory at a time (and half-precision tensors are upcast a cache-sized piece of rows at a
time). A 7B-70B checkpoint on disk can be profiled on a laptop; the numbers equal `profile_model`'s (the same
`head_norms`, the same float32 kernels).

Speed (bench/bench_anysize.py: MP-G scoring <= 1.2x one read of the attention tensors): two
worker threads (STREAM_WORKERS) each take a whole layer -- read its tensors (plain reads, which
release the GIL, into buffers the thread reuses layer after layer) and compute its norms (torch
releases the GIL too) -- so one layer's read overlaps the other's norms, and both cores compute
when the page cache serves the reads faster than one core scores them. Every torch op runs on
one intra-op thread: on small, cache-sized chunks an intra-op thread pool costs more in
synchronisation than it gains, and on a loaded 2-core machine a 2-thread pool was ~20x slower
than one thread (57 s vs 3 s for the norms of an 8B checkpoint). The main thread takes the
layers back in order (progress, Stop between layers). Which thread computes a layer does not
change its bits (the same `head_norms` on one thread).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from analysis.arch.adapters import adapter_for
from analysis.arch.checkpoint import (checkpoint_entries, checkpoint_folder, layer_tensor_names, load_config,
                                      name_prefix, read_tensors)
from analysis.core.errors import ModelLoadError, first_line
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.core.threads import torch_threads
from analysis.measure.profiles import (STREAM_CHUNK, NormProfile, check_finite_norms, check_ord, head_norms,
                                      stack_layers)


def profile_checkpoint(path, *, progress: Progress | None = None, should_stop: ShouldStop | None = None,
                       trust_remote_code: bool = False, ords: tuple[int, ...] = (2, 1)) -> NormProfile:
    """Row-norm profile of a safetensors checkpoint, layer by layer, STREAM_WORKERS layers' attention
    tensors in memory at a time (one layer's read while the other's norms are computed).

    `ords`: the norms taken in this read. (2, 1), the default, takes L1 from the same read (the app,
    whose Profiles page offers both); (2,) only L2, which every weight-only scorer's default
    needs (the CLI): fewer passes over the weights, and L1, if asked for later
    (`NormProfile.norms(1)`), streams the checkpoint once more. The values are the same bits
    either way (`row_norms`)."""
    ords = tuple(dict.fromkeys(check_ord(o) for o in ords))
    if 2 not in ords:
        raise ValueError(f"profile_checkpoint takes L2 in every read (ords {ords} lacks 2)")
    l2, l1 = _stream_norms(path, ords, progress, should_stop, trust_remote_code)
    source = str(checkpoint_folder(path))
    if l1 is not None:
        return NormProfile(l2=l2, l1=l1, source=source)
    return NormProfile(l2=l2, source=source, l1_loader=lambda: _stream_norms(
        path, (1,), None, should_stop, trust_remote_code)[1])


STREAM_WORKERS = 2  # layers in flight, each read and scored by its own worker thread (see the module docstring)


class _LayerNorms:
    """Norms of one layer, read and computed by whichever worker thread runs it; each thread keeps
    its own read buffers (reused layer after layer: touched memory reads ~2.5x faster than fresh
    pages) and its own float temp."""

    def __init__(self, folder, adapter, geometry, entries, roles, ords):
        self.folder, self.adapter, self.geometry, self.entries = folder, adapter, geometry, entries
        self.roles, self.ords = roles, ords
        self._local = threading.local()

    def __call__(self, layer: int) -> dict:
        mine = vars(self._local)
        buffers, scratch = mine.setdefault("buffers", {}), mine.setdefault("scratch", {})
        tensors = read_tensors(self.roles[layer], self.entries, self.geometry, buffers)  # views of buffers
        try:
            hw = self.adapter.heads_from_tensors(tensors, self.geometry)
        except (RuntimeError, ValueError) as err:  # right size, wrong layout (e.g. transposed)
            raise ModelLoadError(f"The attention tensors of layer {layer} in {self.folder} do not have the layout "
                                 f"config.json describes ({first_line(err)}). Use the config.json that belongs "
                                 f"to these weights.") from None
        norms = head_norms(hw, self.ords, STREAM_CHUNK, scratch)  # every order from the same read; new tensors
        for values in norms.values():
            check_finite_norms(values, layer, self.roles[layer], where=f"the checkpoint {self.folder}")
        return norms


def _stream_norms(path, ords, progress, should_stop, trust_remote_code):
    """(L2 table or None, L1 table or None) of the checkpoint at `path`, for the orders in `ords`."""
    folder = checkpoint_folder(path)
    config = load_config(folder, trust_remote_code=trust_remote_code)
    adapter = adapter_for(config)
    geometry = adapter.geometry(config)
    entries = checkpoint_entries(folder)
    prefix = name_prefix(adapter, entries)
    n = geometry.n_layers
    roles = [layer_tensor_names(adapter, layer, entries, prefix) for layer in range(n)]
    job = _LayerNorms(folder, adapter, geometry, entries, roles, ords)
    layers = {o: [] for o in ords}
    with ThreadPoolExecutor(max_workers=STREAM_WORKERS, thread_name_prefix="headscope-stream") as pool, \
            torch_threads(1):
        pending = deque(pool.submit(job, layer) for layer in range(min(STREAM_WORKERS, n)))
        try:
            for layer in range(n):
                check_stop(should_stop, "Profiling")
                norms = pending.popleft().result()  # layers come back in order
                if layer + STREAM_WORKERS < n:
                    pending.append(pool.submit(job, layer + STREAM_WORKERS))
                for o, values in norms.items():
                    layers[o].append(values)
                report(progress, (layer + 1) / n, f"streamed layer {layer + 1}/{n}")
        finally:
            for future in pending:                 # a stop or an error: layers not started are not read
                future.cancel()
    return tuple(stack_layers(layers[o]) if o in layers else None for o in (2, 1))
