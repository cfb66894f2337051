"""`python -m analysis ruler`: RULER's offline tasks (lm-evaluation-harness's `ruler` group, rows generated here)
on the model, greedy generations scored by the harness's string match, per task and length with CIs
(analysis.measure.ruler).

    python -m analysis ruler [--model M] [--tasks all|niah_single_1,ruler_vt,...] [--lengths 1024,2048]
                             [--samples 25] [--ruler-seed S] [--split test|calibration]
                             [--rows-out rows.jsonl [--rows-only]] [--test-set MAP] [--map-out MAP]
                             [--sparsity S (+ scorer / policy options) | --mask-file F | --kv-plan F | --export DIR]
                             [--refresh] [--format json|csv] [--out F] [--quiet]

Dense, and (given one) a cut: the cut options every report takes (analysis.cli.common.add_cut_arguments); a KV
plan generates with its compact cache, an export folder under its kv_plan.json.
The dense side is kept on disk (analysis.core.store, measure "ruler-dense": this model's run of these very rows
by this code), so the next run, another cut or the app's Long context page reads it back (--refresh measures
it again; `cache list` / `cache clear` show and free it). Before the generations the command prints an
estimate of the time on stderr (at most: every row's prefill from analysis.measure.probes.longcontext.
row_seconds and every token it may generate at this machine's decode step at that length, for the sides
that run). --rows-out writes the exact rows as JSONL (token ids split into context / question, references,
max_new_tokens, stop strings) as soon as they are made, so a peer tool can run the very same rows;
--rows-only stops there.
--map-out MAP keeps dense's score on every task x length cell of the run in a dense map (JSON,
analysis.measure.densemap; cells added to the file's own when it is this model's map), whose test cells (dense >=
0.8 on >= 25 rows) `--test-set MAP` then judges on: with --tasks all the map's test cells at --lengths, with tasks
named each asked cell must be one (a task dense never passes there is refused: no loss could show on it).
JSON: {"model", "estimate_s", "per_row_s", "per_step_s", "rows_out", "report":
analysis.measure.ruler.RulerReport.as_dict()}; CSV: one row per task x length (and the average over tasks):
score [CI], seconds, decode speed and KV bytes per row.
Bad input (a task that downloads or is unknown, a length that is not RULER's or is above the model's context,
--samples outside 1..500, a tokenizer that cannot make the rows, a --test-set map of another model or a cell
outside its test set, --test-set or --map-out with calibration rows) is one line, and nothing is written.
"""
from __future__ import annotations

from analysis.cli.common import (add_cut_arguments, add_output_arguments, add_source_arguments, add_store_arguments,
                                 check_one_cut, cut_from, progress_bar, refused_line, register, stored_words)
from analysis.core.errors import InputError


def _arguments(parser):
    from analysis.measure.ruler import DEFAULT_LENGTHS, DEFAULT_SAMPLES, MAX_SAMPLES, OFFLINE_TASKS, RULER_LENGTHS
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--tasks", default="all",
                        help=f"comma-separated RULER tasks, or all (default): {', '.join(OFFLINE_TASKS)} "
                             "(qa_squad / qa_hotpot download their data: refused)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                        help=f"row lengths in tokens, comma-separated, among {', '.join(map(str, RULER_LENGTHS))} "
                             "(at most the model's context)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES,
                        help=f"rows per task and length, 1 to {MAX_SAMPLES} (default {DEFAULT_SAMPLES})")
    parser.add_argument("--ruler-seed", dest="ruler_seed", type=int, default=0,
                        help="which rows (and the bootstrap's resamples); --seed is the random scorer's")
    parser.add_argument("--split", choices=("test", "calibration"), default="test",
                        help="test rows (what verdicts read; the default) or calibration rows drawn apart from them "
                             "(the other half of the built-in text, other keys: what a plan search reads)")
    parser.add_argument("--rows-out", dest="rows_out", default=None,
                        help="write the exact rows here as JSONL (token ids split into context / question, "
                             "references, max_new_tokens, stop strings) for a peer tool")
    parser.add_argument("--rows-only", dest="rows_only", action="store_true",
                        help="with --rows-out: make and write the rows, generate nothing")
    parser.add_argument("--test-set", dest="test_set", default=None, metavar="MAP",
                        help="judge only on this dense map's test cells (dense >= 0.8 on >= 25 rows): with --tasks "
                             "all, its test cells at --lengths; named tasks must each be one")
    parser.add_argument("--map-out", dest="map_out", default=None, metavar="MAP",
                        help="keep dense's score per task x length in this dense map (JSON; cells added to the "
                             "file's own when it is this model's map)")
    add_cut_arguments(parser)
    add_store_arguments(parser, precision=False)
    add_output_arguments(parser)


