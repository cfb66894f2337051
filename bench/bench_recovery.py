"""Benchmark: recovery and compression of SmolLM2-135M (a result, not a timed test).

1. Recovery. For each sparsity (default 25% and 50%, MP-G, global policy), held-out perplexity
   (evaluation split, --eval-tokens) of: dense; one-shot cut; iterative (10% rounds, no
   recovery); one-shot + distillation (--steps steps of --batch x --seq tokens, lr --lr, plain
   T^2 KL at T = --temperature); iterative + distillation (the same total steps spread over the
   rounds); INT8 (ONNX Runtime weight-only) of the last model. "gap closed" = (cut - recovered)
   / (cut - dense). Target at 25%: >= 3/4 of the gap closed within 15 minutes on 2 cores.
2. Step throughput: analysis.compress.distill steps vs a plain PyTorch loop doing the same work (teacher
   forward, student forward and backward, AdamW step) on the same batches, alternating; target
   >= 0.95x.
3. INT8 vs float32 latency (prefill of 128 tokens) in ONNX Runtime, printed.

Usage: nice -n 10 .venv/bin/python bench/bench_recovery.py [--sparsities 0.25,0.5] [--steps 80]
       [--eval-tokens 2048] [--threads 2] [--parts recovery,throughput,int8] [--write-docs]
       [--quick]  (4 steps, 256 eval tokens, 25% only: checks the script in a few minutes)
--write-docs replaces the section between the recovery markers in docs/results.md (appends it if
absent) with the numbers measured, whatever they are.
"""
from __future__ import annotations

import argparse
import copy
import platform
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._timing import compare  # noqa: E402

from analysis.core.atomic import write_section  # noqa: E402
from analysis.compress.distill import DistillConfig, batch_indices, distill, training_sequences  # noqa: E402
from analysis.arch.models import count_parameters, load_model  # noqa: E402
from analysis.compress.pipeline import PipelineConfig, export_round, run_pipeline  # noqa: E402
from analysis.compress.quantize import compare_onnx, quantize_onnx  # noqa: E402
from analysis.compress.report import RECOVERY_MARKERS  # noqa: E402
from analysis.compress.speed import saved_bytes, torch_threads  # noqa: E402

BEGIN, END = RECOVERY_MARKERS


def recovery(loaded, sparsity: float, args) -> dict:
    dcfg = DistillConfig(lr=args.lr, batch_size=args.batch, seq_len=args.seq, temperature=args.temperature)
    base = PipelineConfig(target_sparsity=sparsity, step=0.10, eval_tokens=args.eval_tokens, distill=dcfg)
    rows, results = {}, {}
    runs = {"one-shot": base.one_shot(), "iterative": base,
            "one-shot + distillation": replace(base.one_shot(), recovery_steps=args.steps)}
    n_rounds = len(run_rounds(base, loaded))
    runs["iterative + distillation"] = replace(base, recovery_steps=max(1, args.steps // n_rounds))
    for name, cfg in runs.items():
        start = time.perf_counter()
        result = run_pipeline(loaded, cfg, progress=lambda f, m: None)
        seconds = time.perf_counter() - start
        small, _ = result.smaller()                       # the physically pruned model: its real size
        rows[name] = {"ppl": result.final_metric, "seconds": seconds, "rounds": len(result.accepted),
                      "n_pruned": int(result.pruned.sum()), "params": count_parameters(small),
                      "mb": saved_bytes(small) / 2 ** 20}
        del small
        results[name] = result
        print(f"  {sparsity:.0%} {name:26s} ppl {result.final_metric:8.3f}  ({seconds:6.1f} s, "
              f"{len(result.accepted)} round(s))", flush=True)
    dense, cut = results["one-shot"].dense_metric, rows["one-shot"]["ppl"]
    rows = {"dense": {"ppl": dense, "params": count_parameters(loaded.model), "mb": saved_bytes(loaded.model) / 2 ** 20},
            **rows}
    for name in ("one-shot + distillation", "iterative + distillation"):
        rows[name]["gap_closed"] = (cut - rows[name]["ppl"]) / (cut - dense) if cut > dense else float("nan")
    if "int8" in args.parts:
        final = results["iterative + distillation"]
        with tempfile.TemporaryDirectory(prefix="bench-int8-") as folder:
            fp32 = export_round("onnx", final.model, final.pruned, final.head_rounds, folder, "fp32")
            int8 = quantize_onnx(fp32.path, Path(folder) / "int8")
            cmp = compare_onnx(loaded, fp32.path, int8, max_tokens=args.eval_tokens, threads=args.threads)
        rows["INT8 (iterative + distillation)"] = {"ppl": cmp.perplexity_int8, "size_ratio": cmp.size_ratio,
                                                  "fp32_mb": cmp.bytes_fp32 / 2 ** 20, "int8_mb": cmp.bytes_int8 / 2 ** 20,
                                                  "top1": cmp.top1_agreement, "latency_fp32_ms": cmp.latency_ms_fp32,
                                                  "latency_int8_ms": cmp.latency_ms_int8}
        print(f"  {sparsity:.0%} INT8: ppl {cmp.perplexity_int8:.3f} (fp32 ONNX {cmp.perplexity_fp32:.3f}), file "
              f"{cmp.bytes_int8 / 2**20:.1f} / {cmp.bytes_fp32 / 2**20:.1f} MB, top-1 {cmp.top1_agreement:.3f}, "
              f"prefill@128 {cmp.latency_ms_int8:.1f} vs {cmp.latency_ms_fp32:.1f} ms", flush=True)
    return {"dense": dense, "rows": rows}


def run_rounds(cfg: PipelineConfig, loaded) -> list[int]:
    from analysis.compress.pipeline import round_counts
    return round_counts(cfg.target_sparsity, cfg.step, loaded.geometry.n_total_heads)


def throughput(loaded, args) -> dict:
    """distill() vs a plain loop, same batches and work, alternating, seconds per step."""
    from analysis.arch.head_gates import gates_from_mask, head_mask, zero_heads
    from analysis.score.masks import plan_mask
    from analysis.score.scoring import get_scorer
    cfg = DistillConfig(steps=args.tp_steps, lr=args.lr, batch_size=args.batch, seq_len=args.seq,
                        temperature=args.temperature, max_grad_norm=None)
    ids = training_sequences(loaded.tokenizer, None, cfg)                           # [n, T]
    pruned = plan_mask(get_scorer("mp-g").score(loaded), 0.25, group_size=loaded.geometry.group_size).pruned
    gates = gates_from_mask(pruned)
    student0 = zero_heads(copy.deepcopy(loaded.model), pruned)

    def ours():
        distill(loaded, copy.deepcopy(student0), ids, cfg, gates=gates)

    def plain():
        student = copy.deepcopy(student0)
        student.requires_grad_(True)
        opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * s / cfg.steps)))
        T = args.temperature
        with head_mask(student, gates):
            for step in range(cfg.steps):
                x = ids[batch_indices(ids.shape[0], cfg.batch_size, step, cfg.seed)]   # [B, T]
                with torch.no_grad():
                    t = loaded.model(input_ids=x, use_cache=False).logits             # [B, T, V]
                s = student(input_ids=x, use_cache=False).logits
                V = s.shape[-1]
                loss = T * T * F.kl_div(F.log_softmax(s.reshape(-1, V) / T, -1), F.log_softmax(t.reshape(-1, V) / T, -1),
                                        log_target=True, reduction="batchmean")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

    # interleaved pairs (bench/_timing.compare); throughput headscope / plain = time plain / time headscope
    cmp = compare({"plain": plain, "headscope": ours}, min_pairs=args.tp_repeats, max_pairs=4 * args.tp_repeats + 1,
                  warm=False, collect=True)
    cmp.report(f"  distillation throughput, {cfg.steps} steps per run (seconds per run)", unit=1.0, unit_name="s")
    per = {k: float(np.median(v)) / cfg.steps for k, v in cmp.times.items()}
    ratio = cmp.ratio
    print(f"  throughput: headscope {per['headscope']:.3f} s/step, plain loop {per['plain']:.3f} s/step -> "
          f"{ratio:.3f}x (median of {len(cmp.ratios)} interleaved pairs)", flush=True)
    return {"seconds_per_step": per, "ratio": ratio}


