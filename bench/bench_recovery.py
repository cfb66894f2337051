"""Benchmark: recover and compress SmolLM2-135M (issue 23; a result, not a timed test).

1. Recovery (--parts recovery). For each sparsity (--sparsities, default 12.5 / 25 / 50 %) and each
   scorer (--scorers, default MP-G and the Michel head gate, the best scorer of docs/results.md's
   table), under the mask policy (--policy; default `masks.default_policy`: "groups" on SmolLM2,
   which never grows the model): the one-shot cut, the same cut recovered by distillation
   (analysis.compress.recover.pipeline with the same budget for every scorer: --steps steps of --batch x
   --seq tokens, the cosine schedule's length, stopped after --minutes of training if not done;
   precision --precision), and its integer
   INT8 (ONNX Runtime dynamic, per-channel weights, the sensitive layers and the LM head float; plus
   weight-only INT8 as the size option). Every row: held-out perplexity on --eval-tokens tokens of
   the evaluation split (--window-token non-overlapping windows, 95 % bootstrap CI over windows,
   --bootstrap resamples, the same resamples for every row, as scripts/results.py), next-token
   top-1 accuracy and its ratio to dense, parameters, file size, KV-cache bytes per token
   (masks.surgery_counts), seconds. The held-out curve every --eval-every steps is printed too.
   --compare-at 0.25: the scorers after the first run at these sparsities only; --int8-scorers mp-g:
   only these scorers' recovered models get the INT8 rows; --int8-at 0.25: only at these sparsities
   (all three: to size a run to a time budget).
2. Precision (--parts precision): distillation steps in fp32 and under bfloat16 autocast on the same
   pruned student in interleaved pairs (bench/_timing.compare: calls of --tp-steps steps, each timing
   its steps after the first (the first also builds AdamW's state, once per real run), at least
   --tp-repeats and at most --tp-max-pairs pairs; min / median / max s/step of each side and of the
   per-pair ratio, load average), and
   the perplexity after --precision-steps steps of each (target: bf16 >= 1.5x fp32 steps/s where the
   CPU has bf16 units, final perplexity within 2 %).
3. Formats (--parts formats): the recovered 25 % model (first scorer) exported in every format
   against dense exported in the same format: file bytes, parameters, KV bytes.
4. INT8 against fp32 in the same runtime (part of 1): top-1 agreement, perplexity ratio, file ratio,
   prefill@128 and 1-token latency (ONNX Runtime), and PyTorch dynamic INT8 (prefill, KV-cache decode).

Usage: nice -n 10 .venv/bin/python -m bench.bench_recovery [--sparsities 0.125,0.25,0.5]
       [--scorers mp-g,gate] [--minutes 20] [--steps 300] [--eval-tokens 16384] [--threads 2]
       [--parts recovery,int8,precision,formats] [--compare-at 0.25] [--int8-scorers mp-g]
       [--note "why the budget is what it is"] [--write-docs] [--quick]
--quick: 25 % only, MP-G only, 4 steps, 1024 evaluation tokens, 50 bootstrap resamples: checks the
script in a few minutes (its numbers are not the table). --write-docs replaces the section between
the recovery markers in docs/results.md with the numbers measured, whatever they are.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]



from bench._distill_options import add_distill_options, distill_config as shared_distill_config
from bench._timing import compare, load_average, load_text
from analysis.arch.head_gates import gates_from_mask, zero_heads
from analysis.arch.models import count_parameters, load_model
from analysis.compress.recover.distill import DistillConfig, cpu_has_bf16, distill, resolve_precision, training_sequences
from analysis.compress.export import FORMATS, ExportError
from analysis.compress.recover.pipeline import PipelineConfig, export_round, run_pipeline
from analysis.compress.export.onnx import OnnxLM
from analysis.compress.export.onnx_int8 import quantize_onnx
from analysis.compress.recover.quantize import compare_onnx, torch_int8_report
from analysis.measure.outliers import int8_keep_float_for
from analysis.compress.recover.report import RECOVERY_MARKERS, kv_bytes_per_token, speedup, speedup_text
from analysis.compress.timing import saved_bytes
from analysis.core.threads import torch_threads
from analysis.compress.surgery import prune_heads
from analysis.core.atomic import atomic_write, write_section
from analysis.core.errors import InputError
from analysis.core.text import evaluation_text
from analysis.measure.evaluation import CausalPerplexity, bootstrap_perplexity, evaluate, token_ids
from analysis.score.masks import default_policy
from analysis.score.scoring import get_scorer

BEGIN, END = RECOVERY_MARKERS
SCORER_LABELS = {"mp-g": "MP-G (z = 2.0)", "gate": "Head gate, abs. gradient (Michel)"}


# ---------------------------------------------------------------------------------------------
# Held-out evaluation with CIs (the same windows and resamples for every row)
# ---------------------------------------------------------------------------------------------

class HeldOut:
    """The evaluation ids, the windows and the bootstrap resamples every row shares."""

    def __init__(self, loaded, args):
        self.ids = token_ids(loaded.tokenizer, evaluation_text(), max_tokens=args.eval_tokens)   # [N]
        self.evaluator = CausalPerplexity(window=args.window, stride=args.window, batch_size=args.eval_batch)
        self.n_boot = args.bootstrap

    def row(self, model) -> dict:
        sums, correct, counts = self.evaluator.window_stats(model, self.ids)            # [1, W], [1, W], [W]
        ppl = float(np.exp(sums.sum() / counts.sum()))
        boot = bootstrap_perplexity(sums, counts, self.n_boot)[:, 0]                             # [n]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        return {"ppl": ppl, "lo": float(lo), "hi": float(hi), "top1": float(correct.sum() / counts.sum()),
                "tokens": int(counts.sum()), "windows": int(counts.size)}


def size_row(loaded, model, pruned, kv_policy="auto") -> dict:
    return {"params": count_parameters(model), "mb": saved_bytes(model) / 2 ** 20,
            "kv": kv_bytes_per_token(loaded, pruned, kv_policy)}


# ---------------------------------------------------------------------------------------------
# 1. Recovery, per sparsity and scorer
# ---------------------------------------------------------------------------------------------

def distill_config(args, **over) -> DistillConfig:
    return replace(shared_distill_config(args, steps=args.steps, eval_every=args.eval_every,
                                         max_seconds=None if args.minutes is None else 60 * args.minutes), **over)


def recover(loaded, held: HeldOut, sparsity: float, scorer: str, args, calibration) -> dict:
    cfg = PipelineConfig(target_sparsity=sparsity, step=sparsity, scorer=scorer, policy=args.policy,
                         recovery_steps=args.steps, eval_tokens=args.curve_tokens, distill=distill_config(args))
    start = time.perf_counter()
    result = run_pipeline(loaded, cfg, calibration=calibration)
    wall = time.perf_counter() - start
    r = result.rounds[-1]
    pruned = result.pruned
    one_shot = prune_heads(loaded.model, pruned)[0]                           # the cut of the dense weights
    small, _ = result.smaller()                                               # the recovered model, same shapes
    rows = {"one-shot": {**held.row(one_shot), **size_row(loaded, one_shot, pruned),
                         "seconds": r.seconds - r.recovery_seconds},
            "recovered": {**held.row(small), **size_row(loaded, small, pruned), "seconds": r.recovery_seconds,
                          "steps": len(r.history), "precision": r.precision}}
    curve = [(h["step"], h["heldout"]) for h in r.history if "heldout" in h]
    print(f"  {sparsity:.1%} {scorer}: {int(pruned.sum())} heads ({result.config.policy}), one-shot "
          f"{rows['one-shot']['ppl']:.2f}, recovered {rows['recovered']['ppl']:.2f} after {len(r.history)} steps "
          f"({r.recovery_seconds:.0f} s, {r.precision}); wall {wall:.0f} s; curve {curve}", flush=True)
    out = {"rows": rows, "policy": result.config.policy, "n_pruned": int(pruned.sum()), "curve": curve,
           "loss": [(h["step"], h["loss"]) for h in r.history]}
    if ("int8" in args.parts and (args.int8_scorers is None or scorer in args.int8_scorers)
            and (args.int8_at is None or sparsity in args.int8_at)):
        out["int8"] = int8_rows(loaded, held, result, small, args, rows)
    return out


def int8_rows(loaded, held: HeldOut, result, small, args, rows) -> dict:
    """Integer INT8 (ONNX dynamic) and weight-only INT8 of the recovered model, and PyTorch dynamic INT8."""
    keep = int8_keep_float_for(small, loaded.tokenizer)
    info = {"keep_float": keep}
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as folder:
        fp32 = export_round("onnx", result.model, result.pruned, result.head_rounds, folder, "fp32")
        for method, label in (("dynamic", "INT8 integer (ONNX dynamic)"), ("weight-only", "INT8 weight-only (ONNX)")):
            start = time.perf_counter()
            q = quantize_onnx(fp32.path, Path(folder) / method, method=method,
                              keep_float=keep if method == "dynamic" else ())
            seconds = time.perf_counter() - start
            cmp = compare_onnx(loaded, fp32.path, q, max_tokens=args.agree_tokens, repeats=args.latency_repeats,
                               threads=args.threads)
            model = OnnxLM(q, loaded.model.config, args.threads)
            rows[label] = {**held.row(model), "params": rows["recovered"]["params"], "mb": cmp.bytes_int8 / 2 ** 20,
                           "fp32_onnx_mb": cmp.bytes_fp32 / 2 ** 20, "kv": rows["recovered"]["kv"], "seconds": seconds}
            info[method] = cmp.as_dict()
            print(f"    {label}: top-1 agreement {cmp.top1_agreement:.3f}, ppl x{cmp.perplexity_ratio:.3f}, file "
                  f"{cmp.size_ratio:.3f}x, prefill {speedup_text(info[method], 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}, "
                  f"1-token {speedup_text(info[method], 'one_token', 'one_token_ms_fp32', 'one_token_ms_int8')}",
                  flush=True)
    t = torch_int8_report(loaded, small, max_tokens=args.agree_tokens, repeats=args.latency_repeats,
                          threads=args.threads, keep_float=keep)
    info["torch"] = {k: v for k, v in t.items() if k != "model"}
    print(f"    PyTorch dynamic INT8: top-1 agreement {t['top1_agreement']:.3f}, ppl x{t['metric_int8'] / t['metric_fp32']:.3f}, "
          f"prefill {speedup_text(t, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}, decode "
          f"{speedup_text(t, 'decode', 'decode_ms_fp32', 'decode_ms_int8')}", flush=True)
    return info


# ---------------------------------------------------------------------------------------------
# 2. bf16 vs fp32 recovery steps
# ---------------------------------------------------------------------------------------------

def precision(loaded, args) -> dict:
    cfg = distill_config(args, steps=args.tp_steps, max_seconds=None, eval_every=0, warmup_steps=0)  # clipping on, as in recovery
    ids = training_sequences(loaded.tokenizer, None, cfg)                                # [n, T]
    pruned = get_scorer("mp-g").score(loaded)
    from analysis.score.masks import plan_mask
    mask = plan_mask(pruned, 0.25, group_size=loaded.geometry.group_size,
                     policy=args.policy or default_policy(loaded.geometry.group_size)).pruned
    gates = gates_from_mask(mask)
    student0 = zero_heads(copy.deepcopy(loaded.model), mask)
    # One student per precision, trained again by every call: a step costs the same whatever the
    # weights hold, so no copy is timed. Each call times its own steps after the first (the steady
    # state of a long run: the first step of a call also builds AdamW's state, once per run).
    # bench/_timing.compare: interleaved pairs, per-pair ratio.
    students = {p: copy.deepcopy(student0) for p in ("fp32", "bf16")}
    timed = max(1, cfg.steps - 1)

    def call(p):
        ends = []
        distill(loaded, students[p], ids, replace(cfg, precision=p), gates=gates,
                on_step=lambda record: ends.append(time.perf_counter()))
        return ends[-1] - ends[-1 - timed]

    cmp = compare({p: (lambda p=p: call(p)) for p in ("fp32", "bf16")}, min_pairs=args.tp_repeats,
                  max_pairs=max(args.tp_repeats, args.tp_max_pairs), max_seconds=args.tp_seconds, self_timed=True)
    report = cmp.report(f"  recovery step fp32 vs bf16 autocast (steps 2-{cfg.steps} of each call timed)",
                        unit=1 / timed, unit_name="s/step", target=">= 1.5")
    students.clear()                                   # the two trained copies go
    per = {p: [t / timed for t in cmp.times[p]] for p in ("fp32", "bf16")}
    stats = {k: {"min": min(v), "median": float(np.median(v)), "max": max(v)} for k, v in per.items()}
    ratios = cmp.ratios
    ratio = cmp.ratio
    out = {"seconds_per_step": stats, "ratio": ratio, "bf16_units": cpu_has_bf16(), "steps": cfg.steps, "steady": True,
           "repeats": len(ratios), "ratio_range": [min(ratios), max(ratios)], "converged": cmp.converged,
           "load": [list(cmp.load_before), list(cmp.load_after)], "report": report}
    if args.precision_steps:
        final = {}
        for p in ("fp32", "bf16"):
            res = distill(loaded, copy.deepcopy(student0), ids, replace(cfg, precision=p, steps=args.precision_steps),
                          gates=gates)
            final[p] = evaluate(replace(loaded, model=res.model), None, max_tokens=args.curve_tokens).value
        out["final_ppl"] = final
        out["ppl_ratio"] = final["bf16"] / final["fp32"]
    print(f"  precision: fp32 {stats['fp32']}, bf16 {stats['bf16']} s/step -> bf16 {ratio:.2f}x; "
          f"{out.get('final_ppl')}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# 3. Every export format: the recovered 25 % model against dense
# ---------------------------------------------------------------------------------------------

def formats(loaded, args, calibration) -> dict:
    cfg = PipelineConfig(target_sparsity=0.25, step=0.25, scorer=args.scorers[0], policy=args.policy,
                         recovery_steps=args.format_steps, eval_tokens=args.curve_tokens,
                         distill=distill_config(args, eval_every=0))
    result = run_pipeline(loaded, cfg, calibration=calibration)
    dense_mask = np.zeros_like(result.pruned)
    small, _ = result.smaller()
    out = {}
    with tempfile.TemporaryDirectory(prefix="bench-formats-") as folder:
        for fmt in FORMATS:
            sizes = {}
            for name, model, pruned in (("dense", loaded.model, dense_mask), ("pruned", result.model, result.pruned)):
                try:
                    sizes[name] = export_round(fmt, model, pruned, result.head_rounds * pruned, folder,
                                               f"{fmt}-{name}", tokenizer=loaded.tokenizer).total_bytes
                except (ExportError, InputError) as err:     # e.g. stock: uneven per-layer head counts
                    sizes[name] = str(err).splitlines()[0]
            out[fmt] = sizes
    out["parameters"] = (count_parameters(loaded.model), count_parameters(small))
    out["kv"] = (kv_bytes_per_token(loaded, dense_mask, "auto"), kv_bytes_per_token(loaded, result.pruned, "auto"))
    print(f"  formats: {out}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------

def _ci(row) -> str:
    return f"{row['ppl']:.2f} [{row['lo']:.2f}, {row['hi']:.2f}]"


def run_line(k: int, run: dict, a, several: bool) -> str:
    """What one run was: its recovery budget (from its own command), machine, date, time and load."""
    name = f"Run {k + 1}" if several else "The run"
    return (f"{name}: recovery budget, the same for every scorer: distillation from the dense model, at most "
            f"{a.steps} steps of {a.batch} x {a.seq} tokens and at most {a.minutes:g} minutes, lr {a.lr:g}, warmup "
            f"{a.warmup}, T = {a.temperature:g}, precision {a.precision} (ran: {run.get('ran_precision', '?')}). "
            f"{run['machine']}, {run['date']}; {'the whole run' if run.get('finished') else 'the parts it completed'} "
            f"took {run.get('wall_s', float('nan')) / 60:.0f} min, load average (1/5/15 min) "
            f"{load_text(run.get('load_before'))} at its start, {load_text(run.get('load_after'))} at the end of the last "
            f"saved part." + (f" {a.note}" if a.note else ""))


def markdown(out: dict, note: str = "") -> str:
    """docs/results.md's recovery section from a saved document (`as_runs` form): every run's command
    and budget (parsed from the command it saved), every row tagged with the run that measured it."""
    several = len(out["runs"]) > 1
    settings_of = [command_settings(r["command"]) for r in out["runs"]]

    def tag(entry) -> str:
        return f" (run {entry.get('run', 0) + 1})" if several else ""

    lines = _header_lines(out, settings_of, note)
    for sparsity, by_scorer in sorted(out.get("recovery", {}).items(), key=lambda kv: float(kv[0])):
        lines += _cut_lines(out, sparsity, by_scorer, tag, settings_of)
    lines += target_lines(out, tag) + [""]
    if "precision" in out:
        lines += _precision_lines(out["precision"], tag, settings_of)
    if "formats" in out:
        lines += _format_lines(out["formats"], tag, settings_of)
    lines.append(END)
    return "\n".join(lines) + "\n"


def _header_lines(out: dict, settings_of: list, note: str) -> list[str]:
    """The section's title, the commands that regenerate it, what was measured how, and the dense row."""
    dense, runs = out["dense"], out["runs"]
    several = len(runs) > 1
    first = settings_of[0]
    commands = []
    for k, run in enumerate(runs):
        commands += ([f"# run {k + 1}, {run['date']}"] if several else []) + [run["command"]]
    missing = [(f"run {k + 1}: " if several else "") + (", ".join(not_reached(out, k, a)) or "nothing")
               for k, (run, a) in enumerate(zip(runs, settings_of)) if not run.get("finished")]
    lines = [BEGIN, "## Recovery and compression (bench/bench_recovery.py)", "", "Regenerated by:", "",
             "```", *commands, "```", "",
             f"SmolLM2-135M; mask policy {out['policy']} (the pipeline's default on GQA models: whole KV groups go, "
             f"so the model never grows; the global ranking at 25 % makes it bigger in K/V, see the policy table "
             f"above). Held-out: the first {dense['tokens'] + dense['windows']:,} tokens of the evaluation split, "
             f"{dense['windows']} windows of {first.window} (each window's first token is context only, "
             f"{dense['tokens']:,} scored); perplexity [95 % bootstrap CI over windows, {first.bootstrap} resamples, "
             f"the same for every row{' of every run' if several else ''}]; top-1 = next-token top-1 accuracy "
             f"(ratio to dense)."
             + (f" {len(runs)} runs measured this section (each later one with --update-json, replacing the "
                f"entries it measured); each row says its run." if several else "")
             + (f" **Stopped before finishing, not reached: {'; '.join(missing)}.**" if missing else ""), ""]
    lines += [f"- {run_line(k, run, a, several)}" if several else run_line(k, run, a, several)
              for k, (run, a) in enumerate(zip(runs, settings_of))]
    lines += ([note] if note else []) + ["",
             f"**Dense: perplexity {_ci(dense)}, top-1 {dense['top1']:.3f}, {out['dense_size']['params']:,} "
             f"parameters, {out['dense_size']['mb']:.1f} MB safetensors, {out['dense_size']['kv']:,} KV bytes / "
             f"token.**", ""]
    return lines


