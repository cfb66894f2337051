"""RULER offline (analysis.measure.ruler, `headscope ruler`): rows from the harness's own generators with the
SmolLM2 tokenizer at 1,024 tokens, two rows per task (generation runs on a tiny model with that tokenizer).

Oracles: rows are the same for a seed whatever the global RNG held before, different for another seed, and
the global RNG states (random, np.random, cwe_utils.RNG) and every patched attribute are back after; the
harness's RULER modules import without nltk.download and without printing; every row's prompt (as the
harness builds and tokenizes it) plus max_gen_toks fits its length, and the exported context + question ids
are exactly that prompt; the harness's own scoring gives 1 / 0 / the share of references for known
generations; dense vs cut cells follow from the per-row scores (LOST when the cut's CI is below dense's mean);
the refusals are one line, before any row is made, and the command writes nothing then.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import random
import socket
import sys

import numpy as np
import pytest

from analysis.arch.cut import Cut
from analysis.core.errors import InputError
from analysis.measure import harness as H
from analysis.measure import ruler as R
from tests._apptools import tiny_model_dir, trivial_tokenizer
from tests._evalkit import tiny_loaded
from tests._input_checks import one_error_line, run_captured

LENGTH = 1024
SAMPLES = 2


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def first_import():
    """(nltk.download's calls, what was printed, whether prepare_niah was imported anew): the harness's RULER
    modules imported as for the first time (dropped first if this process has them), with nltk's punkt_tab
    missing, nltk.download recording its calls and stdout captured around the import."""
    import nltk
    calls, out = [], io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nltk, "download", lambda *args, **kwargs: calls.append(args))
        mp.setattr(nltk.data, "find", lambda *args, **kwargs: (_ for _ in ()).throw(LookupError("no punkt_tab")))
        package = importlib.import_module("lm_eval.tasks.ruler")
        for name in [m for m in sys.modules if m.startswith("lm_eval.tasks.ruler.")]:
            mp.delitem(sys.modules, name)
            mp.delattr(package, name.rsplit(".", 1)[1], raising=False)
        R._modules.cache_clear()
        with contextlib.redirect_stdout(out):
            mods = R._modules()
        fresh = mods["prepare"] is sys.modules["lm_eval.tasks.ruler.prepare_niah"]
    return calls, out.getvalue(), fresh


@pytest.fixture(scope="module")
def rows(tok, first_import):
    with pytest.MonkeyPatch.context() as mp:                     # nothing may reach the network
        mp.setattr(socket.socket, "connect", lambda *a, **k: pytest.fail("RULER's rows opened a connection"))
        return R.build_ruler("all", tok, [LENGTH], samples=SAMPLES, seed=0)


def _inputs(rows) -> dict:
    return {t: [(d["input"], d["outputs"]) for d in rows.docs[t]] for t in rows.tasks}


def test_rows_are_deterministic_per_seed_and_fit_their_length(rows, tok):
    assert rows.tasks == R.OFFLINE_TASKS and rows.notes == (R.ESSAY_NOTE,)
    random.seed(12345)                                                     # another global state before
    np.random.seed(6789)
    again = R.build_ruler("all", tok, [LENGTH], samples=SAMPLES, seed=0)
    assert _inputs(again) == _inputs(rows)
    other = R.build_ruler("all", tok, [LENGTH], samples=SAMPLES, seed=1)
    mine, theirs = _inputs(rows), _inputs(other)
    assert all(mine[t] != theirs[t] for t in rows.tasks)
    lengths = R.prompt_lengths(rows, tok)
    for task in rows.tasks:
        assert len(rows.docs[task]) == SAMPLES
        for doc_id, prompt, gen_kwargs in rows.contexts(task):
            doc = rows.docs[task][doc_id]
            assert doc["max_length"] == LENGTH and prompt.startswith(doc["input"])
            assert all(ref in doc["input"] for ref in doc["outputs"]) or task in ("ruler_cwe", "ruler_fwe")
            assert lengths[task, doc_id] + H.generation_rules(gen_kwargs, None)[1] <= LENGTH


def test_the_generators_block_restores_the_global_rngs_and_patches():
    mods = R._modules()
    before = random.getstate(), np.random.get_state()[1].copy(), mods["cwe"].RNG.getstate()
    splitter, bar = mods["prepare"].cached_sent_tokenize, mods["vt"].tqdm
    with R.seeded_generators(7):
        first = random.random(), np.random.rand(), mods["cwe"].RNG.random()
        assert mods["prepare"].cached_sent_tokenize is R.sentences
    with R.seeded_generators(7):
        assert (random.random(), np.random.rand(), mods["cwe"].RNG.random()) == first
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert mods["cwe"].RNG.getstate() == before[2]
    assert mods["prepare"].cached_sent_tokenize is splitter and mods["vt"].tqdm is bar


def test_the_ruler_modules_import_without_a_download_or_a_print(first_import):
    calls, printed, fresh = first_import
    assert fresh and calls == [] and printed == ""


def test_the_declarations_are_what_the_harness_own_task_functions_pass(monkeypatch, first_import):
    mods = R._modules()
    calls = []
    monkeypatch.setattr(mods["niah"], "get_tokenizer", lambda *a, **k: "tokenizer")
    monkeypatch.setattr(mods["niah"], "get_haystack", lambda type_haystack: type_haystack)
    monkeypatch.setattr(mods["niah"], "generate_samples", lambda haystack, **kw: calls.append((haystack, kw)) or [])
    for name, spec in R.RULER_TASKS.items():
        if spec.generator == "niah":
            getattr(mods["niah"], name)(max_seq_lengths=[LENGTH], tokenizer="t")
            haystack, kw = calls.pop()
            assert haystack == spec.haystack and kw.pop("num_samples") == R.MAX_SAMPLES
            assert kw.pop("TOKENIZER") == "tokenizer" and kw.pop("max_seq_length") == LENGTH
            assert kw.pop("template") == mods["niah"].TEMPLATE and kw == spec.options, name
    vt = []
    monkeypatch.setattr(mods["vt"], "sys_vartrack_w_noise_random", lambda **kw: vt.append(kw) or [{}])
    mods["vt"].get_dataset("t", seq=LENGTH)
    assert [(k["max_seq_length"], k.get("incremental")) for k in vt] == [(R.VT_ICL_LENGTH, R.VT_ICL_STEP), (LENGTH, None)]
    assert R.GENERATORS["fwe"].reserve == mods["fwe"].CONFIG["tokens_to_generate"]


def test_sentences_split_like_punkt_on_plain_text():
    assert R.sentences("  One two. Three? Four!  Five\n six. ") == ["One two.", "Three?", "Four!", "Five\n six."]


def test_the_harness_scoring_on_known_generations(rows):
    def score(task: str, doc_id: int, text: str) -> float:
        metrics = rows.prepared.tasks[task].process_results(rows.docs[task][doc_id], [text])
        assert set(metrics) == {str(LENGTH)}                               # keyed by the lengths run here
        return metrics[str(LENGTH)]
    answer = rows.docs["niah_single_1"][0]["outputs"][0]
    assert score("niah_single_1", 0, f" {answer}.") == 1.0
    assert score("niah_single_1", 0, " 1234567.") == 0.0
    values = rows.docs["niah_multivalue"][0]["outputs"]
    assert len(values) == 4 and score("niah_multivalue", 0, f"{values[0]}, {values[2]} and more") == 0.5


def test_exported_rows_are_exactly_the_prompts(rows, tok):
    records = R.export_rows(rows, tok)
    assert len(records) == rows.n_rows()
    prompts = {(t, i): (p, k) for t in rows.tasks for i, p, k in rows.contexts(t)}
    for r in records:
        prompt, gen_kwargs = prompts[r["task"], r["doc_id"]]
        doc = rows.docs[r["task"]][r["doc_id"]]
        assert r["context"] + r["question"] == prompt and r["question"].startswith(doc["input"].split("\n")[-1])
        assert r["context_ids"] + r["question_ids"] == H.prompt_ids(tok, prompt)
        assert r["references"] == doc["outputs"] and r["length"] == LENGTH and r["index"] == r["doc_id"]
        assert r["max_new_tokens"] == gen_kwargs["max_gen_toks"] and tok.eos_token in r["until"]
    assert json.loads(R.rows_jsonl(records[:1]))["question_ids"] == records[0]["question_ids"]


def _run(scores: list[float], task_rows: dict, cost: float = 1.0):
    """A HarnessRun as the bridge logs it: every row's metric at its length, its generation costs."""
    samples = {t: [dict(doc_id=i, metrics={str(LENGTH): s}) for i, s in enumerate(scores)] for t in task_rows}
    gens = {t: [dict(doc_id=i, prefill_s=cost, decode_s=cost, tokens_per_s=2.0, new_tokens=3, kv_bytes_prompt=10,
                     kv_bytes_end=12) for i in range(len(scores))] for t in task_rows}
    return H.HarnessRun({}, {}, {}, 0.0, 1, LENGTH, samples, gens)


def test_cells_pair_dense_and_cut_and_flag_a_loss(rows):
    one = R.RulerRows(("niah_single_1", "ruler_vt"), (LENGTH,), 8, 0,
                      {t: [dict(max_length=LENGTH)] * 8 for t in ("niah_single_1", "ruler_vt")}, None, {})
    dense = _run([1.0] * 8, one.docs)
    cells = R.ruler_cells(one, dense, _run([1.0, 0.0] * 4, one.docs))
    by = {c.task: c for c in cells}
    assert set(by) == {"niah_single_1", "ruler_vt", R.AVERAGE}
    c = by["niah_single_1"]
    assert c.dense["score"] == 1.0 and c.cut["score"] == 0.5 and c.change["score"] == -0.5
    assert c.change["low"] <= -0.5 <= c.change["high"] < 0 and c.lost                  # the cut's CI is below 1.0
    assert by[R.AVERAGE].cut["score"] == 0.5 and by[R.AVERAGE].lost
    assert c.dense["prefill_s"] == 1.0 and c.dense["kv_bytes_end"] == 12
    same = R.ruler_cells(one, dense, _run([1.0] * 8, one.docs))
    assert not any(x.lost for x in same) and all(x.change["score"] == 0.0 for x in same)
    assert [x.cut for x in R.ruler_cells(one, dense)] == [None] * 3


def test_a_tiny_model_generates_the_rows_dense_and_cut(rows, smollm2):
    one = R.build_ruler(["niah_single_1"], smollm2.tokenizer, [LENGTH], samples=SAMPLES, seed=0)
    loaded = tiny_loaded("llama", smollm2.tokenizer, "causal-lm", max_position_embeddings=LENGTH)
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[1, 2:] = True
    rep = R.ruler_report(loaded, one, cut=Cut.of_mask(pruned))
    lengths = R.prompt_lengths(one, smollm2.tokenizer)
    for run in (rep.dense, rep.cut_run):
        gens = run.generations["niah_single_1"]
        assert [g["prompt_tokens"] for g in gens] == [lengths["niah_single_1", i] for i in range(SAMPLES)]
        assert all(1 <= g["new_tokens"] <= 128 and g["kv_bytes_prompt"] > 0 for g in gens)
    table = rep.table()
    assert [r["task"] for r in table] == ["niah_single_1", R.AVERAGE]
    assert (rep.cut["kind"], rep.cut["n_pruned"]) == ("mask", 2) and "cut_score" in table[0]
    assert json.dumps(rep.as_dict(), default=float) and "| NIAH single 1" in rep.markdown()


def test_refusals_are_one_line_before_any_row(tok, monkeypatch):
    monkeypatch.setattr(R, "_generate", lambda *a, **k: pytest.fail("a row was made"))
    cases = [(dict(names="ruler_qa_squad"), "a download"), (dict(names="nope"), "No RULER task"),
             (dict(lengths=[16384], limit=8192), "longer than this model reads"),
             (dict(lengths=[1000]), "one of 1024"), (dict(samples=0), "from 1 to 500"),
             (dict(samples=501), "from 1 to 500")]
    for kwargs, words in cases:
        kwargs = dict(dict(names="niah_single_1", lengths=[LENGTH]), **kwargs)
        with pytest.raises(InputError, match=words) as err:
            R.build_ruler(kwargs.pop("names"), tok, kwargs.pop("lengths"), **kwargs)
        assert "\n" not in str(err.value)


def test_a_tokenizer_whose_words_do_not_fit_is_one_line():
    with pytest.raises(InputError, match="does not fit 1024 tokens with this tokenizer") as err:
        R.build_ruler(["ruler_vt"], trivial_tokenizer(), [LENGTH], samples=1)      # one token per character
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2):
    """Tiny Llama folders: one with the character tokenizer (RULER's vt cannot fit 1,024 tokens), one with
    SmolLM2's tokenizer."""
    chars = tiny_model_dir(tmp_path_factory.mktemp("ruler-chars"), num_hidden_layers=2, max_position_embeddings=LENGTH)
    smol = tmp_path_factory.mktemp("ruler-smol")
    loaded = tiny_loaded("llama", smollm2.tokenizer, "causal-lm", max_position_embeddings=LENGTH)
    loaded.model.save_pretrained(smol)
    smollm2.tokenizer.save_pretrained(smol)
    return chars, smol


