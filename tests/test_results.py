"""scripts/results.py on a tiny model: every row and table is there, every cell's CI holds its value,
one token stream for every row, perplexities equal analysis.measure.evaluation's, policy rows' parameter
counts equal what surgery removes, and main() writes through analysis.core.atomic.atomic_write."""
import importlib.util
import sys

import numpy as np
import pytest

from tests._apptools import tiny_model_dir

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("results_script", ROOT / "scripts" / "results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_script"] = module           # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(results, tmp_path_factory):
    from analysis.arch.models import load_model
    folder = tiny_model_dir(tmp_path_factory.mktemp("tiny-results"), hidden_size=48, num_attention_heads=6,
                            num_key_value_heads=2)
    loaded = load_model(str(folder))
    options = results.Options(eval_tokens=1024, window=64, sparsities=(0.25, 0.5), n_sequences=2, seq_len=16,
                              batch_size=2, ablation_sequences=2, ablation_seq_len=16, ig_steps=2,
                              sweep_tokens=256, bootstrap=200, eval_batch=48, quiet=True)
    text, data = results.run(loaded, options)
    return loaded, options, text, data


def test_every_row_and_table_is_there(results, tiny_run):
    loaded, options, text, data = tiny_run
    for label, _ in results.scorer_rows(options):
        assert f"| {label} |" in text
    for needed in ("Wanda-Head, layer-normalized", "SparseGPT-Head, layer-normalized", "MP-G (z from the sweep)",
                   "Random (mean over seeds 0, 1, 2, 3, 4)", "## MP-G (z = 2) under the mask policies",
                   "| balanced |", "| groups |", "## Agreement with the single-head ablation oracle",
                   "Spearman", "## Timings", "| whole run |", "1,024 tokens", "16 non-overlapping windows of 64"):
        assert needed in text, needed
    assert all(s in data["swept"] for s in options.sparsities)


def test_cells_have_cis_that_hold_their_values(tiny_run):
    _, _, _, data = tiny_run
    ppl, lo, hi = data["ppl"], data["lo"], data["hi"]
    assert np.all(lo <= ppl + 1e-9) and np.all(ppl <= hi + 1e-9) and np.all(lo < hi)
    assert len(data["random_cells"]) == 5 * 2


def test_perplexities_equal_the_library_on_the_same_ids(tiny_run):
    from analysis.measure.evaluation import perplexity
    from analysis.core.text import evaluation_text
    loaded, options, _, data = tiny_run
    text = evaluation_text(max_chars=16 * options.eval_tokens + 4096)
    some = [data["dense"], data["cells"][("MP-G (z = 2.0)", 0.5)], data["cells"][("Wanda-Head", 0.25)]]
    masks = np.stack([data["masks"][i] for i in some])
    want = perplexity(loaded, text, pruned=masks, max_tokens=options.eval_tokens, window=64, stride=64)
    np.testing.assert_allclose(data["ppl"][some], want, rtol=1e-9)
    assert data["ids"].size == options.eval_tokens
    assert not data["masks"][data["dense"]].any()


def test_policy_rows_count_what_surgery_removes(tiny_run):
    from analysis.arch.models import count_parameters
    from analysis.compress.surgery import prune_heads
    loaded, options, text, data = tiny_run
    for (policy, s), plan in data["policy_plans"].items():
        if isinstance(plan, str):
            continue
        smaller, _ = prune_heads(loaded.model, plan.pruned)
        removed = count_parameters(loaded.model) - count_parameters(smaller)
        assert f"| {policy} | {s:g} | {plan.n_pruned} (asked {plan.requested}) |" in text
        row = next(line for line in text.splitlines() if line.startswith(f"| {policy} | {s:g} |"))
        assert f"| {removed:,} (" in row


def test_main_writes_the_file_with_the_shared_atomic_writer(results, monkeypatch, tmp_path):
    written = {}
    monkeypatch.setattr(results, "atomic_write", lambda path, text, what: written.update(path=path, text=text))
    monkeypatch.setattr(results, "run", lambda loaded, options, team=None: (f"table for {options.eval_tokens}", {}))
    monkeypatch.setattr("analysis.arch.models.load_model", lambda name, cache_dir=None: name)
    results.main(["--out", str(tmp_path / "r.md"), "--eval-tokens", "16384", "--quiet"])
    assert written == {"path": tmp_path / "r.md", "text": "table for 16384\n"}


def test_main_keeps_the_recovery_section_of_bench_recovery(results, monkeypatch, tmp_path):
    """docs/results.md has two generators: regenerating the scorer tables keeps the section that
    bench/bench_recovery.py --write-docs owns, and that bench's writer keeps the rest."""
    from analysis.core.atomic import write_section
    from analysis.compress.recover.report import RECOVERY_MARKERS
    out = tmp_path / "r.md"
    section = f"{RECOVERY_MARKERS[0]}\n## Recovery\nnumbers\n{RECOVERY_MARKERS[1]}"
    out.write_text("old table\n\n" + section + "\n", encoding="utf-8")
    monkeypatch.setattr(results, "run", lambda loaded, options, team=None: ("new table", {}))
    monkeypatch.setattr("analysis.arch.models.load_model", lambda name, cache_dir=None: name)
    results.main(["--out", str(out), "--quiet"])
    assert out.read_text(encoding="utf-8") == "new table\n\n" + section + "\n"
    write_section(out, section.replace("numbers", "new numbers"), *RECOVERY_MARKERS)
    assert out.read_text(encoding="utf-8") == "new table\n\n" + section.replace("numbers", "new numbers") + "\n"


def test_main_keeps_every_generated_section(results, monkeypatch, tmp_path):
    """Every bench that owns a section of docs/results.md (recovery, roles, probes, edge, frontier) keeps
    it when the scorer tables are regenerated."""
    from analysis.compress.recover.report import (EDGE_MARKERS, FRONTIER_MARKERS, KV_POLICIES_MARKERS,
                                                  LONG_CONTEXT_MARKERS, RECOVERY_MARKERS)
    from analysis.measure.probes.breaks import PROBES_MARKERS
    from analysis.score.kvscores import KV_HEADS_MARKERS
    from analysis.score.longcontext import KV_QUALITY_MARKERS, LONG_PROBES_MARKERS
    from analysis.score.specialization import ROLES_MARKERS
    out = tmp_path / "r.md"
    sections = [f"{b}\n## {i}\nnumbers {i}\n{e}" for i, (b, e) in
                enumerate((RECOVERY_MARKERS, ROLES_MARKERS, PROBES_MARKERS, EDGE_MARKERS, FRONTIER_MARKERS,
                                       LONG_CONTEXT_MARKERS, KV_HEADS_MARKERS, KV_POLICIES_MARKERS, LONG_PROBES_MARKERS,
                                       KV_QUALITY_MARKERS))]
    out.write_text("old table\n\n" + "\n\n".join(sections) + "\n", encoding="utf-8")
    monkeypatch.setattr(results, "run", lambda loaded, options, team=None: ("new table", {}))
    monkeypatch.setattr("analysis.arch.models.load_model", lambda name, cache_dir=None: name)
    results.main(["--out", str(out), "--quiet"])
    assert out.read_text(encoding="utf-8") == "new table\n\n" + "\n\n".join(sections) + "\n"
