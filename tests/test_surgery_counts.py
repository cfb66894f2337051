"""Summary == surgery: every number shown for a mask equals what the physically pruned model has.

Oracle: the model `analysis.compress.surgery.prune_heads` builds -- its parameter count, its K projections'
rows, the KV cache it really fills on a forward pass, its weights' bytes -- for every mask policy x
kv_policy on tiny GQA models (G = 2 and G = 3, with and without Q/K/V biases; masks with uneven and
emptied groups and emptied layers), and one SmolLM2 case (the issue's uniform mask at 1/3).
"""
import numpy as np
import pytest
import torch

from analysis.core.errors import InputError
from analysis.score.masks import GQA_POLICIES, KV_POLICIES, POLICIES, MaskPlan, plan_mask, summarize_mask, surgery_counts
from analysis.arch.models import count_parameters
from analysis.compress.cost import forward_flops
from analysis.compress.surgery import prune_heads
from tests._tiny import tiny_input_ids, tiny_model

# (family, overrides): G = 2 (llama), G = 3 with biases (qwen2), G = 3 uneven-prone 3-layer llama
MODELS = {
    "llama-g2": ("llama", dict()),
    "qwen2-g3": ("qwen2", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)),
    "llama-g3": ("llama", dict(hidden_size=36, num_attention_heads=9, num_key_value_heads=3,
                               num_hidden_layers=3)),
}
SPARSITIES = (0.2, 0.5)
T = 6


def measured(model, smaller, adapter, g):
    """What the pruned model really holds: parameters removed, per-layer K heads, KV-cache bytes per token."""
    k_heads = [adapter.projection_modules(smaller, layer)["k"].weight.shape[0] // g.head_dim
               for layer in range(g.n_layers)]
    with torch.no_grad():
        cache = smaller(input_ids=tiny_input_ids(1, T), use_cache=True).past_key_values
    values = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    item = next(smaller.parameters()).element_size()
    return dict(params_removed=count_parameters(model) - count_parameters(smaller), k_heads=k_heads,
                cache_bytes=values * item // T,
                bytes_change=sum(p.numel() * p.element_size() for p in smaller.parameters())
                - sum(p.numel() * p.element_size() for p in model.parameters()))


def hand_masks(L, H, G):
    """Uneven groups, an emptied group, an emptied layer."""
    uneven = np.zeros((L, H), bool)
    uneven[0, 0] = True
    uneven[1, : G - 1] = True                    # layer 1: group 0 keeps 1, the others G
    group = np.zeros((L, H), bool)
    group[0, :G] = True                          # group 0 of layer 0 emptied, even elsewhere
    layer = np.zeros((L, H), bool)
    layer[0] = True
    layer[1, G] = True
    return {"uneven": uneven, "emptied-group": group, "emptied-layer": layer}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request):
    family, overrides = MODELS[request.param]
    model = tiny_model(family, **overrides)
    from analysis.arch.adapters import adapter_for
    adapter = adapter_for(model)
    return model, adapter, adapter.geometry(model)


def _cases(g):
    rng = np.random.default_rng(g.n_heads)
    scores = rng.random((g.n_layers, g.n_heads))
    scores[0, :2] = 0.0                          # some ties, broken by (layer, head)
    for policy in POLICIES:
        for s in SPARSITIES:
            try:
                plan = plan_mask(scores, s, group_size=g.group_size, policy=policy)
            except InputError:                  # a GQA policy with no feasible count near s
                continue
            yield f"{policy}@{s}", plan
    for name, pruned in hand_masks(g.n_layers, g.n_heads, g.group_size).items():
        yield name, MaskPlan.from_pruned(pruned, g.group_size)