def test_the_command_refuses_in_one_line_and_writes_nothing(capsys, tmp_path, tiny_dirs):
    out, rows_out = tmp_path / "never.json", tmp_path / "never.jsonl"
    for argv, words in [(["--tasks", "ruler_qa_hotpot"], "a download"), (["--samples", "0"], "--samples"),
                        (["--lengths", "2048", "--model", tiny_dirs[1]], "longer than this model reads"),
                        (["--tasks", "ruler_vt", "--model", tiny_dirs[0]], "does not fit"),
                        (["--rows-only"], "--rows-out")]:
        rows_option = [] if "--rows-only" in argv else ["--rows-out", rows_out]
        code, stdout, err = run_captured(capsys, "ruler", *argv, "--quiet", "--out", out, *rows_option)
        assert code == 2 and stdout == "", (argv, err)
        one_error_line(err, words)
        assert not out.exists() and not rows_out.exists()


def test_the_command_writes_the_rows_and_the_report(capsys, tmp_path, tiny_dirs):
    rows_out = tmp_path / "rows.jsonl"
    code, stdout, err = run_captured(capsys, "ruler", "--model", tiny_dirs[1], "--tasks", "niah_single_1",
                                     "--samples", "1", "--rows-out", rows_out, "--quiet", "--format", "csv")
    assert code == 0, err
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("task,label,length,n,dense_score,dense_low,dense_high")
    assert [line.split(",")[0] for line in lines[1:]] == ["niah_single_1", R.AVERAGE]
    record = json.loads(rows_out.read_text())
    assert record["task"] == "niah_single_1" and len(record["context_ids"]) > 500


