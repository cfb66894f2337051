"""`python -m analysis harness`: EleutherAI's lm-evaluation-harness (zero-shot BoolQ, PIQA, HellaSwag,
WinoGrande, ARC-e, ARC-c, OpenBookQA, WikiText-2 perplexity, or a local task folder's tasks) on the dense
model and on a cut, offline, with the harness's stderr for each metric (analysis.measure.harness).

    python -m analysis harness --tasks boolq,piqa [--task-dir DIR] [--limit N] [--harness-batch-size B] [--max-length T]
                               [--generation-batch B]
                               [--model M] [--sparsity S (+ scorer / policy options) | --mask-file mask.json|DIR
                               | --kv-plan F | --export DIR] [--physical [--kv-policy P]] [--format json|csv] [--out F]

A cut is a mask (scored here with --sparsity, or a mask.json / an export folder's mask.json with
--mask-file) applied to --model as head gates (the one masking mechanism; it computes what surgery
computes), or with --physical surgery's physically pruned twin of it; a KV plan (--kv-plan; --physical: the
twin without its pruned KV heads, its windows on the compact cache); or an export folder's own weights
(--export, under its kv_plan.json when it has one). Without a cut, the dense model alone. The tasks and their data are checked before the model
loads: a missing harness, an unknown task (the line names the folder's tasks) or missing data (the line
says where to put which files) is one line and exit status 2, with nothing written.

JSON: {"model", "harness", "limit", "batch_size", "max_length", "tasks": {task: config, data, output_type,
n_docs}, "cut": what was cut, "rows": [...], "seconds"}; CSV: the rows, one per task and metric: task,
metric, n, dense, dense_stderr, cut, cut_stderr, change, worse (the cut worse than dense beyond 2 combined
stderrs, or any worse perplexity), higher_is_better.
"""
from __future__ import annotations

from analysis.cli.common import (add_cut_arguments, add_kv_policy_argument, add_output_arguments,
                                 add_source_arguments, check_counts, check_one_cut, cut_from, progress_bar, register)
from analysis.core.errors import InputError


def _arguments(parser):
    from analysis.measure.harness import DEFAULT_BATCH_SIZE, DEFAULT_GENERATION_BATCH, STANDARD_TASKS
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--tasks", required=True,
                        help="comma-separated task names: the task folder's own, or the standard ones "
                             f"({', '.join(STANDARD_TASKS)}: the harness's configs with your data)")
    parser.add_argument("--task-dir", dest="task_dir", default=None,
                        help="a local task folder: YAML task configs in the harness's format, and/or "
                             "<task>/<split>.jsonl data of the standard tasks (docs/HARNESS.md)")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--harness-batch-size", dest="harness_batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                        help=f"sequences per forward pass of the harness (default {DEFAULT_BATCH_SIZE}; --batch-size "
                             "is a calibration scorer's)")
    parser.add_argument("--generation-batch", dest="generation_batch", type=int, default=DEFAULT_GENERATION_BATCH,
                        help=f"prompts a generative task generates together, left padded (default "
                             f"{DEFAULT_GENERATION_BATCH}, fewer where memory would not hold them; a cut with "
                             "windowed KV heads generates one at a time)")
    parser.add_argument("--max-length", dest="max_length", type=int, default=None,
                        help="tokens per window (default: the model's context, as the harness reads it)")
    add_cut_arguments(parser)
    parser.add_argument("--physical", action="store_true",
                        help="with --sparsity / --mask-file: run surgery's physically pruned copy instead of gates "
                             "(the same function)")
    add_kv_policy_argument(parser)
    add_output_arguments(parser)


def run_harness(ns):
    from analysis.measure.harness import harness_report, prepare_tasks, require_harness
    require_harness()                                              # before anything else: what to install
    check_counts(ns, {"limit": (1, 2**31), "harness_batch_size": (1, 2**16), "generation_batch": (1, 2**16),
                     "max_length": (2, 2**24)})
    kind = check_one_cut(ns)
    if ns.physical and kind not in ("sparsity", "mask_file", "kv_plan"):
        raise InputError("--physical runs surgery's physically pruned copy of a mask or a KV plan: give --sparsity, "
                         "--mask-file or --kv-plan with it.")
    with progress_bar("reading the tasks", not ns.quiet) as report:
        report(0.0, ns.tasks)
        prepared = prepare_tasks(ns.tasks, ns.task_dir, limit=ns.limit)   # bad tasks or data fail before the model loads
    cut, loaded, info = cut_from(ns)
    if ns.physical:
        from analysis.compress.kvruntime import physical
        cut = physical(cut, loaded, kv_policy=ns.kv_policy)
    with progress_bar("harness", not ns.quiet) as report:
        rep = harness_report(loaded, prepared, cut=cut, batch_size=ns.harness_batch_size, max_length=ns.max_length,
                             generation_batch=ns.generation_batch, progress=report)
    payload = dict(model=info, **rep.as_dict())
    if cut is not None:
        payload["cut"] = cut.as_dict()
    return payload, rep.rows()


register("harness", "EleutherAI's lm-evaluation-harness offline (BoolQ, PIQA, HellaSwag, WinoGrande, ARC, OpenBookQA, "
         "WikiText or a local task folder): dense vs a cut, with the harness's stderr", _arguments, run_harness)
