"""One set of cut options for every report command (analysis/cli/common.py: add_cut_arguments, cut_from;
issue 47): each of evaluate, probes, longctx and harness takes --sparsity, --mask-file, --kv-plan and
--export, refuses two at once in the same words, and never drops a plan: an export folder's kv_plan.json is
applied (the same numbers as --kv-plan on the model), or refused with the reason when it cannot be read (a
broken link, another export's plan). Nothing is written on a refusal.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from analysis import cli
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan
from analysis.arch.window import Window
from tests._input_checks import only_error_line

TASKS = Path(__file__).resolve().parent / "data" / "harness"
# each report command with the options it needs besides the cut (fast settings)
COMMANDS = {
    "evaluate": ("--max-tokens", "64"),
    "probes": ("--probe", "copying", "--items", "8"),
    "longctx": ("--probe", "passkey", "--lengths", "96", "--items", "2"),
    "harness": ("--tasks", "tiny_mc", "--task-dir", str(TASKS), "--limit", "4"),
}
CUTS = {"--sparsity": "0.25", "--mask-file": "MASK", "--kv-plan": "PLAN", "--export": "FOLDER"}


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2):
    """A tiny Llama with SmolLM2's tokenizer (2 layers x 4 heads, 2 KV heads), its plan, and exports of it: one
    written with the plan, one whose kv_plan.json is a broken link, one with another export's plan."""
    from analysis.arch.models import load_model
    from analysis.compress.export import export_to
    from tests._tiny import tiny_model
    root = tmp_path_factory.mktemp("cut-cli")
    model = root / "tiny"
    tiny_model("llama", vocab_size=len(smollm2.tokenizer), max_position_embeddings=512).save_pretrained(model)
    smollm2.tokenizer.save_pretrained(model)
    lm = load_model(str(model))
    plan = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW]]), Window(2, 24), n_heads=lm.geometry.n_heads)
    (root / "plan.json").write_text(plan.to_json())
    export_to("zeroed", lm.model, None, root / "planned", kv_plan=plan, tokenizer=lm.tokenizer)
    export_to("pruned", lm.model, None, root / "broken", kv_plan=plan, tokenizer=lm.tokenizer)
    (root / "broken" / "kv_plan.json").unlink()
    os.symlink(root / "no-such-plan.json", root / "broken" / "kv_plan.json")
    other = KVPlan(np.array([[FULL, PRUNE], [PRUNE, FULL]]), n_heads=lm.geometry.n_heads)
    export_to("pruned", lm.model, None, root / "foreign", kv_plan=plan, tokenizer=lm.tokenizer)
    (root / "foreign" / "kv_plan.json").write_text(other.to_json())
    return dict(model=model, plan=root / "plan.json", planned=root / "planned", broken=root / "broken",
                foreign=root / "foreign", mask=root / "planned" / "mask.json")


def _value(folders, value: str) -> str:
    return str({"MASK": folders["mask"], "PLAN": folders["plan"], "FOLDER": folders["planned"]}.get(value, value))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("pair", [("--sparsity", "--kv-plan"), ("--mask-file", "--export"), ("--kv-plan", "--export")])
def test_two_cuts_are_refused_in_every_command(folders, capsys, tmp_path, command, pair):
    out = tmp_path / "out.json"
    argv = [command, "--model", folders["model"], *COMMANDS[command], "--quiet", "--out", out]
    for flag in pair:
        argv += [flag, _value(folders, CUTS[flag])]
    code, stdout, err = _run(capsys, *argv)
    line = only_error_line(err)
    assert code == 2 and stdout == "" and not out.exists()
    assert f"Give one cut (--sparsity, --mask-file, --kv-plan or --export), not {pair[0]} and {pair[1]}." in line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("folder,words", [("broken", "kv_plan.json"), ("foreign", "another export's plan")])
def test_a_plan_that_cannot_be_read_is_refused_never_dropped(folders, capsys, tmp_path, command, folder, words):
    out = tmp_path / "out.json"
    code, stdout, err = _run(capsys, command, "--model", folders["model"], *COMMANDS[command], "--export",
                             folders[folder], "--quiet", "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert words in only_error_line(err)


@pytest.mark.parametrize("command", ["evaluate", "probes"])
def test_an_export_runs_under_its_plan_like_the_plan_on_the_model(folders, capsys, command):
    """The zeroed export written with the plan, read back with it, computes what the plan computes on the model
    (float32 on both sides: the bound is float32's, for a 2-layer model of logits ~ 1)."""
    runs = {}
    for flag in ("--kv-plan", "--export"):
        code, stdout, err = _run(capsys, command, "--model", folders["model"], *COMMANDS[command], "--quiet",
                                 flag, _value(folders, CUTS[flag]))
        assert code == 0, err
        runs[flag] = json.loads(stdout)
    plan, export = runs["--kv-plan"], runs["--export"]
    if command == "evaluate":
        assert plan["cut"]["kind"] == "plan" and export["cut"]["kind"] == "model"
        assert export["cut"]["kv_plan"] == plan["cut"]["kv_plan"] == {"full": 1, "window": 2, "prune": 1}
        assert abs(plan["masked"] - export["masked"]) <= 1e-4 * plan["masked"]
        assert abs(plan["masked"] - plan["dense"]) > 1e-3 * plan["dense"]          # the plan changes something
    else:
        assert export["cut"]["kind"] == "model" and export["cut"]["kv_plan"]["window"] == 2
        assert len(plan["cut"]["probes"]) == len(export["cut"]["probes"]) == 1
        for a, b in zip(plan["cut"]["probes"], export["cut"]["probes"]):
            assert abs(a["cut_logit_diff"] - b["cut_logit_diff"]) <= 1e-3
