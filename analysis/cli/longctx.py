"""`python -m analysis longctx`: the long-context probes (passkey, passkey-once, needle, long-range copying) at
chosen context lengths and depths, dense and under a cut, with CIs.

    python -m analysis longctx [--model M] [--probe passkey|passkey-once|needle|long-copying ...] [--lengths 1024,2048]
                               [--depths 0.1,0.5,0.9] [--items 16] [--probe-seed S] [--bos auto|none|bos|eos]
                               [--sparsity S (+ scorer / policy options) | --mask-file F | --kv-plan F | --export DIR]
                               [--format json|csv] [--out F] [--quiet]

A cut is a mask (scored here with --sparsity, or a mask.json / an export folder's mask.json with --mask-file)
applied to --model, a KV plan (kv_plan.json, or a folder holding one: per KV head full / window / prune) run
on --model, or an export folder's own weights (--export) measured on the same items (under the folder's
kv_plan.json when it has one: its windows on its own KV heads, analysis.compress.export.planned.cut_of_folder;
one set of cut options for every report: analysis.cli.common.add_cut_arguments). Before the passes the
command prints an estimate of the time (stderr; this machine's pace from a short timed forward and the
attention kernel at each length, and from a timed decode step for the generated answers:
analysis.measure.probes.longcontext.row_seconds, step_seconds).
The digit-answer probes (passkey, passkey-once, needle) are judged twice: teacher-forced (each digit against a
contrast digit) and by the generated answer (greedy decoding under the cut with its own cache; right when the
continuation's first number is the key), with the rows lost / gained and McNemar's p per cell.
JSON: {"model", "seed", "items": per probe and length (rows, items, sequences, rejected), "estimate_s",
"per_row_s", "per_step_s", "report": analysis.score.longcontext.LongContextReport.as_dict()}; CSV: one row per
probe x length x depth (and "all" depths): dense accuracy [CI], exact match [CI], generated exact match [CI], the
cut's, lost, lost generated, rows lost / gained, McNemar p.
Bad input (a length above the model's context, a depth outside [0, 1], a short probe's name, a plan of
another model or with a window of 0, two cuts at once) is one line, and nothing is written.
"""
from __future__ import annotations

from analysis.cli.common import (add_cut_arguments, add_output_arguments, add_source_arguments, add_store_arguments,
                                 check_one_cut, check_precision_option, cut_from, progress_bar, refused_line, register,
                                 stored_words, warn)
from analysis.core.errors import InputError


def _arguments(parser):
    from analysis.measure.long_options import DEFAULT_DEPTHS, PROBE_LENGTH as DEFAULT_LENGTH, PROBE_SEQUENCES
    from analysis.measure.probes.registry import BOS_CHOICES, PROBES
    long = [n for n, s in PROBES.items() if s.long]
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--probe", action="append", default=None,
                        help="long-context probe to run (repeat for several; default: all): "
                             + "; ".join(f"{n}: {PROBES[n].help}" for n in long))
    parser.add_argument("--lengths", default=str(DEFAULT_LENGTH),
                        help=f"context lengths in tokens, comma-separated (the whole row; default {DEFAULT_LENGTH}; "
                             f"at most the model's own context)")
    parser.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                        help="where the needle goes, as fractions of the text (0 = first, 1 = last), comma-separated")
    parser.add_argument("--items", type=int, default=PROBE_SEQUENCES,
                        help=f"sequences (keys, texts) per length and depth (default {PROBE_SEQUENCES})")
    parser.add_argument("--probe-seed", dest="probe_seed", type=int, default=0,
                        help="which keys and texts (and the bootstrap's resamples); --seed is the random scorer's")
    parser.add_argument("--bos", choices=BOS_CHOICES, default="auto",
                        help="what a row starts with: auto = what the tokenizer adds itself")
    add_cut_arguments(parser)
    add_store_arguments(parser)
    add_output_arguments(parser)