def test_the_command_estimates_each_length_with_its_own_prefill_and_decode_step(capsys, tmp_path, tiny_dirs,
                                                                              monkeypatch):
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))      # nothing stored: every side runs
    code, stdout, err = run_captured(capsys, "ruler", "--model", tiny_dirs[1], "--tasks", "niah_single_1",
                                     "--samples", "1", "--format", "json")
    assert code == 0, err
    data = json.loads(stdout)
    assert set(data["per_step_s"]) == set(data["per_row_s"]) and all(s > 0 for s in data["per_step_s"].values())
    assert data["estimate_s"] >= sum(data["per_row_s"].values())          # at most: prefills plus every step
    assert "a decode step" in err and "a prefill" in err                  # the estimate line, per length


def test_the_dense_side_is_kept_on_disk_and_read_back_exactly(capsys, tmp_path, tiny_dirs, monkeypatch):
    """The CLI's second run reads the dense side back (no generation: the store's file is the only source), the
    report number for number; other rows (another seed) are another result; --refresh generates again."""
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))
    argv = ("ruler", "--model", tiny_dirs[1], "--tasks", "niah_single_1", "--samples", "2", "--format", "json")
    code, first, err1 = run_captured(capsys, *argv)
    assert code == 0, err1
    assert "read from the store" not in err1 and list((tmp_path / "results").rglob("*.npz"))
    code, second, err2 = run_captured(capsys, *argv)
    assert code == 0, err2
    assert "read from the store: the dense side" in err2 and "estimate" not in err2
    a, b = json.loads(first)["report"], json.loads(second)["report"]
    assert a == b                       # cells, generations and their measured seconds: read back, not generated
    code, _, err3 = run_captured(capsys, *argv[:-2], "--ruler-seed", "1", "--format", "json")
    assert code == 0 and "read from the store" not in err3              # other rows: measured, not served
    code, _, err4 = run_captured(capsys, *argv, "--refresh")
    assert code == 0 and "read from the store" not in err4



