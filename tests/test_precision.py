"""Half precision (bfloat16, float16) on the CPU: the exactness oracles hold within a stated
tolerance per dtype, reductions stay in float32, and SmolLM2's perplexity in bfloat16 is within 2%
of float32.

Tolerance per dtype, on logits: TOL[dtype] * max|dense logits|, half a unit in the last place of
the largest logit (bfloat16 keeps 8 significant bits, float16 11); measured here: 0, the half
kernels give the same bits for masked, zeroed and pruned. Every exactness test also checks that
the mask moves the logits by more than that tolerance, so it can fail. One family per weight
layout (Separate GQA, Stacked, Interleaved, GPT-2 Conv1D, a BERT encoder) keeps the file fast;
the float32 tests cover every family.
"""
import copy

import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.errors import ModelLoadError
from analysis.arch.head_gates import gates_from_mask, head_mask, zero_heads
from analysis.measure.profiles import profile_model
from analysis.compress.surgery import prune_heads
from tests._tiny import tiny_input_ids, tiny_model

HALF = (torch.bfloat16, torch.float16)
TOL = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}   # relative to the largest dense logit
LAYOUT_FAMILIES = ("llama", "phi3", "gpt_neox", "gpt2", "bert")


def _logits(model, x):
    with torch.no_grad():
        out = model(input_ids=x)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def _mask(model, seed=0):
    g = adapter_for(model).geometry(model)
    pruned = np.random.default_rng(seed).random((g.n_layers, g.n_heads)) < 0.5   # [L, H]
    pruned[0, 0] = True
    return pruned


@pytest.mark.parametrize("dtype", HALF, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_masked_equals_zeroed_equals_pruned(family, dtype):
    model = tiny_model(family).to(dtype)
    x = tiny_input_ids(2, 12)
    pruned = _mask(model)
    dense = _logits(model, x)
    with head_mask(model, gates_from_mask(pruned)):
        masked = _logits(model, x)
    zeroed = _logits(zero_heads(copy.deepcopy(model), pruned), x)
    smaller, _ = prune_heads(model, pruned)
    tol = TOL[dtype] * dense.abs().max().item()
    assert masked.dtype == torch.float32 and next(smaller.parameters()).dtype == dtype
    assert (masked - dense).abs().max() > tol, "the mask must change the output by more than the tolerance"
    assert (masked - zeroed).abs().max() <= tol
    assert (smaller_logits := _logits(smaller, x)).shape == masked.shape
    assert (smaller_logits - masked).abs().max() <= tol


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # Separate layout; GPT-2's transposed Conv1D
def test_half_profile_is_the_float32_profile_of_the_same_weights(family):
    """Row norms of bf16 weights are reduced in float32: the profile equals that of a float32 copy
    of the very same (rounded) values, up to the order of the sums."""
    half = tiny_model(family).to(torch.bfloat16)
    full = copy.deepcopy(half).float()
    a, b = profile_model(half), profile_model(full)
    for p in ("q", "k", "v", "o"):
        np.testing.assert_allclose(a.l2[p], b.l2[p], rtol=1e-6)
        np.testing.assert_allclose(a.norms(1)[p], b.norms(1)[p], rtol=1e-6)


def test_gate_gradients_of_a_half_model_are_float32():
    """A float32 gate on a bf16 model: the product is formed in float32, so dL/dgate is float32 and
    close to the float32 model's with the same weights."""
    from analysis.measure.loss import lm_sequence_losses
    half = tiny_model("llama").to(torch.bfloat16)
    full = copy.deepcopy(half).float()
    x = tiny_input_ids(2, 12)
    grads = []
    for model in (half, full):
        g = adapter_for(model).geometry(model)
        gates = torch.ones(g.n_layers, g.n_heads, requires_grad=True)                 # [L, H]
        with head_mask(model, gates):
            loss = lm_sequence_losses(model, "causal-lm", x).sum()
        (grad,) = torch.autograd.grad(loss, gates)
        grads.append(grad)
    assert grads[0].dtype == torch.float32
    assert torch.isfinite(grads[0]).all()
    scale = grads[1].abs().max()
    assert (grads[0] - grads[1]).abs().max() <= 0.05 * scale   # bf16 activations: a few percent


def test_missing_half_kernels_are_a_clear_refusal(tmp_path, monkeypatch):
    from analysis.core import placement
    from analysis.arch.models import load_model
    from tests._apptools import tiny_model_dir
    folder = tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setattr(placement, "_kernels_work", lambda *a: "no kernel for 'addmm' in Half")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder), dtype="float16")
    text = str(info.value)
    assert "float16" in text and "--dtype float32" in text and "\n" not in text


def test_half_load_has_the_dtype_and_the_same_geometry(tmp_path):
    from analysis.arch.models import load_model
    from tests._apptools import tiny_model_dir
    folder = tiny_model_dir(tmp_path / "tiny")
    for name, dtype in (("bf16", torch.bfloat16), ("float16", torch.float16)):
        loaded = load_model(str(folder), dtype=name)
        assert loaded.dtype == dtype and loaded.placement.dtype == dtype
        assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    assert load_model(str(folder)).dtype == torch.float32   # the library default: the float32 reference


@pytest.fixture(scope="module")
def smollm2_bf16(builtin_cache_dir):
    from analysis.arch.models import load_model
    return load_model("smollm2-135m", cache_dir=builtin_cache_dir, dtype="bfloat16")


def test_smollm2_bfloat16_perplexity_within_two_percent(smollm2, smollm2_bf16):
    from analysis.measure.evaluation import perplexity
    full = float(perplexity(smollm2, max_tokens=256))
    half = float(perplexity(smollm2_bf16, max_tokens=256))
    assert smollm2_bf16.dtype == torch.bfloat16
    assert abs(half / full - 1) <= 0.02, (full, half)