def _lengths(text: str) -> tuple:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise InputError(f"--lengths takes comma-separated whole numbers of tokens; got {text!r}.") from None


def _model(ns) -> str:
    """The model's name as given (a dense map names the model it was measured on so)."""
    from analysis.arch.models import DEFAULT_MODEL
    return ns.model or DEFAULT_MODEL


def judged_cells(ns, names: tuple, lengths: tuple):
    """The (task, length) cells to run: every task at every length, or with --test-set the map's test cells among
    them (InputError, one line: a map of another model, calibration rows, a named cell dense does not pass)."""
    if ns.test_set is None:
        return None
    from analysis.measure.densemap import DenseMap
    from analysis.measure.splits import TEST
    if ns.split != TEST:
        raise InputError("--test-set judges on test rows; it cannot be given with --split calibration.")
    dense_map = DenseMap.read(ns.test_set)
    if dense_map.model != _model(ns):
        raise InputError(f"The dense map {ns.test_set} was measured on {dense_map.model}, not {_model(ns)}: its test "
                         f"set says nothing about this model (make one with --map-out).")
    if str(ns.tasks).strip().lower() != "all":
        return dense_map.check_test_cells([(t, n) for t in names for n in lengths])
    from analysis.measure.ruler import OFFLINE_TASKS
    cells = [(t, n) for t, n in dense_map.test_set() if n in lengths and t in OFFLINE_TASKS]   # the map's probes: longctx's
    if not cells:
        raise InputError(f"The dense map {ns.test_set} has no test cell at {', '.join(f'{n:,}' for n in lengths)} "
                         f"tokens (dense passes nothing measured there); pick other --lengths.")
    return cells


def write_map(path: str, model: str, rep) -> None:
    """Dense's cells of a report added to the dense map at `path` (this model's; a new one when absent)."""
    from pathlib import Path

    from analysis.measure.densemap import DenseCell, DenseMap
    from analysis.measure.ruler import AVERAGE
    dense_map = DenseMap.read(path) if Path(path).exists() else DenseMap(model)
    for c in rep.cells:
        if c.task != AVERAGE:
            dense_map.add(DenseCell.of_ruler(c, rep.rows.split))
    dense_map.write(path)


def _check_map_out(ns) -> None:
    from pathlib import Path

    from analysis.core.atomic import check_output_file
    from analysis.measure.densemap import DenseMap
    from analysis.measure.splits import TEST
    check_output_file(ns.map_out, "--map-out")
    if ns.split != TEST:
        raise InputError("--map-out keeps dense's map of test rows (what the test set is); it cannot be given with "
                         "--split calibration.")
    if Path(ns.map_out).exists():
        found = DenseMap.read(ns.map_out)
        if found.model != _model(ns):
            raise InputError(f"--map-out {ns.map_out} is a dense map of {found.model}, not {_model(ns)}; give "
                             f"another file.")


