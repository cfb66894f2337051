"""bench/bench_kv_policies.py on a tiny model (a seconds-long run of the function, not the benchmark): the
default plans (cut, duo, mix) have the counts the bench says, every context gives dense + each plan with the
measured KV bytes equal to the plan's, the markdown section carries its markers,
and a given plan of another model is one line. The measure itself: analysis.compress.timing.measure_kv."""
import numpy as np
import pytest

from analysis.arch.adapters import adapter_for
from analysis.arch.kvplan import KVPlan
from analysis.arch.models import LoadedModel
from analysis.compress.timing import measure_kv
from analysis.compress.recover.report import KV_POLICIES_MARKERS
from analysis.arch.window import Window
from analysis.core.errors import InputError
from bench import bench_kv_policies as bench
from tests._tiny import tiny_model


def _loaded():
    model = tiny_model("llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=256)
    model.set_attn_implementation("sdpa")
    a = adapter_for(model)
    return LoadedModel(model, None, "tiny-llama", "causal-lm", a, a.geometry(model), "in-process")


def test_a_tiny_quick_run_gives_every_row_with_its_bytes(tmp_path):
    loaded = _loaded()
    g = loaded.geometry
    plans = bench.default_plans(loaded, cut=0.5, window_share=0.5, prune_share=0.25, window=Window(2, 8))
    assert plans["cut"].counts() == {"full": 8, "window": 0, "prune": 8}
    assert plans["duo"].counts() == {"full": 8, "window": 8, "prune": 0}
    assert plans["mix"].counts() == {"full": 4, "window": 8, "prune": 4}
    assert plans["duo"].windowed[:, 0].all() and plans["duo"].windowed[:, 1].all()  # the fixed order: head 0, then 1
    assert all(plan.window == Window(2, 8) for plan in plans.values())
    out = bench.run(loaded, plans, [40], rounds=1, decode_steps=2, warmup=0, threads=1, log=lambda s: None)
    rows = out["contexts"][0]["rows"]
    assert [r["name"] for r in rows] == ["dense", "cut", "duo", "mix"]
    for r in rows:
        plan = plans.get(r["name"]) or KVPlan.full(g)
        assert r["kv_bytes"] == r["kv_bytes_predicted"] == plan.kv_bytes(40, head_dim=g.head_dim, dtype_bytes=4)
    out.update(args=dict(threads=1, rounds=1, decode_steps=2), model="tiny", load=(0.0,), when="2026-01-01T00:00",
               command="test")
    text = bench.markdown(out)
    assert text.startswith(KV_POLICIES_MARKERS[0]) and text.rstrip().endswith(KV_POLICIES_MARKERS[1])
    assert text.count("| 40 |") == 4 and "fixed order" in text
    assert "KV cache <= 0.5x of dense at 40 tokens: cut (0.500x)" in text


def test_given_plans_and_bad_input_are_one_line(tmp_path):
    loaded = _loaded()
    g = loaded.geometry
    good = tmp_path / "kv_plan.json"
    good.write_text(KVPlan.full(g, window=Window(1, 4)).to_json())
    assert list(bench.given_plans([f"mine={good}"], g)) == ["mine"]
    other = tmp_path / "other.json"
    other.write_text(KVPlan(np.zeros((3, 2), np.int8), n_heads=4).to_json())
    with pytest.raises(InputError, match="make the plan for this model"):
        bench.given_plans([f"x={other}"], g)
    with pytest.raises(InputError, match="NAME=kv_plan.json"):
        bench.given_plans(["no-file"], g)
    with pytest.raises(InputError, match="longer than this model reads"):
        measure_kv(loaded, {}, context=256)
    with pytest.raises(InputError, match="dense"):
        measure_kv(loaded, {"dense": KVPlan.full(g)}, context=16, decode_steps=1, repeats=1, warmup=0)

