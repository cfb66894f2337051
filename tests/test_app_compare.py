"""Compare page: every scorer's mask has the same size; the overlap and rank-correlation matrices
agree with the masks and scores the page shows; all quality curves start at the dense value."""
import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from tests._apptools import figure_titled, fresh_caches, heatmap_z, new_app, no_exception, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")
DEFAULT = ["MP (Magnitude Profile)", "MP-G (GQA-aware MP)", "Magnitude", "Random (floor)"]


def _masks(at):
    out = {}
    for label in DEFAULT:
        trace = figure_titled(at, f"{label}<br>")["data"][0]
        out[label] = (np.asarray(trace["z"]).astype(bool), np.asarray(trace["customdata"], dtype=float))
    return out


@pytest.mark.parametrize("sparsity", [0.25, 0.6])
def test_masks_overlap_and_correlation(tiny_dir, sparsity):
    at = new_app(tiny_dir, page="compare", policy="global", sparsity=sparsity, z="1.0")
    no_exception(at)
    masks = _masks(at)
    k = math.floor(sparsity * 16 + 1e-9)
    assert all(int(m.sum()) == k for m, _ in masks.values())
    jaccard = heatmap_z(figure_titled(at, "Jaccard")).astype(float)
    rho = heatmap_z(figure_titled(at, "Spearman")).astype(float)
    for i, a in enumerate(DEFAULT):
        for j, b in enumerate(DEFAULT):
            ma, mb = masks[a][0], masks[b][0]
            assert jaccard[i, j] == pytest.approx((ma & mb).sum() / max(1, (ma | mb).sum()))
            expected = 1.0 if i == j else spearmanr(masks[a][1].ravel(), masks[b][1].ravel()).statistic
            assert rho[i, j] == pytest.approx(np.nan_to_num(expected))


def test_one_scorer_is_not_a_comparison(tiny_dir):
    at = new_app(tiny_dir, page="compare", policy="global")
    at.multiselect(key="hs.w.compare.scorers").set_value(["mp"]).run()
    no_exception(at)
    assert any("at least two" in i.value for i in at.info)
    assert not at.get("plotly_chart")


def test_curves_start_at_the_dense_value(tiny_dir):
    at = new_app(tiny_dir, page="compare", policy="global")
    at.slider(key="hs.w.compare.max_s").set_value(0.3).run()
    at.number_input(key="hs.w.compare.tokens").set_value(64).run()
    at.button(key="compare.curves").click().run()
    no_exception(at)
    fig = figure_titled(at, "vs sparsity")
    assert [t["name"] for t in fig["data"]] == DEFAULT
    starts = [float(np.asarray(t["y"], dtype=float)[0]) for t in fig["data"]]
    xs = [np.asarray(t["x"], dtype=float) for t in fig["data"]]
    assert all(np.allclose(x, [0.0, 0.1, 0.2, 0.3]) for x in xs)
    assert max(starts) == pytest.approx(min(starts), rel=1e-6)   # sparsity 0 = the dense model for all
    ends = [float(np.asarray(t["y"], dtype=float)[-1]) for t in fig["data"]]
    assert len(set(np.round(ends, 6))) > 1                         # the scorers' masks differ


def test_side_by_side_masks_label_at_most_four_heads():
    """Issue 20 walk at 1280x800: under each of the four side-by-side masks MiniLM's 12 head labels
    ran together ("0123456789 10 11"); each narrow mask labels at most 4 heads (COMPACT_TICKS in
    pages/compare.py), every k-th from 0, while a full-width mask labels every head."""
    from components import charts
    at = new_app("minilm-l6", page="compare")
    no_exception(at)
    for label in DEFAULT:
        fig = figure_titled(at, f"{label}<br>")
        n_heads = np.asarray(fig["data"][0]["z"]).shape[1]
        axis = fig["layout"]["xaxis"]
        assert n_heads == 12 and axis["tickmode"] == "linear", (label, axis)
        assert len(range(0, n_heads, int(axis["dtick"]))) <= 4, (label, axis)
    wide = charts.mask_heatmap(np.zeros((6, 12), dtype=bool), np.zeros((6, 12)))
    assert wide.layout.xaxis.dtick == 1
