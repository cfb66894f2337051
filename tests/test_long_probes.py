"""Long-context probes (analysis.measure.probes.longcontext, analysis.score.longcontext, `python -m analysis
longctx`): items are seeded and every row is exactly the length asked; the key sits at its depth and is read
one digit per item against another digit (the needle's against the distractor's, which is in the context);
the built-in SmolLM2 retrieves the pass key at 512 tokens where a tiny random model does not, and a window
that cannot see the key loses it; a KV plan without windows equals the mask, a window covering the context
equals dense (float64, EXACT); the default probe set keeps them out; bad input is one line, nothing written."""
import csv
import io
import json

import numpy as np
import pytest
import torch

from analysis.arch.cut import Cut
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan
from analysis.arch.window import Window
from analysis.core.errors import CancelledError, InputError
from analysis.measure.haystack import haystack, place, sentence_ends
from analysis.measure.probes import PROBES, applicable, chosen
from analysis.measure.probes.breaks import build_applicable
from analysis.measure.probes.items import Vocabulary
from analysis.measure.probes.longcontext import (ALL, NEEDLE_FACT, PASSKEY_INSTRUCTION, PASSKEY_NEEDLE,
                                                 PASSKEY_QUESTION, build_long, digit_answer, measure_long,
                                                 row_seconds)
from analysis.measure.probes.measure import item_values, run_probes
from analysis.score.longcontext import long_context_report, report_work
from tests._apptools import tiny_dir_for
from tests._input_checks import only_error_line as _one_error_line, run_captured as _run
from tests._evalkit import tiny_loaded
from tests._threads import one_torch_thread  # noqa: F401 (autouse)
from tests._tolerance import EXACT, forward_tolerance

LONG = ("passkey", "passkey-once", "needle", "long-copying")




def _find(row: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(row) - len(needle) + 1) if row[i:i + len(needle)] == needle]


def _sequences(items):
    """[(row ids as a list, condition, correct ids, contrast ids)] per row, items in order."""
    out = {}
    for i in range(items.correct.numel()):
        r = int(items.row[i])
        entry = out.setdefault(r, [items.ids[r, :int(items.lengths[r])].tolist(), items.conditions[i], [], [], []])
        entry[2].append(int(items.correct[i]))
        entry[3].append(int(items.contrast[i]))
        entry[4].append(int(items.position[i]))
    return list(out.values())


@pytest.fixture(scope="module")
def tiny64(smollm2):
    """A tiny random Llama (2 layers, 4 heads, 2 KV heads) with SmolLM2's tokenizer and 1,024 positions, float64."""
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm", max_position_embeddings=1024)
    lm.model.double()
    return lm


# -- items ------------------------------------------------------------------------------------------------

def test_items_are_seeded_and_every_row_is_the_length_asked(smollm2):
    tok = smollm2.tokenizer
    a = build_long(None, tok, "causal-lm", [300, 420], n_items=3)
    b = build_long(None, tok, "causal-lm", [300, 420], n_items=3)
    c = build_long(None, tok, "causal-lm", [300, 420], n_items=3, seed=1)
    assert list(a) == [(n, length) for n in LONG for length in (300, 420)]
    for key, (spec, probe, items) in a.items():
        other = b[key][2]
        assert torch.equal(items.ids, other.ids) and torch.equal(items.correct, other.correct)
        assert torch.equal(items.contrast, other.contrast) and items.conditions == other.conditions
        assert not torch.equal(items.ids, c[key][2].ids)                 # the seed picks keys and text
        assert (items.lengths == key[1]).all() and items.ids.shape[1] == key[1]   # the whole row, no padding
        for r in range(items.ids.shape[0]):                               # a row ends at its last read
            assert int(items.position[items.row == r].max()) == key[1] - 1
        assert items.n_units == 3 and items.ids.shape[0] == 9 and spec.long   # 3 sequences, each at 3 depths
        assert all(len(set(items.row[items.unit == u].tolist())) == 3 for u in range(3))   # a unit: its 3 rows
        assert sorted(set(items.conditions)) == ["depth 0.1", "depth 0.5", "depth 0.9"]
        assert (items.correct != items.contrast).all()


