"""Progress reports and cancellation: the one callback contract of every long computation.

Long functions take `progress: Progress | None` (called with a fraction in [0, 1] and a short
message) and `should_stop: ShouldStop | None` (polled between units of work; when it returns
True the work raises `CancelledError`, so nothing half-computed is returned). This module holds
the two types and the helpers that check and report; nothing else defines them.

A signal (SIGTERM / SIGINT under the CLI) only records itself (`request_stop`): raising from the
handler would land in whatever frame runs, and Python discards an exception raised inside a
finalizer (tqdm.__del__), so the interrupt was lost and the run finished with status 0. The
flag is turned into KeyboardInterrupt at the next cancel point: `check_stop`, `report` and
`tick` (every long loop and every progress report), and `raise_if_signalled` where a command
writes its result.
"""
from __future__ import annotations

from typing import Callable

from analysis.core.errors import CancelledError

Progress = Callable[[float, str], None]
ShouldStop = Callable[[], bool]


_SIGNALS: list[int] = []        # signals received and not yet acted on (request_stop)


def request_stop(signum: int) -> None:
    """Record a stop request (a signal handler's whole job); the next cancel point raises."""
    _SIGNALS.append(int(signum))


def stop_requested() -> bool:
    return bool(_SIGNALS)


def clear_stop() -> None:
    """Forget stop requests (at the start and end of a CLI command)."""
    _SIGNALS.clear()


def raise_if_signalled() -> None:
    """KeyboardInterrupt when a signal asked to stop: `finally` blocks then remove temporaries."""
    if _SIGNALS:
        raise KeyboardInterrupt(f"signal {_SIGNALS[0]}")


def check_stop(should_stop: ShouldStop | None, what: str = "The computation") -> None:
    """Raise KeyboardInterrupt after a signal (`request_stop`), CancelledError naming `what` when
    the user's cancel callback says so."""
    raise_if_signalled()
    if should_stop is not None and should_stop():
        raise CancelledError(f"{what} was cancelled; start it again to get a result.")


def report(progress: Progress | None, fraction: float, message: str) -> None:
    """Call `progress` (if any) with the fraction clipped to [0, 1]; a cancel point for signals."""
    raise_if_signalled()
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