def _cut_lines(out: dict, sparsity, by_scorer: dict, tag, settings_of: list) -> list[str]:
    """One sparsity's table (every scorer's variants) and, per scorer, its recovery and INT8 lines."""
    dense = out["dense"]
    lines = [f"### {float(sparsity):.1%} of heads pruned", "",
              "| scorer | variant | perplexity [95 % CI] | top-1 (x dense) | parameters | file | KV bytes / token | "
              "seconds |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for scorer, res in by_scorer.items():
        for name, row in res["rows"].items():
            kind = "INT8 ONNX" if "ONNX" in name else "safetensors"
            lines.append(f"| {SCORER_LABELS.get(scorer, scorer)}{tag(res)} | {name} | {_ci(row)} | {row['top1']:.3f} "
                         f"({row['top1'] / dense['top1']:.3f}x) | {row['params']:,} "
                         f"({row['params'] / out['dense_size']['params']:.3f}x) | {row['mb']:.1f} MB {kind} "
                         f"({row['mb'] / out['dense_size']['mb']:.3f}x) | {row['kv']:,} "
                         f"({row['kv'] / out['dense_size']['kv']:.3f}x) | {row['seconds']:.0f} |")
    lines.append("")
    for scorer, res in by_scorer.items():
        one, rec = res["rows"]["one-shot"]["ppl"], res["rows"]["recovered"]["ppl"]
        gap = (one - rec) / (one - dense["ppl"]) if one > dense["ppl"] else float("nan")
        lines.append(f"- {SCORER_LABELS.get(scorer, scorer)}{tag(res)}: {res['n_pruned']} heads; recovery closes "
                     f"{gap:.0%} of the one-shot gap; recovered / dense perplexity {rec / dense['ppl']:.3f}x; "
                     f"held-out curve (step: perplexity on the first "
                     f"{settings_of[res.get('run', 0)].curve_tokens} tokens): "
                     + (", ".join(f"{s}: {v:.2f}" for s, v in res["curve"]) or "none"))
        if "int8" in res:
            i = res["int8"]
            c, w, t = i["dynamic"], i["weight-only"], i["torch"]
            lines.append(f"  INT8 vs its fp32 in the same runtime -- ONNX integer: top-1 agreement "
                         f"{c['top1_agreement']:.3f}, perplexity {c['perplexity_ratio']:.3f}x, file "
                         f"{c['size_ratio']:.3f}x, prefill@128 {speedup_text(c, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')} "
                         f"faster, 1-token forward {speedup_text(c, 'one_token', 'one_token_ms_fp32', 'one_token_ms_int8')}; ONNX "
                         f"weight-only: agreement {w['top1_agreement']:.3f}, file {w['size_ratio']:.3f}x, prefill "
                         f"{speedup_text(w, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}; PyTorch dynamic: agreement "
                         f"{t['top1_agreement']:.3f}, perplexity {t['metric_int8'] / t['metric_fp32']:.3f}x, prefill "
                         f"{speedup_text(t, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}, decode "
                         f"{speedup_text(t, 'decode', 'decode_ms_fp32', 'decode_ms_int8')}. Kept float: "
                         f"{', '.join(i['keep_float'])}.")
    lines.append("")
    return lines


def _precision_lines(p: dict, tag, settings_of: list) -> list[str]:
    """The fp32 vs bf16 step-throughput paragraph."""
    s = p["seconds_per_step"]
    lo, hi = p.get("ratio_range", (float("nan"),) * 2)
    load = p.get("load", ((), ()))
    a = settings_of[p.get("run", 0)]
    timed = ("steps 2 on of each call timed: a real run builds AdamW's state once"
             if p.get("steady", False) else "set-up such as the optimizer's included in each")
    return [f"Recovery step throughput{tag(p)} (CPU bf16 units: {'yes' if p['bf16_units'] else 'no'}), "
              f"{p['repeats']} interleaved fp32 / bf16 pairs of {p['steps']}-step distill() calls ({timed}; "
              f"bench/_timing.compare; spread "
              f"{'settled' if p.get('converged') else 'not settled'}; load average "
              f"{load_text(load[0])} before, {load_text(load[1])} after): "
              f"fp32 {s['fp32']['median']:.2f} s/step (min "
              f"{s['fp32']['min']:.2f}, max {s['fp32']['max']:.2f}), bf16 autocast {s['bf16']['median']:.2f} "
              f"(min {s['bf16']['min']:.2f}, max {s['bf16']['max']:.2f}): bf16 {p['ratio']:.2f}x (median of the "
              f"per-pair fp32 / bf16 ratios; min {lo:.2f}, max {hi:.2f})"
              + (f"; perplexity after {a.precision_steps} steps fp32 {p['final_ppl']['fp32']:.3f}, bf16 "
                 f"{p['final_ppl']['bf16']:.3f} ({p['ppl_ratio']:.3f}x)." if "final_ppl" in p else "."),
              "bf16 autocast runs the matmuls of both forwards and of the backward in bfloat16; the master "
              "weights, their gradients, AdamW's state and the loss (log-softmax, KL, cross-entropy) stay float32"
              + (", and so does the student's attention core (SDPA: its bfloat16 backward is the slower one on "
                 "CPUs, analysis/arch/attention.py); AdamW is torch's fused kernel." if p.get("steady", False)
                 else "."),
              ""]


def _format_lines(f: dict, tag, settings_of: list) -> list[str]:
    """The 25 % model's bytes on disk in every export format."""
    lines = [f"The 25 % model in every export format{tag(f)} (bytes on disk vs dense in the same format; "
              f"{settings_of[f.get('run', 0)].format_steps} recovery steps: sizes do not depend on them):", "",
              "| format | dense | pruned 25 % | ratio |", "|---|---:|---:|---:|"]
    for fmt in FORMATS:
        d, q = f[fmt]["dense"], f[fmt]["pruned"]
        ok = isinstance(d, int) and isinstance(q, int)
        cells = [f"{v / 2**20:.1f} MB" if isinstance(v, int) else f"not written: {v}" for v in (d, q)]
        lines.append(f"| {fmt} | {cells[0]} | {cells[1]} | {f'{q / d:.3f}x' if ok else 'n/a'} |")
    lines += ["", f"Parameters {f['parameters'][1]:,} vs {f['parameters'][0]:,} "
                  f"({f['parameters'][1] / f['parameters'][0]:.3f}x); KV bytes / token {f['kv'][1]:,} vs "
                  f"{f['kv'][0]:,} ({f['kv'][1] / f['kv'][0]:.3f}x). The zeroed format keeps the full shapes "
                  f"by design (pruned heads are zero rows), so it is never smaller.", ""]
    return lines


def not_reached(out: dict, run: int, args) -> list[str]:
    """What run `run`'s command (settings `args`) asked for that the document lacks from that run, when
    it was stopped (cuts by sparsity and scorer, parts)."""
    done = {(float(s), sc) for s, by in out.get("recovery", {}).items() for sc, res in by.items()
            if res.get("run", 0) == run}
    missing = [f"{s:.1%} {sc}" for s in (float(x) for x in args.sparsities.split(",")) for sc in args.scorers
               if "recovery" in args.parts and (sc == args.scorers[0] or args.compare_at is None or s in args.compare_at)
               and (s, sc) not in done]
    return missing + [p for p in ("precision", "formats")
                      if p in args.parts and out.get(p, {}).get("run", -1) != run]


# issue 23's targets: sparsity -> the recovered perplexity's most allowed ratio to dense
PPL_TARGETS = {0.125: 1.05, 0.25: 1.15}


def target_lines(out: dict, tag=lambda entry: "") -> list[str]:
    """Each target of issue 23 with what was measured (`tag(entry)`: which run): met or not, never tuned."""
    several = len(out.get("runs", ())) > 1
    dense, lines = out["dense"], [f"Targets (issue 23), as measured {'in these runs' if several else 'in this run'}:"]
    for sparsity, by_scorer in sorted(out.get("recovery", {}).items(), key=lambda kv: float(kv[0])):
        limit = PPL_TARGETS.get(float(sparsity))
        for scorer, res in by_scorer.items():
            rows = res["rows"]
            ratio = rows["recovered"]["ppl"] / dense["ppl"]
            if limit is not None:
                lines.append(f"- {float(sparsity):.1%} {scorer}{tag(res)}: recovered perplexity {ratio:.3f}x dense (target <= "
                             f"{limit}x in <= 20 min; {rows['recovered']['seconds'] / 60:.1f} min, "
                             f"{rows['recovered']['steps']} steps): {'met' if ratio <= limit else 'NOT met'}.")
            if "int8" in res:
                c = res["int8"]["dynamic"]
                ok = (c["top1_agreement"] >= 0.95 and c["perplexity_ratio"] <= 1.05
                      and speedup(c, "prefill", "latency_ms_fp32", "latency_ms_int8") >= 1.5
                      and speedup(c, "one_token", "one_token_ms_fp32", "one_token_ms_int8") >= 1.5)
                lines.append(f"- {float(sparsity):.1%} {scorer}{tag(res)}: integer INT8 (>= 1.5x prefill and 1-token, top-1 "
                             f">= 0.95, perplexity <= 1.05x): {'met' if ok else 'NOT met'}; weight-only file "
                             f"{res['int8']['weight-only']['size_ratio']:.3f}x (target <= 0.3x).")
    if "precision" in out:
        p = out["precision"]
        fast = p["ratio"] >= 1.5
        if "ppl_ratio" in p:
            verdict = "met" if fast and abs(p["ppl_ratio"] - 1) <= 0.02 else "NOT met"
            final = f"final perplexity {p['ppl_ratio']:.3f}x"
        else:
            verdict = f"throughput {'met' if fast else 'NOT met'}, perplexity not measured"
            final = "final perplexity not measured (--precision-steps 0)"
        lines.append(f"- bf16 recovery steps{tag(p)} {p['ratio']:.2f}x fp32, {final} (target >= 1.5x, within 2 %): "
                     f"{verdict}.")
    if "formats" in out:
        f = out["formats"]
        sized = {k: v for k, v in f.items() if k in FORMATS and k != "zeroed" and all(isinstance(x, int) for x in v.values())}
        small = all(v["pruned"] < v["dense"] for v in sized.values()) and f["parameters"][1] < f["parameters"][0] \
            and f["kv"][1] < f["kv"][0]
        lines.append(f"- pruned + recovered 25 % smaller{tag(f)} than dense in parameters, KV bytes and every format that "
                     f"exported ({', '.join(sized)}): {'met' if small else 'NOT met'}.")
    return lines


def write_docs(section: str) -> None:
    write_section(ROOT / "docs" / "results.md", section, BEGIN, END, what="The results file")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sparsities", default="0.125,0.25,0.5")
    p.add_argument("--scorers", default="mp-g,gate")
    p.add_argument("--compare-at", dest="compare_at", default=None,
                   help="sparsities at which the scorers after the first run too (default: every sparsity)")
    p.add_argument("--int8-scorers", dest="int8_scorers", default=None,
                   help="scorers whose recovered models get the INT8 rows (default: every scorer)")
    p.add_argument("--int8-at", dest="int8_at", default=None,
                   help="sparsities whose recovered models get the INT8 rows (default: every sparsity)")
    p.add_argument("--note", default="", help="a sentence the section prints under the budget (why it was sized so)")
    p.add_argument("--policy", default=None, help="mask policy (default: masks.default_policy)")
    p.add_argument("--steps", type=int, default=300,
                   help="distillation steps (the cosine schedule's length; 300 x ~4 s = the 20 minutes on 2 cores)")
    p.add_argument("--minutes", type=float, default=20.0, help="most minutes of distillation per cut")
    add_distill_options(p)
    p.add_argument("--eval-every", dest="eval_every", type=int, default=100)
    p.add_argument("--curve-tokens", dest="curve_tokens", type=int, default=2048)
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--eval-batch", dest="eval_batch", type=int, default=8)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--agree-tokens", dest="agree_tokens", type=int, default=2048)
    p.add_argument("--latency-repeats", dest="latency_repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="recovery,int8,precision,formats",
                   help="the parts, run in this order (int8 is part of recovery)")
    p.add_argument("--tp-steps", dest="tp_steps", type=int, default=4)
    p.add_argument("--tp-repeats", dest="tp_repeats", type=int, default=3,
                   help="fewest interleaved fp32/bf16 pairs (bench/_timing.compare)")
    p.add_argument("--tp-max-pairs", dest="tp_max_pairs", type=int, default=7)
    p.add_argument("--tp-seconds", dest="tp_seconds", type=float, default=300.0,
                   help="no pair is started after this many seconds of the comparison (once --tp-repeats ran)")
    p.add_argument("--precision-steps", dest="precision_steps", type=int, default=100)
    p.add_argument("--format-steps", dest="format_steps", type=int, default=0,
                   help="recovery steps of the formats part's model (0: sizes do not depend on them)")
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--save-json", dest="save_json", default=None, help="also write the measured numbers here")
    p.add_argument("--from-json", dest="from_json", default=None,
                   help="render the markdown from numbers saved by --save-json (nothing is measured)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--update-json", dest="update_json", default=None,
                   help="start from the numbers an earlier run saved (--save-json): what this run measures replaces "
                        "their entries (cuts by sparsity and scorer, the precision and formats parts), the rest is "
                        "kept, and the section names the run behind every number")
    return p


