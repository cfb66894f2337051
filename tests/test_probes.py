"""Capability probes (analysis.measure.probes, analysis.score.domains, `python -m analysis probes / domains`):
a planted head comes first in its probe's map, the fast per-head map equals the naive loop in float64,
probes are deterministic and count the fillers a tokenizer splits, a lost capability is flagged, and bad
input (too few items, no LM head, empty / binary / huge text) is one clear line with nothing written."""
import csv
import io
import json

import numpy as np
import pytest
import torch

from analysis.arch.cut import Cut
from analysis.core.errors import InputError
from analysis.measure.ablation import FastAblation
from analysis.measure.probes import PROBES, applicable, chosen
from analysis.measure.probes.breaks import CapabilityCheck, cut_report
from analysis.measure.probes.circuit import length_buckets, probe_map
from analysis.measure.probes.measure import (build_items, item_values, layout, measure_probes, pool, pooled_values,
                                            run_probes)
from analysis.score.domains import user_text_set
from tests._apptools import tiny_model_dir, trivial_tokenizer
from tests._input_checks import only_error_line as _one_error_line, run_captured as _run
from tests._evalkit import tiny_loaded
from tests._probekit import CONTENT, PLANTED, SplittingTokenizer, planted_model
from tests._threads import one_torch_thread  # noqa: F401 (autouse)
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT, float32_inside_tolerance, forward_tolerance




@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-probes"))


