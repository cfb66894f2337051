"""Redundant heads: a head copied into another head's weights must come out as an exact
near-duplicate; the Gram matrix must equal contributions computed through the O module itself;
the redundancy rule and grouping are checked on hand-made similarity matrices."""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.errors import CancelledError, InputError
from analysis.measure.redundancy import (RedundancyFinder, cosine_from_gram, head_output_gram, head_redundancy,
                                 near_duplicate_groups, redundancy_from_similarity)

from ._evalkit import tiny_loaded
from ._tiny import tiny_input_ids, tiny_model


def _copy_head(model, layer, src, dst):
    """Make head dst of `layer` compute exactly what head src computes (same Q/K/V/O slices)."""
    a = adapter_for(model)
    geo = a.geometry(model)
    hw = a.read_heads(model, layer)
    hw.q[dst], hw.o[dst] = hw.q[src], hw.o[src]
    if hw.q_bias is not None:
        hw.q_bias[dst] = hw.q_bias[src]
    gs, gd = geo.kv_group(src), geo.kv_group(dst)
    if gs != gd:
        hw.k[gd], hw.v[gd] = hw.k[gs], hw.v[gs]
        for b in (hw.k_bias, hw.v_bias):
            if b is not None:
                b[gd] = b[gs]
    a.write_heads(model, layer, hw)
    return model


@pytest.mark.parametrize("family,kind", [("gpt2", "output"), ("llama", "output"), ("gpt2", "pattern"),
                                         ("bert", "output")])
def test_copied_head_is_found_as_a_duplicate(family, kind):
    model = _copy_head(tiny_model(family), 1, 0, 1)
    x = tiny_input_ids(2, 12)
    red = RedundancyFinder(kind, threshold=0.999).find(model, x)
    assert red.nearest[1, 0] == pytest.approx(1.0, abs=1e-9)
    assert tuple(red.partner[1, 0]) == (1, 1) and tuple(red.partner[1, 1]) == (1, 0)
    assert [(1, 0), (1, 1)] in red.groups
    off = red.similarity.copy()
    np.fill_diagonal(off, 0)
    off[4, 5] = off[5, 4] = 0                                          # flat indices of (1,0), (1,1)
    assert off.max() < 0.999                                           # nothing else is a duplicate


def test_output_gram_matches_contributions_through_the_o_module():
    model = tiny_model("llama")
    a = adapter_for(model)
    x = tiny_input_ids(1, 9)
    gram = head_output_gram(model, x)
    captured = {}
    hooks = [a.o_proj(model, l).register_forward_pre_hook(lambda m, args, l=l: captured.__setitem__(l, args[0]))
             for l in range(2)]
    try:
        with torch.no_grad():
            model(input_ids=x)
    finally:
        for h in hooks:
            h.remove()
    contribs = []
    with torch.no_grad():
        for l in range(2):
            o = a.o_proj(model, l)
            z = captured[l][0]                                         # [T, H*d]
            for h in range(4):
                only = torch.zeros_like(z)
                only[:, h * 8:(h + 1) * 8] = z[:, h * 8:(h + 1) * 8]
                contribs.append((o(only) - o(torch.zeros_like(z))).double().reshape(-1))  # [T*D]
    c = torch.stack(contribs)                                          # [L*H, T*D]
    torch.testing.assert_close(gram, c @ c.T, rtol=1e-4, atol=1e-6)


def test_cosine_from_gram_hand_computed():
    v = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    sim = cosine_from_gram(v @ v.T)
    np.testing.assert_allclose(sim, [[1, 2 ** -0.5, 0], [2 ** -0.5, 1, 0], [0, 0, 0]], atol=1e-12)


def test_groups_and_redundant_rule_hand_computed():
    # L=2, H=2: heads (0,0)~(1,1) at 0.95, (1,1)~(0,1) at 0.92 -> one chain group; (1,0) alone
    sim = np.eye(4)
    sim[0, 3] = sim[3, 0] = 0.95
    sim[3, 1] = sim[1, 3] = 0.92
    sim[0, 1] = sim[1, 0] = 0.5
    delta = np.array([[0.001, 0.2], [0.0, -0.005]])
    red = redundancy_from_similarity(sim, 2, 2, ablation_delta=delta, threshold=0.9, effect_threshold=0.01)
    assert red.groups == [[(0, 0), (0, 1), (1, 1)]]
    np.testing.assert_allclose(red.nearest, [[0.95, 0.92], [0.0, 0.95]])
    assert red.redundant.tolist() == [[True, False], [False, True]]    # (0,1) matters, (1,0) has no twin
    assert near_duplicate_groups(sim, 2, 0.99) == []
    with pytest.raises(InputError, match="Ablation effects"):
        redundancy_from_similarity(sim, 2, 2, ablation_delta=np.zeros((3, 2)))


def test_bad_input_and_cancel():
    model = tiny_model("gpt2")
    with pytest.raises(InputError, match="Unknown similarity"):
        RedundancyFinder("attention-rollout")
    with pytest.raises(InputError, match="at least two tokens"):
        RedundancyFinder().find(model, torch.tensor([[3]]))
    with pytest.raises(CancelledError):
        RedundancyFinder().find(model, tiny_input_ids(2, 6), should_stop=lambda: True)


def test_head_redundancy_from_text(smollm2):
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm")
    _copy_head(lm.model, 0, 2, 3)
    red = head_redundancy(lm, "The quick brown fox jumps over the lazy dog. " * 4, threshold=0.999,
                          ablation_delta=np.zeros((2, 4)))
    assert red.redundant[0, 2] and red.redundant[0, 3]
    assert red.redundant.sum() == 2
