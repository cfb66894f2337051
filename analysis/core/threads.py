"""Torch's intra-op thread count, set for a block and restored after (`torch_threads`): the one
home of that setting, used by the timing code (analysis.compress.speed) and the streamed profile
(analysis.measure.streaming), which computes on one thread while its reader thread reads ahead."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from analysis.core.errors import InputError


@contextmanager
def torch_threads(n: int | None):
    """Run with `n` torch threads (None: leave as is); restored afterwards."""
    before = torch.get_num_threads()
    if n is not None:
        if int(n) < 1:
            raise InputError(f"Thread count must be at least 1; got {n}.")
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
