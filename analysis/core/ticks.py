"""Log-axis ticks a reader cannot misread (one rule for the app's plotly charts and the reports' PNGs).

A log axis labels only whole numbers, written in full: the decades (10, 100, 1000) when the values span
two or more of them, else the 1-2-5 steps inside (20, 50, 100, 200), else finer steps (20, 30); at least
two of them, and the axis range holds every labelled tick (issue 33: a tick just outside the plotting
library's own range left a chart with no y labels at all; plotly's default labels bare minor digits,
and a reader took a "5" for a perplexity of 5).
"""
from __future__ import annotations

import math
from typing import Iterable

LOG_STEPS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9))   # coarse to fine


def log_ticks(values: Iterable[float]) -> tuple[list[float], tuple[float, float], list[str]] | None:
    """(tick values, (low, high) axis range in log10 units with a little padding, tick labels) for the
    positive finite `values`; None when there is none."""
    v = [float(x) for x in values if math.isfinite(float(x)) and float(x) > 0]
    if not v:
        return None
    vmin, vmax = min(v), max(v)
    lo, hi = math.floor(math.log10(vmin)), math.ceil(math.log10(vmax))
    coarse = 0 if hi - lo >= 2 else 1
    ticks: list[float] = []
    grid: list[float] = []
    for steps in LOG_STEPS[coarse:]:
        grid = sorted({round(m * 10.0 ** k, 12) for k in range(lo - 1, hi + 1) for m in steps})
        ticks = [t for t in grid if vmin / 1.5 <= t <= vmax * 1.5]
        if len(ticks) >= 2:
            break
    if len(ticks) < 2:                              # one value, or a very narrow range: the ticks around it
        below = max((t for t in grid if t <= vmin), default=10.0 ** lo)
        above = min((t for t in grid if t > below and t >= vmax), default=below * 10)
        ticks = [below, above]
    low, high = math.log10(min(vmin, ticks[0])), math.log10(max(vmax, ticks[-1]))
    pad = 0.04 * max(high - low, 0.05)
    labels = [f"{t:,.0f}" if t >= 1 and t == int(t) else f"{t:g}" for t in ticks]
    return ticks, (low - pad, high + pad), labels


def matplotlib_log_y(ax, values) -> None:
    """A matplotlib Axes' y axis on a log scale, labelled by `log_ticks` (values: what it must show)."""
    from matplotlib.ticker import FixedLocator, NullLocator
    found = log_ticks(values)
    if found is None:
        return
    ticks, (low, high), labels = found
    ax.set_yscale("log")
    ax.set_ylim(10 ** low, 10 ** high)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels(labels)
