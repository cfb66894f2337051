"""Figure rules of components/charts.py that a reader relies on: log axes label only whole numbers
written in full (decades over a wide range, 1-2-5 inside a narrow one), never plotly's bare minor
digits; a signed matrix (Spearman) uses a diverging scale centred at 0."""
import numpy as np

from components import charts


def _ticks(values):
    fig = charts.curves({"a": (np.arange(len(values)), values)}, title="t", x_title="x", y_title="ppl", log_y=True)
    return list(fig.layout.yaxis.tickvals), list(fig.layout.yaxis.ticktext), fig.layout.yaxis.type


def test_a_wide_log_axis_labels_decades_only():
    vals, text, kind = _ticks([14.7, 90.0, 2500.0, 31000.0])
    assert kind == "log"
    assert vals == [10.0, 100.0, 1000.0, 10000.0] and text == ["10", "100", "1,000", "10,000"]


def test_a_narrow_log_axis_labels_1_2_5_in_full():
    vals, text, _ = _ticks([14.7, 22.0, 61.0])
    assert vals == [10.0, 20.0, 50.0] and text == ["10", "20", "50"]
    assert all(float(t.replace(",", "")) == v for t, v in zip(text, vals))   # no bare "2" or "5"


def test_the_spearman_matrix_is_diverging_at_zero_and_jaccard_is_not():
    rho = charts.matrix_heatmap(np.array([[1.0, -0.1], [-0.1, 1.0]]), ["a", "b"], title="r", zmin=-1, zmax=1)
    assert rho.data[0].zmid == 0.0 and rho.data[0].colorscale[0][1] != rho.data[0].colorscale[-1][1]
    jac = charts.matrix_heatmap(np.eye(2), ["a", "b"], title="j", zmin=0, zmax=1)
    assert jac.data[0].zmid is None


def _range(values):
    fig = charts.curves({"a": (np.arange(len(values)), values)}, title="t", x_title="x", y_title="ppl", log_y=True)
    return [10 ** x for x in fig.layout.yaxis.range]


def test_every_log_tick_lies_inside_the_axis_range_and_there_are_two():
    """Issue 33: a perplexity axis without any y labels (its one tick lay outside the range)."""
    for values in ([20.5, 24.0], [17.5, 18.0], [14.7, 90.0, 2500.0, 31000.0], [18.0, 3076.0], [42.0], [0.3, 0.31]):
        vals, text, _ = _ticks(values)
        low, high = _range(values)
        assert len(vals) >= 2, (values, vals)
        assert all(low <= v <= high for v in vals), (values, vals, low, high)
        assert low <= min(values) and max(values) <= high
        assert all(float(t.replace(",", "")) == v for t, v in zip(text, vals)), text
    assert _ticks([20.5, 24.0])[0] == [15.0, 20.0, 30.0]


def _frontier_points():
    def point(label, kind, mib, ppl):
        return {"label": label, "type": kind, "bytes": mib * 2**20, "ppl": ppl, "lo": ppl * 0.93, "hi": ppl * 1.08}
    return {f"{lab} {k}": point(lab, k, mib, ppl) for lab, k, mib, ppl in [
        ("dense", "q8_0", 138.1, 15.3), ("dense", "q4_k_m", 100.6, 16.3), ("MP-G 50 %", "q8_0", 124.6, 222.6)]}


def test_the_frontier_chart_and_png_share_the_log_rule():
    """A damaged cut (perplexity 220) beside dense points (15-16) flattened the frontier on a linear axis:
    the app's chart and the report's PNG both use the one log-tick rule (analysis.core.ticks)."""
    from matplotlib import pyplot as plt

    from analysis.core.ticks import log_ticks, matplotlib_log_y
    points = _frontier_points()
    values = [v for p in points.values() for v in (p["lo"], p["ppl"], p["hi"])]
    ticks, (low, high), labels = log_ticks(values)
    fig = charts.frontier(points, title="t")
    assert fig.layout.yaxis.type == "log" and list(fig.layout.yaxis.tickvals) == ticks
    assert low <= np.log10(min(values)) and np.log10(max(values)) <= high
    mfig, ax = plt.subplots()
    try:
        matplotlib_log_y(ax, values)
        assert ax.get_yscale() == "log"
        assert list(ax.get_yticks()) == ticks and [t.get_text() for t in ax.get_yticklabels()] == labels
    finally:
        plt.close(mfig)
