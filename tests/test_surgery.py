"""Surgery: the physically pruned copy computes what the masked model computes, for every family.

Oracle: `analysis.arch.head_gates.head_mask` with the same mask (itself tested == zeroed weights). Masks
include uneven GQA groups (K/V expanded), emptied groups, emptied layers and random masks.
"""
import copy
import zlib
from dataclasses import fields

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from analysis.arch.adapters import HeadWeights, adapter_for
from analysis.core.errors import InputError, UnsupportedModelError
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.compress.surgery import HeadLayout, prune_heads, select_heads
from tests._masks import forward, masked_forward, surgery_masks
from tests._tiny import FAMILIES, tiny_input_ids, tiny_model
from tests._tolerance import EXACT, float32_inside_tolerance, forward_tolerance, max_diff

# equality claims run in float64 and are asserted to EXACT (tests/_tolerance.py)
TOL = EXACT
# families that compute part of the forward in float32 whatever the model's dtype, and why:
# there the bound is forward_tolerance(float32, ...) over that part (see `_tol`)
FLOAT32_INSIDE = {
    "gptj": "GPT-J casts query and key to float32 for the attention scores",
    "mixtral": "Mixtral's experts run through torch's grouped matmul, which takes no float64",
}


def _tol(model, scale: float) -> float:
    """EXACT for a float64 forward; for a family in FLOAT32_INSIDE, the float32 worst case over the
    model's width and depth (tests/_tolerance.py)."""
    if model.config.model_type not in FLOAT32_INSIDE:
        return TOL
    return float32_inside_tolerance(model, scale)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_equals_masked(family):
    model = tiny_model(family, dtype=torch.float64)
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    ids = tiny_input_ids()
    before = _state(model)
    dense = forward(model, ids)
    n_dense = sum(p.numel() for p in model.parameters())
    for name, pruned in surgery_masks(g, zlib.crc32(family.encode())).items():
        masked = masked_forward(model, pruned, ids)
        assert (masked - dense).abs().max().item() > 1e-4, f"{name}: the mask had no effect"
        smaller, layout = prune_heads(model, pruned)
        got = forward(smaller, ids)
        assert got.shape == masked.shape
        assert max_diff(got, masked) <= _tol(model, masked.abs().max().item()), name
        assert np.array_equal(layout.pruned_mask(), pruned)
        for layer in range(g.n_layers):
            _check_layer_weights(adapter, model, smaller, layer, layout, g)
        n_small = sum(p.numel() for p in smaller.parameters())
        expanded = any(layout.kv_expanded(layer) for layer in range(g.n_layers))
        assert expanded or n_small < n_dense, name     # expanded K/V copies may even add parameters
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "prune_heads changed its input model"
    assert not any(type(m).__name__.startswith("Pruned") for m in model.modules())


def _check_layer_weights(adapter, model, smaller, layer, layout, g):
    """The pruned layer holds exactly the selected original rows (read back with its own counts)."""
    n_heads, n_kv = layout.layer_counts(layer)
    assert n_heads == len(layout.heads[layer])
    if n_heads == 0:
        for role, module in adapter.projection_modules(smaller, layer).items():
            assert 0 in tuple(module.weight.shape), (role, module)
        return
    own = HeadGeometry(g.n_layers, n_heads, n_kv, g.head_dim, g.hidden)
    got = adapter.read_heads(smaller, layer, own)
    want = select_heads(adapter.read_heads(model, layer, g), layout.heads[layer], layout.kv_heads[layer])
    for f in fields(HeadWeights):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (layer, f.name)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2"])
def test_gqa_layouts(family):
    model = tiny_model(family, dtype=torch.float64)
    g = adapter_for(model).geometry(model)
    assert (g.n_heads, g.n_kv_heads) == (4, 2)
    masks = surgery_masks(g, 0)
    uneven = HeadLayout.from_mask(masks["uneven-groups"], g, family)
    assert uneven.layer_counts(0) == (3, 3) and uneven.kv_heads[0] == [0, 1, 1]     # expanded: copies
    assert uneven.layer_counts(1) == (4, 2) and not uneven.kv_expanded(1)
    report = uneven.kv_cache_report()
    assert report["kv_heads_after"] == [3, 2] and report["expanded_layers"] == [0]
    assert report["cache_values_per_token_after"] == 2 * 5 * g.head_dim
    emptied = HeadLayout.from_mask(masks["emptied-group"], g, family)
    assert emptied.heads[1] == [2, 3] and emptied.kv_heads[1] == [1]               # group 0 gone
    even = HeadLayout.from_mask(masks["even-groups"], g, family)
    assert even.layer_counts(0) == (2, 2) and even.kv_heads[0] == [0, 1]           # G' = 1, no copies
    with pytest.raises(InputError, match="strict"):
        HeadLayout.from_mask(masks["uneven-groups"], g, family, kv_policy="strict")
    expanded = HeadLayout.from_mask(masks["emptied-group"], g, family, kv_policy="expand")
    assert expanded.kv_heads[1] == [1, 1]
    # the expanded model still equals the masked one
    ids = tiny_input_ids()
    smaller, _ = prune_heads(model, masks["emptied-group"], kv_policy="expand")
    assert (forward(smaller, ids) - masked_forward(model, masks["emptied-group"], ids)).abs().max().item() <= TOL


