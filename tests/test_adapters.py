"""Adapters: head-major views read the right slices and write back bit for bit, per family."""
import pytest
import torch
from transformers import AutoConfig

from analysis.arch.adapters import SUPPORTED_MODEL_TYPES, adapter_for
from analysis.core.errors import UnsupportedModelError
from tests._tiny import FAMILIES, tiny_config, tiny_model


def test_every_tiny_family_is_supported_and_every_supported_family_is_tested():
    assert set(FAMILIES) <= set(SUPPORTED_MODEL_TYPES)
    untested = set(SUPPORTED_MODEL_TYPES) - set(FAMILIES)
    # These share a FAMILIES row with a tested family (same paths and layout object).
    from analysis.arch.adapters import FAMILIES as ROWS
    for t in untested:
        assert any(ROWS[t] == ROWS[f] for f in FAMILIES), f"{t} has a layout no tiny test covers"


@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_is_bit_exact(family):
    model = tiny_model(family)
    ad = adapter_for(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Perturb through the view, then restore through the view: both directions exercised.
    for layer in range(ad.geometry(model).n_layers):
        hw = ad.read_heads(model, layer)
        ad.write_heads(model, layer, hw.map(lambda t: t + 1.0))
        assert torch.equal(ad.read_heads(model, layer).q, hw.q + 1.0)
        ad.write_heads(model, layer, hw)
    after = model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == []


@pytest.mark.parametrize("family", FAMILIES)
def test_view_shapes_follow_geometry(family):
    model = tiny_model(family)
    ad = adapter_for(model)
    g = ad.geometry(model)
    hw = ad.read_heads(model, 0)
    assert hw.q.shape == (g.n_heads, g.head_dim, g.hidden)
    assert hw.k.shape == hw.v.shape == (g.n_kv_heads, g.head_dim, g.hidden)
    assert hw.o.shape == (g.n_heads, g.head_dim, g.hidden)


def test_views_are_the_documented_slices():
    # Llama (nn.Linear [out, in]): head h = rows h*d..(h+1)*d-1 of Q, columns of O.
    m = tiny_model("llama")
    ad = adapter_for(m)
    g = ad.geometry(m)
    d = g.head_dim
    attn = m.model.layers[1].self_attn
    hw = ad.read_heads(m, 1)
    assert g.n_kv_heads == 2 and g.group_size == 2
    assert torch.equal(hw.q[3], attn.q_proj.weight[3 * d:4 * d])
    assert torch.equal(hw.k[1], attn.k_proj.weight[d:2 * d])
    assert torch.equal(hw.o[2], attn.o_proj.weight[:, 2 * d:3 * d].T)
    # GPT-2 Conv1D stores [in, out]: Q of head h = columns h*d.. of c_attn, transposed.
    m = tiny_model("gpt2")
    hw = adapter_for(m).read_heads(m, 0)
    a = m.transformer.h[0].attn
    D = 32
    assert torch.equal(hw.q[1], a.c_attn.weight[:, d:2 * d].T)
    assert torch.equal(hw.v[2], a.c_attn.weight[:, 2 * D + 2 * d:2 * D + 3 * d].T)
    assert torch.equal(hw.o[3], a.c_proj.weight[3 * d:4 * d])
    assert torch.equal(hw.k_bias[0], a.c_attn.bias[D:D + d])
    # GPT-NeoX fuses per head: rows reshape to [H, 3, d].
    m = tiny_model("gpt_neox")
    hw = adapter_for(m).read_heads(m, 0)
    w = m.gpt_neox.layers[0].attention.query_key_value.weight
    assert torch.equal(hw.k[2], w[2 * 3 * d + d:2 * 3 * d + 2 * d])


def test_head_dim_comes_from_config_not_hidden_over_heads():
    g = adapter_for(tiny_config("qwen3")).geometry(tiny_config("qwen3"))
    assert (g.head_dim, g.hidden, g.n_heads, g.n_kv_heads) == (12, 32, 4, 2)


def test_unsupported_model_type_names_the_supported_ones():
    cfg = AutoConfig.for_model("t5")
    with pytest.raises(UnsupportedModelError) as e:
        adapter_for(cfg)
    assert "t5" in str(e.value) and "llama" in str(e.value) and "gpt2" in str(e.value)


@pytest.mark.parametrize("model_type", ["mamba", "resnet"])
def test_attention_free_models_are_told_so(model_type):
    with pytest.raises(UnsupportedModelError, match="no attention heads"):
        adapter_for(AutoConfig.for_model(model_type))
