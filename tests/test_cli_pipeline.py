"""The `pipeline` CLI command on a tiny local model: report files, exports (INT8 included), JSON
payload; bad input exits 2 with one line."""
import json

import pytest
import torch

from analysis.cli import main
from tests._tiny import tiny_model
from tests._threads import one_torch_thread  # noqa: F401 (autouse)


@pytest.fixture(scope="module")
def tiny_folder(smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", vocab_size=len(smollm2.tokenizer), num_hidden_layers=4)
    model.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


def test_pipeline_command_writes_report_and_exports(tiny_folder, tmp_path, capsys):
    out = tmp_path / "runs"
    code = main(["pipeline", "--model", str(tiny_folder), "--target", "0.5", "--step", "0.25",
                 "--recovery-tokens", "64", "--eval-every", "1", "--train-batch", "2", "--train-seq-len", "16",
                 "--lr", "1e-3",
                 "--eval-tokens", "64", "--formats", "pruned,onnx", "--out-dir", str(out), "--name", "run1",
                 "--quiet"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["n_pruned"] == 8 and payload["policy"] == "groups" and payload["warnings"] == []
    assert all(s["kv_bytes_per_token"] and s["top1"] is not None for s in payload["stages"])
    assert [s["stage"] for s in payload["stages"]][0] == "dense" and payload["stages"][-1]["stage"].startswith("INT8")
    run = out / "run1"
    assert sorted(p.name for p in run.iterdir()) == ["onnx", "onnx-int8", "pruned", "report", "run.json"]
    assert sorted(p.name for p in (run / "report").iterdir()) == ["ppl_vs_sparsity.png", "report.json", "report.md"]
    rounds = json.loads((run / "report" / "report.json").read_text())["rounds"]
    # 64 tokens per round = 2 steps of 2 x 16; the held-out metric after each step (the loss curve)
    assert [[h["step"] for h in r["history"]] for r in rounds] == [[1, 2], [1, 2]]
    assert all(h["heldout"] > 0 for r in rounds for h in r["history"])
    layout = json.loads((run / "pruned" / "head_layout.json").read_text())
    assert sorted({r for row in layout["rounds"] for r in row}) == [0, 1, 2]


def test_pipeline_command_bad_input(tiny_folder, tmp_path, capsys):
    code = main(["pipeline", "--model", str(tiny_folder), "--budget", "1.0", "--eval-tokens", "64",
                 "--out-dir", str(tmp_path), "--name", "x", "--quiet", "--no-int8", "--formats", "pruned"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "dense" in err[-1]
    code = main(["pipeline", "--model", str(tiny_folder), "--formats", "tflite", "--out-dir", str(tmp_path),
                 "--name", "y", "--quiet"])
    assert code == 2 and "Unknown export format" in capsys.readouterr().err
    code = main(["pipeline", "--model", str(tiny_folder), "--out-dir", str(tmp_path), "--name", "../escape",
                 "--quiet"])
    assert code == 2 and "outside the output folder" in capsys.readouterr().err


def test_pipeline_frontier_writes_the_points_the_plot_and_the_verdict(tiny_folder, tmp_path, capsys):
    """--frontier: the dense and the final model as GGUF, run in llama.cpp on the report's held-out tokens
    (F32: no rounding, so no self-check can refuse the random tiny model's files)."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "runs"
    code = main(["pipeline", "--model", str(tiny_folder), "--target", "0.5", "--step", "0.5", "--recovery-tokens",
                 "32", "--train-batch", "2", "--train-seq-len", "16", "--eval-tokens", "64", "--no-int8",
                 "--formats", "pruned", "--frontier", "f32", "--out-dir", str(out), "--name", "run", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    points = json.loads(captured.out)["frontier"]
    assert sorted(points) == ["dense f32", "final f32"]
    assert points["final f32"]["bytes"] < points["dense f32"]["bytes"]
    assert all(p["lo"] <= p["ppl"] <= p["hi"] and p["tokens"] > 0 for p in points.values())
    report = out / "run" / "report"
    assert (report / "frontier.png").stat().st_size > 0
    assert "The frontier in llama.cpp" in (report / "report.md").read_text()
    assert "frontier: final f32:" in captured.err and "the frontier" in captured.err
    code = main(["pipeline", "--model", str(tiny_folder), "--frontier", "q9_9", "--out-dir", str(tmp_path),
                 "--name", "bad", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Unknown GGUF type 'q9_9'" in err and not (tmp_path / "bad").exists()
