"""Captum Integrated Gradients over head gates: completeness, agreement with a hand-rolled
integral of autograd gradients, and the Spearman comparison with the ablation oracle."""
import numpy as np
import pytest
import torch

from analysis.measure.ablation import FastAblation
from analysis.arch.adapters import adapter_for
from analysis.measure.attribution import GateAttribution, gate_loss_fn, head_attribution, rank_correlation
from analysis.core.errors import CancelledError, InputError
from analysis.measure.evaluation import token_ids
from analysis.core.text import evaluation_text

from ._evalkit import tiny_loaded
from ._tiny import tiny_input_ids, tiny_model


def _own_integral(model, x, steps=200):
    """Midpoint rule of the gate gradients along g = a * 1, a in (0, 1), with plain autograd."""
    geo = adapter_for(model).geometry(model)
    f = gate_loss_fn(model, x, geo)
    total = torch.zeros(geo.n_total_heads, dtype=torch.float64)
    for chunk in torch.arange(steps).split(50):
        a = (chunk.double() + 0.5) / steps                             # [c]
        g = (a[:, None] * torch.ones(1, geo.n_total_heads, dtype=torch.float64)).float().requires_grad_(True)
        grad, = torch.autograd.grad(f(g).sum(), g)                      # [c, L*H]
        total += grad.double().sum(0) / steps
    return total.reshape(geo.n_layers, geo.n_heads).numpy()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_captum_ig_equals_a_hand_rolled_path_integral_and_is_complete(family):
    model = tiny_model(family)
    x = tiny_input_ids(2, 10)
    res = GateAttribution(n_steps=32, batch_size=16).attribute(model, x)
    np.testing.assert_allclose(res.attribution, _own_integral(model, x), rtol=1e-3, atol=1e-6)
    gap = res.loss_dense - res.loss_baseline
    assert abs(res.attribution.sum() - gap) <= 1e-3 * abs(gap)
    np.testing.assert_array_equal(res.importance, -res.attribution)
    assert all(p.grad is None for p in model.parameters())              # the model is not touched


def test_end_points_are_the_dense_and_all_heads_off_losses():
    model = tiny_model("llama")
    x = tiny_input_ids(1, 12)
    res = GateAttribution(n_steps=4).attribute(model, x)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1]
    dense = torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()
    assert res.loss_dense == pytest.approx(dense, rel=1e-6)
    assert res.loss_baseline != pytest.approx(dense, rel=1e-3)


def test_rank_correlation_hand_computed():
    a = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert rank_correlation(a, a * 10) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)
    b = np.array([[1.0, 3.0], [2.0, np.nan]])
    assert rank_correlation(a, b) == pytest.approx(0.5)                # ranks (1,2,3) vs (1,3,2)
    with pytest.raises(InputError):
        rank_correlation(a, np.ones(3))


def test_bad_input_and_cancel(smollm2, minilm):
    model = tiny_model("gpt2")
    with pytest.raises(InputError):
        GateAttribution(n_steps=0)
    with pytest.raises(InputError, match="two tokens"):
        GateAttribution().attribute(model, torch.tensor([[5]]))
    with pytest.raises(CancelledError):
        GateAttribution(n_steps=4).attribute(model, tiny_input_ids(1, 6), should_stop=lambda: True)
    with pytest.raises(InputError, match="not supported"):
        head_attribution(minilm)
    with pytest.raises(InputError):
        head_attribution(tiny_loaded("llama", smollm2.tokenizer, "causal-lm"), b"\xff\xfe")


@pytest.mark.slow
def test_smollm2_attribution_against_the_ablation_oracle(smollm2):
    """The built-in model: IG's dense end point is the oracle's dense loss, and the comparison
    with the oracle yields a rank correlation over the swept heads."""
    text = evaluation_text(max_chars=2000)
    x = token_ids(smollm2.tokenizer, text, max_tokens=16).unsqueeze(0)  # [1, 16]
    progress = []
    res = GateAttribution(n_steps=4, batch_size=4).attribute(smollm2.model, x,
                                                             progress=lambda f, m: progress.append(f))
    oracle = FastAblation(groups=False).sweep(smollm2.model, x, layers=[28, 29])
    assert res.loss_dense == pytest.approx(oracle.base_loss, rel=1e-5)
    assert progress[-1] == 1.0
    rho = rank_correlation(res.importance, oracle.head_delta)          # NaN rows (unswept) dropped
    assert -1.0 <= rho <= 1.0