def markdown(out: dict, args) -> str:
    lines = [BEGIN, "## Recovery and compression (bench/bench_recovery.py)", "",
             f"SmolLM2-135M, MP-G (z = 2.0), global policy; held-out perplexity on {args.eval_tokens} evaluation "
             f"tokens; distillation: {args.steps} steps x {args.batch} x {args.seq} tokens, lr {args.lr:g}, "
             f"T = {args.temperature:g} (iterative: the same total spread over the 10% rounds). "
             f"{out['machine']}, {out['date']}.", ""]
    for sparsity, res in out.get("recovery", {}).items():
        lines += [f"### {float(sparsity):.0%} of heads pruned (dense {res['dense']:.3f})", "",
                  "| variant | perplexity | gap closed | parameters | size | seconds |", "|---|---:|---:|---:|---|---:|"]
        for name, row in res["rows"].items():
            gap = f"{row['gap_closed']:.0%}" if "gap_closed" in row else ""
            params = f"{row['params']:,}" if "params" in row else ""
            size = (f"{row['int8_mb']:.1f} MB INT8 ONNX ({row['size_ratio']:.2f}x its fp32 ONNX, {row['fp32_mb']:.1f} MB)"
                    if "int8_mb" in row else f"{row['mb']:.1f} MB safetensors" if "mb" in row else "")
            secs = f"{row['seconds']:.0f}" if "seconds" in row else ""
            lines.append(f"| {name} | {row['ppl']:.3f} | {gap} | {params} | {size} | {secs} |")
        lines.append("")
    if "throughput" in out:
        tp = out["throughput"]
        lines += [f"Distillation step throughput vs a plain PyTorch loop: {tp['ratio']:.3f}x "
                  f"({tp['seconds_per_step']['headscope']:.3f} vs {tp['seconds_per_step']['plain']:.3f} s/step).", ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    write_section(ROOT / "docs" / "results.md", section, BEGIN, END, what="The results file")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sparsities", default="0.25,0.5")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="recovery,throughput,int8")
    p.add_argument("--tp-steps", dest="tp_steps", type=int, default=4)
    p.add_argument("--tp-repeats", dest="tp_repeats", type=int, default=3)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.steps, args.eval_tokens, args.sparsities, args.tp_steps, args.tp_repeats = 4, 256, "0.25", 2, 1
    args.parts = set(args.parts.split(","))
    out = {"machine": f"{platform.machine()}, {args.threads} torch thread(s)",
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    with torch_threads(args.threads):
        loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
        if "recovery" in args.parts:
            out["recovery"] = {}
            for s in [float(x) for x in args.sparsities.split(",")]:
                out["recovery"][s] = recovery(loaded, s, args)
        if "throughput" in args.parts:
            out["throughput"] = throughput(loaded, args)
    section = markdown(out, args)
    print(section)
    if args.write_docs:
        write_docs(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