def _numbers(text: str, flag: str, kind):
    """'1024,2048' -> (1024, 2048) of `kind`; InputError naming the flag."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = tuple(kind(p) for p in parts)
    except ValueError:
        raise InputError(f"{flag} takes comma-separated {'whole numbers' if kind is int else 'numbers'}; "
                         f"got {text!r}.") from None
    if not values:
        raise InputError(f"{flag} is empty; give at least one value.")
    return values


def run_longctx(ns):
    from analysis.core.errors import check_whole_number
    from analysis.measure.long_options import MAX_PROBE_SEQUENCES, MIN_PROBE_SEQUENCES
    from analysis.measure.probes.registry import long_chosen
    check_one_cut(ns)
    lengths = _numbers(ns.lengths, "--lengths", int)
    for n in lengths:
        check_whole_number(n, "--lengths", low=1)
    depths = _numbers(ns.depths, "--depths", float)
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise InputError(f"--depths are fractions of the text, 0 to 1; got {bad[0]:g}.")
    check_whole_number(ns.items, "--items", low=MIN_PROBE_SEQUENCES, high=MAX_PROBE_SEQUENCES)
    long_chosen(ns.probe)                                                # bad options fail before the model loads
    check_precision_option(ns)
    import sys

    from analysis.core.progress import duration_words, scaled, with_estimate
    from analysis.measure.evaluation import context_length
    from analysis.measure.probes.longcontext import build_long, row_seconds, step_seconds
    from analysis.score.longcontext import report_work
    from analysis.arch.models import materialize
    cut, loaded, info = cut_from(ns, deferred=not ns.refresh)     # the weights are read on a miss only
    limit = context_length(loaded, default=2**31)             # a deferred load has no model: its config
    if cut is not None and cut.kind == "model":
        limit = min(limit, context_length(cut.model, default=2**31))
    built = build_long(ns.probe, loaded.tokenizer, loaded.kind, lengths, depths=depths, n_items=ns.items,
                       seed=ns.probe_seed, bos=ns.bos, limit=limit)          # bad lengths fail before any pass
    from analysis.measure.longpass import check_precision, precision_block
    from analysis.score.longscan import stored_dense, stored_report
    check_precision(ns.precision, loaded.device)                          # bfloat16 without its kernels: refused now
    stored = dict(seed=ns.probe_seed, precision=ns.precision, refresh=ns.refresh, on_refused=refused_line)
    dense, found = stored_dense(loaded, built, compute=False, **stored)
    rep, found_cut = (None, None) if dense is None else stored_report(loaded, built, cut, dense=dense, compute=False,
                                                                      **stored)
    if dense is None or (cut is not None and rep is None):
        with progress_bar("loading", not ns.quiet) as report:
            loaded = materialize(loaded, report)                  # something to measure: the weights
    work = report_work(built, dense, cut=cut is not None and rep is None)
    per_row = row_seconds(loaded.model, sorted(work.rows), geometry=loaded.geometry) if work.rows else {}
    per_step = step_seconds(loaded.model, sorted(work.steps), geometry=loaded.geometry) if work.steps else {}
    estimate = work.seconds(per_row, per_step)
    if not ns.quiet:
        stored_words({"dense side": found, **({"the cut's side": found_cut} if rep is not None else {})})
        if work.rows:
            rows = ", ".join(f"{r} x {n:,}" for n, r in work.rows.items())
            steps = sum(work.steps.values())
            sides = ("dense and cut" if dense is None else "the cut's") if cut is not None else "dense"
            sys.stderr.write(f"estimate: about {duration_words(estimate)} for {sum(work.rows.values())} rows ({rows} "
                             f"tokens" + (f", {steps} decode calls for the generated answers" if steps else "")
                             + f", {sides}; this machine: "
                             + ", ".join(f"{n:,} tokens {duration_words(s)} a row" for n, s in per_row.items()) + ")\n")
    with progress_bar("long-context probes", not ns.quiet) as report:
        progress = with_estimate(report)
        share = 0.0 if dense is not None else (1.0 if cut is None else 0.5)
        if dense is None:                    # the dense passes, with the heads' scores read from them (stored)
            dense, _ = stored_dense(loaded, built, progress=scaled(progress, 0.0, share), **stored)
        if rep is None:
            with precision_block(loaded.model, ns.precision):
                rep, found_cut = stored_report(loaded, built, cut, dense=dense, per_row=per_row,
                                               progress=scaled(progress, share, 1.0), **stored)
    from dataclasses import replace
    rep = replace(rep, work=work)                      # what this run read (the dense side's rows too, unless stored)
    warn(rep.warnings())
    payload = dict(model=info, seed=ns.probe_seed, context_limit=limit,
                   items={f"{name}@{length}": dict(rows=int(items.ids.shape[0]), n_items=items.n_items,
                                                   n_units=items.n_units, rejected=items.rejected_counts())
                          for (name, length), (_, _, items) in built.items()},
                   estimate_s=estimate, per_row_s={str(n): s for n, s in per_row.items()},
                   per_step_s={str(n): s for n, s in per_step.items()}, report=rep.as_dict(),
                   precision=ns.precision, stored=dict(dense=found.status, cut=None if cut is None or found_cut is None
                                                      else found_cut.status))
    return payload, rep.rows()



register("longctx", "long-context probes (passkey, passkey stated once, needle with a distractor, long-range copying) "
         "at chosen lengths and depths, teacher-forced and generated: dense vs a mask, a KV plan or an export, with "
         "CIs", _arguments, run_longctx)