def test_passkey_digits_are_read_one_per_item_and_the_key_sits_at_its_depth(smollm2):
    tok = smollm2.tokenizer
    (spec, probe, items), = build_long(["passkey"], tok, "causal-lm", [400], n_items=2, depths=(0.0, 0.3, 0.7)).values()
    vocab = Vocabulary(tok)
    head = vocab.encode(PASSKEY_INSTRUCTION)
    seqs = _sequences(items)
    assert len(seqs) == 6 and items.n_items == 30
    for n, (row, condition, correct, contrast, positions) in enumerate(seqs):
        digits = [tok.decode([t]) for t in correct]
        assert all(len(d) == 1 and d.isdigit() for d in digits)            # one digit per item
        assert all(len(tok.decode([t])) == 1 and tok.decode([t]).isdigit() and t != c for t, c in zip(contrast, correct))
        assert positions == list(range(positions[0], positions[0] + 5))   # consecutive digits, teacher-forced
        key = "".join(digits)
        assert row[:len(head)] == head
        needle = vocab.encode(PASSKEY_NEEDLE.format(key=key))
        (start,), = [_find(row, needle)]                                   # the key is in the row once
        tail, at = digit_answer(vocab, PASSKEY_QUESTION, key)
        question = vocab.encode(PASSKEY_QUESTION)
        assert row[len(row) - len(question) - at[-1]:] == question + tail[:at[-1]]   # "... The pass key is" + digits
        N = len(row) - len(head) - len(needle) - len(question) - at[-1]
        text = row[len(head):len(head) + N + len(needle)]
        s = start - len(head)
        filler = torch.tensor(text[:s] + text[s + len(needle):])
        assert torch.equal(filler, haystack(tok, N, seed=probe.haystack_seed(n // 3)))   # real text, seeded
        depth = float(condition.split()[1])
        ends = sentence_ends(tok, filler)
        assert s == place(filler, torch.tensor(needle), depth, ends=ends).start
        if depth == 0.0:
            assert s == 0
        else:                                                              # after the sentence end nearest the depth
            assert (s - 1) in ends.tolist()
            assert abs(s - round(depth * N)) == int((ends + 1 - round(depth * N)).abs().min())
    # the same key and text at every depth: only the needle moves
    assert [tok.decode(c) for c in (seqs[0][2], seqs[1][2], seqs[2][2])] == [tok.decode(seqs[0][2])] * 3


def test_needle_contrast_is_the_distractor_in_the_context(smollm2):
    tok = smollm2.tokenizer
    (_, _, items), = build_long(["needle"], tok, "causal-lm", [400], n_items=3, depths=(0.2, 0.6)).values()
    vocab = Vocabulary(tok)
    for row, condition, correct, contrast, _ in _sequences(items):
        number, other = tok.decode(correct), tok.decode(contrast)
        assert len(number) == len(other) == 5 and all(x != y for x, y in zip(number, other))
        text = tok.decode(row)
        facts = [line for line in text.split(".") if "special magic number for" in line and " is " in line]
        asked = text.rsplit("What is the special magic number for ", 1)[1].split("?")[0]
        mine = vocab.encode(NEEDLE_FACT.format(city=asked, number=number))
        assert len(_find(row, mine)) == 1                                  # the asked city's fact, with its number
        assert f" is {other}" in text and f"for {asked} is {other}" not in text   # the distractor: another city's
        assert len(facts) >= 2


def test_long_copying_reads_the_second_copy_against_its_own_tokens(smollm2):
    tok = smollm2.tokenizer
    (_, probe, items), = build_long(["long-copying"], tok, "causal-lm", [300], n_items=2, depths=(0.5,)).values()
    for row, _, correct, contrast, positions in _sequences(items):
        span = probe.span
        second = row[len(row) - (span - 1):]                               # the second copy up to its last read
        first = _find(row[:len(row) - (span - 1)], second)
        assert len(first) == 1 and first[0] < len(row) // 2 + span        # the first copy sits at the depth
        r = row[first[0]:first[0] + span]
        assert correct == r[1:] and all(c in r and c != t for c, t in zip(contrast, correct))
        assert positions == list(range(len(row) - span + 1, len(row)))    # read at each token of the second copy


def test_a_tokenizer_that_merges_digits_is_counted_or_refused(smollm2):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def merging(pattern: str, pairs):
        vocab = {chr(i): i - 32 for i in range(32, 127)}
        vocab.update({p: 95 + j for j, p in enumerate(pairs)})
        vocab.update({"<unk>": len(vocab), "</s>": len(vocab) + 1})
        t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")

    doubles = [d + d for d in "0123456789"]
    some = merging("|".join(doubles) + "|.", doubles)                     # merges a repeated digit ("77")
    (_, _, items), = build_long(["passkey"], some, "causal-lm", [700], n_items=4, depths=(0.5,)).values()
    rejected = items.rejected_counts()
    assert rejected.get("keys whose digits are not one token each", 0) > 0 and 1 <= items.n_units <= 4
    assert all(not any(d in key for d in doubles) for key in
               ("".join(some.decode([t]) for t in items.correct[items.unit == u].tolist()) for u in items.unit.unique()))
    assert all(len(some.decode([t])) == 1 for t in items.correct.tolist())
    every = merging(r"\d\d|.", [f"{a}{b}" for a in "0123456789" for b in "0123456789"])
    with pytest.raises(InputError) as err:
        build_long(["passkey"], every, "causal-lm", [700], n_items=4, depths=(0.5,))
    assert "\n" not in str(err.value) and "keys whose digits are not one token each" in str(err.value)


# -- registry: out of the default set, run by name ----------------------------------------------------------

def test_long_probes_stay_out_of_the_default_set(tiny64):
    assert set(applicable("causal-lm", long=True)) == set(LONG)
    assert not set(LONG) & set(applicable("causal-lm")) and not set(LONG) & set(chosen(None, "causal-lm"))
    assert not set(LONG) & set(chosen(["all"], "causal-lm"))
    assert chosen(["passkey"], "causal-lm") == ["passkey"] and not applicable("masked-lm", long=True)
    built, _ = build_applicable(tiny64, None)
    assert not set(LONG) & set(built)
    # asked for by name, a long probe runs through the short probes' path too (at its chosen length)
    scores = run_probes(tiny64, ["passkey"], options=dict(n_items=2, length=256, depths=(0.3, 0.7)))
    assert scores["passkey"].n_units == 2 and scores["passkey"].n_items == 20
    # exact match = the share of (key, depth) rows whose every digit is right
    (_, _, items), = build_long(["passkey"], tiny64.tokenizer, "causal-lm", [256], n_items=2, depths=(0.3, 0.7)).values()
    diff, _ = item_values(tiny64.model, items)
    by_row = [(diff[0, (items.row == r).numpy()] > 0).all() for r in range(items.ids.shape[0])]
    assert scores["passkey"].extras["exact_match"][0] == np.mean(by_row)
    assert all(PROBES[n].kinds == ("causal-lm",) for n in LONG)


# -- what SmolLM2 retrieves, and what a window takes away ---------------------------------------------------

def test_smollm2_retrieves_the_pass_key_a_tiny_model_does_not_and_a_short_window_loses_it(smollm2, tiny64):
    """Checked first by hand: the built-in SmolLM2 gets every digit of every key right at 256 and 512 tokens (all
    depths); a tiny random model reads digits it prefers, whatever the key. A KV plan that windows every head to
    4 sinks + 32 recent tokens cannot see a key at depth 0.1 of 384 tokens: lost (at 512 tokens, at chance)."""
    built = build_long(["passkey"], smollm2.tokenizer, "causal-lm", [384], n_items=3, depths=(0.1, 0.9))
    dense = long_context_report(smollm2, built=built)
    tiny = long_context_report(tiny64, built=built)
    (s,), (t,) = [[r for r in rep.rows() if r["depth"] == ALL] for rep in (dense, tiny)]
    assert s["dense_low"] > t["dense_high"] and s["dense_exact_low"] > t["dense_exact_high"]
    assert s["dense_low"] > 0.5 and s["dense_exact"] > 0.5                # retrieval, not a digit preference
    g = smollm2.geometry
    plan = KVPlan(np.full((g.n_layers, g.n_kv_heads), WINDOW, np.int8), Window(4, 32), n_heads=g.n_heads)
    cut = long_context_report(smollm2, built=built, cut=Cut.of_plan(plan), dense=dense.dense)
    assert cut.work.rows == {384: 6}                                      # the dense half came from the cache
    cells = {r["depth"]: r for r in cut.rows()}
    assert cells["depth 0.1"]["lost"] and cells["depth 0.1"]["cut_exact"] < cells["depth 0.1"]["dense_exact"]
    before = {r["depth"]: r["dense_accuracy"] for r in dense.rows()}
    assert all(r["dense_accuracy"] == before[r["depth"]] for r in cut.rows())   # dense reused as it was
    assert any("loses pass key retrieval at 384 tokens, depth 0.1" in w for w in cut.warnings())


# -- exactness of the cut paths (float64) ----------------------------------------------------------------

def test_plan_without_windows_equals_the_mask_and_a_covering_window_equals_dense(tiny64):
    g = tiny64.geometry
    built = build_long(["passkey", "long-copying"], tiny64.tokenizer, "causal-lm", [256], n_items=2, depths=(0.3, 0.8))
    modes = np.zeros((g.n_layers, g.n_kv_heads), np.int8)
    modes[0, 1] = modes[1, 0] = PRUNE
    plan = KVPlan(modes, n_heads=g.n_heads)
    dense = long_context_report(tiny64, built=built)
    by_plan = long_context_report(tiny64, built=built, cut=Cut.of_plan(plan), dense=dense.dense)
    by_mask = long_context_report(tiny64, built=built, cut=Cut.of_mask(plan.pruned_heads()), dense=dense.dense)
    for a, b in zip(by_plan.rows(), by_mask.rows()):
        assert abs(a["cut_logit_diff"] - b["cut_logit_diff"]) <= EXACT and a["cut_accuracy"] == b["cut_accuracy"]
    assert any(abs(r["cut_logit_diff"] - r["dense_logit_diff"]) > 1e-6 for r in by_mask.rows())   # a real cut
    covering = KVPlan(np.full_like(modes, WINDOW), Window(2, 256), n_heads=g.n_heads)
    short = KVPlan(np.full_like(modes, WINDOW), Window(2, 64), n_heads=g.n_heads)
    same = long_context_report(tiny64, built=built, cut=Cut.of_plan(covering), dense=dense.dense)
    other = long_context_report(tiny64, built=built, cut=Cut.of_plan(short), dense=dense.dense)
    for r in same.rows():
        assert abs(r["cut_logit_diff"] - r["dense_logit_diff"]) <= EXACT and not r["lost"]
    assert any(abs(r["cut_logit_diff"] - r["dense_logit_diff"]) > 1e-6 for r in other.rows())


def test_work_estimate_and_stop(tiny64):
    built = build_long(["passkey"], tiny64.tokenizer, "causal-lm", [128, 256], n_items=2, depths=(0.5,))
    assert report_work(built).rows == {128: 2, 256: 2} and report_work(built, cut=True).rows == {128: 4, 256: 4}
    per_row = row_seconds(tiny64.model, [128, 256])
    assert set(per_row) == {128, 256} and all(np.isfinite(v) and v > 0 for v in per_row.values())
    calls = []
    with pytest.raises(CancelledError):                                   # 1, 2: before the pass; 3: its first layer
        measure_long(tiny64.model, built, should_stop=lambda: calls.append(1) or len(calls) > 2)
    assert len(calls) == 3                                                # stopped inside the first forward
    layers = tiny64.adapter.layers(tiny64.model)
    assert all(not layer._forward_pre_hooks for layer in layers)          # the stop hooks are gone
    assert not tiny64.model.base_model._forward_hooks


def test_refusals_are_one_line(tiny64, smollm2):
    g = tiny64.geometry
    built = build_long(["passkey"], tiny64.tokenizer, "causal-lm", [256], n_items=2, depths=(0.5,))
    for call, words in (
            (lambda: build_long(["passkey"], tiny64.tokenizer, "causal-lm", [2048], limit=1024), "longer than"),
            (lambda: build_long(["passkey"], tiny64.tokenizer, "causal-lm", [256], depths=(1.5,)), "depth"),
            (lambda: build_long(["passkey"], tiny64.tokenizer, "causal-lm", [40]), "too short"),
            (lambda: build_long(["ioi"], tiny64.tokenizer, "causal-lm", [256]), "short probe"),
            (lambda: build_long(["passkey"], tiny64.tokenizer, "causal-lm", [256], n_items=0), "sequences"),
            (lambda: long_context_report(tiny64, built=built, cut=Cut.of_plan(KVPlan.full(smollm2.geometry))),
             "make the plan"),
            (lambda: long_context_report(tiny64, built=built, cut=Cut.of_mask(np.zeros((3, 4), bool))),
             "give a mask of this model"),
            (lambda: KVPlan.full(g, window=(4, 0)), "window of 0")):
        with pytest.raises(InputError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value)


# -- the command line -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2):
    """A tiny Llama folder with SmolLM2's tokenizer and a 1,024-token context."""
    return tiny_dir_for(tmp_path_factory.mktemp("tiny-longctx"), smollm2.tokenizer, max_position_embeddings=1024)


def test_cli_longctx_json_csv_and_cuts(tiny_dir, capsys, tmp_path):
    base = ("longctx", "--model", tiny_dir, "--lengths", "160,256", "--depths", "0.2,0.8", "--items", "2", "--quiet")
    code, stdout, _ = _run(capsys, *base, "--probe", "passkey")
    data = json.loads(stdout)
    assert code == 0 and data["context_limit"] == 1024 and data["report"]["work"]["rows"] == {"160": 4, "256": 4}
    assert {(c["probe"], c["length"], c["depth"]) for c in data["report"]["cells"]} == {
        ("passkey", n, d) for n in (160, 256) for d in ("all", "depth 0.2", "depth 0.8")}
    assert data["estimate_s"] > 0 and set(data["per_row_s"]) == {"160", "256"}
    code, stdout, _ = _run(capsys, *base, "--sparsity", "0.5", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(stdout)))
    assert code == 0 and {r["probe"] for r in rows} == set(LONG) and "cut_accuracy" in rows[0] and "lost" in rows[0]
    from analysis.arch.models import load_model
    g = load_model(str(tiny_dir)).geometry
    modes = np.full((g.n_layers, g.n_kv_heads), WINDOW, np.int8)
    plan_file = tmp_path / "kv_plan.json"
    plan_file.write_text(KVPlan(modes, Window(1, 1024), n_heads=g.n_heads).to_json())
    code, stdout, _ = _run(capsys, *base, "--probe", "long-copying", "--kv-plan", plan_file)
    cells = json.loads(stdout)["report"]["cells"]
    bound = forward_tolerance(torch.float32, width=64, depth=2, scale=10.0)   # float32: another kernel call
    assert code == 0 and all(abs(c["cut_logit_diff"] - c["dense_logit_diff"]) <= bound for c in cells)
    # the same mask as a mask.json on --model and as the pruned export's own weights: the same numbers
    from analysis.compress.export import export, mask_record
    lm = load_model(str(tiny_dir))
    pruned = np.zeros((g.n_layers, g.n_heads), bool)
    pruned[0, :2] = pruned[1, 2:] = True                                 # whole KV groups: no K/V copies
    record = mask_record(pruned, geometry=g, model=lm.name, model_type=lm.adapter.model_type)
    res = export("pruned", lm.model, pruned, tmp_path, "cut", record=record, tokenizer=lm.tokenizer)
    cuts = {}
    for flag, value in (("--mask-file", res.path / "mask.json"), ("--export", res.path)):
        code, stdout, _ = _run(capsys, *base, "--probe", "needle", flag, value)
        assert code == 0
        cuts[flag] = json.loads(stdout)["report"]["cells"]
    for a, b in zip(cuts["--mask-file"], cuts["--export"]):
        assert (a["length"], a["depth"]) == (b["length"], b["depth"])
        assert abs(a["cut_logit_diff"] - b["cut_logit_diff"]) <= bound
    # an export written with a KV plan runs under it: the same numbers as the plan on --model
    from analysis.compress.export import export_to
    mixed = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW]]), Window(2, 64), n_heads=g.n_heads)
    (tmp_path / "mixed.json").write_text(mixed.to_json())
    export_to("pruned", lm.model, None, tmp_path / "planned", kv_plan=mixed, tokenizer=lm.tokenizer)
    runs = {}
    for flag, value in (("--kv-plan", tmp_path / "mixed.json"), ("--export", tmp_path / "planned")):
        code, stdout, _ = _run(capsys, *base, "--probe", "passkey", flag, value)
        assert code == 0
        runs[flag] = json.loads(stdout)["report"]
    said = runs["--export"]["cut"]
    assert said["kind"] == "model" and "windowed" in said["describe"] and said["kv_plan"] == mixed.counts()
    assert (said["sinks"], said["recent"]) == (2, 64) and said["export"] == str(tmp_path / "planned")
    diffs = [abs(a["cut_logit_diff"] - b["cut_logit_diff"]) for a, b in zip(runs["--kv-plan"]["cells"],
                                                                              runs["--export"]["cells"])]
    assert max(diffs) <= bound
    assert any(abs(c["cut_logit_diff"] - c["dense_logit_diff"]) > 10 * bound for c in runs["--export"]["cells"])


