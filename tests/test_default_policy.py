"""The pipeline's default mask policy on GQA models never grows the model (issue 23).

`masks.default_policy(G)` is "groups" for G > 1 and "global" for MHA. Property (hypothesis, random
head scores with ties, random sparsities): the mask it plans, cut by `surgery.prune_heads`, gives a
model with no more attention parameters and no more KV cache per token than the dense one, and
exactly the numbers `masks.surgery_counts` predicts. Oracle: the model prune_heads really builds (its
parameter count and the KV cache a forward pass fills), on tiny GQA models with G = 2 and G = 3.
A counter-example shows the property can fail: the global policy on the same models does grow them.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from analysis.arch.adapters import adapter_for
from analysis.compress.recover.pipeline import PipelineConfig
from analysis.arch.models import count_parameters
from analysis.compress.surgery import prune_heads
from analysis.core.errors import InputError
from analysis.score.masks import default_policy, plan_mask, surgery_counts
from tests._tiny import tiny_input_ids, tiny_model

MODELS = {
    "llama-g2": ("llama", dict(num_hidden_layers=3)),                                   # H 4, Hkv 2
    "llama-g3": ("llama", dict(hidden_size=36, num_attention_heads=9, num_key_value_heads=3,
                               num_hidden_layers=3)),                                   # H 9, Hkv 3
    "qwen2-g3-bias": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)),
}
T = 5
_BUILT = {}


def built(name):
    if name not in _BUILT:
        family, overrides = MODELS[name]
        model = tiny_model(family, **overrides)
        adapter = adapter_for(model)
        _BUILT[name] = (model, adapter, adapter.geometry(model))
    return _BUILT[name]


def cache_bytes(model) -> int:
    """KV-cache bytes per token that a forward pass of T tokens really fills."""
    with torch.no_grad():
        cache = model(input_ids=tiny_input_ids(1, T), use_cache=True).past_key_values
    values = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    return values * next(model.parameters()).element_size() // T


def cut_and_count(name, pruned):
    model, adapter, g = built(name)
    smaller, _ = prune_heads(model, pruned)
    bias = adapter.projection_modules(model, 0)["q"].bias is not None
    counts = surgery_counts(pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden, bias=bias)
    return model, smaller, counts


@st.composite
def scores_and_sparsity(draw):
    name = draw(st.sampled_from(sorted(MODELS)))
    _, _, g = built(name)
    values = st.integers(0, 6).map(float) | st.floats(0, 10, allow_nan=False)    # ties are common
    scores = np.array(draw(st.lists(values, min_size=g.n_total_heads, max_size=g.n_total_heads)))
    return name, scores.reshape(g.n_layers, g.n_heads), draw(st.floats(0.01, 0.99))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scores_and_sparsity())
def test_default_gqa_policy_never_grows_the_model(case):
    name, scores, sparsity = case
    model, _, g = built(name)
    policy = default_policy(g.group_size)
    assert policy == "groups"
    try:
        plan = plan_mask(scores, sparsity, group_size=g.group_size, policy=policy)
    except InputError:                       # below one whole group: nothing to cut
        assume(False)
    model, smaller, counts = cut_and_count(name, plan.pruned)
    removed = count_parameters(model) - count_parameters(smaller)   # only attention weights are cut
    assert removed >= 0 and removed == counts.params_removed
    assert counts.attention_params_after <= counts.attention_params
    dense_cache, cut_cache = cache_bytes(model), cache_bytes(smaller)
    assert cut_cache <= dense_cache
    assert cut_cache == counts.kv_cache_bytes_per_token_after and dense_cache == counts.kv_cache_bytes_per_token
    assert not counts.expanded_layers and not counts.warnings


@pytest.mark.parametrize("name", ["llama-g2", "llama-g3"])
def test_the_global_policy_can_grow_the_same_models(name):
    """The property is not vacuous: one query head pruned per layer (uneven groups) makes surgery copy
    K/V per query head, which the global policy does and the default never does."""
    _, _, g = built(name)
    scores = np.ones((g.n_layers, g.n_heads))
    scores[:, 0] = 0.0                                      # the lowest head of every layer
    plan = plan_mask(scores, 1 / g.n_heads, group_size=g.group_size, policy="global")
    model, smaller, counts = cut_and_count(name, plan.pruned)
    assert cache_bytes(smaller) > cache_bytes(model)               # G - 1 kept heads need G - 1 K/V copies
    if g.group_size > 2:   # G = 2: 3 query + 3 KV heads weigh what 4 + 2 did; G = 3: 8 + 8 outweigh 9 + 3
        assert count_parameters(smaller) > count_parameters(model) and counts.params_removed < 0


def test_default_policy_table_and_the_pipeline_uses_it():
    assert default_policy(1) == "global" and default_policy(3) == "groups"
    gqa, mha = built("llama-g3")[2], adapter_for(tiny_model("gpt2")).geometry(tiny_model("gpt2"))
    assert PipelineConfig().for_model(gqa).policy == "groups"
    assert PipelineConfig().for_model(mha).policy == "global"
    assert PipelineConfig(policy="balanced").for_model(gqa).policy == "balanced"     # an explicit choice stays
