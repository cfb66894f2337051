"""Heads page: the ablation heatmap matches an independent naive sweep (one masked forward pass per
head); bad text is refused with a fix."""
import numpy as np
import pytest

from tests._apptools import figure_titled, fresh_caches, heatmap_z, new_app, no_exception, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_ablation_heatmap_matches_naive_sweep(tiny_dir):
    from analysis.measure.ablation import head_ablation
    from analysis.arch.models import load_model
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


def test_attention_pattern_is_the_heads_real_pattern(tiny_dir, monkeypatch):
    import torch
    from analysis.measure import roles
    from analysis.arch.models import load_model
    calls = []
    real = roles.attention_probabilities
    monkeypatch.setattr(roles, "attention_probabilities", lambda *a, **k: calls.append(1) or real(*a, **k))
    at = new_app(tiny_dir, page="heads")
    sentence = "A dog saw a cat."
    at.text_input(key="hs.w.heads.sentence").set_value(sentence).run()
    lm = load_model(str(tiny_dir))
    lm.model.set_attn_implementation("eager")                                  # our own copy: probabilities
    ids = lm.tokenizer(sentence, return_tensors="pt")["input_ids"]             # [1, T]
    with torch.no_grad():
        expected = lm.model(input_ids=ids, output_attentions=True).attentions  # L x [1, H, T, T]
    n_calls = len(calls)
    for layer, head in ((0, 0), (3, 2), (1, 3)):
        at.slider(key="hs.w.heads.layer").set_value(layer).run()
        at.slider(key="hs.w.heads.head").set_value(head).run()
        no_exception(at)
        shown = heatmap_z(figure_titled(at, f"Layer {layer}, head {head} ")).astype(float)
        np.testing.assert_allclose(shown, expected[layer][0, head].numpy(), atol=1e-5)
        assert np.allclose(np.triu(shown, 1), 0) and np.allclose(shown.sum(axis=1), 1, atol=1e-5)
    assert len(calls) == n_calls, "switching the head recomputed the attention"


def test_roles_and_redundancy_render(tiny_dir):
    at = new_app(tiny_dir, page="heads")
    at.button(key="heads.roles").click().run()
    at.button(key="heads.redundancy").click().run()
    no_exception(at)
    roles_map = figure_titled(at, "Primary role of each head")
    assert np.asarray(roles_map["data"][0]["z"]).shape == (4, 4)
    nearest = heatmap_z(figure_titled(at, "most similar other head")).astype(float)
    assert nearest.shape == (4, 4) and np.all(nearest <= 1 + 1e-6) and np.all(nearest >= -1 - 1e-6)
    assert any("near-duplicate groups" in m.value for m in at.markdown)


def test_attribution_and_its_correlation_with_ablation(tiny_dir):
    from analysis.measure.attribution import rank_correlation
    at = new_app(tiny_dir, page="heads")
    at.number_input(key="hs.w.heads.ablation.tokens").set_value(32).run()
    at.number_input(key="hs.w.heads.ig.tokens").set_value(32).run()
    at.number_input(key="hs.w.heads.ig.steps").set_value(4).run()
    at.button(key="heads.ablate").click().run()
    at.button(key="heads.attribute").click().run()
    no_exception(at)
    importance = heatmap_z(figure_titled(at, "Importance")).astype(float)
    ablation = heatmap_z(figure_titled(at, "increase when one head is removed")).astype(float)
    rho = [m for m in at.metric if m.label.startswith("Spearman")][0].value
    assert float(rho) == pytest.approx(rank_correlation(importance, ablation), abs=1e-3)


def test_a_stale_ablation_is_never_used_beside_other_results(tiny_dir):
    """Issue 33's sibling on Heads: the roles table, the redundancy flags and the attribution's Spearman
    used the last ablation whatever its settings, after the ablation above said it was stale."""
    at = new_app(tiny_dir, page="heads")
    at.number_input(key="hs.w.heads.ablation.tokens").set_value(32).run()
    at.button(key="heads.ablate").click().run()
    at.button(key="heads.roles").click().run()
    no_exception(at)
    assert any("Ablation effect from the sweep above" in c.value for c in at.caption)
    at.number_input(key="hs.w.heads.ablation.tokens").set_value(48).run()       # the ablation is stale now
    no_exception(at)
    assert any("text or token count changed since the sweep" in c.value for c in at.caption)
    assert not any("Ablation effect from the sweep above" in c.value for c in at.caption)
    assert any("Run the ablation sweep above to see each tagged head" in c.value for c in at.caption)
