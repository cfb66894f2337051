"""The pipeline command: `python -m analysis pipeline ...` builds a PipelineConfig from its options,
runs the iterative schedule with the compression report (analysis.compress.recover.report), and writes the
report and the final model's exports under --out-dir/--name."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from analysis.cli.common import (add_output_arguments, add_scorer_arguments, add_source_arguments, placement_kwargs,
                                 progress_bar, register, scorer_from, warn)
from analysis.core import progress as cancel     # signals: a flag checked at cancel points
from analysis.core.errors import InputError
from analysis.core.text import clean_user_text
from analysis.core.threads import check_threads
from analysis.score.masks import POLICIES

# The compress package (distillation, peft, ONNX, the report) is imported when this command runs, not
# when the CLI starts or builds this command's options (they read the format declarations only).


def _pipeline_arguments(parser) -> None:
    from analysis.compress.export.format_registry import EXPORT_DTYPES, FORMATS
    add_source_arguments(parser, streaming=False)
    add_scorer_arguments(parser)               # None: the pipeline's DEFAULT_SCORER (config_from)
    parser.add_argument("--target", type=float, default=0.25, help="target head sparsity (fraction of all heads)")
    parser.add_argument("--step", type=float, default=0.10, help="fraction of all heads pruned per round")
    parser.add_argument("--one-shot", dest="one_shot", action="store_true", help="one round, no recovery")
    parser.add_argument("--recovery-steps", dest="recovery_steps", type=int, default=0,
                        help="distillation steps after each round (0 = none)")
    parser.add_argument("--recovery-tokens", dest="recovery_tokens", type=int, default=None,
                        help="distillation tokens per round instead of --recovery-steps (steps = tokens / "
                             "(train batch x seq len x grad accum), rounded up)")
    parser.add_argument("--recovery-minutes", dest="recovery_minutes", type=float, default=None,
                        help="stop each round's distillation after this many minutes (at least one step)")
    parser.add_argument("--eval-every", dest="eval_every", type=int, default=0,
                        help="held-out metric every N distillation steps, into the round's loss curve (0 = never)")
    parser.add_argument("--budget", type=float, default=None, help="perplexity budget: stop before a round breaks it")
    parser.add_argument("--policy", choices=POLICIES, default=None,
                        help="mask policy (default: 'groups' on GQA models, which never grows the model; "
                             "'global' on MHA)")
    parser.add_argument("--kv-policy", dest="kv_policy", choices=("auto", "expand", "strict"), default="auto")
    parser.add_argument("--lr", type=float, default=1e-4, help="distillation learning rate")
    parser.add_argument("--train-batch", dest="train_batch", type=int, default=4, help="sequences per batch")
    parser.add_argument("--train-seq-len", dest="train_seq_len", type=int, default=128)
    parser.add_argument("--grad-accum", dest="grad_accum", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0, help="warmup steps")
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--ce-weight", dest="ce_weight", type=float, default=0.0)
    parser.add_argument("--hidden-weight", dest="hidden_weight", type=float, default=0.0)
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (merged at export) instead of full tuning")
    parser.add_argument("--lora-rank", dest="lora_rank", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16", "auto"), default="fp32",
                        help="distillation precision: bf16 = bfloat16 autocast (master weights, optimizer state "
                             "and loss stay float32); auto = bf16 where the CPU / GPU has bfloat16 units")
    parser.add_argument("--train-seed", dest="train_seed", type=int, default=0)
    parser.add_argument("--train-text", dest="train_text", default=None, help="UTF-8 file to distill on")
    parser.add_argument("--eval-text", dest="eval_text", default=None, help="UTF-8 file to evaluate on")
    parser.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=512)
    parser.add_argument("--formats", default="pruned,onnx", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--export-dtype", dest="export_dtype", choices=EXPORT_DTYPES, default="source",
                        help="the dtype of the exported weights (zeroed, pruned, stock): source = what the checkpoint "
                             "stores (the recovered float32 weights are rounded to it); ONNX and GGUF have their own")
    parser.add_argument("--no-int8", dest="int8", action="store_false", help="skip the INT8 ONNX stage")
    parser.add_argument("--frontier", default="", metavar="TYPES",
                        help="also write the dense and the final model as GGUF at these types (e.g. q8_0,q4_k_m, or "
                             "'default': q8_0,q5_k_m,q4_k_m) and run them in llama.cpp: file size vs perplexity, the "
                             "Pareto frontier and its verdict in the report (frontier.png)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the timings")
    parser.add_argument("--out-dir", dest="out_dir", required=True, help="output root folder")
    parser.add_argument("--name", required=True, help="run folder to create under --out-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace existing folders")
    add_output_arguments(parser)


PIPELINE_TEXT_MAX_BYTES = 256 * 2**20   # --train-text / --eval-text: far more text than a run trains on


def _read_text(path: str | None, option: str) -> str | None:
    """--train-text / --eval-text through the one capped, regular-file-only reader."""
    from analysis.core.files import read_file_bytes
    if path is None:
        return None
    return clean_user_text(read_file_bytes(path, PIPELINE_TEXT_MAX_BYTES, what=option,
                                           fix="give the path of a UTF-8 .txt file (at most 256 MiB)"))


def config_from(ns):
    """A PipelineConfig from the `pipeline` command's options."""
    from analysis.compress.recover.distill import DistillConfig
    from analysis.compress.recover.pipeline import DEFAULT_SCORER, PipelineConfig
    if ns.scorer is None:
        ns.scorer = DEFAULT_SCORER
    scorer = scorer_from(ns)
    cfg = PipelineConfig(
        target_sparsity=ns.target, step=ns.step, recovery_steps=ns.recovery_steps, ppl_budget=ns.budget,
        scorer=scorer.name, scorer_params=scorer.params(), policy=ns.policy, kv_policy=ns.kv_policy,
        eval_tokens=ns.eval_tokens, recovery_tokens=ns.recovery_tokens,
        distill=DistillConfig(max_seconds=None if ns.recovery_minutes is None else 60 * ns.recovery_minutes,
                              eval_every=ns.eval_every,
                              lr=ns.lr, batch_size=ns.train_batch, seq_len=ns.train_seq_len, grad_accum=ns.grad_accum,
                              warmup_steps=ns.warmup, temperature=ns.temperature, ce_weight=ns.ce_weight,
                              hidden_weight=ns.hidden_weight, lora=ns.lora, lora_rank=ns.lora_rank,
                              precision=ns.precision, seed=ns.train_seed))
    return (cfg.one_shot() if ns.one_shot else cfg).validate()


