"""The measured side (analysis/compress/timing.py): the speed report of every kind of cut runs, leaves the model as it
was, measures the KV bytes its prediction says, reads every time after a device sync, and its timing helpers
(rotation, self-timed calls, per-round ratios) by hand. (Speed itself is measured in bench/bench_surgery.py and
bench/bench_kv_policies.py, never asserted in unit tests.)"""
import numpy as np
import pytest
import torch

from analysis.arch.cut import Cut
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan
from analysis.arch.models import count_parameters
from analysis.arch.window import Window
from analysis.compress.kvruntime import physical
from analysis.compress.timing import Timings, alternating_times, measure, saving_ratio
from analysis.core import clock
from analysis.core.errors import InputError
from analysis.core.threads import torch_threads
from tests._tiny import tiny_model


def _mask():
    pruned = np.zeros((2, 4), bool)
    pruned[0] = True            # layer 0 emptied
    pruned[1, 2:] = True        # layer 1 loses KV group 1: H' = 2, H_kv' = 1
    return pruned


def _untouched(model, before):
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


def test_measure_report_runs_and_leaves_the_model_alone():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = measure(model, Cut.of_mask(_mask()), prefill=(8, 16, 4096), decode_context=8, decode_steps=2,
                     repeats=1, warmup=0, threads=1)
    assert set(report.latency_ms) == {"prefill@8", "prefill@16", "decode@8"}
    assert report.skipped == ["prefill@4096 (model max positions 64)"]
    assert report.variants == ["dense", "masked", "pruned"]
    assert all(set(ms) == {"dense", "masked", "pruned"} and min(ms.values()) > 0 for ms in report.latency_ms.values())
    assert set(report.cpu_ms) == set(report.latency_ms)
    assert report.parameters["pruned"] < report.parameters["dense"] == count_parameters(model)
    assert report.file_bytes["pruned"] < report.file_bytes["dense"]
    assert report.predicted_speedup("prefill@16") > 1
    assert report.heads_pruned == 6 and report.cut["kind"] == "mask"
    # the real caches: the gates keep dense's cache, the twin's is what surgery's count says
    assert report.kv_bytes["masked"] == report.kv_bytes["dense"] == report.kv_bytes_predicted["dense"]
    assert report.kv_bytes["pruned"] == report.kv_bytes_predicted["pruned"] < report.kv_bytes["dense"]
    assert len(report.rows()) == 3 and "masked vs dense (x)" in report.rows()[0]
    assert any("causal" in note for note in report.notes)
    _untouched(model, before)


def test_encoders_get_no_decode_row():
    report = measure(tiny_model("bert"), Cut.of_mask(_mask()), prefill=(8,), repeats=1, warmup=0, measure_files=False)
    assert list(report.latency_ms) == ["prefill@8"] and report.file_bytes == {} and report.kv_bytes == {}


