"""The lm-evaluation-harness bridge (analysis.measure.harness, `headscope harness`) on the project's own tiny
task folder (tests/data/harness: a multiple-choice task, a perplexity task, BoolQ's layout with 8 items).

Oracles: the dense run's log-likelihood of every request equals headscope's own loss
(analysis.measure.loss.token_nll) on the same tokens, and its acc / acc_norm / perplexities follow from them
(float64 tiny model); the masked cut equals surgery's physically pruned twin (float64); the refusals are
one line, exit status 2, nothing written. SmolLM2 runs a few items (--limit) through the command.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.cut import Cut
from analysis.compress.surgery import prune_heads
from analysis.core.errors import CancelledError, InputError
from analysis.measure import harness as H
from analysis.measure.loss import token_nll
from tests._apptools import datasets_cache, tiny_model_dir, trivial_tokenizer  # noqa: F401 - datasets_cache: autouse
from tests._input_checks import run_captured
from tests._tiny import tiny_model
from tests._tolerance import EXACT

TASKS = Path(__file__).resolve().parent / "data" / "harness"
CONTEXT = 128            # the tiny model's context: every prompt of the test tasks fits
# a cut of the tiny GQA Llama (2 layers x 4 heads, 2 KV groups): layer 1 loses KV group 1 whole
PRUNED = np.array([[True, False, False, False], [False, False, True, True]])


@pytest.fixture(scope="module")
def tiny64():
    return tiny_model("llama", dtype=torch.float64, max_position_embeddings=CONTEXT), trivial_tokenizer()


@pytest.fixture(scope="module")
def prepared(datasets_cache):
    return H.prepare_tasks("tiny_mc,tiny_ppl,boolq", TASKS)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-harness"), max_position_embeddings=CONTEXT)


def _direct_ll(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context) with headscope's loss: the tokens the harness scores (the whole
    string's tokens after the context's), one forward of all but the last token."""
    ctx = tok(context).input_ids
    whole = tok(context + continuation).input_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole[:-1]])).logits[0]             # [T-1, V]
    return -float(token_nll(logits[len(ctx) - 1:], torch.tensor(whole[len(ctx):])).sum())


def _direct_rolling(model, tok, text: str) -> float:
    """log p(text) scored from the prefix token (BOS, else EOS), as the harness's perplexity tasks do."""
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    ids = [prefix] + tok(text).input_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]                # [T-1, V]
    return -float(token_nll(logits, torch.tensor(ids[1:])).sum())


def test_tasks_come_from_the_folder_and_the_standard_configs(prepared):
    src = prepared.sources
    assert Path(src["tiny_mc"].config) == TASKS / "mc.yaml" and src["tiny_mc"].data == str(TASKS / "mc.jsonl")
    assert src["boolq"].config.endswith("super_glue/boolq/default.yaml")        # the harness's own BoolQ config
    assert src["boolq"].data == str(TASKS / "boolq" / "validation.jsonl")
    assert {n: s.n_docs for n, s in src.items()} == {"tiny_mc": 12, "tiny_ppl": 6, "boolq": 8}
    assert src["tiny_ppl"].output_type == "loglikelihood_rolling"
    assert H.known_tasks(TASKS)[:2] == ["tiny_mc", "tiny_ppl"] and "piqa" in H.known_tasks(TASKS)


def test_relative_data_paths_are_read_from_the_config_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)                   # the harness alone would look for mc.jsonl here
    assert H.prepare_tasks(["tiny_mc"], TASKS, limit=3).n_docs("tiny_mc") == 3


