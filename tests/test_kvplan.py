"""The per-head KV plan (analysis/arch/kvplan.py; plan_kv in analysis/score/kvscores.py): pruned == the existing mask, windows == spans, the
file round trip and its refusals, and the KV bytes it claims."""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.arch.spans import windowed
from analysis.core.errors import InputError
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, applied, read_kv_plan
from analysis.arch.window import Window
from analysis.score.kvscores import plan_kv
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT


def _llama():
    m = tiny_model("llama", dtype=torch.float64)
    m.set_attn_implementation("sdpa")
    return m, adapter_for(m).geometry(m)


def test_pruned_kv_heads_are_the_groups_mask():
    m, geo = _llama()
    modes = np.array([[PRUNE, FULL], [FULL, PRUNE]])
    plan = KVPlan(modes, n_heads=geo.n_heads)
    mask = np.array([[True, True, False, False], [False, False, True, True]])
    assert np.array_equal(plan.pruned_heads(), mask)
    assert np.array_equal(KVPlan.from_mask(mask, geo).modes, modes)
    x = tiny_input_ids(2, 10)
    with torch.no_grad():
        with applied(m, plan):
            a = m(x).logits
        with head_mask(m, gates_from_mask(mask)):
            b = m(x).logits
    assert (a - b).abs().max().item() <= EXACT


def test_windows_and_pruning_together_are_spans_plus_mask():
    m, geo = _llama()
    plan = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW]]), Window(1, 3), n_heads=geo.n_heads)
    x = tiny_input_ids(2, 10)
    with torch.no_grad():
        with applied(m, plan):
            a = m(x).logits
        with head_mask(m, gates_from_mask(plan.pruned_heads())), windowed(m, plan.windowed, Window(1, 3)):
            b = m(x).logits
        c = m(x).logits
    assert (a - b).abs().max().item() <= EXACT
    assert (a - c).abs().max().item() > 1e-4


def test_a_partial_group_is_not_a_kv_plan():
    _, geo = _llama()
    with pytest.raises(InputError, match="some query heads"):
        KVPlan.from_mask(np.array([[True, False, False, False], [False] * 4]), geo)


def test_file_round_trip_and_refusals(tmp_path):
    _, geo = _llama()
    plan = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW]]), Window(2, 5), n_heads=geo.n_heads, model="tiny")
    (tmp_path / "kv_plan.json").write_text(plan.to_json())
    back = read_kv_plan(tmp_path, geometry=geo)
    assert np.array_equal(back.modes, plan.modes) and back.window == Window(2, 5)
    other = type(geo)(geo.n_layers, geo.n_heads, geo.n_heads, geo.head_dim, geo.hidden)
    with pytest.raises(InputError, match="make the plan for this model"):
        read_kv_plan(plan.to_json(), geometry=other)
    data = plan.as_dict()
    data["modes"][1].append("full")                                    # a head that does not exist
    with pytest.raises(InputError, match="heads in layer 1"):
        read_kv_plan(data)
    data = plan.as_dict()
    data["modes"][0][0] = "stream"
    with pytest.raises(InputError, match="is not one of"):
        read_kv_plan(data)
    data = plan.as_dict()
    data["recent"] = 0
    with pytest.raises(InputError, match="window of 0"):
        read_kv_plan(data)
    with pytest.raises(InputError):
        read_kv_plan(tmp_path / "missing.json")


def test_kv_bytes_count_what_each_head_keeps():
    plan = KVPlan(np.array([[FULL, WINDOW, PRUNE]] * 4), Window(4, 60), n_heads=6)
    d, ctx = 8, 1000
    assert plan.kv_bytes(ctx, head_dim=d, dtype_bytes=2) == 2 * d * 2 * 4 * (1000 + 64 + 0)
    assert plan.kv_ratio(ctx) == pytest.approx((1000 + 64) / 3000)
    assert plan.kv_ratio(50) == pytest.approx((50 + 50) / 150)        # a window longer than the context holds it all


def test_plan_kv_windows_the_lowest_streaming_scores_and_keeps_what_it_is_told():
    _, geo = _llama()
    streaming = np.array([[0.1, 0.9], [0.2, 0.05]])
    plan = plan_kv(geo, streaming, window_share=0.5)
    assert np.array_equal(plan.windowed, streaming <= 0.1)
    kept = plan_kv(geo, streaming, window_share=0.5, keep=np.array([[False, False], [False, True]]))
    assert np.array_equal(kept.windowed, np.array([[True, False], [True, False]]))
    mixed = plan_kv(geo, streaming, window_share=0.25, prune_scores=np.array([[5, 1, ], [3, 4]]), prune_share=0.25)
    assert mixed.counts() == {"full": 2, "window": 1, "prune": 1} and mixed.modes[0, 1] == PRUNE
    with pytest.raises(InputError):
        plan_kv(geo, streaming, window_share=0.8, prune_scores=streaming, prune_share=0.5)
