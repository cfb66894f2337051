"""RULER on the Long context page: the field's long-context benchmark (lm-evaluation-harness's `ruler` tasks that
need no download, rows generated here: analysis.measure.ruler) on the dense model and under the view's KV plan,
greedy generations scored by the harness's string match, per task with paired bootstrap CIs, LOST where the plan's
interval lies below dense's score; the expected time before the run, progress and Stop during it, CSV / JSON after.

The plan generates with its compact cache (analysis.arch.cut.Cut.new_cache), so its memory is the memory it uses.
The rows and the dense side depend on the settings only: cached once per model and settings (`dense_side`), so a
second plan costs its own generations alone (the estimate says which).
"""
from __future__ import annotations

import json

import streamlit as st

from analysis.arch.kvplan import KVPlan
from analysis.measure.densemap import MIN_ROWS, PASS

from . import cache, longstate, numbers, state
from .errors import shown_errors
from .state import ModelKey

APP_SAMPLES = 5                    # rows per task the page suggests: a first look (the bench takes 25 and more)
MAX_SAMPLES_APP = 100
APP_TASKS = ("niah_single_1", "niah_multikey_2")


@st.cache_resource(show_spinner=False, max_entries=4, hash_funcs=cache.KEY_HASH)
def ruler_rows(key: ModelKey, tasks: tuple, length: int, samples: int, seed: int):
    """RULER's rows of these settings (the tokenizer only; InputError for a task that downloads, a length above the
    model's context, a tokenizer that cannot make the rows). A resource: the harness's task objects are reused."""
    from analysis.measure.evaluation import context_length
    from analysis.measure.ruler import build_ruler
    lm = cache.load(key)
    return build_ruler(list(tasks), lm.tokenizer, (length,), samples=samples, seed=seed,
                       limit=context_length(lm.model))


@longstate.forgotten_with_store
@st.cache_resource(show_spinner=False)
def dense_measured() -> set:
    """The dense sides this server has cached (their keys): a second plan's estimate is the plan's alone."""
    return set()


@longstate.forgotten_with_store
@st.cache_data(show_spinner=False, max_entries=8, hash_funcs=cache.KEY_HASH)
def dense_side(key: ModelKey, tasks: tuple, length: int, samples: int, seed: int, _progress=None,
               _should_stop=None):
    """The dense model's run of the rows (RulerReport.dense: pass back as dense=): read from this machine's store
    when the CLI or an earlier server measured it, else generated and stored (analysis.measure.ruler.stored_dense)."""
    from analysis.measure.ruler import stored_dense
    rows = ruler_rows(key, tasks, length, samples, seed)
    with cache.exclusive(key, _progress, _should_stop) as lm:
        dense, _ = stored_dense(lm, rows, progress=_progress, should_stop=_should_stop,
                                fingerprint=longstate.fingerprint(key))
    dense_measured().add((repr(key), tasks, length, samples, seed))
    return dense


def dense_known(key: ModelKey, tasks: tuple, length: int, samples: int, seed: int) -> bool:
    """Whether the dense side costs nothing: measured by this server, or on this machine's disk (then remembered,
    so the file is read once)."""
    from analysis.measure.ruler import stored_dense
    known = dense_measured()
    if (repr(key), tasks, length, samples, seed) not in known:
        run, _ = stored_dense(cache.load(key), ruler_rows(key, tasks, length, samples, seed), compute=False,
                              fingerprint=longstate.fingerprint(key))
        if run is not None:
            known.add((repr(key), tasks, length, samples, seed))
    return (repr(key), tasks, length, samples, seed) in known


@longstate.forgotten_with_store
@st.cache_resource(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)   # it holds the rows (a resource)
def plan_report(key: ModelKey, tasks: tuple, length: int, samples: int, seed: int, plan: KVPlan,
                _progress=None, _should_stop=None):
    """RulerReport of the plan (cached by its contents) against the dense side (cached on its own, measured first
    with its own share of the progress); a plan with every KV head full is the dense side alone."""
    from analysis.arch.cut import Cut
    from analysis.core.progress import scaled
    from analysis.measure.ruler import ruler_report
    known = dense_known(key, tasks, length, samples, seed)
    rows = ruler_rows(key, tasks, length, samples, seed)
    dense = dense_side(key, tasks, length, samples, seed, _should_stop=_should_stop,     # before the lock
                       _progress=None if known else scaled(_progress, 0.0, 0.5))
    cut = None if plan.is_full else Cut.of_plan(plan, info=dict(source="the Long context page"))
    with cache.exclusive(key, _progress, _should_stop) as lm:
        return ruler_report(lm, rows, cut=cut, dense=dense, should_stop=_should_stop,
                            progress=_progress if known else scaled(_progress, 0.5, 1.0))


def _seconds(key: ModelKey, rows, known: bool, cut: bool) -> float:
    """This machine's predicted seconds of the run (components/jobs.py's "ruler"), the ruler command's estimate:
    analysis.measure.ruler.RulerWork.seconds, every row's prefill and every token it may generate at this machine's
    decode step for its length (one row a batch, as the harness generates), for the sides that run (at most: a row
    that stops at its answer is faster; the measured pace corrects it run after run)."""
    from analysis.measure.ruler import ruler_work
    work = ruler_work(rows, cut=cut, dense=not known)
    if not work.passes:
        return 0.0
    lengths = tuple(sorted(work.rows))
    return work.seconds(longstate.per_row(key, lengths), longstate.per_step(key, lengths, batch_tokens=1))


