"""bench/_timing.compare_rounds, the one way a bench prints a ratio: the rotation of the rounds, one
Comparison per requested ratio over the same rounds, the stop rule on the spread, and self-timed
callables. The callables return made-up seconds (self_timed), so nothing here is timed."""
import itertools
import statistics

from bench._timing import compare, compare_rounds


def test_rounds_rotate_and_every_ratio_shares_them():
    order = []

    def side(label, seconds):
        def fn():
            order.append(label)
            return seconds
        return fn

    got = compare_rounds({"a": side("a", 6.0), "b": side("b", 3.0), "c": side("c", 1.0)},
                         [("a", "b"), ("b", "c"), ("a", "c")], min_rounds=4, max_rounds=4, warm=False,
                         self_timed=True)
    assert order == list("abc" "bca" "cab" "abc")            # every position taken by each in turn
    assert got[("a", "b")].ratios == [2.0] * 4 and got[("b", "c")].ratios == [3.0] * 4
    assert got[("a", "c")].ratio == 6.0 and all(c.converged for c in got.values())
    assert got[("a", "b")].times["b"] is got[("b", "c")].times["b"]    # one sample list per contender


def test_stops_on_the_spread_and_reports_min_median_max():
    noisy = itertools.cycle([1.0, 2.0, 4.0])                  # the ratio's spread never settles
    cmp = compare({"slow": lambda: next(noisy), "fast": lambda: 1.0}, min_pairs=5, max_pairs=9,
                  warm=False, self_timed=True, max_seconds=None)
    assert len(cmp.ratios) == 9 and not cmp.converged
    assert cmp.ratio == statistics.median(cmp.ratios)
    text = cmp.report("t", caches="stated here")
    assert "spread NOT settled" in text and "caches stated here" in text
    assert f"min {min(cmp.ratios):.4g} / median {cmp.ratio:.4g} / max {max(cmp.ratios):.4g}" in text

    steady = compare({"x": lambda: 2.0, "y": lambda: 1.0}, min_pairs=5, max_pairs=31, warm=False,
                     self_timed=True)
    assert len(steady.ratios) == 5 and steady.converged and steady.ratio == 2.0