def test_calibration_rows_are_drawn_apart_from_the_test_rows(rows, tok):
    """Issue 52 item 2: the test split is the rows as they always were (a stored dense side stays valid);
    calibration rows come from the other half of the built-in text with other keys, checked apart token for
    token; rows that meet, or the splits the wrong way round, are one line."""
    from analysis.core.text import calibration_text
    cal = R.build_ruler("all", tok, [LENGTH], samples=SAMPLES, seed=0, split="calibration")
    assert rows.split == "test" and cal.split == "calibration" and rows.info()["split"] == "test"
    assert R.rows_settings(cal)["split"] == "calibration" and R.rows_settings(cal)["rows"] != rows.digest
    R.check_apart(cal, rows, tok)
    theirs, mine = _inputs(cal), _inputs(rows)
    for task in rows.tasks:
        assert all(a != b for (a, _), (b, _) in zip(theirs[task], mine[task]))
        assert {tuple(o) for _, o in theirs[task]}.isdisjoint({tuple(o) for _, o in mine[task]})
    essay = cal.docs["niah_single_2"][0]["input"]
    words = [w for w in essay.split() if len(w) > 9 and w.isalpha()][:5]
    assert words and all(w in calibration_text(max_chars=R.ESSAY_CHARS_PER_TOKEN * LENGTH) for w in words)
    for a, b in ((rows, rows), (cal, cal), (rows, cal)):
        with pytest.raises(InputError) as err:
            R.check_apart(a, b, tok)
        assert "\n" not in str(err.value)
    import dataclasses
    same = dataclasses.replace(rows, split="calibration")         # test rows labelled calibration: they meet
    with pytest.raises(InputError, match="overlap"):
        R.check_apart(same, rows, tok)
    with pytest.raises(InputError, match="one split"):
        R.build_ruler(["niah_single_1"], tok, [LENGTH], samples=SAMPLES, split="train")