def table_rows(table: list[dict]) -> list[dict]:
    """The report's rows as the page's table: one row per task (the average last), the plan's columns when a plan
    was measured, LOST where its interval lies below dense's score."""
    def ci(r: dict, side: str) -> str:
        return f"{r[f'{side}_score']:.2f} [{r[f'{side}_low']:.2f}, {r[f'{side}_high']:.2f}]"
    out = []
    for r in table:
        row = {"task": r["label"], "rows": r["n"], "dense score": ci(r, "dense"),
               "dense s / row": f"{r['dense_prefill_s'] + r['dense_decode_s']:.1f}"}
        if "cut_score" in r:
            row.update({"plan score": ci(r, "cut"), "plan - dense": f"{r['change']:+.2f} [{r['change_low']:+.2f}, "
                                                                    f"{r['change_high']:+.2f}]",
                        "": "LOST" if r["lost"] else ""})
        out.append(row)
    return out


def not_test_cells(dense_map, tasks, length: int) -> list[str]:
    """The tasks that are not test cells at `length` in `dense_map` (analysis.measure.densemap; none when there is
    no map for the model)."""
    if dense_map is None:
        return []
    test = set(dense_map.test_set())
    return [t for t in tasks if (t, int(length)) not in test]


def ruler_section(lm, plan: KVPlan, context: int) -> None:
    """RULER of `plan` (a KVPlan of this model) at a length the user picks (RULER's lengths up to the model's
    context; 1k by default, what a CPU reads in minutes)."""
    from analysis.measure.harness import installed
    from analysis.measure.ruler import OFFLINE_TASKS, RULER_LENGTHS, RULER_TASKS
    st.subheader("RULER: the field's long-context benchmark")
    if not installed():
        from analysis.measure.harness import harness_missing
        st.info(harness_missing(), icon=":material/download:")
        return
    limit = longstate.context_limit(lm)
    lengths = [n for n in RULER_LENGTHS if n <= limit]
    if not lengths:
        st.caption(f"RULER's shortest rows are {RULER_LENGTHS[0]:,} tokens; this model reads {limit:,}.")
        return
    st.caption("Needles in a haystack, variable tracking, common and frequent words (lm-evaluation-harness's RULER "
               "tasks that need no download; the essay haystack is the built-in Wikipedia text): the model writes "
               "its answers greedily, scored by whether they contain each reference (the harness's string match). "
               "The plan generates with its own compact KV cache.")
    c1, c2, c3 = st.columns([4, 2, 2])
    tasks = c1.multiselect("Tasks", list(OFFLINE_TASKS), format_func=lambda n: RULER_TASKS[n].label,
                           key=state.widget_key("long.ruler.tasks", value=list(APP_TASKS)))
    fit = [n for n in lengths if n <= max(context, lengths[0])]
    length = int(c2.selectbox("Tokens per row", lengths, key=state.widget_key("long.ruler.length", value=fit[0]),
                              help="RULER's row lengths up to this model's context (a row's cost grows with its "
                                   "square; 1,024 takes minutes on a CPU)."))
    samples = int(c3.number_input("Rows per task", 1, MAX_SAMPLES_APP, step=1,
                                  key=state.widget_key("long.ruler.samples", value=APP_SAMPLES),
                                  help="Each row is one bootstrap unit; the bench takes 25 and more. More rows: "
                                       "narrower intervals, proportionally longer."))
    if not tasks:
        st.caption("Pick at least one task.")
        return
    outside = not_test_cells(longstate.dense_map(lm.name), tasks, length)
    if outside:
        st.warning(f"Dense does not pass {', '.join(RULER_TASKS[t].label for t in outside)} at {length:,} tokens in "
                   f"its map (below {PASS} on {MIN_ROWS} rows, or not measured): a plan's loss cannot show there, so "
                   "judge the plan on the map's test cells (Where dense passes, below).", icon=":material/rule:")
    args = (tuple(tasks), length, samples, 0)
    rows = None
    with shown_errors("Making RULER's rows"):
        rows = ruler_rows(state.model_key(), *args)
    if rows is None:
        return
    known = dense_known(state.model_key(), *args)
    cut = not plan.is_full
    if not cut:
        st.caption("Every KV head is full: the plan is the dense model, so the run measures dense alone.")
    sides = "dense is measured" if known else "dense and plan" if cut else "dense"
    counts = plan.counts()
    with shown_errors("RULER"):
        rep = cache.run_button(
            f"Run RULER on this plan ({rows.n_rows()} rows of {length:,} tokens, {sides})",
            button_key="long.ruler.run", slot="long.ruler", run_key=(state.model_key(), *args, plan.to_json()),
            fn=plan_report, args=(state.model_key(), *args, plan), label="Running RULER", kind="ruler",
            work=_seconds(state.model_key(), rows, known, cut),
            view=f"{counts['full']} full / {counts['window']} window / {counts['prune']} prune, {length:,} tokens",
            stale_note="The plan or RULER's settings changed since the last run ({view}); press the button again.")
        if rep is not None:
            _show(rep)


def _show(rep) -> None:
    numbers.cut_verdict(table_rows(rep.table()), cut=rep.cut is not None, warnings=rep.warnings(), lost="on RULER",
                        kept="No task lost: the plan's interval reaches dense's score on every task.",
                        notes=("Note: " + "; ".join(dict.fromkeys(rep.rows.notes)) + ".") if rep.rows.notes else "",
                        title="RULER", file="ruler", key="long.ruler", csv=numbers.csv_text(rep.table()),
                        as_json=json.dumps(rep.as_dict(), indent=1, default=str))
