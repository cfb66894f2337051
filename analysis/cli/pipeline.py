"""The pipeline command: `python -m analysis pipeline ...` builds a PipelineConfig from its options,
runs the iterative schedule with the compression report (analysis.compress.report), and writes the
report and the final model's exports under --out-dir/--name."""
from __future__ import annotations

from pathlib import Path

from analysis.cli.common import (add_output_arguments, add_scorer_arguments, add_source_arguments, placement_kwargs,
                                 progress_bar, register, scorer_from)
from analysis.core.errors import InputError
from analysis.core.text import clean_user_text
from analysis.score.masks import POLICIES

# The compress package (distillation, peft, ONNX, the report) is imported when this command runs or
# builds its options, not when the CLI starts: `python -m analysis mask ...` never pays for it.


def _pipeline_arguments(parser) -> None:
    from analysis.compress.export import FORMATS
    from analysis.compress.pipeline import DEFAULT_SCORER
    add_source_arguments(parser, streaming=False)
    add_scorer_arguments(parser, default=DEFAULT_SCORER)
    parser.add_argument("--target", type=float, default=0.25, help="target head sparsity (fraction of all heads)")
    parser.add_argument("--step", type=float, default=0.10, help="fraction of all heads pruned per round")
    parser.add_argument("--one-shot", dest="one_shot", action="store_true", help="one round, no recovery")
    parser.add_argument("--recovery-steps", dest="recovery_steps", type=int, default=0,
                        help="distillation steps after each round (0 = none)")
    parser.add_argument("--budget", type=float, default=None, help="perplexity budget: stop before a round breaks it")
    parser.add_argument("--policy", choices=POLICIES, default="global")
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
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--train-seed", dest="train_seed", type=int, default=0)
    parser.add_argument("--train-text", dest="train_text", default=None, help="UTF-8 file to distill on")
    parser.add_argument("--eval-text", dest="eval_text", default=None, help="UTF-8 file to evaluate on")
    parser.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=512)
    parser.add_argument("--formats", default="pruned,onnx", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--no-int8", dest="int8", action="store_false", help="skip the INT8 ONNX stage")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for the timings")
    parser.add_argument("--out-dir", dest="out_dir", required=True, help="output root folder")
    parser.add_argument("--name", required=True, help="run folder to create under --out-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace existing folders")
    add_output_arguments(parser)


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return clean_user_text(Path(path).read_bytes())
    except OSError as err:
        raise InputError(f"Cannot read the text file {path} ({err.strerror or type(err).__name__}).") from err


def config_from(ns):
    """A PipelineConfig from the `pipeline` command's options."""
    from analysis.compress.distill import DistillConfig
    from analysis.compress.pipeline import PipelineConfig
    scorer = scorer_from(ns)
    cfg = PipelineConfig(
        target_sparsity=ns.target, step=ns.step, recovery_steps=ns.recovery_steps, ppl_budget=ns.budget,
        scorer=scorer.name, scorer_params=scorer.params(), policy=ns.policy, kv_policy=ns.kv_policy,
        eval_tokens=ns.eval_tokens,
        distill=DistillConfig(lr=ns.lr, batch_size=ns.train_batch, seq_len=ns.train_seq_len, grad_accum=ns.grad_accum,
                              warmup_steps=ns.warmup, temperature=ns.temperature, ce_weight=ns.ce_weight,
                              hidden_weight=ns.hidden_weight, lora=ns.lora, lora_rank=ns.lora_rank,
                              precision=ns.precision, seed=ns.train_seed))
    return (cfg.one_shot() if ns.one_shot else cfg).validate()


def run_pipeline_command(ns):
    """Run the pipeline, write the report and the final model's exports under --out-dir/--name."""
    from analysis.arch.models import DEFAULT_MODEL, load_model
    from analysis.compress.export import FORMATS, resolve_under
    from analysis.compress.pipeline import export_round
    from analysis.compress.report import compression_report, write_report
    formats = [f.strip() for f in ns.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise InputError(f"Unknown export format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}.")
    config = config_from(ns)
    run_dir = resolve_under(ns.out_dir, ns.name)
    train, held_out = _read_text(ns.train_text), _read_text(ns.eval_text)
    with progress_bar("loading", not ns.quiet) as bar:
        loaded = load_model(ns.model or DEFAULT_MODEL, trust_remote_code=ns.trust_remote_code, cache_dir=ns.cache_dir,
                            progress=bar, **placement_kwargs(ns))
    with progress_bar("pipeline", not ns.quiet) as bar:
        rep, result = compression_report(loaded, config, train_data=train, eval_text=held_out, int8=ns.int8,
                                         threads=ns.threads, progress=bar)
    files = {name: str(path) for name, path in write_report(rep, run_dir / "report", overwrite=ns.overwrite).items()}
    exports = {}
    for fmt in formats:
        out = export_round(fmt, result.model, result.pruned, result.head_rounds, run_dir, fmt,
                           tokenizer=loaded.tokenizer, kv_policy=config.kv_policy, overwrite=ns.overwrite)
        exports[fmt] = str(out.path)
    if ns.int8 and "onnx" in formats:
        from analysis.compress.quantize import quantize_onnx   # onnxruntime: only for this stage
        exports["onnx-int8"] = str(quantize_onnx(Path(exports["onnx"]), run_dir / "onnx-int8",
                                                 overwrite=ns.overwrite).parent)
    stages = [{"stage": s.name, "sparsity": s.sparsity, "parameters": s.parameters, "size_mb": s.size_mb,
               rep.metric: s.metric, **{f"{k}_ratio": v for k, v in s.ratios.items()}} for s in rep.stages]
    payload = {"model": loaded.name, "metric": rep.metric, "n_pruned": int(result.pruned.sum()),
               "stopped_by_budget": result.stopped_by_budget, "stages": stages, "curves": rep.curves,
               "report": files, "exports": exports}
    return payload, stages


register("pipeline", "iterative prune -> distill -> INT8, with a compression report and the final exports",
         _pipeline_arguments, run_pipeline_command)
