"""Headless CLI: score / mask / sweep on a streamed tiny checkpoint and on SmolLM2, JSON and CSV
output equal to the library's numbers, one-line errors with exit status 2, plugin commands."""

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis import cli
from analysis.score.masks import default_policy, plan_mask
from analysis.measure.profiles import profile_model
from analysis.score.scoring import MPGScorer
from tests._tiny import tiny_model
from tests._tolerance import EXACT, max_diff

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", num_hidden_layers=3)
    model.save_pretrained(folder)
    return folder, model


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_score_json_equals_library(checkpoint, capsys):
    folder, model = checkpoint
    code, out, _ = _run(capsys, "score", "--checkpoint", folder, "--scorer", "mp-g", "--z", "1.5", "--quiet")
    assert code == 0
    data = json.loads(out)
    expected = MPGScorer(z=1.5).score(profile_model(model))
    np.testing.assert_allclose(data["scores"], expected.scores, rtol=1e-12)
    assert data["name"] == "mp-g" and data["params"]["z"] == 1.5
    assert data["zero_score_heads"] == expected.zero_count
    assert data["model"]["n_layers"] == 3 and data["model"]["group_size"] == 2


def test_score_csv(checkpoint, capsys, tmp_path):
    folder, model = checkpoint
    target = tmp_path / "scores.csv"
    code, out, _ = _run(capsys, "score", "--checkpoint", folder, "--scorer", "magnitude", "--format", "csv",
                        "--out", target, "--quiet")
    assert code == 0 and out == ""
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    assert len(rows) == 3 * 4 and list(rows[0]) == ["layer", "head", "score"]
    assert {(int(r["layer"]), int(r["head"])) for r in rows} == {(l, h) for l in range(3) for h in range(4)}


def test_mask_matches_plan_mask(checkpoint, capsys):
    folder, model = checkpoint
    scores = MPGScorer(z=1.0).score(profile_model(model))
    for policy in ("global", None):          # None: the default, groups on this GQA model (never grows it)
        extra = ("--policy", policy) if policy else ()
        code, out, _ = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.5", "--z", "1.0", "--quiet",
                            *extra)
        assert code == 0
        data = json.loads(out)
        plan = plan_mask(scores, 0.5, group_size=2, policy=policy or "groups")
        assert data["policy"] == (policy or "groups")
        assert np.array_equal(np.array(data["pruned"], dtype=bool), plan.pruned)
    assert data["summary"]["params_removed"] > 0 and data["summary"]["kv_cache_ratio"] < 1   # groups: smaller
    assert data["summary"]["n_pruned"] == math.floor(0.5 * 12)
    assert data["summary"]["kv_heads_removed"] == int(plan.kv_pruned.sum())


def test_mask_csv_ranks_and_policy(checkpoint, capsys):
    folder, _ = checkpoint
    code, out, _ = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.5", "--policy", "uniform",
                        "--format", "csv", "--quiet")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and sorted(int(r["rank"]) for r in rows) == list(range(12))
    per_layer = [sum(r["pruned"] == "True" for r in rows if int(r["layer"]) == l) for l in range(3)]
    assert per_layer == [2, 2, 2]


@pytest.mark.parametrize("argv,message", [
    (["score", "--scorer", "wanda"], "streams weights only"),
    (["mask", "--sparsity", "1.0"], "every head"),
    (["mask", "--sparsity", "-0.2"], "Sparsity"),
    (["score", "--z", "-1"], "negative"),
    (["score", "--z", "nan"], "finite"),
])
def test_user_errors_are_one_line_and_exit_2(checkpoint, capsys, argv, message):
    folder, _ = checkpoint
    code, out, err = _run(capsys, *argv, "--checkpoint", folder, "--quiet")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_missing_checkpoint_is_a_user_error(capsys, tmp_path):
    code, _, err = _run(capsys, "score", "--checkpoint", tmp_path / "absent", "--quiet")
    assert code == 2 and "checkpoint folder" in err


def test_plugins_can_register_commands(capsys):
    def add(parser):
        parser.add_argument("--word", default="hi")
        parser.add_argument("--format", default="json")

    cli.register("echo-test", "test command", add, lambda ns: ({"word": ns.word}, [{"word": ns.word}]))
    try:
        code, out, _ = _run(capsys, "echo-test", "--word", "yo")
        assert code == 0 and json.loads(out) == {"word": "yo"}
    finally:
        cli.COMMANDS.pop("echo-test")


