"""`python -m analysis kv-plan`: measure a window score (and the retrieval score), write a per-KV-head plan.

    python -m analysis kv-plan [--model M] --window-share 0.5 [--prune-share 0.25] [--no-keep-retrieval]
                               [--window-score streaming|retrieval-aware]
                               [--sinks 4] [--recent 256] [--lengths 2048] [--depths 0.1,0.5,0.9]
                               [--prune-tokens 256] --out kv_plan.json

The plan (analysis.score.kvscores.plan_from_scores -> plan_kv): the `--prune-share`
of KV heads with the lowest KV-group ablation loss (on --prune-tokens tokens of the built-in text) are
pruned, then the `--window-share` with the lowest `--window-score` are windowed (sinks + recent tokens;
streaming: the output change under the window on plain text, the default; retrieval-aware: the needle
answers' log-probability lost when the KV head alone is windowed, L x KV heads passes per row, slow),
KV heads holding a retrieval head stay full (unless --no-keep-retrieval, which also skips measuring it).
kv_plan.json's notes name the window score.
`--out` gets kv_plan.json (atomic; checked before any work); stdout gets a JSON summary: the plan's
counts, its KV cache against dense at the measured lengths and the model's context, the scores per KV
head and the seconds spent. Every score is kept on disk (analysis.score.longscan, `headscope cache`): run again
with the same model, options and code, it is read back (`"stored"` says "hit"); `--refresh` measures again.
`--rows probes` reads both scores from one shared scan of the Long context page's probe rows (the results the
app stores), `--precision bfloat16` runs that scan in bfloat16 where the CPU has the kernels.

Plans that travel (DuoAttention's pattern folder, analysis.compress.export.duo; docs/PEERS.md):

    python -m analysis kv-plan ... --to-duo DIR [--duo-pruned refuse|full|window]
    python -m analysis kv-plan --plan kv_plan.json --to-duo DIR          # an existing plan, nothing measured
    python -m analysis kv-plan [--model M] --from-duo DIR [--duo-threshold 0.5 | --duo-sparsity S] --out kv_plan.json
    ... --compare kv_plan.json|DIR                                         # which KV heads both keep full

`--to-duo` writes full_attention_heads.tsv + config.json (what DuoAttention and kvpress's DuoAttentionPress
read) and the plan's kv_plan.json into a new folder (atomic). `--from-duo` takes the plan from a pattern
folder instead of measuring (the gates thresholded as DuoAttention does; the model's layers and KV heads
checked). `--plan` takes an existing kv_plan.json. `--compare` adds the agreement on full KV heads with another
plan (a kv_plan.json, or a pattern folder thresholded by the same --duo-threshold / --duo-sparsity).
"""
from __future__ import annotations

import argparse

from analysis.cli.common import (add_source_arguments, add_store_arguments, check_counts, check_precision_option,
                                 load_source, progress_bar, refused_line, register, stored_words)
from analysis.cli.roles import number_list


