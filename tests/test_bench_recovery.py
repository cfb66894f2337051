"""bench/bench_recovery.py's saved documents (no model is run: the numbers are made up, the logic is
real): a one-run file saved before --update-json becomes run 0, a second run's entries replace the ones
it measured and are tagged with their run, each run's budget is read from its own command, and a run
whose held-out settings differ is refused."""
import copy
import json

import pytest

from bench import bench_recovery as B

RUN1 = "nice -n 10 .venv/bin/python bench/bench_recovery.py --steps 400 --lr 1e-4 --note 'first note'"
RUN2 = ("nice -n 10 .venv/bin/python bench/bench_recovery.py --parts recovery,precision --sparsities 0.125 "
        "--scorers gate --steps 650 --update-json x.json")


def _row(ppl, **extra):
    return {"ppl": ppl, "lo": ppl * 0.9, "hi": ppl * 1.1, "top1": 0.4, "tokens": 16352, "windows": 32,
            "params": 130_000_000, "mb": 500.0, "kv": 40_000, "seconds": 60.0, **extra}


def _cut(one_shot, recovered, steps):
    return {"rows": {"one-shot": _row(one_shot), "recovered": _row(recovered, steps=steps, precision="bf16")},
            "policy": "groups", "n_pruned": 33, "curve": [[100, recovered + 1]], "loss": []}


def _legacy():
    """The shape of docs/data/recovery.json as the one-run bench saved it."""
    return {"machine": "x86_64, 2 torch thread(s)", "command": RUN1, "date": "2026-12-02 02:08 UTC",
            "load_before": [1, 1, 1], "load_after": [2, 2, 2], "wall_s": 5600.0, "finished": True,
            "ran_precision": "bf16", "policy": "groups", "dense": _row(15.2), "dense_size": _row(15.2),
            "recovery": {"0.125": {"mp-g": _cut(25.0, 16.27, 391)}, "0.25": {"mp-g": _cut(54.3, 19.8, 349)}},
            "precision": {"seconds_per_step": {p: {"min": 1, "median": 2, "max": 3} for p in ("fp32", "bf16")},
                          "ratio": 1.37, "bf16_units": True, "steps": 4, "repeats": 4, "ratio_range": [1.3, 1.4],
                          "converged": True, "load": [[1, 1, 1], [1, 1, 1]]}}


def test_a_one_run_file_becomes_run_0_and_renders_its_own_budget():
    doc = B.as_runs(_legacy())
    assert [r["command"] for r in doc["runs"]] == [RUN1] and "command" not in doc
    assert doc["recovery"]["0.125"]["mp-g"]["run"] == 0 and doc["precision"]["run"] == 0
    text = B.markdown(doc, "a later note")
    assert "at most 400 steps" in text and "lr 0.0001" in text            # from the saved command, not defaults
    assert "first note" in text and "a later note" in text
    assert "(run 1)" not in text                                            # one run: no tags
    assert "- 12.5% mp-g: recovered perplexity 1.070x dense" in text and "NOT met" in text


def test_a_second_run_replaces_what_it_measured_and_every_row_names_its_run(tmp_path, monkeypatch):
    saved = tmp_path / "x.json"
    saved.write_text(json.dumps(_legacy()))
    args = B.settings(["--parts", "recovery,precision", "--sparsities", "0.125", "--scorers", "gate",
                       "--steps", "650", "--update-json", str(saved)])
    monkeypatch.setattr(B, "load_average", lambda: (0.5, 0.5, 0.5))
    doc, run = B.start_document(args, RUN2)
    assert run == 1 and len(doc["runs"]) == 2
    doc["recovery"]["0.125"]["gate"] = {**_cut(17.0, 15.9, 650), "run": run}
    doc["precision"] = {**copy.deepcopy(doc["precision"]), "ratio": 1.61, "steady": True, "run": run}
    doc["runs"][run].update(finished=True, wall_s=1500.0, load_after=[1, 1, 1])
    text = B.markdown(json.loads(json.dumps(doc)))
    assert "# run 1, 2026-12-02 02:08 UTC" in text and RUN2 in text
    assert "Run 1: recovery budget" in text and "at most 400 steps" in text
    assert "Run 2: recovery budget" in text and "at most 650 steps" in text
    assert "| MP-G (z = 2.0) (run 1) | recovered |" in text
    assert "| Head gate, abs. gradient (Michel) (run 2) | recovered |" in text
    assert "- 12.5% gate (run 2): recovered perplexity 1.046x dense" in text      # 15.9 / 15.2
    assert "- bf16 recovery steps (run 2) 1.61x fp32" in text and "fused kernel" in text


def test_a_run_on_other_held_out_windows_is_refused(tmp_path):
    saved = tmp_path / "x.json"
    saved.write_text(json.dumps(_legacy()))
    args = B.settings(["--eval-tokens", "4096", "--update-json", str(saved)])
    with pytest.raises(SystemExit, match="eval_tokens"):
        B.start_document(args, "nice -n 10 .venv/bin/python bench/bench_recovery.py --eval-tokens 4096")


def test_a_stopped_run_says_what_it_did_not_reach():
    doc = B.as_runs(_legacy())
    doc["runs"][0]["finished"] = False
    del doc["precision"]
    text = B.markdown(doc)
    assert "Stopped before finishing, not reached: 12.5% gate, 25.0% gate, 50.0% mp-g, 50.0% gate, precision, formats." in text