@pytest.mark.slow
def test_module_entry_point_with_progress_on_stderr(checkpoint):
    folder, _ = checkpoint
    proc = subprocess.run([sys.executable, "-m", "analysis", "score", "--checkpoint", str(folder), "--format",
                           "csv"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "layer,head,score" and len(proc.stdout.splitlines()) == 13
    assert "%" in proc.stderr  # the tqdm bar


@pytest.mark.slow
def test_mask_and_sweep_on_smollm2(capsys, builtin_cache_dir):
    code, out, err = _run(capsys, "mask", "--cache-dir", builtin_cache_dir, "--sparsity", "0.25", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    summary = data["summary"]
    # the default policy on this GQA model is groups: whole KV groups of G = 3 heads, the nearest
    # feasible count to floor(0.25 * 270) = 67 (66 = 22 groups), and the model only shrinks
    assert data["policy"] == "groups" and summary["kv_heads"] == 90
    assert summary["n_pruned"] == 3 * round(math.floor(0.25 * 270) / 3) == 66 and summary["kv_heads_removed"] == 22
    assert summary["params_removed"] > 0 and summary["kv_cache_ratio"] < 1
    assert [w for w in summary["warnings"] if "nearest feasible count, 66" not in w] == []   # no growth warning
    assert data["scorer"] == "mp-g"                      # the default scorer on a GQA model
    assert data["stock"]["ok"] is False and "Nearest sparsities that can" in data["stock"]["message"]
    assert {"sparsity": 1 / 3, "policy": "balanced-uniform", "kv_policy": "auto", "heads": 6,
            "kv_heads": 3} in data["stock"]["nearest"]
    code, out, err = _run(capsys, "sweep", "--cache-dir", builtin_cache_dir, "--sparsity", "0.125",
                          "--z-values", "1.5,2.5", "--max-tokens", "64", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert [r["z"] for r in data["rows"]] == [1.5, 2.5]
    assert data["suggested_z"] in (1.5, 2.5) and data["suggested_evaluation"] > 1
    best = min(data["rows"], key=lambda r: r["calibration"])
    assert best["calibration"] == min(r["calibration"] for r in data["rows"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests._apptools import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-tok"))


def test_evaluate_reports_dense_and_masked_equal_to_the_library(model_dir, capsys):
    from analysis.measure.evaluation import evaluate
    from analysis.arch.models import load_model

    text = "the quick brown fox jumps over the lazy dog. " * 4
    (model_dir.parent / "text.txt").write_text(text)
    code, out, err = _run(capsys, "evaluate", "--model", model_dir, "--sparsity", "0.25", "--max-tokens", "64",
                          "--text-file", model_dir.parent / "text.txt", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    loaded = load_model(str(model_dir))
    G = loaded.geometry.group_size
    plan = plan_mask(MPGScorer().score(profile_model(loaded.model)), 0.25, group_size=G, policy=default_policy(G))
    assert data["policy"] == default_policy(G) == "groups"
    assert data["n_pruned"] == plan.n_pruned == math.floor(0.25 * 16)
    want = evaluate(loaded, text, pruned=plan.pruned, max_tokens=64).value
    dense = evaluate(loaded, text, max_tokens=64).value
    assert data["metric"] == "perplexity"
    assert math.isclose(data["masked"], want, rel_tol=1e-5) and math.isclose(data["dense"], dense, rel_tol=1e-5)
    assert data["masked"] != data["dense"]


def test_evaluate_takes_any_cut_and_needs_one(model_dir, tmp_path, capsys):
    """--kv-plan: the masked number is the library's evaluate under that cut (the same computation on the same
    placement: equal); no cut at all is one line."""
    from analysis.arch.cut import Cut
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.measure.evaluation import evaluate

    text = "the quick brown fox jumps over the lazy dog. " * 4
    (tmp_path / "text.txt").write_text(text)
    loaded = load_model(str(model_dir))
    plan = KVPlan(np.array([[1, 2], [0, 1], [0, 0], [1, 1]]), Window(1, 8), loaded.geometry.n_heads)
    (tmp_path / "kv_plan.json").write_text(plan.to_json())
    argv = ("evaluate", "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--max-tokens", "64",
            "--text-file", tmp_path / "text.txt", "--quiet")                     # load_model's own placement
    code, out, err = _run(capsys, *argv, "--kv-plan", tmp_path / "kv_plan.json")
    assert code == 0, err
    data = json.loads(out)
    assert data["cut"]["kind"] == "plan" and data["cut"]["kv_plan"] == plan.counts()
    assert data["n_pruned"] == int(plan.pruned_heads().sum()) == 2
    assert data["masked"] == evaluate(loaded, text, cut=Cut.of_plan(plan), max_tokens=64).value
    assert data["dense"] == evaluate(loaded, text, max_tokens=64).value and data["masked"] != data["dense"]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "Give the cut to compare with the dense model: --sparsity, --mask-file, --kv-plan or --export." in err


def test_export_writes_a_pruned_model_that_reloads_and_refuses_to_overwrite(model_dir, tmp_path, capsys):
    from analysis.compress.export import load_pruned, read_mask_json

    argv = ("export", "--model", model_dir, "--sparsity", "0.5", "--policy", "uniform", "--out-dir", tmp_path,
            "--name", "half", "--quiet")
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    data = json.loads(out)
    folder = Path(data["path"])
    assert folder == tmp_path / "half" and {"head_layout.json", "mask.json"} <= set(data["files"])
    record = read_mask_json(folder / "mask.json")
    assert record.pruned().sum() == data["n_pruned"] == 8 and record.sparsity == 0.5
    import torch

    from analysis.arch.head_gates import gates_from_mask, head_mask
    from analysis.arch.models import load_model

    original = load_model(str(model_dir)).model.double()      # float64: "equal" holds on every CPU
    smaller = load_pruned(folder).double()
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in original.parameters())
    ids = torch.arange(4, 20)[None]                                    # [1, 16]
    with torch.no_grad(), head_mask(original, gates_from_mask(record.pruned())):
        masked = original(input_ids=ids).logits
    assert max_diff(smaller(input_ids=ids).logits, masked) <= EXACT
    code, out, err = _run(capsys, *argv)
    assert code == 2 and "exist" in err.lower()
    code, out, err = _run(capsys, "export", "--model", model_dir, "--sparsity", "0.5", "--out-dir", tmp_path,
                          "--name", "../escape", "--quiet")
    assert code == 2 and not (tmp_path.parent / "escape").exists()


@pytest.fixture(scope="module")
def mha_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-mha")
    tiny_model("llama", num_key_value_heads=4).save_pretrained(folder)
    return folder


def test_default_scorer_follows_the_model(checkpoint, mha_checkpoint, capsys):
    for folder, want in ((checkpoint[0], "mp-g"), (mha_checkpoint, "mp")):
        code, out, err = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.25", "--quiet")
        assert code == 0, err
        assert json.loads(out)["scorer"] == want
    code, out, _ = _run(capsys, "mask", "--checkpoint", mha_checkpoint, "--scorer", "mp-g", "--sparsity", "0.25",
                        "--quiet")
    assert json.loads(out)["scorer"] == "mp-g"           # an explicit choice is kept


def test_mask_summary_is_what_surgery_builds_for_each_kv_policy(checkpoint, capsys):
    from analysis.arch.models import count_parameters
    from analysis.compress.surgery import prune_heads

    folder, model = checkpoint
    for policy in ("global", "uniform", "balanced", "groups"):
        for kv_policy in ("auto", "expand", "strict"):
            code, out, err = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.25", "--z", "0.5",
                                  "--policy", policy, "--kv-policy", kv_policy, "--quiet")
            if code == 2:                                  # strict refuses an uneven mask, saying what avoids it
                assert kv_policy == "strict" and "'balanced'" in err, err
                continue
            data = json.loads(out)
            pruned = np.array(data["pruned"], dtype=bool)
            smaller, _ = prune_heads(model, pruned, kv_policy=kv_policy)
            summary = data["summary"]
            assert summary["params_removed"] == count_parameters(model) - count_parameters(smaller)
            assert summary["kv_policy"] == kv_policy and data["kv_policy"] == kv_policy
            assert ("warning: K/V are expanded" in err) == bool(summary["expanded_layers"])
            assert set(data["stock"]) == {"ok", "message", "nearest"}


def test_unsatisfiable_policy_lists_the_feasible_sparsities(checkpoint, capsys):
    folder, _ = checkpoint                                 # 3 layers x 4 heads, 2 KV heads: steps of 6
    code, out, err = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.1", "--policy",
                          "balanced-uniform", "--quiet")
    assert code == 2 and out == "" and "Feasible sparsities: 0.5 (6 heads)" in err and "Traceback" not in err
    code, out, err = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.4", "--policy", "balanced",
                          "--quiet")
    assert code == 0 and json.loads(out)["summary"]["n_pruned"] == 4            # k = 4, a multiple of Hkv
    code, out, err = _run(capsys, "mask", "--checkpoint", folder, "--sparsity", "0.3", "--policy", "balanced",
                          "--quiet")
    assert code == 0 and json.loads(out)["summary"]["n_pruned"] == 2 and "nearest feasible count, 2" in err  # 3: a tie


def test_std_option_reaches_the_scorer(checkpoint, capsys):
    folder, model = checkpoint
    for std in ("population", "sample"):
        code, out, err = _run(capsys, "score", "--checkpoint", folder, "--z", "1.0", "--std", std, "--quiet")
        assert code == 0, err
        data = json.loads(out)
        expected = MPGScorer(z=1.0, std=std).score(profile_model(model))
        np.testing.assert_allclose(data["scores"], expected.scores, rtol=1e-12)
        assert data["params"]["std"] == std
    assert not np.allclose(MPGScorer(z=1.0, std="sample").score(profile_model(model)).scores,
                           MPGScorer(z=1.0).score(profile_model(model)).scores)
