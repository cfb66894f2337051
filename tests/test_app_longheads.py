"""Heads page, "Heads for long contexts": each long detector (not in the quick run: tests/test_detectors.py,
default_detectors) has its own button with an expected time, and its map is what
analysis.measure.detectors computes with the same options."""
import numpy as np
import pytest

from tests._apptools import figure_titled, fresh_caches, heatmap_z, long_tiny, new_app, no_exception, texts  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_long_detectors_run_on_their_own_buttons(long_tiny):
    from analysis.arch.models import load_model
    from analysis.measure.detectors import detect_heads
    at = new_app(long_tiny, page="heads")
    no_exception(at)
    page = texts(at)
    assert "Heads for long contexts" in page and "Expected: about" in page
    assert not [f for f in at.get("plotly_chart") if "Retrieval score" in str(f.proto.spec)]   # nothing ran yet
    at.number_input(key="hs.w.heads.long.retrieval.context").set_value(256).run()
    at.number_input(key="hs.w.heads.long.retrieval.needles").set_value(1).run()
    at.button(key="heads.long.retrieval").click().run()
    at.number_input(key="hs.w.heads.long.streaming.context").set_value(128).run()
    at.number_input(key="hs.w.heads.long.streaming.recent").set_value(16).run()
    at.button(key="heads.long.streaming").click().run()
    no_exception(at)
    lm = load_model(str(long_tiny))
    want = detect_heads(lm, ["retrieval"], options=dict(lengths=(256,), needles=1))["retrieval"]
    np.testing.assert_allclose(heatmap_z(figure_titled(at, "Retrieval score")).astype(float), want.scores, atol=1e-9)
    want = detect_heads(lm, ["streaming"], options=dict(lengths=(128,), sinks=4, recent=16))["streaming"]
    np.testing.assert_allclose(heatmap_z(figure_titled(at, "Streaming score")).astype(float), want.scores, atol=1e-6)
    page = texts(at)
    assert "retrieval heads" in page and "Does MP find them?" in page and "Wu et al. 2024" in page