def _arguments(parser):
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS
    from analysis.measure.long_options import (DEFAULT_NEEDLES, DEFAULT_PRUNE_TOKENS, DEFAULT_QUERIES,
                                               DEFAULT_WINDOW_SCORE, RETRIEVAL_THRESHOLD, WINDOW_SCORES)
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--window-share", dest="window_share", type=float, default=0.5,
                        help="share of the KV heads to window, lowest window score first (0 to 1; default 0.5)")
    parser.add_argument("--window-score", dest="window_score", choices=WINDOW_SCORES, default=DEFAULT_WINDOW_SCORE,
                        help=f"the score that chooses the windowed KV heads (default {DEFAULT_WINDOW_SCORE}): streaming = "
                             f"output change under the window on plain text (one pass per text); retrieval-aware = "
                             f"needle answers' log-probability lost when the KV head alone is windowed (about 1 + KV "
                             f"heads x (layers + 1) / 2 passes per needle row)")
    parser.add_argument("--prune-share", dest="prune_share", type=float, default=0.0,
                        help="share of the KV heads to prune, lowest KV-group ablation loss first (default 0)")
    parser.add_argument("--keep-retrieval", dest="keep_retrieval", action=argparse.BooleanOptionalAction,
                        default=True, help="measure the retrieval score and keep KV heads with a retrieval head full "
                                           "(default: on)")
    parser.add_argument("--retrieval-threshold", dest="retrieval_threshold", type=float, default=RETRIEVAL_THRESHOLD,
                        help=f"a retrieval head copies at least this share of the needle (default {RETRIEVAL_THRESHOLD})")
    parser.add_argument("--sinks", type=int, default=DEFAULT_SINKS, help=f"sink tokens a window keeps (default "
                                                                        f"{DEFAULT_SINKS})")
    parser.add_argument("--recent", type=int, default=DEFAULT_RECENT,
                        help=f"recent tokens a window keeps, the query's own included (default {DEFAULT_RECENT})")
    parser.add_argument("--lengths", default=None,
                        help="context lengths (tokens, comma-separated) the scores are measured at (default 2048 for "
                             "the streaming score, 1024,2048 for retrieval; at most the model's context)")
    parser.add_argument("--depths", default=None, help="retrieval (and retrieval-aware) needle depths, comma-separated "
                                                       "(default 0.1,0.5,0.9)")
    parser.add_argument("--needles", type=int, default=DEFAULT_NEEDLES, help="retrieval needles per length and depth")
    parser.add_argument("--queries", type=int, default=DEFAULT_QUERIES,
                        help="query rows sampled beyond the window per sequence (streaming score)")
    parser.add_argument("--prune-tokens", dest="prune_tokens", type=int, default=DEFAULT_PRUNE_TOKENS,
                        help="tokens of built-in text for the KV-group ablation (with --prune-share)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the texts and needles")
    add_store_arguments(parser, rows=True)
    parser.add_argument("--out", dest="plan_out", default=None, help="write kv_plan.json here (atomic)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--plan", dest="plan_file", default=None, metavar="FILE",
                       help="an existing kv_plan.json instead of measuring (for --to-duo / --compare)")
    given.add_argument("--from-duo", dest="from_duo", default=None, metavar="DIR",
                       help="the plan from a DuoAttention pattern folder (full_attention_heads.tsv + config.json) "
                            "instead of measuring")
    parser.add_argument("--to-duo", dest="to_duo", default=None, metavar="DIR",
                        help="also write the plan as a DuoAttention pattern folder (new or empty; atomic)")
    parser.add_argument("--duo-pruned", dest="duo_pruned", choices=("refuse", "full", "window"), default="refuse",
                        help="a pruned KV head in --to-duo: refused (default), or written as a full / streaming "
                             "gate (for a model whose pruned heads are zeroed)")
    duo = parser.add_mutually_exclusive_group()
    duo.add_argument("--duo-threshold", dest="duo_threshold", type=float, default=None,
                     help="a pattern's KV head is full when its gate >= this (default 0.5, DuoAttention's)")
    duo.add_argument("--duo-sparsity", dest="duo_sparsity", type=float, default=None,
                     help="instead: this share of a pattern's KV heads streaming, lowest gates first "
                          "(DuoAttention's quantile rule)")
    parser.add_argument("--compare", default=None, metavar="PLAN",
                        help="a kv_plan.json or a DuoAttention pattern folder: which KV heads both plans keep full")


def run(ns):
    from analysis.compress.export.duo import check_gate_rule, check_pattern_target, looked_up
    from analysis.core.atomic import check_output_file
    if ns.plan_out is not None:
        check_output_file(ns.plan_out, "--out")
    if ns.plan_file is not None:
        looked_up(ns.plan_file, "--plan")                # a name too long is one line (read_kv_plan's is_dir raises)
    if ns.to_duo is not None:
        check_pattern_target(ns.to_duo)
    check_gate_rule(ns.duo_threshold, ns.duo_sparsity)
    other = _read_compare(ns.compare) if ns.compare is not None else None    # its own checks before any work
    if ns.plan_file is not None or ns.from_duo is not None:
        plan, payload = _given_plan(ns)
    else:
        plan, payload = _measured_plan(ns)
    return _travel(ns, plan, payload, other), None


