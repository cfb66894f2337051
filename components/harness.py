"""EleutherAI's lm-evaluation-harness in the app (analysis.measure.harness): the Export page's benchmarks job.

The user names a local task folder (optional: the standard tasks read their data from it, or from the HF
datasets cache) and the tasks; the tasks and their data are checked before anything runs (a missing file is
one line saying where to put which file), the expected time shows under the button, and the job runs as
every long job of the app does (`cache.run_button`: a `tracked` job queued for the model's lock, progress
with the time left, a Stop that stops it at the next forward batch). The result is one table, dense vs the
view's mask, with the harness's stderr for each metric, and its CSV / JSON downloads. The dense side is
cached on its own, so a second mask runs only the cut.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import streamlit as st

from components import cache, exports, numbers, state
from components.errors import shown_errors
from components.state import ModelKey

DEFAULT_LIMIT = 100          # documents per task by default: minutes on a CPU, not hours (0 = every document)
TASKS_ENV = "HEADSCOPE_HARNESS_TASKS"   # a server's own task folder (a class): fixed, nothing typed
STAMP_FILES = 2000           # files of a task folder whose size and time go into the cache keys


def folder_stamp(task_dir: str) -> tuple:
    """(path, size, mtime) of the task folder's files (the first STAMP_FILES): in every cache key, so a data file
    added or edited is read again instead of an old result being shown."""
    if not task_dir.strip() or not Path(task_dir).is_dir():
        return ()
    out = []
    for root, dirs, files in os.walk(task_dir):
        dirs.sort()
        for name in sorted(files):
            try:
                st_ = os.stat(os.path.join(root, name))
            except OSError:
                continue
            out.append((os.path.join(root, name), st_.st_size, st_.st_mtime_ns))
            if len(out) >= STAMP_FILES:
                return tuple(out)
    return tuple(out)


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def task_plan(key: ModelKey, task_dir: str, names: tuple, limit: int | None, stamp: tuple) -> dict:
    """The tasks checked and read (offline) before the button: where each comes from, and the tokens one
    run puts through the model (the time estimate's work)."""
    from analysis.measure import harness
    prepared = harness.prepare_tasks(names, task_dir or None, limit=limit)
    return dict(sources={n: s.as_dict() for n, s in prepared.sources.items()},
                tokens=harness.request_tokens(prepared, cache.load(key).tokenizer))


@st.cache_resource(show_spinner=False)
def _dense_measured() -> set:
    """The dense runs this server has cached (their keys): a second mask's estimate is the cut's alone."""
    return set()


@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def dense_run(key: ModelKey, task_dir: str, names: tuple, limit: int | None, stamp: tuple,
              _progress=None, _should_stop=None):
    """The dense model's HarnessRun on the tasks."""
    from analysis.measure import harness
    prepared = harness.prepare_tasks(names, task_dir or None, limit=limit)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        run = harness.run_harness(lm.model, lm.tokenizer, prepared, progress=_progress, should_stop=_should_stop)
    _dense_measured().add((repr(key), task_dir, names, limit, stamp))
    return run


@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def compare(key: ModelKey, pruned, plan, task_dir: str, names: tuple, limit: int | None, stamp: tuple,
            _progress=None, _should_stop=None):
    """HarnessReport: the dense run (cached on its own) and the page's cut: the mask pruned [L, H] as head gates,
    or with the KV plan the export writes (analysis.compress.export.planned.exported_cut)."""
    from analysis.compress.export.planned import exported_cut
    from analysis.core.progress import scaled
    from analysis.measure import harness
    known = (repr(key), task_dir, names, limit, stamp) in _dense_measured()
    dense = dense_run(key, task_dir, names, limit, stamp, _progress=None if known else scaled(_progress, 0.0, 0.5),
                      _should_stop=_should_stop)                  # before taking the lock (cache.exclusive)
    prepared = harness.prepare_tasks(names, task_dir or None, limit=limit)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return harness.harness_report(lm, prepared, cut=exported_cut(lm, pruned, plan), dense=dense,
                                      progress=_progress if known else scaled(_progress, 0.5, 1.0),
                                      should_stop=_should_stop)


def _value(value, stderr) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}" + ("" if stderr is None else f" ± {stderr:.2g}")


def table_rows(rows: list[dict]) -> list[dict]:
    """The report's rows as the page shows them (value ± the harness's stderr; red = worse)."""
    return [{"task": r["task"], "metric": r["metric"] + ("" if r["higher_is_better"] is None else
                                                         " (↑)" if r["higher_is_better"] else " (↓)"),
             "documents": r["n"], "dense": _value(r["dense"], r["dense_stderr"]),
             "cut": _value(r.get("cut"), r.get("cut_stderr")),
             "change": "—" if r.get("change") is None else f"{r['change']:+.4g}",
             "worse": "worse" if r.get("worse") else ""} for r in rows]


