"""Benchmark: the compression frontier of SmolLM2-135M in llama.cpp, and iterative vs one-shot recovery
(issue 35; a result, not a test).

1. Iterative vs one-shot at the same budget (--parts iterative). For each scorer (--scorers: the head
   gate and MP-G) and target (--targets: 25 % and 50 %), under the groups policy (whole KV groups:
   the model never grows): the one-shot cut without recovery, and the cut reached in one round, in
   rounds of 12.5 % and in rounds of 6.25 % of the heads (--steps-per-target), every schedule with the
   same total distillation steps (--total-steps, split evenly over its rounds) of the same batch, so
   the same tokens. Every final model: held-out perplexity on --eval-tokens tokens of the evaluation
   split (non-overlapping windows of --window, 95 % bootstrap CI over windows, the same resamples for
   every row) and next-token top-1 accuracy; the per-round metric on the pipeline's own 512 tokens.
2. The frontier (--parts frontier). File size against llama.cpp's perplexity on the same held-out
   tokens (windows as above, CIs by the same bootstrap): the dense model at F16, Q8_0, Q6_K, Q5_K_M,
   Q4_K_M and Q4_0 (--dense-types), and the pruned + recovered models (the one-round runs of part 1
   at the targets, plus one-round runs at --extra-targets, default 12.5 %) at Q8_0, Q5_K_M and Q4_K_M
   (--pruned-types). Every GGUF is written by the gguf export (so it is self-checked), measured by
   llama.cpp with its f16 KV cache. The Pareto frontier (no other point both smaller and lower), a
   plot (docs/data/frontier.png) and the verdict in words.

Numbers go to --save-json (default docs/data/frontier.json) after every run, so a long run can stop
and resume (--resume skips what the file holds); --write-docs renders the section between the
frontier markers of docs/results.md from that file.

Usage: nice -n 10 .venv/bin/python -m bench.bench_frontier [--parts iterative,frontier] [--total-steps 240]
       [--eval-tokens 16384] [--scorers gate,mp-g] [--resume] [--write-docs] [--quick]
--quick: MP-G only, 25 % only, 4 steps, 1024 tokens: checks the script in a few minutes.
"""
from __future__ import annotations

import argparse
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

from analysis.arch.models import load_model
from analysis.compress.export import export
from analysis.compress.export.selfcheck import SelfCheckFailed
from analysis.compress.recover.pipeline import PipelineConfig, export_round, run_pipeline
from analysis.compress.recover.frontier import gguf_point, measured, pareto, plot_png, prior_lattice, verdict
from analysis.compress.recover.report import FRONTIER_MARKERS
from analysis.compress.surgery import prune_heads
from analysis.core.atomic import atomic_write, write_section
from analysis.core.text import evaluation_text
from analysis.measure.evaluation import CausalPerplexity, bootstrap_perplexity, token_ids
from bench._distill_options import add_distill_options, distill_config
from bench._timing import load_average

ROOT = Path(__file__).resolve().parents[1]
MARKERS = FRONTIER_MARKERS          # the default section's; --section NAME owns <!-- NAME:begin/end -->
SCORER_LABELS = {"mp-g": "MP-G", "gate": "head gate"}


class HeldOut:
    """The evaluation ids, the windows and the bootstrap resamples every row shares (PyTorch and llama.cpp)."""

    def __init__(self, loaded, args):
        self.ids = token_ids(loaded.tokenizer, evaluation_text(), max_tokens=args.eval_tokens)      # [N]
        self.window, self.n_boot = args.window, args.bootstrap
        self.evaluator = CausalPerplexity(window=args.window, stride=args.window, batch_size=8)

    def _row(self, sums: np.ndarray, counts: np.ndarray, correct: float | None) -> dict:
        boot = bootstrap_perplexity(sums[None], counts, self.n_boot)[:, 0]                        # [n]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        return {"ppl": float(np.exp(sums.sum() / counts.sum())), "lo": float(lo), "hi": float(hi),
                "top1": correct, "tokens": int(counts.sum())}

    def torch_row(self, model) -> dict:
        sums, correct, counts = self.evaluator.window_stats(model, self.ids)                      # [1, W] x2, [W]
        return self._row(sums[0], counts, float(correct.sum() / counts.sum()))

    def gguf_row(self, path: Path) -> dict:
        return gguf_point(path, self.ids.numpy(), window=self.window, n_boot=self.n_boot)


