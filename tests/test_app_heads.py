"""Heads page: the ablation heatmap matches an independent naive sweep (one masked forward pass per
head); bad text is refused with a fix; sections whose analysis module is missing say so honestly."""
import numpy as np
import pytest

from tests._apptools import figure_titled, fresh_caches, heatmap_z, new_app, no_exception, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_ablation_heatmap_matches_naive_sweep(tiny_dir):
    from analysis.ablation import head_ablation
    from analysis.models import load_model
    at = new_app(tiny_dir, page="heads")
    at.number_input(key="hs.w.heads.ablation.tokens").set_value(64).run()
    at.button(key="heads.ablate").click().run()
    no_exception(at)
    shown = heatmap_z(figure_titled(at, "increase when one head is removed")).astype(float)
    naive = head_ablation(load_model(str(tiny_dir)), None, max_tokens=64, method="naive")
    assert shown.shape == (4, 4)
    np.testing.assert_allclose(shown, naive.head_delta, atol=1e-4)
    groups = heatmap_z(figure_titled(at, "whole KV group")).astype(float)
    np.testing.assert_allclose(groups, naive.group_delta, atol=1e-4)


def test_own_text_is_used_and_empty_text_refused(tiny_dir):
    at = new_app(tiny_dir, page="heads")
    at.radio(key="hs.w.heads.ablation.text_source").set_value("own").run()
    no_exception(at)
    assert any("text is empty" in e.value for e in at.error)
    at.text_area(key="hs.w.heads.ablation.text").set_value("The cat sat on the mat. " * 8).run()
    at.button(key="heads.ablate").click().run()
    no_exception(at)
    assert not at.error
    assert heatmap_z(figure_titled(at, "increase when one head is removed")).shape == (4, 4)


def test_missing_analysis_modules_are_labelled(tiny_dir, monkeypatch):
    from components import cache
    real = cache.optional
    monkeypatch.setattr(cache, "optional", lambda name: None if name in ("roles", "redundancy", "ablation")
                        else real(name))
    at = new_app(tiny_dir, page="heads")
    no_exception(at)
    notes = " ".join(i.value for i in at.info)
    for module in ("roles", "redundancy", "ablation"):
        assert f"analysis/{module}.py" in notes
    assert not at.get("plotly_chart")
