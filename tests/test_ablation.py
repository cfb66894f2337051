"""Single-head ablation sweeps: the fast sweep (prefix reuse, batched gates) must equal the naive
loop of one full forward per head, and both must equal copies with the head zeroed in weights."""
import copy

import numpy as np
import pytest
import torch

from analysis.measure.ablation import FastAblation, ablation_gates, head_ablation, naive_sweep
from analysis.measure.tokens import split_sequences
from analysis.core.errors import CancelledError, InputError
from analysis.measure.evaluation import evaluate, token_ids
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import zero_heads
from analysis.core.text import evaluation_text

from ._evalkit import tiny_loaded
from ._tiny import tiny_input_ids, tiny_model
from ._tolerance import EXACT

TEXT = evaluation_text(max_chars=2000)


def _loss(model, x):
    with torch.no_grad():
        logits = model(input_ids=x).logits[:, :-1].double()          # [n, T-1, V]
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


def test_ablation_gates_hand_built():
    geo = HeadGeometry(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=2, hidden=8)
    g = ablation_gates(geo, 1, groups=True)
    assert g.shape == (6, 3, 4)
    assert (g[:, [0, 2]] == 1).all()
    assert g[:4, 1].tolist() == [[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]
    assert g[4:, 1].tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]
    assert ablation_gates(geo, 0, groups=False).shape == (4, 3, 4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bloom", "opt", "phi3", "qwen3", "gemma3_text"])
def test_fast_sweep_equals_naive_loop_on_tiny_models(family):
    model = tiny_model(family, dtype=torch.float64)                    # equality in float64: EXACT
    x = tiny_input_ids(3, 12)                                          # n = 3 sequences
    fast = FastAblation(batch_size=4).sweep(model, x)                   # 1 mask per pass: chunked rows
    naive = naive_sweep(model, x)
    assert fast.method == "fast"
    assert fast.base_loss == naive.base_loss
    np.testing.assert_allclose(fast.head_delta, naive.head_delta, rtol=0, atol=EXACT)
    if naive.group_delta is not None:
        np.testing.assert_allclose(fast.group_delta, naive.group_delta, rtol=0, atol=EXACT)
    assert np.abs(naive.head_delta).min() > 0                           # every head does something


@pytest.mark.parametrize("family,overrides", [
    ("gemma3_text", dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"])),
])
def test_fast_sweep_with_per_layer_attention_masks(family, overrides):
    """Layers called with different masks (sliding vs full) each get their own batch probe."""
    model = tiny_model(family, dtype=torch.float64, **overrides)
    x = tiny_input_ids(3, 12)                                          # longer than the window
    fast = FastAblation(batch_size=6).sweep(model, x)
    assert fast.method == "fast"
    np.testing.assert_allclose(fast.head_delta, naive_sweep(model, x).head_delta, rtol=0, atol=EXACT)


def test_fast_sweep_equals_zeroed_weight_copies():
    model = tiny_model("llama", dtype=torch.float64)                    # GQA: 4 heads, 2 KV groups
    x = tiny_input_ids(2, 10)
    res = FastAblation(batch_size=16).sweep(model, x)
    dense = _loss(model, x)
    assert res.base_loss == pytest.approx(dense, rel=0, abs=EXACT)
    for l, h in [(0, 0), (1, 3)]:
        p = np.zeros((2, 4), dtype=bool)
        p[l, h] = True
        assert res.head_delta[l, h] == pytest.approx(_loss(zero_heads(copy.deepcopy(model), p), x) - dense, rel=0, abs=EXACT)
    p = np.zeros((2, 4), dtype=bool)
    p[1, 2:] = True                                                     # KV group 1 of layer 1
    assert res.group_delta[1, 1] == pytest.approx(_loss(zero_heads(copy.deepcopy(model), p), x) - dense, rel=0, abs=EXACT)


def test_model_whose_tail_cannot_be_replayed_falls_back_to_naive():
    model = tiny_model("gemma2", dtype=torch.float64)                   # final logit soft-capping
    x = tiny_input_ids(2, 8)
    fast = FastAblation().sweep(model, x)
    assert fast.method.startswith("naive")
    np.testing.assert_allclose(fast.head_delta, naive_sweep(model, x).head_delta, rtol=0, atol=EXACT)


def test_layer_subset_leaves_other_rows_nan():
    model = tiny_model("gpt2", dtype=torch.float64)
    x = tiny_input_ids(1, 10)
    part = FastAblation().sweep(model, x, layers=[1])
    full = naive_sweep(model, x)
    assert np.isnan(part.head_delta[0]).all()
    np.testing.assert_allclose(part.head_delta[1], full.head_delta[1], rtol=0, atol=EXACT)
    with pytest.raises(InputError, match="not valid"):
        FastAblation().sweep(model, x, layers=[2])


def test_bad_token_input():
    model = tiny_model("gpt2")
    with pytest.raises(InputError, match="T >= 2"):
        FastAblation().sweep(model, torch.tensor([[5]]))
    with pytest.raises(InputError, match="T >= 2"):
        naive_sweep(model, torch.zeros(1, 0, dtype=torch.long))


def test_progress_and_cancel():
    model = tiny_model("llama")
    x = tiny_input_ids(1, 8)
    seen = []
    FastAblation().sweep(model, x, progress=lambda f, m: seen.append(f))
    assert seen[-1] == pytest.approx(1.0) and all(a <= b for a, b in zip(seen, seen[1:]))
    with pytest.raises(CancelledError):
        FastAblation().sweep(model, x, should_stop=lambda: True)
    with pytest.raises(CancelledError):
        naive_sweep(model, x, should_stop=lambda: True)


def test_split_sequences():
    ids = torch.arange(10)
    assert split_sequences(ids, 4).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert split_sequences(ids, 16).tolist() == [list(range(10))]


def test_head_ablation_from_text_fast_equals_naive(smollm2):
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm")
    fast = head_ablation(lm, TEXT, max_tokens=40, seq_len=20)
    naive = head_ablation(lm, TEXT, max_tokens=40, seq_len=20, method="naive")
    assert fast.n_tokens == 2 * 19
    np.testing.assert_allclose(fast.head_delta, naive.head_delta, rtol=1e-4, atol=0)
    with pytest.raises(InputError):
        head_ablation(lm, "", max_tokens=40)


@pytest.mark.parametrize("kind", ["masked-lm", "encoder"])
def test_head_ablation_for_other_kinds_matches_single_mask_evaluations(minilm, kind):
    lm = tiny_loaded("bert", minilm.tokenizer, "masked-lm")
    lm.model.double()            # an equality claim, in float64: the delta is a small difference of two NLLs
    if kind == "encoder":
        lm.model, lm.kind = lm.model.base_model, "encoder"
    res = head_ablation(lm, TEXT, max_tokens=24)
    p = np.zeros((2, 4), dtype=bool)
    p[1, 2] = True
    dense, one = evaluate(lm, TEXT, max_tokens=24), evaluate(lm, TEXT, max_tokens=24, pruned=p)
    want = (one.mean_nll[0] - dense.mean_nll[0]) if kind == "masked-lm" else (dense.value - one.value)
    assert abs(res.head_delta[1, 2] - want) <= EXACT


@pytest.mark.slow
def test_fast_sweep_equals_naive_loop_on_smollm2(smollm2_f64):
    """Real model, float64: batched GEMMs with other row counts reorder sums (in float32 single
    losses differed by ~1e-6 nats, CPU-dependent); in float64 the deltas agree to EXACT."""
    x = token_ids(smollm2_f64.tokenizer, TEXT, max_tokens=16).unsqueeze(0)  # [1, 16]
    layers = [10, 29]
    fast = FastAblation().sweep(smollm2_f64.model, x, layers=layers)
    naive = naive_sweep(smollm2_f64.model, x, layers=layers)
    assert fast.method == "fast" and fast.group_delta.shape == (30, 3)
    assert fast.base_loss == naive.base_loss
    for got, want in [(fast.head_delta[layers], naive.head_delta[layers]),
                      (fast.group_delta[layers], naive.group_delta[layers])]:
        assert np.abs(got - want).max() <= EXACT
        assert np.abs(want).max() > 1e-2                                # real effects, not noise