def schedule_name(target: float, step: float) -> str:
    return "one round" if step >= target else f"rounds of {step * 100:g} %"


def run_schedule(loaded, held: HeldOut, scorer: str, target: float, step: float, args) -> tuple[dict, object]:
    """One schedule: the pipeline to `target` in rounds of `step`, args.total_steps split over its rounds."""
    base = PipelineConfig(target_sparsity=target, step=step, scorer=scorer, policy="groups",
                          distill=distill_config(args, steps=args.total_steps), eval_tokens=512)
    rounds = len(run_rounds(loaded, base))
    cfg = replace(base, recovery_steps=max(1, args.total_steps // rounds))
    start = time.perf_counter()
    result = run_pipeline(loaded, cfg)
    small, _ = result.smaller()
    row = {**held.torch_row(small), "rounds": rounds, "steps_per_round": cfg.recovery_steps,
           "steps": sum(len(r.history) for r in result.rounds), "n_pruned": int(result.pruned.sum()),
           "per_round": [{"sparsity": r.sparsity, "cut": r.metric_cut, "recovered": r.metric} for r in result.rounds],
           "seconds": time.perf_counter() - start, "precision": result.rounds[-1].precision}
    print(f"  {SCORER_LABELS[scorer]} {target:.1%} {schedule_name(target, step)}: {row['rounds']} rounds x "
          f"{row['steps_per_round']} steps, ppl {row['ppl']:.2f} [{row['lo']:.2f}, {row['hi']:.2f}], top-1 "
          f"{row['top1']:.3f}, {row['seconds']:.0f} s; rounds {row['per_round']}", flush=True)
    return row, result


def run_rounds(loaded, cfg: PipelineConfig) -> list[int]:
    from analysis.compress.recover.pipeline import policy_unit, round_counts
    g = loaded.geometry
    return round_counts(cfg.target_sparsity, cfg.step, g.n_total_heads, policy_unit("groups", g))


def one_shot(loaded, held: HeldOut, scorer: str, target: float) -> dict:
    result = run_pipeline(loaded, PipelineConfig(target_sparsity=target, step=target, scorer=scorer, policy="groups",
                                                 eval_tokens=512))
    small, _ = prune_heads(loaded.model, result.pruned)
    return {**held.torch_row(small), "rounds": 1, "steps": 0, "n_pruned": int(result.pruned.sum())}


def gguf_points(loaded, held: HeldOut, result, label: str, types: list[str], folder: Path, out: dict,
                saved=lambda: None, source_ppl: float | None = None) -> None:
    """Write `result`'s model (None: the dense model) at each GGUF type and measure it in llama.cpp
    (`saved()` after each point: a stopped run resumes from the next). `source_ppl`: PyTorch's held-out
    perplexity of the model the files were written from (kept with each point: points of one label
    written by different runs can be checked to come from the same model)."""
    for gguf_type in types:
        key = f"{label} {gguf_type}"
        if key in out["frontier"]:
            continue
        name = f"g{len(out['frontier'])}"
        try:
            if result is None:
                pruned = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool)
                written = export("gguf", loaded.model, pruned, folder, name, tokenizer=loaded.tokenizer,
                                 gguf_type=gguf_type)
            else:
                written = export_round("gguf", result.model, result.pruned, result.head_rounds, folder, name,
                                       tokenizer=loaded.tokenizer, gguf_type=gguf_type)
        except SelfCheckFailed as refused:         # the export refused the file: a point that does not exist
            out["frontier"][key] = {"refused": str(refused), "label": label, "type": gguf_type}
            saved()
            print(f"  {key}: REFUSED by the export's self-check: {refused}", flush=True)
            continue
        row = {**held.gguf_row(written.path / "model.gguf"), "label": label, "type": gguf_type,
               "self_check": written.checks[-1]["line"] if written.checks else "F32/F16 reference",
               **({"source_ppl": source_ppl} if source_ppl is not None else {})}
        out["frontier"][key] = row
        saved()
        print(f"  {key}: {row['bytes'] / 2**20:.1f} MiB, llama.cpp ppl {row['ppl']:.2f} [{row['lo']:.2f}, "
              f"{row['hi']:.2f}]", flush=True)


def section_markers(section: str) -> tuple[str, str]:
    """The markers of docs/results.md's section: "frontier" is the pipeline report's (FRONTIER_MARKERS);
    another name (a run at another budget, with its own --save-json) gets its own pair."""
    return MARKERS if section == "frontier" else (f"<!-- {section}:begin -->", f"<!-- {section}:end -->")


def markdown(out: dict, section: str = "frontier") -> str:
    a = out["args"]
    markers = section_markers(section)
    title = ("The compression frontier and iterative recovery" if section == "frontier" else
             f"Iterative vs one-shot with {a['total_steps']} distillation steps")
    lines = [markers[0], "", f"## {title} (bench/bench_frontier.py)", "",
             f"Measured {out['when']} on {out['machine']} ({out['threads']} threads), load average "
             f"{out['load']}. " + commands_line(out), "",
             f"Held-out: {a['eval_tokens']:,} tokens of the evaluation split in windows of {a['window']}, 95 % "
             f"bootstrap CIs over windows ({a['bootstrap']} resamples, the same for every row). Recovery: "
             f"{a['total_steps']} distillation steps in all per schedule (batch {a['batch']} x {a['seq']} tokens, "
             f"lr {a['lr']:g}, precision {a['precision']}), split evenly over the schedule's rounds; groups policy.", ""]
    if out.get("iterative"):
        lines += ["### Iterative vs one-shot at the same budget", "",
                  "| scorer | target | schedule | rounds x steps | perplexity [95 % CI] | top-1 | per round (cut -> recovered) |",
                  "|---|---|---|---|---|---:|---|"]
        for key, row in out["iterative"].items():
            scorer, target, schedule = key.split("|")
            steps = "none" if not row["steps"] else f"{row['rounds']} x {row['steps_per_round']}"
            per_round = "; ".join(f"{r['sparsity']:.1%}: {r['cut']:.1f} -> {r['recovered']:.1f}"
                                  for r in row.get("per_round", []))
            lines.append(f"| {SCORER_LABELS.get(scorer, scorer)} | {float(target):.1%} | {schedule} | {steps} | "
                         f"{row['ppl']:.2f} [{row['lo']:.2f}, {row['hi']:.2f}] | {row['top1']:.3f} | {per_round} |")
        lines.append("")
    if out.get("frontier"):
        points = measured(out["frontier"])
        lines += ["### Size against llama.cpp perplexity", "", "![frontier](data/frontier.png)", "",
                  "| model | type | file MiB | perplexity [95 % CI] | on the frontier |", "|---|---|---:|---|---|"]
        front = set(pareto(points))
        for key, p in sorted(points.items(), key=lambda kv: kv[1]["bytes"]):
            lines.append(f"| {p['label']} | {p['type']} | {p['bytes'] / 2**20:.1f} | {p['ppl']:.2f} [{p['lo']:.2f}, "
                         f"{p['hi']:.2f}] | {'yes' if key in front else ''} |")
        lines += ["", "Per pruned file:", *(f"- {line}" for line in verdict(out["frontier"])), ""]
    lines.append(markers[1])
    return "\n".join(lines) + "\n"


def commands_line(out: dict) -> str:
    """The commands whose rows the file holds (a --resume run adds to the rows of the ones before)."""
    runs = out.get("commands") or [{"command": out["command"], "when": out["when"]}]
    if len(runs) == 1:
        return f"Command: `{runs[0]['command']}`."
    return "Commands, in order (each --resume run added its rows): " + "; ".join(
        f"`{r['command']}` ({r['when']})" for r in runs) + "."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="iterative,frontier")
    p.add_argument("--scorers", default="gate,mp-g")
    p.add_argument("--targets", default="0.25,0.5")
    p.add_argument("--steps-per-target", dest="steps_per_target", default="0.125,0.0625",
                   help="round sizes of the iterative schedules (besides one round)")
    p.add_argument("--extra-targets", dest="extra_targets", default="0.125",
                   help="one-round recovered cuts for the frontier only")
    p.add_argument("--total-steps", dest="total_steps", type=int, default=240)
    add_distill_options(p)
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--dense-types", dest="dense_types", default="f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_0")
    p.add_argument("--pruned-types", dest="pruned_types", default="q8_0,q5_k_m,q4_k_m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--save-json", dest="save_json", default=str(ROOT / "docs" / "data" / "frontier.json"))
    p.add_argument("--resume", action="store_true", help="skip the runs --save-json already holds")
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--section", default="frontier",
                   help="docs/results.md section to write (another name: a run kept apart, e.g. at another budget)")
    p.add_argument("--render-only", dest="render_only", action="store_true",
                   help="only render docs/results.md's section (and the plot) from --save-json")
    p.add_argument("--quick", action="store_true")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.scorers, args.targets, args.steps_per_target, args.extra_targets = "mp-g", "0.25", "0.125", ""
        args.total_steps, args.eval_tokens, args.bootstrap = 4, 1024, 50
        args.dense_types, args.pruned_types = "f16,q8_0", "q8_0"
    save = Path(args.save_json)
    out = json.loads(save.read_text()) if (args.resume or args.render_only) and save.is_file() else {}
    if not args.render_only:
        run(args, out, save)
    if out.get("frontier"):
        plot_png(out["frontier"], save.with_suffix(".png"),
                 "SmolLM2-135M: size vs perplexity, dense quantized vs pruned + recovered + quantized")
    if args.write_docs:
        write_section(ROOT / "docs" / "results.md", markdown(out, args.section), *section_markers(args.section))
    print(markdown(out, args.section))
    return 0