def test_dense_run_equals_headscope_loss(tiny64, prepared):
    model, tok = tiny64
    run = H.run_harness(model, tok, prepared, batch_size=1, keep_samples=True)
    worst = 0.0
    for task in ("tiny_mc", "boolq"):
        acc, acc_norm = [], []
        docs = list(prepared.tasks[task].eval_docs)
        for sample in run.samples[task]:
            direct = [_direct_ll(model, tok, ctx, cont) for ctx, cont in sample["arguments"]]
            worst = max(worst, max(abs(a - b) for a, b in zip(direct, sample["loglikelihoods"])))
            doc = docs[sample["doc_id"]]
            lengths = [len(cont.lstrip(" ")) for _, cont in sample["arguments"]]
            gold = doc["label"]
            acc.append(float(np.argmax(direct) == gold))
            acc_norm.append(float(np.argmax(np.array(direct) / lengths) == gold))
        assert run.metrics[task]["acc"][0] == pytest.approx(np.mean(acc), abs=EXACT)
        n = len(acc)
        assert run.metrics[task]["acc"][1] == pytest.approx(np.std(acc, ddof=1) / math.sqrt(n), abs=EXACT)
        if task == "tiny_mc":
            assert run.metrics[task]["acc_norm"][0] == pytest.approx(np.mean(acc_norm), abs=EXACT)
    assert worst <= EXACT
    texts = [d["text"] for d in prepared.tasks["tiny_ppl"].eval_docs]
    ll = sum(_direct_rolling(model, tok, t) for t in texts)
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    nbytes = sum(len(t.encode()) for t in texts)
    ppl = run.metrics["tiny_ppl"]
    assert ppl["word_perplexity"][0] == pytest.approx(math.exp(-ll / words), rel=EXACT)
    assert ppl["byte_perplexity"][0] == pytest.approx(math.exp(-ll / nbytes), rel=EXACT)
    assert ppl["bits_per_byte"][0] == pytest.approx(-ll / nbytes / math.log(2), rel=EXACT)
    assert ppl["word_perplexity"][1] is None                   # the harness gives no stderr for it
    assert run.n_samples == {"tiny_mc": 12, "tiny_ppl": 6, "boolq": 8}
    assert run.max_length == CONTEXT


