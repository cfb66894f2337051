"""Torch's intra-op thread count, set for a block and restored after (`torch_threads`), and the one
check of a thread count (`check_threads`, also llama.cpp's): the one home of that setting, used by the
timing code (analysis.compress.timing) and the streamed profile (analysis.measure.streaming), which
computes on one thread while its reader thread reads ahead."""

from __future__ import annotations

from contextlib import contextmanager

from analysis.core.errors import check_whole_number

MAX_THREADS = 1024                    # far more cores than a machine has; a larger count is a typo


def check_threads(n, what: str = "Thread count", *, none_ok: bool = False) -> int | None:
    """A thread count (torch's or llama.cpp's) as an int in 1 .. MAX_THREADS; InputError otherwise."""
    return check_whole_number(n, what, low=1, high=MAX_THREADS, none_ok=none_ok)


@contextmanager
def torch_threads(n: int | None):
    """Run with `n` torch threads (None: leave as is); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(check_threads(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