def test_the_dense_sides_key_covers_every_module_of_the_harness_package():
    """A stored dense side is made by the harness package's code: each of its modules is in the key's digest
    (DENSE_MODULES), and so is each decode loop it generates with, so editing any one of them measures again."""
    from pathlib import Path

    import analysis.measure.harness as harness
    here = Path(harness.__file__).parent
    modules = {"analysis.measure.harness"} | {f"analysis.measure.harness.{p.stem}" for p in here.glob("*.py")
                                                if p.name != "__init__.py"}
    assert modules <= set(R.DENSE_MODULES)
    import re
    decoders = {f"analysis.measure.{m}" for f in here.glob("*.py")             # the decode loops it generates with
                for m in re.findall(r"analysis\.measure\.(decode\w*)", f.read_text())}
    assert decoders and decoders <= set(R.DENSE_MODULES), decoders - set(R.DENSE_MODULES)


def test_a_test_set_makes_only_its_cells_and_each_cell_its_own_rows(tok):
    """cells=: the pairs asked, none other; a cell's rows are the rows it gets when made alone."""
    sparse = R.build_ruler(None, tok, cells=[("niah_single_1", LENGTH), ("niah_single_2", 2048)], samples=1)
    assert sparse.tasks == ("niah_single_1", "niah_single_2") and sparse.lengths == (LENGTH, 2048)
    assert sparse.has("niah_single_1", LENGTH) and not sparse.has("niah_single_1", 2048)
    assert sparse.doc_ids("niah_single_2", LENGTH) == [] and len(sparse.doc_ids("niah_single_2", 2048)) == 1
    alone = R.build_ruler(["niah_single_1"], tok, [LENGTH], samples=1)
    assert _inputs(alone)["niah_single_1"] == _inputs(sparse)["niah_single_1"]
    assert sparse.info()["made"] == ["niah_single_1@1024", "niah_single_2@2048"]
    with pytest.raises(InputError, match="No RULER cells"):
        R.build_ruler(None, tok, cells=[], samples=1)


