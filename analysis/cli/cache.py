"""`python -m analysis cache`: the results kept on disk (analysis.core.store): list them, clear them, or warm them
for a class.

    python -m analysis cache [list] [--format json|csv]
    python -m analysis cache clear [--model M] [--measure long-scan|long-dense|kv-importance|detector-...]
    python -m analysis cache warm  [--model M] [--lengths 2048] [--probe passkey ...] [--depths 0.1,0.5,0.9]
                                   [--items 2] [--sinks 4] [--recent 256] [--precision float32|bfloat16]
                                   [--no-importance] [--refresh]

`warm` measures what the app's Long context page fills from the heads' scores and its probes' dense side, with
the page's defaults (analysis.measure.long_options PAGE_*: the pass key at 2,048 tokens clipped to the model's
context, depths 0.1 / 0.5 / 0.9, 2 sequences, 4 sink + 256 recent tokens, float32) or the options given: the scan
of the probes' calibration rows (analysis.score.longscan.stored_scan: the retrieval and streaming scores a plan is
chosen by, on other keys and the other half of the built-in text), the probes' dense side on their test rows (what
their verdicts read: stored_dense) and the KV groups' importance (256 tokens). Every page, session and command of this machine that asks the same of the
same model then reads them (docs/CLASS.md). Stored results are keyed by the model's fingerprint, the settings and
the code, so nothing stale is ever served; `clear` frees the disk (`--model` matches the name a result was
measured under or its fingerprint).
"""
from __future__ import annotations

import argparse

from analysis.cli.common import (add_output_arguments, add_source_arguments, add_store_arguments,
                                 check_precision_option, load_source, progress_bar, refused_line, register,
                                 stored_words)
from analysis.core.errors import InputError

ACTIONS = ("list", "clear", "warm")


def _arguments(parser):
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS
    from analysis.measure.long_options import DEFAULT_DEPTHS, PAGE_IMPORTANCE_TOKENS, PAGE_SEQUENCES
    from analysis.measure.probes.registry import PROBES
    parser.add_argument("action", choices=ACTIONS, nargs="?", default="list",
                        help="list the stored results (the default), clear them, or warm the Long context page's for "
                             "a model")
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--measure", default=None, help="clear: only this measure's results (see `cache list`)")
    parser.add_argument("--probe", action="append", default=None,
                        choices=[n for n, s in PROBES.items() if s.long],
                        help="warm: long-context probe (repeat for several; default: passkey, as the page)")
    parser.add_argument("--lengths", default=None, help="warm: tokens per row, comma-separated (default 2048, "
                                                        "clipped to the model's context)")
    parser.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                        help="warm: needle depths, comma-separated")
    parser.add_argument("--items", type=int, default=PAGE_SEQUENCES, help="warm: sequences per depth (default "
                                                                          f"{PAGE_SEQUENCES}, as the page)")
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINKS, help="warm: the window's sink tokens")
    parser.add_argument("--recent", type=int, default=DEFAULT_RECENT, help="warm: the window's recent tokens")
    parser.add_argument("--importance", action=argparse.BooleanOptionalAction, default=True,
                        help="warm: the KV groups' importance too (the ablation a plan prunes by; default: on)")
    parser.add_argument("--importance-tokens", dest="importance_tokens", type=int, default=PAGE_IMPORTANCE_TOKENS,
                        help=f"warm: tokens of the KV groups' ablation (default {PAGE_IMPORTANCE_TOKENS}, as the page)")
    add_store_arguments(parser)
    add_output_arguments(parser)


def run(ns):
    from analysis.core.store import Store
    store = Store()
    if ns.action == "list":
        rows = [dict(measure=e.measure, model=e.about.get("model_name", ""), stored=e.about.get("stored", ""),
                     seconds=e.about.get("seconds"), bytes=e.bytes, fingerprint=_short(e.key.get("model", "")),
                     file=str(e.path)) for e in store.entries()]
        return dict(folder=str(store.root), results=rows, bytes=sum(r["bytes"] for r in rows)), rows
    if ns.action == "clear":
        removed = store.clear(model=ns.model, measure=ns.measure)
        return dict(folder=str(store.root), removed=removed, model=ns.model, measure=ns.measure), None
    return warm(ns, store)


def _short(fingerprint: str) -> str:
    import hashlib
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:12] if fingerprint else ""


def warm(ns, store):
    from analysis.arch.window import Window
    from analysis.cli.roles import number_list
    from analysis.core.errors import check_whole_number
    from analysis.core.progress import scaled
    from analysis.measure.long_options import MAX_PROBE_SEQUENCES, MIN_PROBE_SEQUENCES
    from analysis.measure.longheads import check_depths, check_lengths
    from analysis.measure.longpass import check_precision
    from analysis.score.longscan import page_rows, stored_importance, stored_scan
    if ns.measure is not None:
        raise InputError("--measure is for `cache clear`; `cache warm` measures the Long context page's results.")
    lengths = number_list(ns.lengths, "--lengths")
    if lengths is not None:
        check_lengths(lengths)
    depths = check_depths(number_list(ns.depths, "--depths", float))
    check_whole_number(ns.items, "--items", low=MIN_PROBE_SEQUENCES, high=MAX_PROBE_SEQUENCES)
    check_whole_number(ns.importance_tokens, "--importance-tokens", low=2, high=2**20)
    window = Window(ns.sinks, ns.recent)
    check_precision_option(ns)
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    if loaded.kind != "causal-lm":
        raise InputError(f"The Long context page's results are a causal language model's; {info['source']} is a "
                         f"{loaded.kind}.")
    check_precision(ns.precision, loaded.device)
    from analysis.measure.splits import SCORE_SPLIT, TEST
    from analysis.score.longscan import stored_dense
    scored = page_rows(loaded, lengths, depths, probes=ns.probe, n_items=ns.items, split=SCORE_SPLIT)
    judged = page_rows(loaded, lengths, depths, probes=ns.probe, n_items=ns.items, split=TEST)
    found = {}
    with progress_bar("warming", not ns.quiet) as report:
        split = 0.8 if ns.importance else 1.0                 # the heads' scores on calibration rows, the probes'
        scan, found["scan"] = stored_scan(loaded, scored, window=window, precision=ns.precision,   # dense side on
                                          progress=scaled(report, 0.0, split / 2), refresh=ns.refresh,  # test rows
                                          on_refused=refused_line)
        _, found["dense"] = stored_dense(loaded, judged, window=window, precision=ns.precision,
                                         progress=scaled(report, split / 2, split), refresh=ns.refresh,
                                         on_refused=refused_line)
        if ns.importance:
            _, found["importance"] = stored_importance(loaded, ns.importance_tokens, precision=ns.precision,
                                                       progress=scaled(report, split, 1.0), refresh=ns.refresh,
                                                       on_refused=refused_line)
    stored_words(found, ns.quiet)
    rows = [dict(part=part, status=f.status, file=str(f.path) if f.path else "", seconds=f.about.get("seconds"))
            for part, f in found.items()]
    return dict(model=info, folder=str(store.root), scanned=scan.describe_rows(), window=window.as_dict(),
                precision=ns.precision, stored=rows), rows


register("cache", "the results kept on disk: list, clear, or warm the Long context page's (the shared long-context "
         "scan and the KV groups' importance) for a class", _arguments, run)