def test_masked_equals_surgery_and_the_dense_model_is_untouched(tiny64, prepared):
    model, tok = tiny64
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = []
    masked = H.run_harness(model, tok, prepared, cut=Cut.of_mask(PRUNED), batch_size=4, keep_samples=True,
                           progress=lambda f, m: steps.append(f))
    twin, _ = prune_heads(model, PRUNED)
    pruned = H.run_harness(twin, tok, prepared, batch_size=4, keep_samples=True)
    dense = H.run_harness(model, tok, prepared, batch_size=4, keep_samples=True)
    diffs, moved = [], []
    for task, samples in masked.samples.items():
        for a, b, d in zip(samples, pruned.samples[task], dense.samples[task]):
            diffs += [abs(x - y) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"])]
            moved += [abs(x - y) for x, y in zip(a["loglikelihoods"], d["loglikelihoods"])]
    assert max(diffs) <= EXACT and max(moved) > 1e-3            # the cut is the twin, and it changes the model
    for task, metrics in masked.metrics.items():
        for metric, (value, stderr) in metrics.items():
            assert pruned.metrics[task][metric][0] == pytest.approx(value, rel=EXACT)
    assert steps == sorted(steps) and steps[-1] == 1.0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and "tie_weights" not in vars(model)
    assert all(not m._forward_pre_hooks for m in model.modules())           # the gates are gone
    assert tok.pad_token is None                                              # the harness padded its own copy


def test_report_rows_and_stop(tiny64, prepared):
    model, tok = tiny64

    class Loaded:                                 # what harness_report reads of a LoadedModel
        kind, name, tokenizer, adapter = "causal-lm", "tiny", tok, None
    Loaded.model, Loaded.geometry = model, adapter_for(model).geometry(model)
    rep = H.harness_report(Loaded, prepared, cut=Cut.of_mask(PRUNED), batch_size=4)
    rows = rep.rows()
    assert [(r["task"], r["metric"]) for r in rows][:2] == [("tiny_mc", "acc"), ("tiny_mc", "acc_norm")]
    assert all(r["change"] == pytest.approx(r["cut"] - r["dense"]) for r in rows)
    assert json.dumps(rep.as_dict())                               # plain JSON
    with pytest.raises(CancelledError):
        H.run_harness(model, tok, prepared, cut=Cut.of_mask(PRUNED), should_stop=lambda: True)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_oversized_perplexity_batch_is_refused_before_it_runs(tiny64, prepared, monkeypatch):
    model, tok = tiny64
    from analysis.measure.harness import lm
    monkeypatch.setattr(lm, "MEMORY_SHARE", 1e-12)                # as if the machine had no memory free
    steps = []
    with pytest.raises(InputError, match=r"windows of up to 51 tokens, 6 at a time.*--harness-batch-size"):
        H.run_harness(model, tok, prepared, batch_size=64, progress=lambda f, m: steps.append(f))
    assert steps == []                                            # refused before the first forward


def test_work_estimate_counts_the_request_tokens(prepared):
    tok = trivial_tokenizer()
    chars = sum(len(d["text"]) for d in prepared.tasks["tiny_ppl"].eval_docs)
    assert H.request_tokens(prepared, tok) > chars
    assert H.request_tokens(H.prepare_tasks("tiny_ppl", TASKS), tok) == chars   # one token per character


@pytest.mark.parametrize("yaml, data, words", [
    ("task: gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: d.jsonl\noutput_type: generate_until\n"
     "test_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ngeneration_kwargs:\n  do_sample: true\n"
     "  temperature: 0.7\n", True, "samples its generations"),
    ("task: gone\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: missing.jsonl\n"
     "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\n"
     "doc_to_choice: ['a', 'b']\n", False, "missing.jsonl, which is not there"),
])
def test_bad_folder_tasks_are_one_line(tmp_path, yaml, data, words):
    (tmp_path / "t.yaml").write_text(yaml)
    if data:
        (tmp_path / "d.jsonl").write_text('{"q": "a?", "a": "b"}\n')
    name = re.search(r"task: (\w+)", yaml).group(1)
    with pytest.raises(InputError, match=words) as err:
        H.prepare_tasks(name, tmp_path)
    assert "\n" not in str(err.value)


def test_cli_dense_vs_cut_json_and_csv(tiny_dir, capsys, tmp_path):
    out = tmp_path / "h.json"
    code, _, err = run_captured(capsys, "harness", "--model", tiny_dir, "--tasks", "tiny_mc,tiny_ppl", "--task-dir", TASKS,
                        "--sparsity", "0.25", "--quiet", "--out", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["harness"] == H.HARNESS_VERSION and data["cut"]["n_pruned"] == 4
    assert {r["task"] for r in data["rows"]} == {"tiny_mc", "tiny_ppl"}
    assert data["tasks"]["tiny_mc"]["n_docs"] == 12 and data["max_length"] == CONTEXT
    code, csv_text, err = run_captured(capsys, "harness", "--model", tiny_dir, "--tasks", "tiny_mc", "--task-dir", TASKS,
                               "--mask-file", tmp_path / "none.json", "--quiet")
    assert code == 2 and err.count("\n") == 1                       # a missing mask file: one line
    code, csv_text, err = run_captured(capsys, "harness", "--model", tiny_dir, "--tasks", "tiny_mc", "--task-dir", TASKS,
                               "--sparsity", "0.25", "--physical", "--limit", "5", "--format", "csv", "--quiet")
    assert code == 0, err
    lines = csv_text.strip().splitlines()
    assert lines[0] == "task,metric,n,dense,dense_stderr,cut,cut_stderr,change,worse,higher_is_better"
    assert [line.split(",")[:3] for line in lines[1:]] == [["tiny_mc", "acc", "5"], ["tiny_mc", "acc_norm", "5"]]


def _refused(capsys, tmp_path, *argv) -> str:
    out = tmp_path / "never.json"
    code, stdout, err = run_captured(capsys, "harness", *argv, "--quiet", "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_cli_refusals_are_one_line_and_write_nothing(capsys, tmp_path, monkeypatch):
    err = _refused(capsys, tmp_path, "--tasks", "nope", "--task-dir", TASKS)
    assert "tiny_mc, tiny_ppl" in err                                    # the tasks the folder has
    err = _refused(capsys, tmp_path, "--tasks", "piqa", "--task-dir", TASKS)
    assert str(TASKS / "piqa" / "validation.jsonl") in err and "goal, sol1, sol2" in err
    err = _refused(capsys, tmp_path, "--tasks", "boolq", "--task-dir", tmp_path / "no-such-folder")
    assert "is not a folder" in err
    err = _refused(capsys, tmp_path, "--tasks", "tiny_mc", "--task-dir", TASKS, "--export", tmp_path, "--physical")
    assert "--physical runs surgery's physically pruned copy of a mask or a KV plan" in err
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)                     # the harness "not installed"
    err = _refused(capsys, tmp_path, "--tasks", "boolq", "--task-dir", TASKS)
    assert f"pip install {H.HARNESS_REQUIREMENT}" in err


def test_smollm2_runs_a_few_items(capsys, builtin_cache_dir):
    code, out, err = run_captured(capsys, "harness", "--cache-dir", builtin_cache_dir, "--tasks", "boolq,tiny_mc",
                          "--task-dir", TASKS, "--limit", "4", "--sparsity", "0.3", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["limit"] == 4 and {t["n_docs"] for t in data["tasks"].values()} == {4}
    for row in data["rows"]:
        assert 0.0 <= row["dense"] <= 1.0 and 0.0 <= row["cut"] <= 1.0 and row["dense_stderr"] is not None
    assert data["max_length"] == 8192                       # the harness reads SmolLM2's context


# Two records per standard task in the fields docs/HARNESS.md (and STANDARD_TASKS) name, made up here: every
# standard config must build from them and run (what a user's files are checked against).
STANDARD_RECORDS = {
    "piqa": [{"goal": "Dry a wet cup", "sol1": "use a towel", "sol2": "use a hose", "label": 0}] * 2,
    "hellaswag": [{"activity_label": "Cooking", "ctx_a": "A man cuts bread.", "ctx_b": "he",
                   "endings": ["eats it.", "flies.", "sings.", "swims."], "label": "0"}] * 2,
    "winogrande": [{"sentence": "The jar broke because _ was thin.", "option1": "the jar", "option2": "the shelf",
                    "answer": "1"}] * 2,
    "arc_easy": [{"question": "What melts ice?", "choices": {"text": ["heat", "cold"], "label": ["A", "B"]},
                  "answerKey": "A"}] * 2,
    "arc_challenge": [{"question": "What is H2O?", "choices": {"text": ["salt", "water", "air"],
                                                               "label": ["1", "2", "3"]}, "answerKey": "2"}] * 2,
    "openbookqa": [{"question_stem": "Plants need", "choices": {"text": ["light", "rocks"], "label": ["A", "B"]},
                    "answerKey": "A"}] * 2,
    "wikitext": [{"page": " = Mill = \n The mill @-@ house stood by the river . \n"}] * 2,
}


def test_every_standard_task_runs_from_its_documented_fields(tiny64, tmp_path):
    model, tok = tiny64
    for name, records in STANDARD_RECORDS.items():
        split = "validation" if name in ("piqa", "hellaswag", "winogrande") else "test"
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        assert name in H.STANDARD_TASKS
    prepared = H.prepare_tasks(list(STANDARD_RECORDS), tmp_path)
    assert {n: s.n_docs for n, s in prepared.sources.items()} == {n: 2 for n in STANDARD_RECORDS}
    run = H.run_harness(model, tok, prepared, batch_size=8)
    for name in STANDARD_RECORDS:
        first = next(iter(run.metrics[name].values()))[0]
        assert first is not None and math.isfinite(first), (name, run.metrics[name])
    assert set(run.metrics["wikitext"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