def test_select_heads_picks_rows_by_index():
    # hand-built weights where every value names its head: selection must be plain indexing
    H, Hkv, d, D = 4, 2, 3, 5
    q = torch.arange(H, dtype=torch.float)[:, None, None].expand(H, d, D).clone()
    k = 10 + torch.arange(Hkv, dtype=torch.float)[:, None, None].expand(Hkv, d, D).clone()
    hw = HeadWeights(q=q, k=k, v=-k, o=-q, q_bias=q[:, :, 0], k_bias=k[:, :, 0], v_bias=-k[:, :, 0],
                     o_bias=torch.ones(D))
    sub = select_heads(hw, [1, 3], [0, 1, 1])
    assert sub.q[:, 0, 0].tolist() == [1, 3] and sub.o[:, 0, 0].tolist() == [-1, -3]
    assert sub.k[:, 0, 0].tolist() == [10, 11, 11] and sub.v_bias[:, 0].tolist() == [-10, -11, -11]
    assert torch.equal(sub.o_bias, torch.ones(D))
    sub.q.zero_()
    assert hw.q[1, 0, 0] == 1, "selection must copy, not alias"


def test_layout_json_round_trip_and_validation():
    model = tiny_model("llama")
    g = adapter_for(model).geometry(model)
    layout = HeadLayout.from_mask(surgery_masks(g, 3)["uneven-groups"], g, "llama")
    again = HeadLayout.from_json(layout.to_json())
    assert again == layout
    broken = layout.to_dict()
    broken["kv_heads"][0] = [1, 1, 1]           # head 0 is in group 0, not 1
    with pytest.raises(InputError, match="layer 0"):
        HeadLayout.from_dict(broken)
    with pytest.raises(InputError, match="JSON"):
        HeadLayout.from_json("{not json")
    with pytest.raises(InputError, match="malformed"):
        HeadLayout.from_dict({"model_type": "llama"})


def test_bad_masks_and_policies():
    model = tiny_model("llama")
    with pytest.raises(InputError, match=r"\[2, 4\]"):
        prune_heads(model, np.zeros((3, 4), bool))
    with pytest.raises(InputError, match="KV policy"):
        prune_heads(model, np.zeros((2, 4), bool), kv_policy="sometimes")


def test_empty_mask_is_an_identical_copy():
    model = tiny_model("gpt2")
    ids = tiny_input_ids()
    smaller, layout = prune_heads(model, np.zeros((2, 4), bool))
    assert layout.is_identity
    assert torch.equal(forward(smaller, ids), forward(model, ids))
    assert smaller is not model


def test_emptied_layer_attention_outputs_exactly_o_bias():
    # independent of the masking hook: call the emptied attention block directly
    model = tiny_model("qwen2")            # q/k/v biases; o_proj has none -> output must be exact zeros
    pruned = np.zeros((2, 4), bool)
    pruned[0] = True
    smaller, _ = prune_heads(model, pruned)
    ad = adapter_for(smaller)
    attn = ad.attention(smaller, 0)
    hidden = torch.randn(2, 5, 32)
    with torch.no_grad():
        out, weights = attn(hidden, position_embeddings=None, attention_mask=None)
    assert weights is None and torch.equal(out, torch.zeros(2, 5, 32))
    gpt2 = tiny_model("gpt2")
    small2, _ = prune_heads(gpt2, pruned)
    attn2 = adapter_for(small2).attention(small2, 0)
    with torch.no_grad():
        out2, _ = attn2(hidden)
    bias = adapter_for(gpt2).o_proj(gpt2, 0).bias
    assert torch.equal(out2, bias.expand(2, 5, 32))