def test_every_kind_of_cut_is_measured():
    """A KV plan: dense / the plan on the dense model / its twin; a model of its own: dense / it. The real KV bytes
    after the prompt are the plan's promise on both plan paths."""
    model = tiny_model("llama", num_hidden_layers=3)
    model.set_attn_implementation("sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW], [FULL, FULL]], np.int8), Window(2, 3), n_heads=4)
    promise = plan.kv_bytes(20, head_dim=8)
    kw = dict(prefill=(20,), decode_context=20, decode_steps=2, repeats=1, warmup=0, threads=1, measure_files=False)
    report = measure(model, Cut.of_plan(plan), **kw)
    assert report.variants == ["dense", "masked", "pruned"] and report.heads_pruned == 2      # one KV group
    assert report.kv_bytes["masked"] == report.kv_bytes["pruned"] == report.kv_bytes_predicted["pruned"] == promise
    own = measure(model, physical(Cut.of_plan(plan), model), **kw)
    assert own.variants == ["dense", "pruned"] and own.baseline == "dense"
    assert own.kv_bytes["pruned"] == promise and own.heads_pruned == 2           # counted on the twin itself
    assert "pruned vs dense (x)" in own.rows()[0] and "masked vs dense (x)" not in own.rows()[0]
    _untouched(model, before)
    with pytest.raises(InputError, match="Cut.of_mask"):
        measure(model, _mask(), **kw)
    with pytest.raises(InputError, match="rounds"):
        measure(model, Cut.of_plan(plan), **{**kw, "repeats": 0})


def test_every_time_is_read_after_a_device_sync(monkeypatch):
    """A fake device sync (the table's CPU entry) counts its calls: two reads per timed prefill (before, after) and
    two per decode call's forward (the prompt's prefill is untimed), every one behind a sync."""
    seen = []
    monkeypatch.setitem(clock.SYNCHRONIZE, "cpu", lambda device: seen.append(clock.device_type(device)))
    repeats, warmup, steps, variants = 2, 1, 3, 3
    measure(tiny_model("llama"), Cut.of_mask(_mask()), prefill=(8,), decode_context=8, decode_steps=steps,
            repeats=repeats, warmup=warmup, threads=1, measure_files=False)
    prefill_reads = 2 * repeats * variants                       # warm-up rounds are not timed
    decode_reads = 2 * steps * (warmup + repeats) * variants     # DecodeSteps times its warm-up calls too
    assert len(seen) == prefill_reads + decode_reads and set(seen) == {"cpu"}


def test_alternating_times_rotates_order_and_threads_are_restored():
    order = []
    calls = {name: (lambda n=name: order.append(n)) for name in "abc"}
    times = alternating_times(calls, repeats=3, warmup=0)
    assert order == list("abc" "bca" "cab") and all(len(t) == 3 for t in times.wall.values())
    assert set(times.cpu) == set("abc") and all(t >= 0 for t in times.cpu["a"])
    before = torch.get_num_threads()
    with torch_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with pytest.raises(InputError):
        with torch_threads(0):
            pass


def test_self_timed_calls_keep_their_own_seconds_and_rotate_too():
    """A decode step times itself (its prefill untimed): the seconds it returns are what is kept."""
    order = []
    seconds = {"a": (0.5, 0.25), "b": (2.0, 1.0)}
    calls = {name: (lambda n=name: order.append(n) or seconds[n]) for name in "ab"}
    times = alternating_times(calls, repeats=4, warmup=1, self_timed=True)
    assert order == list("ab" "ab" "ba" "ab" "ba")                  # warm-up, then rotated rounds
    assert times.wall == {"a": [0.5] * 4, "b": [2.0] * 4} and times.cpu == {"a": [0.25] * 4, "b": [1.0] * 4}
    assert times.ratio_spread("b", "a") == {"min": 4.0, "median": 4.0, "max": 4.0, "rounds": 4}


def test_paired_ratio_and_saving_ratio_by_hand():
    t = Timings(wall={"m": [2.0, 4.0, 3.0], "p": [1.0, 4.0, 2.0]}, cpu={"m": [1.0], "p": [1.0]})
    assert t.paired_ratio("m", "p") == 1.5                    # ratios 2.0, 1.0, 1.5
    assert t.median_ms()["m"] == 3000.0
    assert saving_ratio(1.25, 1.25) == pytest.approx(1.0)     # as predicted
    assert saving_ratio(1.0, 2.0) == 0.0                      # no saving at all
    assert saving_ratio(4 / 3, 2.0) == pytest.approx(0.5)     # 25% saved of a predicted 50%


@pytest.mark.parametrize("kv_policy", ["auto", "expand"])
def test_report_prediction_equals_what_it_measured(kv_policy):
    # qwen2 (Q/K/V biases), G = 3: layer 0 keeps 2 + 3 (uneven -> K/V copied), layer 1 loses group 1
    model = tiny_model("qwen2", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    pruned = np.zeros((2, 6), bool)
    pruned[0, 0] = True
    pruned[1, 3:] = True
    report = measure(model, Cut.of_mask(pruned), kv_policy=kv_policy, prefill=(16,), decode_context=16,
                     decode_steps=1, repeats=1, warmup=0, threads=1)
    p = report.predicted
    assert p["kv_policy"] == kv_policy and p["seq_len"] == 16
    assert report.parameters["dense"] - report.parameters["pruned"] == p["params_removed"]
    assert p["params_removed"] < 0 if kv_policy == "expand" else True     # expanding everywhere grows it here
    flops = report.attention_flops["prefill@16"]
    assert flops["dense"] - flops["pruned"] == p["attention_flops_removed"]
    assert report.kv_bytes["pruned"] / report.kv_bytes["dense"] == pytest.approx(p["kv_cache_ratio"])
    file_change = report.file_bytes["pruned"] - report.file_bytes["dense"]
    assert abs(file_change - p["checkpoint_bytes_change"]) < 1024           # the safetensors header aside


def test_ratio_spread_is_taken_per_round_not_from_two_medians():
    # made-up seconds: round 2 ran under load for both sides alike; per round int8 is 2x, 2x, 4x faster
    wall = {"fp32": [2.0, 20.0, 4.0], "int8": [1.0, 10.0, 1.0]}
    spread = Timings(wall, wall).ratio_spread("fp32", "int8")
    assert spread == {"min": 2.0, "median": 2.0, "max": 4.0, "rounds": 3}
    # the ratio of the two medians (4.0 / 1.0) is what this replaces: it mixes rounds
    assert Timings(wall, wall).median_ms()["fp32"] / Timings(wall, wall).median_ms()["int8"] == 4.0
