"""Heads page, "What heads do": the detector heatmaps show what analysis.measure.detectors computes,
the per-token DLA view closes, the MP-G panel shows an AUC per role, and a too-short sentence is an
error box, not a traceback."""
import numpy as np
import pytest

from tests._apptools import figure_titled, fresh_caches, heatmap_z, new_app, no_exception, texts, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_detector_heatmaps_match_the_library(tiny_dir):
    from analysis.arch.models import load_model
    from analysis.measure.detectors import detect_heads
    at = new_app(tiny_dir, page="heads")
    at.number_input(key="hs.w.heads.taxonomy.tokens").set_value(64).run()
    at.button(key="heads.taxonomy").click().run()
    no_exception(at)
    expected = detect_heads(load_model(str(tiny_dir)), None, max_tokens=64)
    for name, title in (("induction", "Induction score"), ("copying", "Copying score"),
                        ("dla", "Direct logit attribution (mean"), ("previous-token", "Previous-token score")):
        shown = heatmap_z(figure_titled(at, title)).astype(float)
        assert shown.shape == (4, 4)
        np.testing.assert_allclose(shown, expected[name].scores, atol=1e-6, err_msg=name)
    figure_titled(at, "Strongest detected role")
    figure_titled(at, "per predicted token")
    figure_titled(at, "MP-G score vs")
    page = texts(at)
    assert "Does MP find the specialized heads?" in page and "rebuild the correct-token logit" in page
    # a one-token sentence: one clear error box, the rest of the section stays
    at.text_input(key="hs.w.heads.dla.sentence").set_value("a").run()
    no_exception(at)
    assert any("token" in e.value for e in at.error)
