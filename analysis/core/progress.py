"""Progress reports and cancellation: the one callback contract of every long computation.

Long functions take `progress: Progress | None` (called with a fraction in [0, 1] and a short
message) and `should_stop: ShouldStop | None` (polled between units of work; when it returns
True the work raises `CancelledError`, so nothing half-computed is returned). This module holds
the two types and the helpers that check and report; nothing else defines them.
"""
from __future__ import annotations

from typing import Callable

from analysis.core.errors import CancelledError

Progress = Callable[[float, str], None]
ShouldStop = Callable[[], bool]


def check_stop(should_stop: ShouldStop | None, what: str = "The computation") -> None:
    """Raise CancelledError naming `what` when the user's cancel callback says so."""
    if should_stop is not None and should_stop():
        raise CancelledError(f"{what} was cancelled; start it again to get a result.")


def report(progress: Progress | None, fraction: float, message: str) -> None:
    """Call `progress` (if any) with the fraction clipped to [0, 1]."""
    if progress is not None:
        progress(float(min(max(fraction, 0.0), 1.0)), message)


def tick(progress: Progress | None, should_stop: ShouldStop | None, fraction: float, message: str,
         what: str = "The computation") -> None:
    """One step of long work: check for cancel first, then report."""
    check_stop(should_stop, what)
    report(progress, fraction, message)


def scaled(progress: Progress | None, start: float, stop: float) -> Progress | None:
    """A callback that maps [0, 1] onto [start, stop] of `progress` (None stays None)."""
    if progress is None:
        return None
    return lambda fraction, message: report(progress, start + (stop - start) * fraction, message)


def no_progress(fraction: float, message: str) -> None:
    """A progress callback that reports nowhere (for code that always calls one)."""
