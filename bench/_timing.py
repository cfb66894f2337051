"""Timing helpers shared by the bench scripts: one timed call, and A/B runs that alternate order
every round so drifting machine load hits every contender alike."""
import gc
import statistics
import time


def timed(fn) -> float:
    """Seconds one call of fn() takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_call(fn) -> tuple[float, object]:
    """(seconds one call of fn() takes, its result): freeing the result is not timed."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def alternate_times(fns: dict, repeats: int, warm: bool = True, collect: bool = False,
                    untimed_free: bool = False) -> dict:
    """{label: [seconds per round]} for callables run alternately (order flipped every round).

    collect=True runs a garbage collection before every timed call (not timed), so one contender
    does not pay for the garbage the other left (e.g. a freed 500 MB model: without it, whichever
    call came first in a round was ~2x slower). Leave it off for sub-millisecond calls, where it
    leaves the caches cold. untimed_free=True frees each call's result after its time is taken
    (for calls that build a model: freeing it is not part of building it)."""
    if warm:
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    items = list(fns.items())
    for i in range(repeats):
        for label, fn in items if i % 2 == 0 else items[::-1]:
            if collect:
                gc.collect()
            times[label].append(timed_call(fn)[0] if untimed_free else timed(fn))
    return times


def alternate(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, from `alternate_times` (warmed up first)."""
    return {k: statistics.median(v) for k, v in alternate_times(fns, repeats).items()}