def settings(argv: list[str], p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The options of a command line (argv after the script), --quick applied and lists split: what
    main runs with, and what the section renders a saved run's budget from (its saved command)."""
    p = p or parser()
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.eval_tokens, args.sparsities, args.scorers = 4, 1024, "0.25", "mp-g"
        args.bootstrap, args.eval_every, args.curve_tokens, args.agree_tokens = 50, 2, 256, 256
        args.tp_steps, args.tp_repeats, args.precision_steps, args.latency_repeats = 2, 1, 2, 2
        args.tp_max_pairs, args.tp_seconds = 1, 0.0
        args.max_sequences, args.minutes = 64, 2.0
    if args.tp_steps < 2:
        p.error("--tp-steps must be at least 2 (the steps after the first are timed)")
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]     # run in this order
    args.scorers = [s.strip() for s in args.scorers.split(",") if s.strip()]
    args.int8_scorers = None if args.int8_scorers is None else set(args.int8_scorers.split(","))
    args.compare_at, args.int8_at = ({float(x) for x in v.split(",")} if v else None
                                     for v in (args.compare_at, args.int8_at))
    return args


def command_settings(command: str) -> argparse.Namespace:
    """`settings` of a saved command line ("nice -n 10 .venv/bin/python -m bench.bench_recovery ...", or a
    document saved before the benches ran as modules: "... python bench/bench_recovery.py ...")."""
    words = shlex.split(command)
    script = next(i for i, w in enumerate(words) if w.endswith("bench_recovery.py") or w == "bench.bench_recovery")
    return settings(words[script + 1:])