def run_pipeline_command(ns):
    """Run the pipeline, write the report and the final model's exports under --out-dir/--name."""
    from analysis.arch.models import DEFAULT_MODEL, load_model
    from analysis.compress.export import FORMATS, TOOL, export_dtype, resolve_under
    from analysis.compress.export.folder import RUN_FILE, atomic_folder, clean_leftovers
    from analysis.compress.recover.pipeline import export_round
    from analysis.compress.recover.report import compression_report, write_report
    formats = [f.strip() for f in ns.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise InputError(f"Unknown export format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}.")
    if len(set(formats)) != len(formats):
        raise InputError(f"--formats names a format twice ({ns.formats}); give each format once, e.g. zeroed,onnx.")
    config = config_from(ns)
    from analysis.compress.recover.frontier import parse_types
    frontier = parse_types(ns.frontier)                        # a bad type fails before the rounds
    check_threads(ns.threads, "--threads", none_ok=True)       # used by the last stage: checked before the first
    run_dir = resolve_under(ns.out_dir, ns.name)
    train, held_out = _read_text(ns.train_text, "--train-text"), _read_text(ns.eval_text, "--eval-text")
    for note in clean_leftovers(run_dir.parent):              # a run killed earlier (SIGKILL)
        sys.stderr.write(f"note: {note}\n")
    # the run folder is written like an export: a temporary folder, made before the first round (a
    # read-only --out-dir or an existing run fails now, not after the rounds), moved into place at the
    # end; a failure, SIGTERM or Ctrl-C removes it, and --overwrite replaces only a headscope run
    with atomic_folder(run_dir, overwrite=ns.overwrite) as tmp:
        with progress_bar("loading", not ns.quiet) as bar:
            loaded = load_model(ns.model or DEFAULT_MODEL, trust_remote_code=ns.trust_remote_code,
                                cache_dir=ns.cache_dir, progress=bar, **placement_kwargs(ns))
        with progress_bar("pipeline", not ns.quiet) as bar:
            rep, result = compression_report(loaded, config, train_data=train, eval_text=held_out, int8=ns.int8,
                                             frontier_types=frontier,
                                             threads=ns.threads, progress=bar)
        def moved(path) -> str:                  # where a file written into `tmp` will be
            return str(run_dir / Path(path).resolve().relative_to(tmp.resolve()))
        files = {name: moved(path) for name, path in write_report(rep, tmp / "report").items()}
        exports = {}
        if ns.int8 and "onnx" in formats and "onnx-int8" not in formats:
            formats.append("onnx-int8")            # the INT8 stage's file, self-checked like any export
        for fmt in formats:
            out = export_round(fmt, result.model, result.pruned, result.head_rounds, tmp, fmt,
                               tokenizer=loaded.tokenizer, kv_policy=config.kv_policy,
                               dtype=export_dtype(ns.export_dtype, loaded.source_dtype))
            exports[fmt] = moved(out.path)
            for line in out.notes:
                sys.stderr.write(f"note: {fmt}: {line}\n")
        stages = [{"stage": s.name, "sparsity": s.sparsity, "parameters": s.parameters, "size_mb": s.size_mb,
                   "kv_bytes_per_token": s.kv_bytes_per_token, rep.metric: s.metric, "top1": s.top1,
                   **{f"{k}_ratio": v for k, v in s.ratios.items()}} for s in rep.stages]
        payload = {"model": loaded.name, "metric": rep.metric, "policy": result.config.policy,
                   "warnings": rep.warnings, "capability_warnings": rep.capability_warnings,
                   "n_pruned": int(result.pruned.sum()),
                   "stopped_by_budget": result.stopped_by_budget, "stages": stages, "curves": rep.curves,
                   "report": files, "exports": exports, "frontier": rep.frontier}
        (tmp / RUN_FILE).write_text(json.dumps({"tool": TOOL, "model": loaded.name, "formats": formats}, indent=1))
        cancel.raise_if_signalled()              # a signal during the last export: the run folder goes
    warn(rep.capability_warnings)
    if rep.frontier:
        from analysis.compress.recover.frontier import verdict
        for line in verdict(rep.frontier):
            sys.stderr.write(f"frontier: {line}\n")
    return payload, stages


register("pipeline", "iterative prune -> distill -> INT8, with a compression report and the final exports",
         _pipeline_arguments, run_pipeline_command)
