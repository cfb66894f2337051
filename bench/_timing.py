"""Timing helpers shared by the bench scripts: one timed call, A/B runs that alternate order
every round so drifting machine load hits every contender alike, and `compare`: the one way a
bench prints a ratio (interleaved pairs until the spread is known; min / median / max of each side
and of the per-pair ratio; load average and cache state; targets judged on the median ratio), and
`compare_rounds`, the same for three or more contenders sharing rounds (several ratios at once)."""
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

    def report(self, title: str, *, unit: float = 1e3, unit_name: str = "ms", target: str | None = None,
               caches: str | None = None) -> str:
        """Lines with min / median / max of each side and of the ratio, the load and the cache state
        (`caches` states it where the default, one untimed call of each side first, does not say it all)."""
        def row(values, scale, fmt):
            return (f"min {fmt.format(min(values) * scale)} / median {fmt.format(statistics.median(values) * scale)}"
                    f" / max {fmt.format(max(values) * scale)}")
        n = len(self.ratios)
        lines = [f"{title}: {n} interleaved pairs ({'spread known' if self.converged else 'spread NOT settled'}: "
                 f"ratio IQR/median {self.spread():.2f}); caches {caches or ('warm (one untimed call of each side first)' if self.warm else 'cold')}; "
                 f"load average {load_text(self.load_before)} before, {load_text(self.load_after)} after"]
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


def load_text(avg) -> str:
    """A load average (1, 5, 15 min) as "0.52/0.82/0.92", or "n/a"."""
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
    `max_seconds`. collect / untimed_free as in `alternate_times`; self_timed as in `compare_rounds`."""
    (a, _), (b, _) = list(fns.items())
    return compare_rounds(fns, [(a, b)], min_rounds=min_pairs, max_rounds=max_pairs, spread=spread,
                          max_seconds=max_seconds, warm=warm, collect=collect, untimed_free=untimed_free,
                          self_timed=self_timed)[(a, b)]


def compare_rounds(fns: dict, ratios: list[tuple[str, str]], *, min_rounds: int = 5, max_rounds: int = 31,
                   spread: float = 0.10, max_seconds: float | None = 120.0, warm: bool = True,
                   collect: bool = False, untimed_free: bool = False, self_timed: bool = False) -> dict:
    """{(a, b): Comparison} for several callables timed in rounds (each round runs every callable once,
    the order rotated by one every round, so each takes every position alike; with two callables the
    rounds are the pairs A B, B A, ... of `compare`), one Comparison per requested ratio a / b over
    the same rounds. Stops once every ratio's IQR/median is at most `spread` (after `min_rounds`),
    after `max_rounds`, or after `max_seconds`.

    self_timed=True: each callable times itself and returns its seconds (a browser round trip
    measured in the page, a run whose untimed setup must stay outside the time); the rounds, the
    stop rule and the report are the same."""
    labels = list(fns)
    times = {k: [] for k in labels}
    load_before = load_average()
    result = {(a, b): Comparison(a=a, b=b, times={a: times[a], b: times[b]}, warm=warm, load_before=load_before)
              for a, b in ratios}
    if warm:
        for fn in fns.values():
            fn()
    started = time.perf_counter()
    for i in range(max_rounds):
        k = i % len(labels)
        for label in labels[k:] + labels[:k]:
            if collect:
                gc.collect()
            fn = fns[label]
            times[label].append(fn() if self_timed else timed_call(fn)[0] if untimed_free else timed(fn))
        if i + 1 >= min_rounds and all(c.spread() <= spread for c in result.values()):
            for c in result.values():
                c.converged = True
            break
        if max_seconds is not None and time.perf_counter() - started > max_seconds and i + 1 >= min_rounds:
            break
    load_after = load_average()
    for c in result.values():
        c.load_after = load_after
    return result
