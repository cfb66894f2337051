"""The compression report (analysis/compress/recover/report.py): every stage measured, ratios to dense, the
one-shot curve equals the first iterative round (same mask from the same dense scores), files
written atomically (JSON, markdown, PNG)."""
import json

import pytest
import torch

from analysis.compress.recover.distill import DistillConfig
from analysis.compress.export import ExportError
from analysis.compress.recover.pipeline import PipelineConfig
from analysis.compress.recover.report import REPORT_FILES, compression_report, write_report
from analysis.core.threads import torch_threads
from tests._evalkit import tiny_loaded
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

IDS = torch.randint(10, 1000, (4, 16), generator=torch.Generator().manual_seed(0))   # [4, 16]


@pytest.fixture(scope="module")
def built(smollm2, tmp_path_factory):
    loaded = tiny_loaded("llama", smollm2.tokenizer, "causal-lm", num_hidden_layers=4)
    cfg = PipelineConfig(target_sparsity=0.5, step=0.25, recovery_steps=2, eval_tokens=64,
                         distill=DistillConfig(lr=1e-3, batch_size=2, seq_len=16))
    with torch_threads(1):
        rep, result = compression_report(loaded, cfg, train_data=IDS, repeats=1, seq_len=16,
                                         workdir=tmp_path_factory.mktemp("work"))
    return loaded, rep, result


def test_stages_and_ratios(built):
    loaded, rep, result = built
    names = [s.name for s in rep.stages]
    assert names == ["dense", "round 1 cut", "round 1 recovered", "round 2 cut", "round 2 recovered", "final",
                     "final (ONNX fp32)", "INT8 weight-only (ONNX)", "INT8 integer (ONNX dynamic)",
                     "INT8 Q8_0 (llama.cpp GGUF)", "INT8 integer (PyTorch dynamic)"]
    dense, final = rep.stages[0], rep.stages[names.index("final")]
    assert all(v == pytest.approx(1.0) for v in dense.ratios.values())
    assert final.parameters < dense.parameters and final.attention_flops < dense.attention_flops
    assert final.ratios["parameters"] == pytest.approx(final.parameters / dense.parameters)
    assert final.metric == result.final_metric and final.sparsity == 0.5
    assert rep.stages[1].metric == result.rounds[0].metric_cut
    for method in ("weight-only", "dynamic"):
        assert rep.int8[method]["bytes_int8"] < rep.int8[method]["bytes_fp32"]
    assert rep.stages[names.index("INT8 weight-only (ONNX)")].metric == rep.int8["weight-only"]["perplexity_int8"]
    assert rep.stages[-1].metric == rep.int8["torch"]["metric_int8"]
    assert "lm_head" in rep.int8["keep_float"]                           # the LM head stays float
    # llama.cpp's INT8 route: Q8_0 against the F32 GGUF of the same model, in llama.cpp, timed in pairs
    gguf = rep.int8["gguf"]
    assert gguf["bytes_int8"] < 0.5 * gguf["bytes_fp32"] and gguf["floor"]["passed"]
    assert gguf["speedups"]["decode"]["rounds"] >= 3
    assert rep.stages[names.index("INT8 Q8_0 (llama.cpp GGUF)")].metric == gguf["perplexity_int8"]
    assert set(rep.int8["recommended"]["routes"]) == {"ONNX dynamic", "ONNX weight-only", "PyTorch dynamic",
                                                      "llama.cpp Q8_0"}
    # every stage: parameters, size, KV bytes and top-1 next to the metric; the KV bytes are surgery's
    from analysis.score.masks import surgery_counts
    g = loaded.geometry
    counts = surgery_counts(result.pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden)
    assert final.kv_bytes_per_token == counts.kv_cache_bytes_per_token_after
    assert dense.kv_bytes_per_token == counts.kv_cache_bytes_per_token
    assert all(s.top1 is not None and s.kv_bytes_per_token for s in rep.stages)
    assert rep.config["policy"] == "groups"                                # the GQA default
    assert final.ratios["kv_bytes_per_token"] < 1 and not rep.warnings     # groups: smaller, no warning
    # every stage names its input; a cut has its recovered model's shapes, timed once and marked so
    made_from = {s.name: s.made_from for s in rep.stages}
    assert made_from["round 1 cut"] == "dense" and made_from["round 1 recovered"] == "round 1 cut"
    assert made_from["round 2 cut"] == "round 1 recovered" and made_from["final"] == "round 2 recovered"
    assert made_from["INT8 weight-only (ONNX)"] == "final (ONNX fp32)" and made_from[names[-1]] == "final"
    timed = {s.name: s.timed_as for s in rep.stages}
    assert timed["round 1 cut"] == "round 1 recovered" and timed["final"] == "round 2 recovered"
    assert timed["round 1 recovered"] is None and timed["dense"] is None