def test_the_command_keeps_dense_map_and_judges_only_its_test_cells(capsys, tmp_path, tiny_dirs, monkeypatch):
    """--map-out keeps dense's cells; --test-set runs only the map's test cells and refuses, in one line and
    before the model loads, a cell dense does not pass, a map of another model and calibration rows."""
    from analysis.measure.densemap import DenseCell, DenseMap
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))
    model = str(tiny_dirs[1])
    measured = tmp_path / "map.json"
    code, _, err = run_captured(capsys, "ruler", "--model", model, "--tasks", "niah_single_1", "--samples", "1",
                                "--map-out", measured, "--quiet", "--format", "json")
    assert code == 0, err
    kept = DenseMap.read(measured)
    assert list(kept.cells) == [("niah_single_1", LENGTH)] and kept.cells["niah_single_1", LENGTH].n == 1
    passing = DenseMap(model)
    passing.add(DenseCell("niah_single_2", LENGTH, 0.96, 0.88, 1.0, 25))
    passing.add(DenseCell("niah_single_1", LENGTH, 0.40, 0.20, 0.60, 25))
    good = tmp_path / "passing.json"
    good.write_text(json.dumps(passing.as_dict()))
    code, stdout, err = run_captured(capsys, "ruler", "--model", model, "--samples", "1", "--test-set", good,
                                     "--quiet", "--format", "json")
    assert code == 0, err
    cells = {(c["task"], c["length"]) for c in json.loads(stdout)["report"]["cells"]}
    assert cells == {("niah_single_2", LENGTH), (R.AVERAGE, LENGTH)}
    other = DenseMap("another-model")
    other.add(DenseCell("niah_single_2", LENGTH, 0.96, 0.88, 1.0, 25))
    (tmp_path / "other.json").write_text(json.dumps(other.as_dict()))
    out = tmp_path / "never.json"
    for argv, words in [(["--test-set", measured], "no test cell"),
                        (["--test-set", good, "--tasks", "niah_single_1"], "not a test cell"),
                        (["--test-set", good, "--lengths", "2048"], "no test cell"),
                        (["--test-set", tmp_path / "other.json"], "measured on another-model"),
                        (["--test-set", good, "--split", "calibration"], "calibration"),
                        (["--map-out", tmp_path / "other.json"], "dense map of another-model"),
                        (["--map-out", tmp_path / "new.json", "--split", "calibration"], "test rows")]:
        code, stdout, err = run_captured(capsys, "ruler", "--model", model, "--samples", "1", *argv, "--quiet",
                                         "--out", out)
        assert code == 2 and stdout == "", (argv, err)
        one_error_line(err, words)
        assert not out.exists() and not (tmp_path / "new.json").exists()