def _given_plan(ns):
    """(plan, payload) of --plan FILE or --from-duo DIR: nothing measured."""
    from analysis.arch.kvplan import read_kv_plan
    if ns.plan_file is not None:
        plan = read_kv_plan(ns.plan_file)
        info = dict(source=ns.plan_file, model=plan.model)
    else:
        from analysis.compress.export.duo import plan_from_pattern, read_pattern
        pattern = read_pattern(ns.from_duo)                  # the files' own checks before the model loads
        with progress_bar("loading", not ns.quiet) as report:
            _, loaded, info = load_source(ns, report)
        plan = plan_from_pattern(pattern, loaded.geometry, threshold=ns.duo_threshold, sparsity=ns.duo_sparsity,
                                 model=loaded.name)
    _write_plan(ns, plan)
    return plan, dict(model=info, plan=_plan_summary(plan), out=ns.plan_out)


def _travel(ns, plan, payload: dict, other) -> dict:
    """--compare and --to-duo, after the plan is made (and written)."""
    from analysis.compress.export import duo
    if other is not None:
        if isinstance(other, duo.DuoPattern):
            other = duo.plan_from_pattern(other, n_heads=plan.n_heads, threshold=ns.duo_threshold,
                                          sparsity=ns.duo_sparsity)
        payload["agreement"] = dict(plan=ns.compare, **duo.full_agreement(plan, other).as_dict(("this", "other")))
    if ns.to_duo is not None:
        duo.write_pattern(ns.to_duo, duo.pattern_from_plan(plan, pruned=ns.duo_pruned), plan=plan)
        payload["duo"] = ns.to_duo
    return payload


def _read_compare(source: str):
    """--compare's plan: a DuoPattern (a folder holding full_attention_heads.tsv) or a KVPlan (kv_plan.json)."""
    from analysis.compress.export.duo import is_pattern_folder, read_pattern
    from analysis.arch.kvplan import read_kv_plan
    return read_pattern(source) if is_pattern_folder(source) else read_kv_plan(source)


def _write_plan(ns, plan) -> None:
    from analysis.core import progress as cancel
    from analysis.core.atomic import atomic_write
    cancel.raise_if_signalled()                          # stopped after the last cancel point: write nothing
    if ns.plan_out is not None:
        atomic_write(ns.plan_out, plan.to_json() + "\n", what="--out")


def _plan_summary(plan) -> dict:
    return dict(describe=plan.describe(), counts=plan.counts(), **plan.window.as_dict(), notes=list(plan.notes),
                modes=plan.as_dict()["modes"])


