"""Verdicts on measured stages: a speed ratio in words, and what makes a stage worse than the stage it was
made from (its input). One home for both, read by the compression report (`report.py`: markdown, JSON),
the deployment report (`deploy.py`) and the pages that draw them.

- `speed_words(speedup)`: "1.96x faster" or "2.86x slower", never "0.35x faster" (issue 33). speedup is
  old time / new time (= new rate / old rate): above 1 the new one is faster.
- `worse_than_input(...)`: the flags of one stage against its input: slower (by SLOWER_MARGIN or more:
  below it a shared CPU's timing noise decides), bigger (parameters, file, KV cache), a worse metric
  where the step is not meant to cost quality (recovery, a format change), and below the INT8 floor of
  the export self-check (a broken file). An empty list: nothing is worse.
"""
from __future__ import annotations

import math

SLOWER_MARGIN = 1.10        # slower by 10 % or more is flagged; below, timing noise on a shared CPU decides
METRIC_MARGIN = 1.05        # a metric 5 % worse than its input, where the step should keep it (recovery)


def speed_words(speedup: float | None) -> str:
    """old time / new time in words: "1.96x faster", "2.86x slower", "same speed" (to 2 digits); "n/a"."""
    if speedup is None or not math.isfinite(speedup) or speedup <= 0:
        return "n/a"
    if round(speedup, 2) == 1.0:
        return "same speed (1.00x)"
    return f"{speedup:.2f}x faster" if speedup > 1 else f"{1 / speedup:.2f}x slower"


def is_slower(speedup: float | None) -> bool:
    """Whether old time / new time says slower by SLOWER_MARGIN or more."""
    return speedup is not None and math.isfinite(speedup) and speedup > 0 and 1 / speedup >= SLOWER_MARGIN


def worse_than_input(*, times: dict[str, tuple[float | None, float | None]] | None = None,
                     sizes: dict[str, tuple[float | None, float | None]] | None = None,
                     metric: tuple[float | None, float | None, bool] | None = None,
                     floor: dict | None = None) -> list[str]:
    """Flags of a stage against its input.

    times: what -> (input time, stage time) (seconds or ms, larger = slower);
    sizes: what -> (input size, stage size) (larger = bigger);
    metric: (input value, stage value, higher_is_better) for a step that should keep the quality;
    floor: the self-check floor verdict of a lossy file ({"passed", "agreement", "perplexity_ratio"}) with
    "top1_agreement" and "ratio" of the stage added."""
    flags = []
    for what, (before, after) in (times or {}).items():
        if before and after and is_slower(before / after):
            flags.append(f"{what} {speed_words(before / after)}")
    for what, (before, after) in (sizes or {}).items():
        if before and after and after > before:
            flags.append(f"{what} {after / before:.3g}x bigger")
    if metric is not None:
        before, after, higher = metric
        if before and after and (before / after if higher else after / before) >= METRIC_MARGIN:
            flags.append(f"metric worse ({before:.4g} -> {after:.4g})")
    if floor is not None and not floor.get("passed", True):
        flags.append(f"BROKEN: below the INT8 floor (top-1 agreement {floor['top1_agreement']:.3f} < "
                     f"{floor['agreement']:.2f} or perplexity {floor['ratio']:.3g}x > {floor['perplexity_ratio']:.2f}x)")
    return flags
