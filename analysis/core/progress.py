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

`with_estimate` adds a time-left estimate derived from this machine's pace so far to work whose
fractions follow where its time goes (no fixed "about 20 s": the same step takes 3x longer on a
busy CPU).
"""
from __future__ import annotations

import time
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


def stoppable(progress: Progress | None, should_stop: ShouldStop | None,
              what: str = "The computation") -> Progress:
    """A callback that checks for cancel (`tick`) on every report, for work whose only cancel
    points are its progress reports (None + None: a callback that reports nowhere)."""
    return lambda fraction, message: tick(progress, should_stop, fraction, message, what)


def duration_words(seconds: float) -> str:
    """'8 s', '40 s', '3 min', '2.5 h': a rounded duration for an estimate."""
    if seconds < 10:
        return f"{max(seconds, 1.0):.0f} s"
    if seconds < 90:
        return f"{5 * round(seconds / 5):.0f} s"
    if seconds < 5400:
        return f"{round(seconds / 60):.0f} min"
    return f"{seconds / 3600:.1f} h"


def with_estimate(progress: Progress | None, *, clock: Callable[[], float] = time.monotonic,
                  after_s: float = 2.0, min_fraction: float = 0.05) -> Progress | None:
    """A callback that appends "about N s left" to each message once `after_s` seconds and
    `min_fraction` of the work have passed: time so far * (1 - fraction) / fraction, i.e. the
    pace measured on this machine, so only meaningful where fractions are proportional to time.
    The clock starts when this is called."""
    if progress is None:
        return None
    start = clock()

    def estimating(fraction: float, message: str) -> None:
        elapsed = clock() - start
        if min_fraction <= fraction < 1.0 and elapsed >= after_s:
            left = elapsed * (1.0 - fraction) / fraction
            message = f"{message} (about {duration_words(left)} left at this machine's pace so far)"
        report(progress, fraction, message)
    return estimating


def no_progress(fraction: float, message: str) -> None:
    """A progress callback that reports nowhere (for code that always calls one)."""
