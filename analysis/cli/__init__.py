"""Headless command line: `python -m analysis <command> ...` with JSON or CSV output.

Commands (one module each: commands.py, export.py, pipeline.py; the entry point is main.py,
the shared options and the registry common.py):
    score   scores of one scorer for every head           (JSON: metadata + [L, H] scores; CSV: layer,head,score)
    mask    the mask at a sparsity, with its summary      (CSV: layer,head,score,rank,pruned)
    sweep   MP / MP-G metric vs z at a fixed sparsity     (CSV: one row per z)
    ablate  single-head (and KV-group) ablation sweep     (CSV: layer,head,kv_group,delta,group_delta)
    evaluate  perplexity (or the kind's metric) dense and under the mask
    export  the pruned model in one of four formats, plus mask.json
    pipeline  iterative prune -> distill -> INT8 with a compression report (analysis/compress/recover/pipeline.py)
    roles   what heads do: induction, duplicate-token, previous-token, copying, successor, DLA scores (roles.py)
    probes  capability probes dense vs a cut, per-head maps; --list: the registered probes; domains: heads per
            text set (probes.py)
    kv-plan  streaming / retrieval heads measured on long text -> kv_plan.json (full / window / prune per KV head)
    harness  EleutherAI's lm-evaluation-harness offline (BoolQ, PIQA, ..., WikiText; a local task folder) dense vs a cut (harness.py)
    longctx  long-context probes (passkey, needle, long-range copying) at lengths x depths, dense vs a mask,
            a KV plan or an export (longctx.py)
    ruler   RULER's offline tasks (lm-evaluation-harness's ruler group, rows generated here) at chosen lengths:
            greedy generations, string-match scores with CIs, the exact rows as JSONL (ruler.py)
    plan-search  a KV plan chosen whole against calibration answers at a target KV (plansearch.py)
    cache   the results kept on disk (analysis.core.store): list, clear, warm the Long context page's (cache.py)

Sources: `--model` (a built-in name, a local folder or a hub id in the local cache) loads the
model; `--checkpoint DIR` profiles a safetensors checkpoint by streaming, without building
the model (weight-only scorers only: those registered with needs_calibration = False).

Scorers come from `analysis.score.scorer_registry.SCORERS`: --scorer's choices, and one option per
parameter of any registered scorer, derived from its declaration (`ScorerSpec.parameters` /
`Scorer.parameters`: `--its-name` typed from its default, with its choices and help; an undeclared
constructor keyword gets an option typed from its default).

Fast start: the parser and everything it reads (this package, the command registry, the scorer,
policy, probe, detector and format declarations) import neither torch nor transformers; each command
imports the library inside its run. `--help`, `probes --list` and the refusals the parser or the
declarations can judge answer in a fraction of a second (bench/bench_cli.py; tests/test_cli_fast.py
fails if the parser imports torch or transformers).

Commands: `register(name, help, add_arguments, run)`; `run(namespace) -> (payload, rows)` where
payload is JSON-able and rows (a list of dicts, or None) is what --format csv prints.

Progress bars go to stderr (tqdm), results to stdout or --out; user errors print one line
and exit with status 2. --out is checked before any work and written atomically
(`analysis.core.atomic`): a full disk or a kill never leaves a truncated file or destroys the old one.
SIGTERM is handled like Ctrl-C (temporary files and folders are removed; exit status 130).
Custom model code runs only with --trust-remote-code; transformers never prompts for it.

Multi-process (`accelerate launch --multi_gpu --num_processes N -m analysis <command> ...` or torchrun;
docs/DISTRIBUTED.md): commands registered with distributed=True (score, mask, sweep, evaluate,
ablate) split their forward passes over the processes (analysis.core.distributed) and give the
single-process numbers; the other commands run on rank 0 alone. Only rank 0 draws progress and
writes the result; a lost process ends the run with one error line.
"""
from analysis.cli.common import COMMANDS, register
from analysis.cli import (cache, commands, export, harness, kvplan, longctx, pipeline, plansearch, probes,  # noqa: F401
                          roles, ruler)  # each registers its commands
from analysis.cli.main import build_parser, main

__all__ = ["COMMANDS", "register", "build_parser", "main"]