@pytest.mark.parametrize("args,words", [
    (("--lengths", "2048"), "longer than this model reads (1024"),
    (("--lengths", "1k"), "--lengths takes comma-separated whole numbers"),
    (("--depths", "0.5,1.5"), "0 to 1"),
    (("--probe", "ioi"), "short probe"),
    (("--items", "0"), "--items"),
    (("--sparsity", "0.25", "--kv-plan", "x.json"), "Give one cut"),
    (("--kv-plan", "OTHER"), "make the plan for this model"),
    (("--kv-plan", "ZERO"), "window of 0"),
])
def test_cli_refusals_write_nothing(tiny_dir, smollm2, capsys, tmp_path, args, words):
    other = tmp_path / "other.json"
    other.write_text(KVPlan.full(smollm2.geometry).to_json())
    zero = json.loads(KVPlan.full(tiny_loaded("llama", smollm2.tokenizer, "causal-lm").geometry).to_json())
    zero["recent"] = 0
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    args = [{"OTHER": other, "ZERO": tmp_path / "zero.json"}.get(a, a) for a in args]
    out = tmp_path / "out.json"
    code, stdout, stderr = _run(capsys, "longctx", "--model", tiny_dir, "--items", "2", "--out", out, "--quiet", *args)
    assert code == 2 and words in _one_error_line(stderr) and stdout == "" and not out.exists()