def _measured_plan(ns):
    from analysis.arch.window import Window
    from analysis.core.errors import InputError
    from analysis.measure.evaluation import context_length
    from analysis.measure.longheads import DEFAULT_DEPTHS, MAX_NEEDLES, MAX_QUERIES, check_depths, check_lengths
    from analysis.score.kvscores import check_plan_options, kv_heads_summary, plan_from_scores
    check_counts(ns, {"needles": (1, MAX_NEEDLES), "queries": (1, MAX_QUERIES), "prune_tokens": (2, 2**20)})
    window = Window(ns.sinks, ns.recent)
    lengths = number_list(ns.lengths, "--lengths")
    depths = check_depths(number_list(ns.depths, "--depths", float) or DEFAULT_DEPTHS)
    if lengths is not None:
        check_lengths(lengths)
    if ns.rows == "own" and ns.precision != "float32":
        raise InputError("--precision bfloat16 runs the shared scan of the probes' rows (--rows probes); the "
                         "detectors' own rows are measured in float32.")
    check_precision_option(ns)
    if not 0.0 <= ns.retrieval_threshold <= 1.0:
        raise InputError(f"--retrieval-threshold is a share of the needle's tokens, 0 to 1; got {ns.retrieval_threshold}.")
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report, deferred=_may_be_stored(ns))
    if loaded.kind != "causal-lm":
        raise InputError(f"A KV plan reads a causal language model's attention over long contexts; {info['source']} "
                         f"is a {loaded.kind}.")
    geo = loaded.geometry
    check_plan_options(geo, window_share=ns.window_share, prune_share=ns.prune_share)
    if loaded.deferred is not None and not _all_stored(loaded, ns, window, lengths, depths):
        from analysis.arch.models import materialize
        with progress_bar("loading", not ns.quiet) as report:
            loaded = materialize(loaded, report)                  # something to measure: the weights
    from analysis.score.longscan import stored_kv_scores
    with progress_bar("KV head scores", not ns.quiet) as report:
        scores, found = stored_kv_scores(loaded, rows=ns.rows, window=window, lengths=lengths, depths=depths,
                                         needles=ns.needles, queries=ns.queries, retrieval=ns.keep_retrieval,
                                         prune=ns.prune_share > 0, prune_tokens=ns.prune_tokens,
                                         window_score=ns.window_score, seed=ns.seed, precision=ns.precision,
                                         progress=report, refresh=ns.refresh, on_refused=refused_line)
    stored_words(found, ns.quiet)
    plan = plan_from_scores(geo, scores, window_share=ns.window_share, prune_share=ns.prune_share,
                            keep_retrieval=ns.keep_retrieval, retrieval_threshold=ns.retrieval_threshold,
                            window=window, window_score=ns.window_score, model=loaded.name)
    from analysis.arch.kvplan import KVPlan
    limit = context_length(loaded)                           # a deferred load has no model: its config
    dense, size = KVPlan.full(geo), loaded.dtype.itemsize
    contexts = sorted(set(scores.detections[ns.window_score].extras["lengths"]) | {limit})
    _write_plan(ns, plan)
    payload = dict(model=info, plan=dict(_plan_summary(plan), window_share=ns.window_share,
                                         window_score=ns.window_score, prune_share=ns.prune_share,
                                         keep_retrieval=ns.keep_retrieval),
                   kv_ratio={str(c): plan.kv_ratio(c) for c in contexts},
                   kv_bytes={str(c): plan.kv_bytes(c, head_dim=geo.head_dim, dtype_bytes=size) for c in contexts},
                   dense_kv_bytes={str(c): dense.kv_bytes(c, head_dim=geo.head_dim, dtype_bytes=size) for c in contexts},
                   scores=kv_heads_summary(scores, geo.group_size), out=ns.plan_out,
                   rows=ns.rows, precision=ns.precision, stored={part: f.status for part, f in found.items()})
    return plan, payload


def _may_be_stored(ns) -> bool:
    """Whether `_all_stored` can find these options' parts (else the model loads at once: no deferred load first)."""
    return not ns.refresh and ns.rows == "probes" and ns.window_score == "streaming"


def _all_stored(loaded, ns, window, lengths, depths) -> bool:
    """Whether every part stored_kv_scores reads for these options is stored (lookups only, nothing measured): then
    the weights are never read. Only the shared scan of the probes' rows (--rows probes) with the streaming window
    score, and the KV groups' importance with --prune-share, are looked up; anything else loads the model."""
    from analysis.measure.long_options import PAGE_IMPORTANCE_TOKENS
    from analysis.score.longscan import page_rows, stored_importance, stored_scan
    if not _may_be_stored(ns):
        return False
    from analysis.measure.splits import SCORE_SPLIT
    built = page_rows(loaded, lengths, depths, seed=ns.seed, split=SCORE_SPLIT)      # what stored_kv_scores reads
    _, found = stored_scan(loaded, built, window=window, queries=ns.queries, seed=ns.seed, precision=ns.precision,
                           compute=False)
    if not found.hit:
        return False
    if ns.prune_share > 0:
        tokens = int(ns.prune_tokens or PAGE_IMPORTANCE_TOKENS)
        _, found = stored_importance(loaded, tokens, precision=ns.precision, compute=False)
    return found.hit


register("kv-plan", "measure streaming (or retrieval-aware) and retrieval heads on long built-in text and write a "
         "per-KV-head plan (full / window / prune) to kv_plan.json", _arguments, run)