# -- the planted head ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer,head", [(1, 2), (0, 1)])
def test_planted_head_comes_first_by_a_margin(layer, head, monkeypatch):
    monkeypatch.setitem(PROBES, "planted", PLANTED)                    # a probe is one record, registered once
    assert "planted" in applicable("causal-lm") and "planted" not in applicable("masked-lm")
    model = planted_model(layer, head)
    items = PLANTED.make(n_items=24).build(trivial_tokenizer(), "causal-lm")
    diff, _ = item_values(model, items)
    assert (diff > 0).all()                                            # the task is solved, by that head
    m = probe_map(model, PLANTED, items)
    assert abs(m.base - diff.mean()) <= EXACT                           # the map reads what the probe measures
    (l0, h0, first), (_, _, second) = m.top(2)
    assert (l0, h0) == (layer, head)
    assert first > 10 * second and first > 0.5 * m.base                # first, by a margin
    assert np.unravel_index(np.argmax(m.group_drop), m.group_drop.shape) == (layer, head // 2)
    naive = probe_map(model, PLANTED, items, method="naive")
    assert np.abs(m.drop - naive.drop).max() <= EXACT
    assert m.drop_ci[layer, head, 0] > 0                               # its CI excludes 0


def test_cut_report_flags_the_lost_capability(monkeypatch):
    """Pruning the planted head loses the planted probe (flagged, at chance); pruning another head does not."""
    monkeypatch.setitem(PROBES, "planted", PLANTED)
    model = planted_model()
    lm = tiny_loaded("llama", trivial_tokenizer(), "causal-lm")
    lm = type(lm)(**{**lm.__dict__, "model": model})
    for heads, lost in (([(1, 2)], True), ([(1, 0), (0, 3)], False)):
        pruned = np.zeros((2, 4), bool)
        for l, h in heads:
            pruned[l, h] = True
        rep = cut_report(lm, Cut.of_mask(pruned), names=["planted"], options=dict(n_items=32))
        (change,) = rep.changes
        assert change.lost is lost and bool(rep.warnings()) is lost
        if lost:
            assert change.at_chance and "loses planted copy" in rep.warnings()[0]
            assert change.cut["accuracy_high"] < change.dense["accuracy"]
    check = CapabilityCheck(lm, ["planted"], options=dict(n_items=32))
    stage = check.stage("round 1", 0.125, Cut.of_model(model))         # a model of its own (e.g. recovered)
    assert stage["probes"][0]["lost"] is False and stage["stage"] == "round 1"
    with pytest.raises(InputError, match="Give the cut"):              # a bare mask is not a Cut
        cut_report(lm, pruned, names=["planted"], options=dict(n_items=32))


# -- fast == naive, in float64 --------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_fast_map_equals_the_naive_loop(family):
    """The fast sweep's length buckets hand the float32 parts inside a float64 Llama / Qwen2 (attention
    softmax, rotary cos/sin: tests/_tolerance.py) rows of other lengths than the naive loop's one padded
    batch, so those two are bounded by `float32_inside_tolerance`; GPT-2 computes in float64 throughout
    and stays EXACT."""
    model = tiny_model(family, dtype=torch.float64)
    built = build_items(["copying", "code"], trivial_tokenizer(), "causal-lm", options=dict(n_items=16, max_chars=48))
    for spec, _, items in built.values():
        fast = probe_map(model, spec, items)
        naive = probe_map(model, spec, items, method="naive")
        bound = EXACT if family == "gpt2" else float32_inside_tolerance(model, np.abs(naive.drop).max())
        assert fast.method == "fast" and naive.method == "naive"
        assert abs(fast.base - naive.base) <= bound
        assert np.abs(fast.drop - naive.drop).max() <= bound
        if naive.group_drop is not None:
            assert np.abs(fast.group_drop - naive.group_drop).max() <= bound
        assert np.abs(naive.drop).max() > 1e-6                         # real effects
        if spec.name == "code":                                        # rows of several lengths: several buckets
            assert len(set(items.lengths.tolist())) > 1 and len(length_buckets(items, 6)) > 1


def test_map_buckets_change_no_number():
    """One length bucket per distinct length or one for all rows: the same drops and the same CIs (the units
    keep their order, shortest row first, so the bootstrap draws the same resamples); float64."""
    model = tiny_model("llama", dtype=torch.float64)
    spec, _, items = build_items(["code"], trivial_tokenizer(), "causal-lm", options=dict(n_items=12, max_chars=48))["code"]
    many, one = length_buckets(items, 6, 0), length_buckets(items, 6, 2**40)
    assert len(one) == 1 and len(many) == len(set(items.lengths[items.row].tolist())) > 2
    assert [s for b in many for s in b] == one[0]                     # the same units in the same order
    a, b = probe_map(model, spec, items, pass_tokens=0), probe_map(model, spec, items, pass_tokens=2**40)
    bound = float32_inside_tolerance(model, np.abs(a.drop).max())
    assert np.abs(a.drop - b.drop).max() <= bound and np.abs(a.drop_ci - b.drop_ci).max() <= bound
    assert np.abs(a.group_drop - b.group_drop).max() <= bound


def test_unit_changes_add_up_to_the_head_effect():
    """The fast sweep's per-sequence changes (what CIs resample) sum to its per-head loss change."""
    model = tiny_model("llama", dtype=torch.float64)
    res = FastAblation(batch_size=4).sweep(model, tiny_input_ids(3, 12))
    total = res.unit_delta.sum(2) / res.unit_weight.sum()              # [L, R]
    np.testing.assert_allclose(total[:, :4], res.head_delta, rtol=0, atol=EXACT)
    np.testing.assert_allclose(total[:, 4:], res.group_delta, rtol=0, atol=EXACT)


# -- pooled passes == one row at a time ------------------------------------------------------------------

def _one_row_at_a_time(model, items, gates):
    """The reference: every row in a pass of its own (batch_tokens=1), one mask at a time."""
    rows = [item_values(model, items, gates[b:b + 1], batch_tokens=1) for b in range(gates.shape[0])]
    return np.concatenate([d for d, _ in rows]), np.concatenate([n for _, n in rows])


@pytest.mark.parametrize("family,kind", [("llama", "causal-lm"), ("gpt2", "causal-lm"), ("bert", "masked-lm")])
def test_pooled_passes_equal_one_row_at_a_time(family, kind, minilm):
    """Every probe's rows pooled into shared passes of several lengths, two masks per pass, give each item
    what a pass of its own row gives (float64; the float32 parts inside see other shapes: a derived bound)."""
    if kind == "causal-lm":
        model, tok, names = tiny_model(family, dtype=torch.float64), trivial_tokenizer(), ["copying", "code"]
    else:
        model, tok, names = tiny_loaded("bert", minilm.tokenizer, kind).model.double(), minilm.tokenizer, None
    built = build_items(names, tok, kind, options=dict(n_items=8, max_chars=48))
    items_list = [items for _, _, items in built.values()]
    gates = torch.ones(2, 2, 4, dtype=torch.float64)
    gates[1, 0, 1] = gates[1, 1, 3] = 0.0
    pooled, _ = pool(items_list)
    passes = layout(pooled.lengths.tolist(), 2)
    owner = np.repeat(np.arange(len(items_list)), [it.ids.shape[0] for it in items_list])   # [S] probe of each row
    assert len(passes) > 1 and any(len(set(owner[p])) > 1 for p in passes)   # shared passes, of several lengths
    for items, (diff, nll) in zip(items_list, pooled_values(model, items_list, gates)):
        ref_diff, ref_nll = _one_row_at_a_time(model, items, gates)
        bound = float32_inside_tolerance(model, np.abs(ref_diff).max() + np.abs(ref_nll).max())
        assert np.abs(diff - ref_diff).max() <= bound and np.abs(nll - ref_nll).max() <= bound
        assert np.abs(ref_diff[0] - ref_diff[1]).max() > 1e-6                # the masks differ
    scores = measure_probes(model, built, gates=gates)
    for (name, (_, _, items)) in built.items():
        ref_diff, _ = _one_row_at_a_time(model, items, gates)
        s = items.scored.numpy()
        assert np.abs(scores[name].logit_diff - ref_diff[:, s].mean(1)).max() <= EXACT + bound


def test_layout_covers_every_row_once_within_the_budget():
    lengths = [3, 38, 5, 5, 6, 16, 16, 17, 31, 31, 31, 31, 8, 8, 9, 14] * 3
    for masks, budget, pass_tokens in ((1, 4096, 48), (2, 4096, 0), (1, 64, 48), (3, 4096, 10**9)):
        passes = layout(lengths, masks, budget, pass_tokens)
        assert sorted(s for p in passes for s in p) == list(range(len(lengths)))
        assert all(len(p) == 1 or len(p) * max(lengths[s] for s in p) * masks <= budget for p in passes)
        padded = sum(len(p) * max(lengths[s] for s in p) for p in passes)
        if pass_tokens == 0:                                           # passes are free: no padding at all
            assert padded == sum(lengths)
        if pass_tokens == 10**9:                                       # padding is free: the fewest passes
            assert len(passes) == -(-len(lengths) // (budget // (max(lengths) * masks)))
    assert layout([], 1) == []


# -- items: deterministic, checked against the tokenizer -------------------------------------------------

def test_probes_are_deterministic(smollm2):
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm")
    first = build_items(None, smollm2.tokenizer, "causal-lm")
    again = build_items(None, smollm2.tokenizer, "causal-lm")
    other = build_items(None, smollm2.tokenizer, "causal-lm", options=dict(seed=1))
    assert list(first) == applicable("causal-lm")                      # every built-in short probe applies
    assert not {"passkey", "needle", "long-copying"} & set(first)      # the long-context ones only by name
    for name in first:
        a, b, c = first[name][2], again[name][2], other[name][2]
        assert torch.equal(a.ids, b.ids) and torch.equal(a.correct, b.correct) and a.conditions == b.conditions
        assert not torch.equal(a.ids, c.ids) or not torch.equal(a.correct, c.correct)   # the seed picks items
        assert a.n_items >= 8
        # the answer really follows the prompt in the tokenizer's own text
        i = 0
        assert a.ids[a.row[i], a.position[i] + 1] == a.correct[i] or a.lengths[a.row[i]] == a.position[i] + 1
    s1, s2 = measure_probes(lm.model, first), measure_probes(lm.model, again)
    for name in s1:
        for field in ("accuracy", "accuracy_ci", "logit_diff", "logit_diff_ci"):
            assert np.array_equal(getattr(s1[name], field), getattr(s2[name], field))


def test_conditions_are_balanced(smollm2):
    built = build_items(["ioi", "agreement", "anaphor"], smollm2.tokenizer, "causal-lm", options=dict(n_items=48))
    for _, _, items in built.values():
        counts = {c: items.conditions.count(c) for c in set(items.conditions)}
        assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_rejected_fillers_are_counted_and_reported(smollm2):
    tok = SplittingTokenizer(smollm2.tokenizer, ["Mary", "John"])
    spec = PROBES["ioi"]
    items = spec.make(n_items=16).build(tok, "causal-lm")
    plain = spec.make(n_items=16).build(smollm2.tokenizer, "causal-lm").rejected   # SmolLM2 splits " cafe"
    assert "names" not in plain and items.rejected == {"names": ["Mary", "John"], **plain}
    assert items.rejected_counts() == {"names": 2, **{k: len(v) for k, v in plain.items()}}
    prompts = [tok.decode(r) for r in items.ids.tolist()]
    assert not any("Mary" in p or "John" in p for p in prompts)
    lm = tiny_loaded("llama", tok, "causal-lm")
    rep = cut_report(lm, Cut.of_mask(np.eye(2, 4, dtype=bool)), names=["ioi"], options=dict(n_items=16))
    assert rep.as_dict()["rejected"]["ioi"]["names"] == 2
    assert measure_probes(lm.model, {"ioi": (spec, spec.make(), items)})["ioi"].rejected["names"] == 2


# -- bad input: one clear line, nothing half-done --------------------------------------------------------

def test_too_few_items_is_one_clear_line(tiny_dir, capsys, tmp_path):
    with pytest.raises(InputError) as err:
        PROBES["ioi"].make().build(trivial_tokenizer(), "causal-lm")
    message = str(err.value)
    assert "\n" not in message and "could build only 0 item(s)" in message and "46 names" in message
    out = tmp_path / "probes.json"
    code, stdout, stderr = _run(capsys, "probes", "--model", tiny_dir, "--probe", "ioi", "--out", out, "--quiet")
    assert code == 2 and "could build only 0 item(s)" in _one_error_line(stderr)
    assert not out.exists() and stdout == ""
    # without a named probe, the ones that build run and the others are reported as skipped
    code, stdout, _ = _run(capsys, "probes", "--model", tiny_dir, "--quiet")
    data = json.loads(stdout)
    assert code == 0 and set(data["probes"]) == {"copying", "code"}
    assert "could build only" in data["skipped"]["ioi"]


def test_model_without_an_lm_head_is_one_clear_line(minilm, capsys):
    assert applicable("encoder") == []
    with pytest.raises(InputError, match="no MLM head"):
        chosen(["ioi"], "encoder")
    with pytest.raises(InputError, match="no language-model head"):
        chosen(None, "encoder")
    code, _, stderr = _run(capsys, "probes", "--model", "minilm-l6", "--probe", "ioi", "--quiet")
    assert code == 2 and "needs a causal language model or a masked language model" in _one_error_line(stderr)


@pytest.mark.parametrize("content,words", [(b"", "empty"), (b"   \n ", "empty"), (b"text\x00\x01\x02" * 50, "binary"),
                                           (b"\xff\xfe\x00binary", "binary"), (bytes(range(1, 9)) * 100, "binary"),
                                           (b"\xc3\x28 not utf-8", "UTF-8")])
def test_bad_text_sets_are_refused(content, words, capsys, tmp_path):
    with pytest.raises(InputError) as err:
        user_text_set("B", content)
    assert "\n" not in str(err.value) and words.lower() in str(err.value).lower()
    path, out = tmp_path / "b.txt", tmp_path / "domains.json"
    path.write_bytes(content)
    code, stdout, stderr = _run(capsys, "domains", "--model", "smollm2-135m", "--b", path, "--out", out, "--quiet")
    assert code == 2 and _one_error_line(stderr) and not out.exists() and stdout == ""


def test_huge_text_is_refused_before_the_model_loads(capsys, tmp_path):
    from analysis.score.domains import USER_TEXT_MAX_BYTES
    with pytest.raises(InputError, match="MiB"):
        user_text_set("B", b"word " * (USER_TEXT_MAX_BYTES // 5 + 1))
    path, out = tmp_path / "huge.txt", tmp_path / "domains.json"
    with open(path, "wb") as f:
        f.truncate(USER_TEXT_MAX_BYTES + 4096)                         # sparse: cheap to make
    code, _, stderr = _run(capsys, "domains", "--model", "no-such-model-is-loaded", "--a", path, "--out", out,
                           "--quiet")
    assert code == 2 and "takes at most" in _one_error_line(stderr) and not out.exists()


# -- masked LMs, reports, the CLI -------------------------------------------------------------------------

def test_masked_lm_versions(minilm):
    """Every probe has a masked-token version; the batched per-head map equals one mask at a time (float64)."""
    lm = tiny_loaded("bert", minilm.tokenizer, "masked-lm")
    lm.model.double()
    built = build_items(None, minilm.tokenizer, "masked-lm", options=dict(n_items=8))
    assert list(built) == applicable("masked-lm") == [n for n, s in PROBES.items() if not s.long]
    mask_id = minilm.tokenizer.mask_token_id
    for spec, _, items in built.values():
        assert (items.ids[items.row, items.position] == mask_id).all()
        assert items.ids[0, 0] == minilm.tokenizer.cls_token_id
    spec, _, items = built["agreement"]
    m = probe_map(lm.model, spec, items)
    assert m.method == "batched masks"
    gates = torch.ones(1, 2, 4)
    gates[0, 1, 3] = 0
    dense, _ = item_values(lm.model, items)
    one, _ = item_values(lm.model, items, gates)
    assert abs(m.drop[1, 3] - (dense.mean() - one.mean())) <= EXACT


def test_smollm2_dense_accuracy_with_cis(smollm2):
    """The dense model is well above chance on IOI and agreement (reported with CIs)."""
    scores = run_probes(smollm2, ["ioi", "agreement"])
    for s in scores.values():
        low, high = s.accuracy_ci[0]
        assert low <= s.accuracy[0] <= high and low > 0.5, (s.name, s.accuracy, s.accuracy_ci)
        assert s.logit_diff_ci[0, 0] > 0


def test_cli_probes_json_csv_mask_file_and_export(tiny_dir, capsys, tmp_path):
    """A cut given as a mask.json and as the exported pruned folder gives the same numbers (masking ==
    surgery, float32: a derived bound); CSV has one row per probe, --map one per probe and head."""
    from analysis.arch.models import load_model
    from analysis.compress.export import export, mask_record
    lm = load_model(str(tiny_dir))
    pruned = np.zeros((4, 4), bool)
    pruned[1, :2] = pruned[3, 2:] = True
    record = mask_record(pruned, geometry=lm.geometry, model=lm.name, model_type=lm.adapter.model_type)
    res = export("pruned", lm.model, pruned, tmp_path, "cut", record=record, tokenizer=lm.tokenizer)
    outs = {}
    for flag, value in (("--mask-file", res.path / "mask.json"), ("--export", res.path)):
        code, stdout, _ = _run(capsys, "probes", "--model", tiny_dir, flag, value, "--quiet")
        assert code == 0
        outs[flag] = json.loads(stdout)["cut"]["probes"]
    bound = forward_tolerance(torch.float32, width=64, depth=4, scale=10.0)
    for a, b in zip(outs["--mask-file"], outs["--export"]):
        assert a["probe"] == b["probe"] and abs(a["cut_logit_diff"] - b["cut_logit_diff"]) <= bound
    code, stdout, _ = _run(capsys, "probes", "--model", tiny_dir, "--sparsity", "0.25", "--format", "csv", "--quiet")
    rows = list(csv.DictReader(io.StringIO(stdout)))
    assert code == 0 and [r["probe"] for r in rows] == ["copying", "code"] and "cut_accuracy" in rows[0]
    code, stdout, _ = _run(capsys, "probes", "--model", tiny_dir, "--probe", "copying", "--map", "--format", "csv",
                           "--quiet")
    rows = list(csv.DictReader(io.StringIO(stdout)))
    assert code == 0 and len(rows) == 16 and {r["probe"] for r in rows} == {"copying"}
    code, stdout, _ = _run(capsys, "probes", "--model", tiny_dir, "--probe", "copying", "--map", "--quiet")
    mpg = json.loads(stdout)["maps"]["copying"]["versus_mpg"]
    assert code == 0 and mpg["n_with_role"] == 10 and 0 <= mpg["auc"] <= 1 and 0 < mpg["p_value"] <= 1


def test_cli_domains(tiny_dir, capsys, tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." * 3 for i in range(40)))
    code, stdout, _ = _run(capsys, "domains", "--model", tiny_dir, "--a", a, "--b", "python", "--tokens", "64",
                           "--seq-len", "16", "--eval-tokens", "128", "--quiet")
    data = json.loads(stdout)
    assert code == 0 and np.asarray(data["difference"]).shape == (4, 4)
    ci = np.asarray(data["difference_ci"])
    assert ci.shape == (4, 4, 2) and (ci[..., 0] <= ci[..., 1]).all()
    assert [c["scored_on"] for c in data["cuts"]] == ["dense", "--a a.txt", "Python source"]
    assert data["cuts"][0]["ratio_a"] == 1.0 and "PSF License" in " ".join(data["attributions"])


def test_pipeline_report_has_each_rounds_capabilities(smollm2):
    from analysis.compress.recover.pipeline import PipelineConfig
    from analysis.compress.recover.report import compression_report
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm")
    cfg = PipelineConfig(target_sparsity=0.5, step=0.25, recovery_steps=0, eval_tokens=32)
    rep, _ = compression_report(lm, cfg, int8=False, repeats=1, seq_len=8)
    assert [s["stage"] for s in rep.capabilities] == ["round 1", "round 2"]
    assert [p["probe"] for p in rep.capabilities[0]["probes"]] == applicable("causal-lm")   # no 8k-token probe
    md = rep.to_markdown()
    assert "What each stage breaks (capability probes)" in md and "| round 2 |" in md
    assert json.loads(rep.to_json())["capabilities"][1]["sparsity"] == 0.5
