"""The Export page's benchmarks job (components/harness.py): the tasks of a local folder checked before the
button, the expected time under it, dense vs the view's mask in one table with the harness's stderr and its
downloads; a task without data is one line and no button; without lm_eval, one line saying what to install."""
import csv
import io
import sys
from pathlib import Path

import pytest

from tests._apptools import datasets_cache, downloads, fresh_caches, new_app, no_exception, texts, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")
TASKS = Path(__file__).resolve().parent / "data" / "harness"


def _pick(at, tasks, limit=5):
    at.text_input(key="hs.w.export.harness.dir").set_value(str(TASKS)).run()
    at.multiselect(key="hs.w.export.harness.tasks").set_value(tasks).run()
    at.number_input(key="hs.w.export.harness.limit").set_value(limit).run()
    return at


def test_dense_vs_cut_table_and_downloads(tiny_dir, downloads):
    at = _pick(new_app(tiny_dir, page="export", policy="global", sparsity="0.25"), ["tiny_mc", "tiny_ppl"])
    no_exception(at)
    shown = texts(at)
    assert "tiny_mc: 5 documents from" in shown and "Expected: about" in shown
    at.button(key="export.harness").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    rows = list(csv.DictReader(io.StringIO(downloads["harness.csv"].decode())))
    assert [(r["task"], r["metric"]) for r in rows] == [("tiny_mc", "acc"), ("tiny_mc", "acc_norm"),
                                                        ("tiny_ppl", "word_perplexity"), ("tiny_ppl", "byte_perplexity"),
                                                        ("tiny_ppl", "bits_per_byte")]
    assert all(r["n"] == "5" and r["dense"] and r["cut"] for r in rows)
    assert "harness.json" in downloads and "Only the first 5 documents" in texts(at)
    at.run()
    table = at.table[-1].value                                               # the table stays on a rerun
    assert list(table["task"]) == [r["task"] for r in rows] and "worse" in table.columns
    labels = [b.label for b in at.button if b.key == "export.harness"]
    assert labels == ["Run the harness (the cut; dense is measured)"]     # another mask runs the cut alone


def test_a_task_without_data_is_one_line_and_no_button(tiny_dir):
    at = _pick(new_app(tiny_dir, page="export", policy="global"), ["piqa"])
    no_exception(at)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and str(TASKS / "piqa" / "validation.jsonl") in errors[0]
    assert "export.harness" not in [b.key for b in at.button]


def test_without_the_harness_one_line_says_what_to_install(tiny_dir, monkeypatch):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")] or ["lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)
    at = new_app(tiny_dir, page="export", policy="global")
    no_exception(at)
    assert any("pip install lm_eval==0.4.13" in i.value for i in at.info)
    assert "hs.w.export.harness.dir" not in [t.key for t in at.text_input]


def test_a_class_server_types_no_folder(tiny_dir, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_EXPORTS", "fixed")
    at = new_app(tiny_dir, page="export", policy="global")
    assert "hs.w.export.harness.dir" not in [t.key for t in at.text_input]
    assert "its admin can set HEADSCOPE_HARNESS_TASKS" in texts(at)
    monkeypatch.setenv("HEADSCOPE_HARNESS_TASKS", str(TASKS))         # the server's own folder
    at = new_app(tiny_dir, page="export", policy="global")
    no_exception(at)
    assert at.multiselect(key="hs.w.export.harness.tasks").options[:2] == ["tiny_mc", "tiny_ppl"]