def test_summary_equals_surgery_for_every_policy(tiny):
    model, adapter, g = tiny
    bias = adapter.read_heads(model, 0).q_bias is not None
    seen_expanded = seen_empty = 0
    for name, plan in _cases(g):
        pruned = plan.pruned
        for kv_policy in KV_POLICIES:
            case = f"{name} kv_policy={kv_policy}"
            try:
                smaller, layout = prune_heads(model, pruned, kv_policy=kv_policy)
            except InputError:
                with pytest.raises(InputError, match="strict"):
                    summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, kv_policy=kv_policy)
                assert kv_policy == "strict", case
                continue
            summary = summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, seq_len=T, bias=bias,
                                     kv_policy=kv_policy)
            real = measured(model, smaller, adapter, g)
            assert summary.params_removed == real["params_removed"], case
            assert [kv for _, kv in summary.layer_counts] == real["k_heads"], case
            assert summary.kv_heads - summary.kv_heads_removed == sum(real["k_heads"]), case
            assert summary.kv_cache_bytes_per_token_after == real["cache_bytes"], case
            assert summary.checkpoint_bytes_change == real["bytes_change"], case
            flops = forward_flops(smaller, T, T, adapter=adapter).attention
            assert summary.attention_flops - summary.attention_flops_removed == flops, case
            assert summary.attention_flops == forward_flops(model, T, T, adapter=adapter).attention, case
            if summary.expanded_layers:
                seen_expanded += 1
                assert summary.warnings and "balanced" in " ".join(summary.warnings) or kv_policy == "expand", case
            seen_empty += bool(summary.empty_layers)
            if plan.policy in GQA_POLICIES and kv_policy != "expand":
                assert not summary.expanded_layers and summary.params_removed >= 0, case
    assert seen_expanded and seen_empty       # the cases did cover growth and emptied layers


def test_growth_is_shown_as_growth_with_its_cause():
    # G = 3, one head pruned per layer from group 0: every layer keeps 2 + 3 + 3 -> K/V expanded
    pruned = np.zeros((2, 9), bool)
    pruned[:, 0] = True
    c = surgery_counts(pruned, group_size=3, head_dim=4, hidden=36)
    head, kv = 2 * 4 * 36, 2 * 4 * 36
    assert c.layer_counts == [(8, 8), (8, 8)] and c.expanded_layers == [0, 1]
    assert c.params_removed == 2 * (head - 5 * kv) < 0           # 1 query head gone, 5 KV copies added
    assert c.kv_cache_ratio == pytest.approx(8 / 3)
    assert "GROWS" in c.warnings[0] and "2 + 3 + 3" in c.warnings[0] and "'balanced'" in c.warnings[0]
    assert c.checkpoint_bytes_change == -4 * c.params_removed > 0
    assert not surgery_counts(pruned, group_size=3, head_dim=4, hidden=36, kv_policy="expand").warnings == []


def test_smollm2_uniform_third_summary_equals_surgery(smollm2):
    from analysis.measure.profiles import profile_model
    from analysis.score.scoring import MPGScorer

    g, adapter = smollm2.geometry, smollm2.adapter
    scores = MPGScorer(z=2.5).score(profile_model(smollm2.model, adapter=adapter))
    plan = plan_mask(scores, 1 / 3, group_size=g.group_size, policy="uniform")
    summary = summarize_mask(plan, scores, head_dim=g.head_dim, hidden=g.hidden, seq_len=T)
    smaller, layout = prune_heads(smollm2.model, plan.pruned)
    real = measured(smollm2.model, smaller, adapter, g)
    del smaller
    assert summary.params_removed == real["params_removed"]
    assert [kv for _, kv in summary.layer_counts] == real["k_heads"]
    assert summary.kv_cache_bytes_per_token_after == real["cache_bytes"]
    assert summary.expanded_layers and summary.warnings   # the uniform mask expands K/V here
    balanced = plan_mask(scores, 1 / 3, group_size=g.group_size, policy="balanced-uniform")
    b = summarize_mask(balanced, scores, head_dim=g.head_dim, hidden=g.hidden)
    assert balanced.n_pruned == 90 and b.expanded_layers == [] and b.kv_cache_ratio == 1.0
    assert b.layer_counts == [(6, 3)] * 30 and b.params_removed == 30 * 3 * (2 * 64 * 576)