def task_dir_widget(where_, key_prefix: str) -> str:
    """The task folder: typed (exports `on`), the server's own (`HEADSCOPE_HARNESS_TASKS`), or none on a server
    that takes no typed paths (exports `fixed` / `off`: a folder's helper files would run as Python there)."""
    fixed = os.environ.get(TASKS_ENV, "").strip()
    if fixed:
        where_.caption(f"Task folder (fixed by the server, {TASKS_ENV}): **{fixed}**")
        return fixed
    if exports.mode() != "on":
        where_.caption(f"Task folder: none (this server takes no typed paths, {exports.EXPORTS_ENV}={exports.mode()}; "
                       f"its admin can set {TASKS_ENV}). The standard tasks read the HF datasets cache.")
        return ""
    return where_.text_input("Task folder (optional)", key=state.widget_key(f"{key_prefix}.harness.dir", value=""),
                             help="A local folder: YAML task configs in the harness's format, and/or "
                                  "<task>/<split>.jsonl data of the standard tasks (docs/HARNESS.md). Empty: the "
                                  "standard tasks from the HF datasets cache.").strip()


def panel(lm, pruned: np.ndarray, *, where: str = "export", kv_plan=None) -> None:
    """The benchmarks section for the view's mask pruned [L, H], with the KV plan written with it (None: the
    mask alone)."""
    from analysis.measure import harness
    st.subheader("Benchmarks (lm-evaluation-harness)")
    if lm.kind != "causal-lm":
        st.caption("The harness's tasks score a causal language model's next tokens; this model has no such head.")
        return
    if not harness.installed():
        st.info(harness.harness_missing() or f"pip install {harness.HARNESS_REQUIREMENT}",
                icon=":material/download:")
        return
    c1, c2, c3 = st.columns([3, 3, 1])
    task_dir = task_dir_widget(c1, where)
    known = None
    with shown_errors("Reading the task folder"):
        known = harness.known_tasks(task_dir or None)
    if known is None:
        return
    names = c2.multiselect("Tasks", known, key=state.widget_key(f"{where}.harness.tasks", value=[]),
                           help="The folder's own tasks first, then the standard ones: "
                                + ", ".join(f"{n} ({s.label})" for n, s in harness.STANDARD_TASKS.items()))
    limit = int(c3.number_input("Documents per task", 0, 10**7, step=50,
                                key=state.widget_key(f"{where}.harness.limit", value=DEFAULT_LIMIT),
                                help="0 = every document (the published setting). A subset gives other numbers "
                                     "than the papers' (the harness itself says --limit is for testing)."))
    if not names:
        st.caption("Pick the tasks to run: the harness's zero-shot scores of the dense model and of this mask "
                   "(head gates: what the exported cut computes), side by side.")
        return
    stamp = folder_stamp(task_dir)
    args = (task_dir, tuple(names), limit or None, stamp)
    tasks = None
    with shown_errors("Checking the tasks"):
        tasks = task_plan(state.model_key(), *args)
    if tasks is None:
        return
    st.caption("Data: " + "; ".join(f"{n}: {s['n_docs']} documents from {s['data']}" for n, s in tasks["sources"].items()))
    sides = 1 if (repr(state.model_key()), *args) in _dense_measured() else 2
    pruned = np.asarray(pruned, bool)
    rep = cache.run_button("Run the harness" + (" (the cut; dense is measured)" if sides == 1 else " (dense and cut)"),
                           button_key=f"{where}.harness", slot=f"{where}.harness",
                           run_key=(state.model_key(), pruned.tobytes(), None if kv_plan is None else kv_plan.to_json(),
                                    *args), fn=compare,
                           args=(state.model_key(), pruned, kv_plan, *args), label="Running the harness", kind="harness",
                           work=sides * tasks["tokens"],
                           view=f"{int(pruned.sum())} heads pruned" + ("" if kv_plan is None else " + the KV plan")
                                + f", {', '.join(names)}",
                           stale_note="The mask, its plan or the tasks changed since the last run ({view}); press the "
                                      "button again.")
    if rep is None:
        return
    rows = rep.rows()
    numbers.flagged_table(table_rows(rows), flag="worse")
    st.caption(f"Zero-shot, lm-evaluation-harness {harness.HARNESS_VERSION}: value ± the harness's standard error "
               "(none for perplexities); ↑ higher is better, ↓ lower. Red: the cut is worse than dense by more than "
               f"{harness.WORSE_STDERRS:g} standard errors of the two combined (any worse perplexity)."
               + (f" Only the first {rep.limit} documents of each task: not the published numbers." if rep.limit else ""))
    d1, d2 = st.columns(2)
    d1.download_button("Benchmarks (CSV)", numbers.csv_text(rows), file_name="harness.csv", mime="text/csv",
                       key=f"{where}.harness.csv")
    d2.download_button("Benchmarks (JSON)", json.dumps(rep.as_dict(), indent=1, default=str), file_name="harness.json",
                       mime="application/json", key=f"{where}.harness.json")