def test_pruned_model_works_with_sdpa_attention():
    # the built-ins load with SDPA (GQA packing path), the tiny models with eager
    model = tiny_model("llama", dtype=torch.float64)
    model.set_attn_implementation("sdpa")
    ids = tiny_input_ids()
    for name, pruned in surgery_masks(adapter_for(model).geometry(model), 7).items():
        smaller, _ = prune_heads(model, pruned)
        assert (forward(smaller, ids) - masked_forward(model, pruned, ids)).abs().max().item() <= TOL, name


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "gpt2", "bloom", "gpt_neox", "gptj", "opt"])
def test_generate_with_kv_cache_matches_masked(family):
    # layer 0 emptied: its cache must still advance, or positions (RoPE) and lengths go wrong
    model = tiny_model(family, dtype=torch.float64)
    g = adapter_for(model).geometry(model)
    pruned = np.zeros((g.n_layers, g.n_heads), bool)
    pruned[0] = True
    pruned[1, 1] = True
    ids = tiny_input_ids(batch=1, seq=6)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
    with head_mask(model, gates_from_mask(pruned)):
        ref = model.generate(ids, **kwargs)
    smaller, _ = prune_heads(model, pruned)
    got = smaller.generate(ids, **kwargs)
    assert got.sequences.tolist() == ref.sequences.tolist()
    # generate hands its scores back rounded once to float32, so two float64 logits equal to
    # within _tol may round to neighbouring float32 values: the bound adds that one rounding
    full = forward(smaller, got.sequences)
    scale = full.abs().max().item()
    one_rounding = forward_tolerance(torch.float32, width=1, depth=1, scale=scale) + _tol(model, scale)
    for a, b in zip(got.scores, ref.scores):
        assert max_diff(a, b) <= one_rounding
    # and the cached decode equals a full forward over the generated sequence; the two hand the
    # model's float32 parts (softmax, rotary cos/sin) different shapes, so the bound is theirs
    # (tests/_tolerance.py: 4e-8 on an AVX2-only CPU, 0 on AVX-512, against a bound of ~1e-5)
    across = float32_inside_tolerance(model, scale)
    assert max_diff(full[:, -2], got.scores[-1]) <= one_rounding + across
    # a plain forward with a cache (no generate bookkeeping): the cache length must come out right
    seq = got.sequences
    with torch.no_grad():
        first = smaller(input_ids=seq[:, :5], use_cache=True)
        assert first.past_key_values.get_seq_length() == 5
        step = smaller(input_ids=seq[:, 5:7], past_key_values=first.past_key_values, use_cache=True)
    assert max_diff(step.logits, full[:, 5:7]) <= float32_inside_tolerance(model, full.abs().max().item())


def _extra_model(model_type, **overrides):
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2, vocab_size=128,
                               max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    dtype = torch.float32 if model_type in FLOAT32_INSIDE else torch.float64
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()


@pytest.mark.parametrize("model_type", ["olmo", "starcoder2", "mixtral"])
def test_llama_like_families_outside_the_tiny_set(model_type):
    model = _extra_model(model_type)
    ids = tiny_input_ids()
    for name, pruned in surgery_masks(adapter_for(model).geometry(model), 11).items():
        smaller, _ = prune_heads(model, pruned)
        masked = masked_forward(model, pruned, ids)
        assert max_diff(forward(smaller, ids), masked) <= _tol(model, masked.abs().max().item()), (model_type, name)


def test_olmo2_is_refused_with_a_reason():
    # Its q_norm spans all heads, so masking != zeroing != removing a head (checked by hand:
    # max |masked - zeroed| = 2e-3 on a tiny model); refused at the adapter.
    with pytest.raises(UnsupportedModelError, match="all heads together"):
        adapter_for(AutoConfig.for_model("olmo2"))


def test_deepcopy_of_a_pruned_model_still_works():
    model = tiny_model("bloom")                 # ALiBi slicing + an emptied layer: swapped forwards
    pruned = np.zeros((2, 4), bool)
    pruned[0] = True
    pruned[1, 1] = True
    smaller, _ = prune_heads(model, pruned)
    twin = copy.deepcopy(smaller)
    ids = tiny_input_ids()
    assert torch.equal(forward(twin, ids), forward(smaller, ids))


@pytest.mark.slow
def test_smollm2_pruned_equals_masked(smollm2_f64):
    # the real built-in: 30 layers x 9 heads in 3 GQA groups, SDPA attention, tied LM head;
    # float64, so the claim "equal" holds on every CPU (float32 matmuls of different shapes
    # round differently: 1e-4 on Intel, 2.6e-3 on AMD; see tests/_tolerance.py)
    model, g = smollm2_f64.model, smollm2_f64.geometry
    rng = np.random.default_rng(0)
    pruned = rng.random((g.n_layers, g.n_heads)) < 0.5          # mostly uneven groups: K/V expanded
    pruned[3] = True                                            # an emptied layer
    pruned[4] = [True] * 3 + [False] * 6                        # an emptied group, even groups kept
    ids = smollm2_f64.tokenizer("The quick brown fox jumps over the lazy dog near the river bank.",
                                return_tensors="pt").input_ids
    smaller, layout = prune_heads(model, pruned)
    assert layout.layer_counts(3) == (0, 0) and layout.layer_counts(4) == (6, 2)
    assert max_diff(forward(smaller, ids), masked_forward(model, pruned, ids)) <= EXACT
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=smollm2_f64.tokenizer.pad_token_id)
    with head_mask(model, gates_from_mask(pruned)):
        ref = model.generate(ids, **kwargs)
    assert smaller.generate(ids, **kwargs).tolist() == ref.tolist()
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in model.parameters())
