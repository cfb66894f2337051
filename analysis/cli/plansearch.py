"""`python -m analysis plan-search`: a KV plan chosen whole against calibration answers at a target KV ratio.

    python -m analysis plan-search [--model M] --kv-target 0.5 [--context 4096] [--search greedy]
                                   [--tasks niah_single_1,niah_single_2] [--cal-length 1024] [--cal-samples 2]
                                   [--block 8] [--budget 0.1] [--sinks 4] [--recent 256] [--keep-partial]
                                   --out kv_plan.json

The rows it reads are calibration rows only (analysis.measure.splits: RULER's rows of --tasks at --cal-length,
split "calibration": the other half of the built-in text, other keys), so any verdict on RULER's test rows
(`headscope ruler --kv-plan kv_plan.json`, the default split) judges the plan on rows it was not chosen on. The
search (analysis.score.plansearch, PLAN_SEARCHES): the whole plan's calibration loss re-measured block by block; the
KV target is the cache held at --context tokens over dense's (0 < target <= 1).
Before the passes stderr gets an estimate; Ctrl-C stops the search, and nothing is written unless --keep-partial
(then the plan so far, marked STOPPED in its notes). `--out` gets kv_plan.json (atomic, checked before any work);
stdout gets a JSON summary: the plan's counts and KV, calibration loss and exact answers dense vs plan, the
evaluations, the trace, and the rows it was chosen on (their sha256).
Bad input (a target of 0 or above 1, a target windowing cannot reach, an unknown search or task) is one line,
before the model loads where it can be.
"""
from __future__ import annotations

from analysis.cli import common
from analysis.cli.common import add_source_arguments, progress_bar, register
from analysis.core.errors import InputError


def _arguments(parser):
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS
    from analysis.measure.long_options import DEFAULT_SEARCH_BLOCK as DEFAULT_BLOCK
    from analysis.measure.long_options import DEFAULT_SEARCH_BUDGET as DEFAULT_BUDGET
    from analysis.measure.long_options import PLAN_SEARCHES
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--kv-target", dest="kv_target", type=float, required=True,
                        help="the KV cache the plan may hold, as a fraction of dense's (above 0, at most 1)")
    parser.add_argument("--context", type=int, default=4096, help="tokens at which the KV target is measured")
    parser.add_argument("--search", choices=tuple(PLAN_SEARCHES), default="greedy")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1",
                        help="RULER tasks whose calibration rows the search reads (comma-separated)")
    parser.add_argument("--cal-length", dest="cal_length", type=int, default=1024,
                        help="tokens of each calibration row (a RULER length)")
    parser.add_argument("--cal-samples", dest="cal_samples", type=int, default=2,
                        help="calibration rows per task")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="KV heads tried at once")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help="nats a row the plan may lose on the calibration answers (mean over rows)")
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINKS)
    parser.add_argument("--recent", type=int, default=DEFAULT_RECENT)
    parser.add_argument("--keep-partial", dest="keep_partial", action="store_true",
                        help="on Ctrl-C, write the plan found so far (marked STOPPED) instead of nothing")
    parser.add_argument("--out", dest="plan_out", required=True, help="kv_plan.json to write")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run_plan_search(ns):
    from analysis.arch.window import Window
    from analysis.core.atomic import atomic_write, check_output_file
    from analysis.measure.ruler import build_ruler, check_ruler_lengths, check_samples, check_tasks
    from analysis.score.plansearch import plan_search, ruler_answer_rows
    check_output_file(ns.plan_out, "--out")
    tasks = check_tasks(ns.tasks)
    check_ruler_lengths(ns.cal_length)
    check_samples(ns.cal_samples, "--cal-samples")
    search = plan_search(ns.search, target=ns.kv_target, context=ns.context, window=Window(ns.sinks, ns.recent),
                         block=ns.block, budget=ns.budget)                  # the options' checks, before the model
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = common.load_source(ns, report)
    if loaded.kind != "causal-lm":
        raise InputError(f"A KV plan reads a causal language model's attention; {info['source']} is a {loaded.kind}.")
    search.needed(loaded.geometry)                                           # the target reachable by windowing
    from analysis.measure.evaluation import context_length
    limit = context_length(loaded.model, default=2**31)
    with progress_bar("making the calibration rows", not ns.quiet) as report:
        cal = build_ruler(tasks, loaded.tokenizer, (ns.cal_length,), samples=ns.cal_samples, seed=0,
                          split="calibration", limit=limit, progress=report)
    rows = ruler_answer_rows(cal, loaded.tokenizer)
    rows_used = dict(chosen_on=dict(split=cal.split, what=f"RULER {', '.join(tasks)} at {ns.cal_length:,}, seed 0",
                                    rows=len(rows), digest=cal.digest))
    if not ns.quiet:
        import sys

        from analysis.core.progress import duration_words
        from analysis.measure.probes.longcontext import row_seconds
        per = row_seconds(loaded.model, [ns.cal_length], geometry=loaded.geometry)[ns.cal_length]
        sys.stderr.write(f"estimate: at least {duration_words(search.estimate(loaded.geometry, rows, lambda T: per))} "
                         f"({search.evaluations(loaded.geometry)}+ evaluations of {len(rows)} calibration rows, "
                         f"{duration_words(per)} a row on this machine)\n")
    with progress_bar("plan search", not ns.quiet) as report:
        result = search.search(loaded, rows, progress=report, keep_partial=ns.keep_partial, rows_used=rows_used)
    from analysis.core import progress as cancel
    if result.partial:
        cancel.clear_stop()                               # asked for: the plan so far is the result
    cancel.raise_if_signalled()                           # stopped after the last cancel point: write nothing
    atomic_write(ns.plan_out, result.plan.with_modes(result.plan.modes, "rows: " + _rows_words(rows_used))
                 .to_json() + "\n", what="--out")
    payload = dict(model=info, out=ns.plan_out, plan=dict(describe=result.plan.describe(), counts=result.plan.counts(),
                                                         notes=list(result.plan.notes)),
                   search=result.summary(), trace=result.trace)
    return payload, None


def _rows_words(rows_used: dict) -> str:
    from analysis.measure.splits import RowsUsed
    return RowsUsed(rows_used["chosen_on"]).describe()


register("plan-search", "a KV plan chosen whole against calibration answers at a target KV ratio (greedy search; "
         "calibration rows drawn apart from RULER's test rows) -> kv_plan.json", _arguments, run_plan_search)
