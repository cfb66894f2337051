"""Timing helpers shared by the bench scripts: one timed call, A/B runs that alternate order
every round so drifting machine load hits every contender alike, and `compare`: the one way a
bench prints a ratio (interleaved pairs until the spread is known; min / median / max of each side
and of the per-pair ratio; load average and cache state; targets judged on the median ratio)."""
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field


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


# -- side-by-side comparisons that can be read -----------------------------------------------------
#
# A ratio of two medians taken minutes apart moves with the machine's load (issue 25: 9.19x,
# 12.16x and 1.30x in three runs). `compare` times the two sides in interleaved pairs (A B, then
# B A, ...), so both sides of a pair see the same load, takes the ratio per pair, and keeps adding
# pairs until the ratios' spread is known (the interquartile range over the median below
# `spread`) or a limit is reached. `Comparison.report` prints min / median / max of each side and
# of the per-pair ratio, the load average and whether caches were warm; a target is judged on the
# median of the per-pair ratios.

@dataclass
class Comparison:
    a: str
    b: str
    times: dict = field(default_factory=dict)     # label -> [seconds per pair]
    warm: bool = True
    converged: bool = False
    load_before: tuple = ()
    load_after: tuple = ()

    @property
    def ratios(self) -> list[float]:
        """a / b of each interleaved pair."""
        return [x / y for x, y in zip(self.times[self.a], self.times[self.b]) if y > 0]

    @property
    def ratio(self) -> float:
        """The median of the per-pair ratios: what a target is judged on."""
        return statistics.median(self.ratios)

    def spread(self) -> float:
        """Interquartile range of the per-pair ratios over their median."""
        return relative_iqr(self.ratios)

    def report(self, title: str, *, unit: float = 1e3, unit_name: str = "ms", target: str | None = None) -> str:
        """Lines with min / median / max of each side and of the ratio, the load and the cache state."""
        def row(values, scale, fmt):
            return (f"min {fmt.format(min(values) * scale)} / median {fmt.format(statistics.median(values) * scale)}"
                    f" / max {fmt.format(max(values) * scale)}")
        n = len(self.ratios)
        lines = [f"{title}: {n} interleaved pairs ({'spread known' if self.converged else 'spread NOT settled'}: "
                 f"ratio IQR/median {self.spread():.2f}); caches {'warm (one untimed call of each side first)' if self.warm else 'cold'}; "
                 f"load average {_load(self.load_before)} before, {_load(self.load_after)} after"]
        for label in (self.a, self.b):
            lines.append(f"    {label:>20}: {row(self.times[label], unit, '{:.4g}')} {unit_name}")
        lines.append(f"    {self.a + ' / ' + self.b:>20}: {row(self.ratios, 1.0, '{:.4g}')}"
                     + (f"  (target {target}, judged on the median)" if target else ""))
        text = "\n".join(lines)
        print(text, flush=True)
        return text


def relative_iqr(values) -> float:
    if len(values) < 4:
        return math.inf
    q = statistics.quantiles(values, n=4)
    med = statistics.median(values)
    return (q[2] - q[0]) / med if med else math.inf


def _load(avg: tuple) -> str:
    return "/".join(f"{x:.2f}" for x in avg) if avg else "n/a"


def load_average() -> tuple:
    try:
        return tuple(os.getloadavg())
    except OSError:
        return ()


def compare(fns: dict, *, min_pairs: int = 5, max_pairs: int = 31, spread: float = 0.10,
            max_seconds: float | None = 120.0, warm: bool = True, collect: bool = False,
            untimed_free: bool = False, self_timed: bool = False) -> Comparison:
    """Time two callables (dict label -> fn, the first is the numerator) in interleaved pairs until
    the per-pair ratios' IQR/median is at most `spread` (after `min_pairs`), `max_pairs` pairs, or
    `max_seconds`. collect / untimed_free as in `alternate_times`. self_timed=True: each call
    returns its own seconds (a child process that times only its work, not its imports)."""
    (a, fa), (b, fb) = list(fns.items())
    result = Comparison(a=a, b=b, times={a: [], b: []}, warm=warm, load_before=load_average())
    if warm:
        fa(), fb()
    started = time.perf_counter()
    for i in range(max_pairs):
        for label, fn in ((a, fa), (b, fb)) if i % 2 == 0 else ((b, fb), (a, fa)):
            if collect:
                gc.collect()
            result.times[label].append(fn() if self_timed else timed_call(fn)[0] if untimed_free else timed(fn))
        if i + 1 >= min_pairs and result.spread() <= spread:
            result.converged = True
            break
        if max_seconds is not None and time.perf_counter() - started > max_seconds and i + 1 >= min_pairs:
            break
    result.load_after = load_average()
    return result