def run(args, out: dict, save: Path) -> None:
    import torch
    torch.set_num_threads(args.threads)
    out.update(args={k: v for k, v in vars(args).items() if k not in ("resume", "write_docs", "render_only", "section")},
               command="python -m bench.bench_frontier " + shlex.join(sys.argv[1:]), machine=platform.processor()
               or platform.machine(), threads=args.threads, when=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    # a resumed file holds rows of earlier commands too: every command that added rows is listed
    out["commands"] = [c for c in out.get("commands", []) if c["command"] != out["command"]] + [
        {"command": out["command"], "when": out["when"]}]
    out.setdefault("iterative", {})
    out.setdefault("frontier", {})

    def saved():
        out["load"] = load_average()
        atomic_write(save, json.dumps(out, indent=1), encoding="utf-8")

    loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
    held = HeldOut(loaded, args)
    parts = set(args.parts.split(","))
    scorers = [s for s in args.scorers.split(",") if s]
    targets = [float(t) for t in args.targets.split(",") if t]
    steps = [float(s) for s in args.steps_per_target.split(",") if s]
    extra = [float(t) for t in args.extra_targets.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="bench-frontier-") as tmp:
        folder = Path(tmp)
        if "frontier" in parts:
            gguf_points(loaded, held, None, "dense", args.dense_types.split(","), folder, out, saved)
            lattice = prior_lattice(loaded.model)       # the verdict's caveat when the dense model was quantized before
            for point in out["frontier"].values():
                if point["label"] == "dense" and "refused" not in point:
                    point["lattice"] = lattice
            saved()
        for scorer in scorers:
            for target in targets + (extra if "frontier" in parts else []):
                schedules = [target] + ([s for s in steps if s < target] if "iterative" in parts and target in targets
                                        else [])
                if "iterative" in parts and target in targets:
                    key = f"{scorer}|{target}|one-shot, no recovery"
                    if key not in out["iterative"]:
                        out["iterative"][key] = one_shot(loaded, held, scorer, target)
                        saved()
                for step in schedules:
                    key = f"{scorer}|{target}|{schedule_name(target, step)}"
                    label = f"{SCORER_LABELS[scorer]} {target * 100:g} %"
                    wants_gguf = "frontier" in parts and step >= target and any(
                        f"{label} {t}" not in out["frontier"] for t in args.pruned_types.split(","))
                    if not wants_gguf and (key in out["iterative"] or target not in targets):
                        continue           # held already (an extra target is run only for its GGUF points)
                    row, result = run_schedule(loaded, held, scorer, target, step, args)
                    if target in targets and key not in out["iterative"]:
                        out["iterative"][key] = row
                    elif key in out["iterative"]:  # re-run for new GGUF types: the held row stays, its rerun is compared
                        held_ppl = out["iterative"][key]["ppl"]
                        print(f"  re-run of a held schedule: ppl {row['ppl']:.4f} (held {held_ppl:.4f})", flush=True)
                    if wants_gguf:
                        gguf_points(loaded, held, result, label, args.pruned_types.split(","), folder, out, saved,
                                    source_ppl=row["ppl"])
                    saved()


if __name__ == "__main__":
    raise SystemExit(main())
