"""Head gates (analysis.arch.head_gates): hook gates == zeroed weights, for every family; batching; hook hygiene."""
import copy
import zlib

import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.errors import InputError
from analysis.arch.head_gates import gates_from_mask, head_mask, kv_groups_emptied, zero_heads
from tests._tiny import FAMILIES, tiny_input_ids, tiny_model
from tests._tolerance import EXACT, max_diff


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _masks(geometry, seed):
    """Random masks plus the edge cases: a whole layer pruned, a whole KV group pruned."""
    L, H, G = geometry.n_layers, geometry.n_heads, geometry.group_size
    rng = np.random.default_rng(seed)
    random = rng.random((L, H)) < 0.4
    random[rng.integers(L), rng.integers(H)] = True   # never an empty mask
    whole_layer = np.zeros((L, H), bool)
    whole_layer[0] = True
    whole_group = np.zeros((L, H), bool)
    whole_group[1, G:2 * G] = True          # group 1 of layer 1 emptied
    whole_group[0, 0] = True                # and a lone head elsewhere
    return [random, whole_layer, whole_group]


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_mask_equals_zeroed_weights(family):
    model = tiny_model(family, dtype=torch.float64)     # equality claims in float64 (tests/_tolerance.py)
    g = adapter_for(model).geometry(model)
    ids = tiny_input_ids()
    for pruned in _masks(g, seed=zlib.crc32(family.encode())):
        with head_mask(model, gates_from_mask(pruned)):
            masked = _logits(model, ids)
        zeroed = _logits(zero_heads(copy.deepcopy(model), pruned), ids)
        dense = _logits(model, ids)
        assert max_diff(masked, zeroed) <= EXACT
        assert (masked - dense).abs().max().item() > 1e-4, "mask had no effect: the oracle proves nothing"


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "phi3"])
def test_zeroing_a_groups_values_equals_gating_its_heads(family):
    # An independent check of the K/V layout: V rows (and bias) of group g all zero make every
    # head of that group output exactly zero, like gating those heads.
    model = tiny_model(family, dtype=torch.float64)
    ad = adapter_for(model)
    g = ad.geometry(model)
    ids = tiny_input_ids()
    twin = copy.deepcopy(model)
    hw = ad.read_heads(twin, 1)
    hw.v[1] = 0
    if hw.v_bias is not None:
        hw.v_bias[1] = 0
    ad.write_heads(twin, 1, hw)
    pruned = np.zeros((g.n_layers, g.n_heads), bool)
    pruned[1, g.group_size:2 * g.group_size] = True
    with head_mask(model, gates_from_mask(pruned)):
        masked = _logits(model, ids)
    assert max_diff(masked, _logits(twin, ids)) <= EXACT


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_all_ones_gates_are_bit_identical(family):
    model = tiny_model(family)
    g = adapter_for(model).geometry(model)
    ids = tiny_input_ids()
    dense = _logits(model, ids)
    with head_mask(model, torch.ones(g.n_layers, g.n_heads)):
        assert torch.equal(_logits(model, ids), dense)


def _hook_count(model):
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_are_removed_when_the_body_raises():
    model = tiny_model("llama")
    g = adapter_for(model).geometry(model)
    with pytest.raises(RuntimeError, match="boom"):
        with head_mask(model, torch.zeros(g.n_layers, g.n_heads)):
            assert _hook_count(model) == g.n_layers
            raise RuntimeError("boom")
    assert _hook_count(model) == 0
    # and when the forward itself raises (a bad input inside the context)
    with pytest.raises(Exception):
        with head_mask(model, torch.zeros(g.n_layers, g.n_heads)):
            model(input_ids=torch.tensor([[10_000]]))
    assert _hook_count(model) == 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "gpt_neox"])
def test_a_batch_of_masks_equals_separate_forwards(family):
    model = tiny_model(family, dtype=torch.float64)
    g = adapter_for(model).geometry(model)
    ids = tiny_input_ids(batch=2)
    rng = np.random.default_rng(0)
    masks = rng.random((3, g.n_layers, g.n_heads)) < 0.5                 # [K, L, H]
    gates = gates_from_mask(masks)
    with head_mask(model, gates):
        batched = _logits(model, ids.repeat_interleave(1, 0).repeat(3, 1))   # [K*2, S, V]: mask-major
    for k in range(3):
        with head_mask(model, gates[k]):
            single = _logits(model, ids)
        assert max_diff(batched[2 * k:2 * k + 2], single) <= EXACT


def test_fractional_gates_carry_gradients():
    model = tiny_model("llama")
    g = adapter_for(model).geometry(model)
    gates = torch.full((g.n_layers, g.n_heads), 1.0, requires_grad=True)
    ids = tiny_input_ids()
    with head_mask(model, gates):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert gates.grad is not None and gates.grad.abs().sum() > 0


def test_bad_gates_are_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(InputError, match="shape"):
        with head_mask(model, torch.ones(3, 3)):
            pass
    with pytest.raises(InputError, match="NaN"):
        with head_mask(model, torch.full((2, 4), float("nan"))):
            pass
    with pytest.raises(InputError, match="multiple"):
        with head_mask(model, torch.zeros(3, 2, 4)):
            model(input_ids=tiny_input_ids(batch=2))
    assert _hook_count(model) == 0


def test_kv_groups_emptied():
    pruned = np.array([[1, 1, 1, 0], [0, 0, 1, 1]], bool)
    assert kv_groups_emptied(pruned, 2).tolist() == [[True, False], [False, True]]