def test_curves_share_the_first_round(built):
    _, rep, result = built
    assert set(rep.curves) == {"one-shot", "iterative", "iterative + recovery"}
    one, it, rec = (rep.curves[k] for k in ("one-shot", "iterative", "iterative + recovery"))
    assert one["sparsity"] == it["sparsity"] == rec["sparsity"] == [0.0, 0.25, 0.5]
    assert one["metric"][0] == it["metric"][0] == rec["metric"][0] == result.dense_metric
    # round 1 of the iterative runs is the one-shot mask at 25% (both ranked on the dense weights)
    assert it["metric"][1] == pytest.approx(one["metric"][1], rel=1e-5)
    assert result.rounds[0].metric_cut == pytest.approx(one["metric"][1], rel=1e-5)
    assert rec["metric"][1:] == [r.metric for r in result.rounds]


def test_files_json_markdown_png(built, tmp_path):
    _, rep, _ = built
    files = write_report(rep, tmp_path / "report")
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == sorted(REPORT_FILES)
    data = json.loads(files["report.json"].read_text())
    assert [s["name"] for s in data["stages"]] == [s.name for s in rep.stages]
    md = files["report.md"].read_text()
    assert "| final |" in md and "perplexity vs sparsity" in md
    assert files["ppl_vs_sparsity.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ExportError, match="already exists"):
        write_report(rep, tmp_path / "report")


def test_growth_warnings_name_the_stage_and_what_grew():
    from analysis.compress.recover.report import Stage, _with_ratios, growth_warnings

    def stage(name, sparsity, parameters, size_mb, kv):
        return Stage(name, sparsity, parameters, size_mb, 1, 1.0, None, 10.0, kv_bytes_per_token=kv)

    stages = _with_ratios([stage("dense", 0.0, 100, 4.0, 80), stage("global", 0.125, 104, 4.1, 130),
                           stage("groups", 0.125, 90, 3.6, 70)])
    warnings = growth_warnings(stages)
    assert len(warnings) == 1 and "'global'" in warnings[0]
    assert all(w in warnings[0] for w in ("parameters", "file size", "KV cache per token"))


def test_int8_lines_print_the_per_round_speedup_with_its_spread():
    from analysis.compress.recover.report import int8_lines
    # made-up numbers: per round the integer route was 1.5x / 2x / 3x faster; the medians of each side
    # alone (100 ms vs 40 ms) would say 2.50x, which is what the per-round median replaces
    spread = {"min": 1.5, "median": 2.0, "max": 3.0, "rounds": 3}
    onnx = {"top1_agreement": 0.9, "perplexity_ratio": 1.02, "size_ratio": 0.3, "latency_ms_fp32": 100.0,
            "latency_ms_int8": 40.0, "one_token_ms_fp32": 10.0, "one_token_ms_int8": 4.0,
            "speedups": {"prefill": spread, "one_token": spread}}
    torch_row = {"top1_agreement": 0.8, "metric_fp32": 10.0, "metric_int8": 11.0, "size_ratio": 0.4,
                 "latency_ms_fp32": 100.0, "latency_ms_int8": 40.0, "decode_ms_fp32": 5.0, "decode_ms_int8": 2.0}
    lines = int8_lines({"keep_float": ["lm_head"], "weight-only": onnx, "dynamic": onnx, "torch": torch_row})
    assert all("2.00x faster (speed-up per round min 1.50 / max 3.00, 3 rounds)" in line for line in lines[1:3]), lines
    assert "2.50x faster (ratio of medians)" in lines[3], lines[3]        # older saved numbers say what they are


def test_int8_recommendation_names_the_route_that_meets_the_bar_or_why_none_does():
    from analysis.compress.recover.report import INT8_BAR, int8_recommendation
    fast = {"min": 1.6, "median": 1.8, "max": 2.0, "rounds": 3}
    slow = {"min": 0.9, "median": 1.1, "max": 1.2, "rounds": 3}
    good = {"top1_agreement": 0.97, "perplexity_ratio": 1.005, "speedups": {"prefill": fast, "decode": fast}}
    onnx = {"top1_agreement": 0.90, "perplexity_ratio": 1.02, "speedups": {"prefill": fast, "one_token": slow}}
    torch_row = {"top1_agreement": 0.96, "metric_fp32": 10.0, "metric_int8": 10.05,
                 "speedups": {"prefill": fast, "decode": slow}}
    rec = int8_recommendation({"dynamic": onnx, "torch": torch_row, "gguf": good})
    assert rec["route"] == "llama.cpp Q8_0" and rec["bar"] == INT8_BAR
    assert rec["routes"]["ONNX dynamic"]["misses"] == ["top-1 agreement 0.900 < 0.95", "perplexity 1.020x > 1.01x",
                                                       "one-token 1.10x < 1.5x"]
    assert rec["routes"]["PyTorch dynamic"]["misses"] == ["decode 1.10x < 1.5x"]
    none = int8_recommendation({"dynamic": onnx, "torch": torch_row})
    assert none["route"] is None and all(r["misses"] for r in none["routes"].values())


def test_int8_lines_say_slower_for_a_slowdown():
    """Issue 33: report.md said "decode 0.35x ... faster" for a decode 2.9x slower."""
    from analysis.compress.recover.report import int8_lines
    slow = {"min": 0.3, "median": 0.35, "max": 0.4, "rounds": 3}
    onnx = {"top1_agreement": 0.129, "perplexity_ratio": 176.0, "size_ratio": 0.3, "latency_ms_fp32": 10.0,
            "latency_ms_int8": 77.0, "one_token_ms_fp32": 1.0, "one_token_ms_int8": 7.7,
            "speedups": {"prefill": slow, "one_token": {**slow, "median": 0.13}},
            "floor": {"agreement": 0.9, "perplexity_ratio": 1.5, "passed": False}}
    torch_row = {"top1_agreement": 0.9, "metric_fp32": 10.0, "metric_int8": 10.1, "size_ratio": 0.4,
                 "latency_ms_fp32": 10.0, "latency_ms_int8": 20.0, "decode_ms_fp32": 1.0, "decode_ms_int8": 2.86}
    lines = int8_lines({"keep_float": [], "weight-only": onnx, "dynamic": onnx, "torch": torch_row})
    assert "prefill 2.86x slower" in lines[1] and "1-token forward 7.69x slower" in lines[1], lines[1]
    assert "BELOW THE INT8 FLOOR" in lines[1]
    assert "prefill 2.00x slower" in lines[3] and "decode 2.86x slower" in lines[3], lines[3]
    assert not any("faster" in line for line in lines), lines


def test_markdown_and_json_mark_a_stage_worse_than_its_input():
    from analysis.compress.recover.report import CompressionReport, Stage, _with_ratios
    from analysis.compress.verdict import worse_than_input

    def stage(name, prefill, decode, metric):
        return Stage(name, 0.25, 100, 4.0, 1, prefill, decode, metric, kv_bytes_per_token=80)

    dense, cut, broken = stage("dense", 10.0, 1.0, 20.0), stage("round 1 cut", 8.0, 1.3, 25.0), stage("INT8", 30.0, None, 3076.0)
    cut.made_from, broken.made_from = "dense", "round 1 cut"
    cut.flags = worse_than_input(times={"prefill": (10.0, 8.0), "decode": (1.0, 1.3)})
    broken.flags = worse_than_input(times={"prefill": (8.0, 30.0)}, floor={
        "passed": False, "agreement": 0.9, "perplexity_ratio": 1.5, "top1_agreement": 0.129, "ratio": 176.0})
    rep = CompressionReport("m", "perplexity", {"policy": "groups"}, _with_ratios([dense, cut, broken]), {}, [])
    md = rep.to_markdown()
    row = next(line for line in md.splitlines() if line.startswith("| round 1 cut |"))
    assert "**WORSE than dense**: decode 1.30x slower" in row and "prefill" not in row.split("WORSE")[1]
    assert "(1.25x faster than dense)" in row and "(1.30x slower than dense)" in row       # every ratio in words
    bad = next(line for line in md.splitlines() if line.startswith("| INT8 |"))
    assert "BROKEN: below the INT8 floor" in bad and "prefill 3.75x slower" in bad
    assert "size MiB" in md and "size MB" not in md                     # the column holds MiB
    data = json.loads(rep.to_json())
    assert data["stages"][0]["flags"] == [] and data["stages"][1]["made_from"] == "dense"
    assert data["stages"][1]["flags"] == ["decode 1.30x slower"]


def test_speed_words():
    from analysis.compress.verdict import is_slower, speed_words
    assert speed_words(2.0) == "2.00x faster" and speed_words(0.5) == "2.00x slower"
    assert speed_words(1.001).startswith("same speed") and speed_words(None) == "n/a"
    assert is_slower(1 / 1.10) and not is_slower(1 / 1.09) and not is_slower(1.5)