# what every run of a document must share: the held-out rows are comparable only on the same windows
HELD_OUT_SETTINGS = ("eval_tokens", "window", "bootstrap", "eval_batch", "policy", "batch", "seq", "max_sequences")


def as_runs(doc: dict) -> dict:
    """A saved document in the several-runs form: "runs" [{command, date, ...}] and a "run" index on
    every measured entry (a one-run file saved before --update-json existed becomes run 0)."""
    if "runs" in doc:
        return doc
    keys = ("machine", "command", "date", "load_before", "load_after", "wall_s", "finished", "ran_precision")
    run = {k: doc.pop(k) for k in keys if k in doc}
    for by_scorer in doc.get("recovery", {}).values():
        for res in by_scorer.values():
            res.setdefault("run", 0)
    for part in ("precision", "formats"):
        if part in doc:
            doc[part].setdefault("run", 0)
    return {**doc, "runs": [run]}


def start_document(args, command: str) -> tuple[dict, int]:
    """(the document this run writes into, this run's index in its "runs")."""
    run = {"machine": f"{platform.machine()}, {args.threads} torch thread(s)", "command": command,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_before": load_average(),
           "ran_precision": resolve_precision(args.precision, "cpu")}
    if not args.update_json:
        return {"runs": [run]}, 0
    doc = as_runs(json.loads(Path(args.update_json).read_text()))
    first = command_settings(doc["runs"][0]["command"])
    differ = [k for k in HELD_OUT_SETTINGS if getattr(first, k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"--update-json: this run's {', '.join(differ)} differ from the saved run's; the rows "
                         f"would not be comparable. Use the same options (or a new --save-json file).")
    doc["runs"].append(run)
    return doc, len(doc["runs"]) - 1


def main() -> int:
    p = parser()
    args = settings(sys.argv[1:], p)
    command = "nice -n 10 .venv/bin/python -m bench.bench_recovery " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    if args.from_json:
        section = markdown(as_runs(json.loads(Path(args.from_json).read_text())), args.note)
        print(section)
        if args.write_docs:
            write_docs(section)
        return 0
    out, run = start_document(args, command)
    began = time.perf_counter()
    with torch_threads(args.threads):
        loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
        out["policy"] = args.policy or default_policy(loaded.geometry.group_size)
        calibration = get_calibration(loaded)
        held = HeldOut(loaded, args)
        zeros = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool)
        dense = held.row(loaded.model)
        if "dense" in out and not np.isclose(out["dense"]["ppl"], dense["ppl"], rtol=1e-6, atol=0.0):
            raise SystemExit(f"--update-json: dense perplexity {dense['ppl']:.6f} here, {out['dense']['ppl']:.6f} in "
                             f"the saved run: another model or text; the rows would not be comparable.")
        out["dense"], out["dense_size"] = dense, size_row(loaded, loaded.model, zeros)
        print(f"  dense: {out['dense']}", flush=True)
        for part in [x for x in args.parts if x in ("recovery", "precision", "formats")]:
            if part == "recovery":
                out.setdefault("recovery", {})
                for s in [float(x) for x in args.sparsities.split(",")]:
                    for sc in args.scorers:
                        if sc == args.scorers[0] or args.compare_at is None or s in args.compare_at:
                            result = {**recover(loaded, held, s, sc, args, calibration), "run": run}
                            out["recovery"].setdefault(str(s), {})[sc] = result
                            save_json(out, run, args, began)
            elif part == "precision":
                out["precision"] = {**precision(loaded, args), "run": run}
            else:
                out["formats"] = {**formats(loaded, args, calibration), "run": run}
            save_json(out, run, args, began)
    out["runs"][run]["finished"] = True
    save_json(out, run, args, began)
    print(f"  whole run: {out['runs'][run]['wall_s']:.0f} s", flush=True)
    section = markdown(json.loads(json.dumps(out, default=str)), args.note)   # the keys --from-json sees
    print(section)
    if args.write_docs:
        write_docs(section)
    return 0


def save_json(out: dict, run: int, args, began: float) -> None:
    """The numbers so far (after every cut and part, atomically), so a run stopped early can still be
    rendered with --from-json: the section then says which parts it lacks ("finished" is unset)."""
    out["runs"][run]["load_after"], out["runs"][run]["wall_s"] = load_average(), time.perf_counter() - began
    if args.save_json:
        atomic_write(args.save_json, json.dumps(out, indent=1, default=str), what="The --save-json file")


def get_calibration(loaded):
    """The scorers' calibration ids (8 x 128 tokens of the calibration split, as docs/results.md's table)."""
    from analysis.score.scoring import calibration_ids as scorer_calibration
    return scorer_calibration(loaded.tokenizer)


if __name__ == "__main__":
    raise SystemExit(main())