def run_ruler(ns):
    from analysis.core.atomic import check_output_file
    from analysis.measure.ruler import check_ruler_lengths, check_samples, check_tasks
    names = check_tasks(ns.tasks)                                   # bad options fail before the model loads
    lengths = check_ruler_lengths(_lengths(ns.lengths))
    check_samples(ns.samples, "--samples")
    from analysis.core.errors import check_seed
    check_seed(ns.ruler_seed, "--ruler-seed")
    if ns.rows_only and ns.rows_out is None:
        raise InputError("--rows-only writes the rows only: give --rows-out FILE with it.")
    if ns.rows_out is not None:
        check_output_file(ns.rows_out, "The rows file")
    if ns.map_out is not None:
        _check_map_out(ns)
    cells = judged_cells(ns, names, lengths)                        # a cell outside the test set: before the model
    check_one_cut(ns)
    from analysis.measure.harness import require_harness
    require_harness()
    cut, loaded, info = cut_from(ns)
    if loaded.kind != "causal-lm":
        raise InputError(f"RULER scores a causal language model's generations; {loaded.name} is a {loaded.kind} model.")
    from analysis.core.atomic import atomic_write
    from analysis.core.progress import duration_words, scaled, with_estimate
    from analysis.measure.evaluation import context_length
    from analysis.measure.probes.longcontext import row_seconds, step_seconds
    from analysis.measure.ruler import (build_ruler, export_rows, ruler_report, ruler_work, rows_jsonl,
                                        stored_dense)
    limit = context_length(loaded.model, default=2**31)
    check_ruler_lengths(lengths, limit)                              # above the model's context: before any row
    with progress_bar("making RULER's rows", not ns.quiet) as report:
        rows = build_ruler(names, loaded.tokenizer, lengths, samples=ns.samples, seed=ns.ruler_seed, split=ns.split,
                           limit=limit, cells=cells, progress=report)
    if ns.rows_out is not None:
        atomic_write(ns.rows_out, rows_jsonl(export_rows(rows, loaded.tokenizer)), what="The rows file")
    if ns.rows_only:
        return dict(model=info, rows_out=ns.rows_out, rows=rows.n_rows(), ruler=rows.info()), None
    dense, found = stored_dense(loaded, rows, compute=False, refresh=ns.refresh, on_refused=refused_line)
    work = ruler_work(rows, cut=cut is not None, dense=dense is None)
    per_row = row_seconds(loaded.model, sorted(work.rows), geometry=loaded.geometry)
    per_step = step_seconds(loaded.model, sorted(work.rows), batch_tokens=1, geometry=loaded.geometry)  # row by row
    estimate = work.seconds(per_row, per_step)
    if not ns.quiet:
        import sys
        stored_words({"the dense side": found})
        if work.passes:
            sides = ("dense and cut" if work.passes == 2 else "the cut's" if cut is not None else "dense")
            sys.stderr.write(f"estimate: at most {duration_words(estimate)} for {rows.n_rows()} rows ("
                             + ", ".join(f"{r} x {n:,} tokens" for n, r in work.rows.items())
                             + f", up to {work.steps:,} generated tokens a side, {sides}; this machine: "
                             + ", ".join(f"{n:,} tokens {duration_words(s)} a prefill, {per_step[n]:.2f} s a decode "
                                         "step" for n, s in per_row.items()) + ")\n")
    with progress_bar("RULER", not ns.quiet) as report:
        progress = with_estimate(report)
        share = 0.0 if dense is not None else (1.0 if cut is None else 0.5)
        if dense is None:                          # generated, then kept on disk for the next run and the app
            dense, _ = stored_dense(loaded, rows, refresh=ns.refresh, on_refused=refused_line,
                                    progress=scaled(progress, 0.0, share))
        rep = ruler_report(loaded, rows, cut=cut, dense=dense, progress=scaled(progress, share, 1.0))
    if ns.map_out is not None:
        write_map(ns.map_out, _model(ns), rep)
    payload = dict(model=info, estimate_s=estimate, per_row_s={str(n): s for n, s in per_row.items()},
                   per_step_s={str(n): s for n, s in per_step.items()},
                   rows_out=ns.rows_out, report=rep.as_dict())
    return payload, rep.table()


register("ruler", "RULER's offline tasks (needles, variable tracking, common / frequent words) at chosen lengths: "
         "greedy generations scored by the harness's string match, with CIs; the exact rows as JSONL", _arguments,
         run_ruler)
