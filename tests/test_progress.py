"""analysis.core.progress: the time-left estimate (with_estimate) and the stop-checking callback
(stoppable), on a fake clock so nothing depends on this machine's speed."""
import pytest

from analysis.core.errors import CancelledError
from analysis.core.progress import stoppable, with_estimate


def test_estimate_follows_the_pace_measured_so_far():
    now = [100.0]
    seen = []
    report = with_estimate(lambda f, m: seen.append((f, m)), clock=lambda: now[0])
    report(0.0, "start")
    now[0] = 101.0
    report(0.5, "early")                     # 1 s in: too soon to estimate
    now[0] = 104.0
    report(0.25, "quarter")                  # 4 s for a quarter: 12 s left, shown to 5 s
    now[0] = 108.0
    report(0.8, "most")                      # 8 s for 80 %: 2 s left
    report(1.0, "done")                      # finished: no estimate
    assert seen == [(0.0, "start"), (0.5, "early"),
                    (0.25, "quarter (about 10 s left at this machine's pace so far)"),
                    (0.8, "most (about 2 s left at this machine's pace so far)"), (1.0, "done")]


def test_estimate_rounds_long_waits_to_minutes():
    now = [0.0]
    seen = []
    report = with_estimate(lambda f, m: seen.append(m), clock=lambda: now[0])
    now[0] = 60.0
    report(0.2, "slow")                      # 60 s for 20 %: 240 s left
    assert seen == ["slow (about 4 min left at this machine's pace so far)"]
    assert with_estimate(None) is None


def test_stoppable_checks_before_each_report():
    seen, stop = [], [False]
    report = stoppable(lambda f, m: seen.append(f), lambda: stop[0], "The conversion")
    report(0.5, "half")
    stop[0] = True
    with pytest.raises(CancelledError, match="The conversion was cancelled"):
        report(0.6, "more")
    assert seen == [0.5]
    stoppable(None, None)(0.3, "nowhere")    # no callback, no stop: reports nowhere
