"""Benchmark: what per-head KV plans keep at the model's longest context (issue 41 item 4's quality side; a
result, not a test): the long-context probes of dense and of each plan, with the plan's KV memory next to them.

bench/bench_kv_policies.py times plans whose windows come from a fixed order (speed and memory depend only on
how many heads of each kind there are); quality depends on WHICH heads, so the plans here are made the way a
user makes them, from the heads' own scores (analysis.score.kvscores: the streaming score at 2,048 tokens, the
retrieval score at 1,024 and 2,048, the KV-group ablation on 256 tokens; `headscope kv-plan`):
- cut: MP-G's groups-policy cut at --cut (default 50 %) as a KV plan (bench_kv_policies' cut row);
- duo: --window-share (default 50 %) of the KV heads windowed, lowest streaming score first, KV heads holding
  a retrieval head kept full (DuoAttention-style);
- duo+: the same with --wider-share (default 55 %) windowed (the smallest share whose KV is under 0.5x here);
- mix: --prune-share (default 25 %) pruned by importance, then --window-share windowed, retrieval kept full.
Every plan is read on the same rows as dense (analysis.score.longcontext.long_context_report; paired bootstrap):
a cell is LOST when the plan's CI lies below dense's accuracy; the goal line asks for KV <= 0.5x of dense with
the pass key's all-depth accuracy inside dense's CI.

Usage: nice -n 10 .venv/bin/python -m bench.bench_kv_quality [--length 8192] [--probe passkey] [--items 4]
       [--depths 0.1,0.5,0.9] [--threads 1] [--scores FILE.json] [--out FILE.json] [--write-docs]
       [--render-only FILE.json]
--scores keeps the heads' scores (measured once, read back on a rerun); --out is rewritten after every plan,
so a run stopped part way keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from analysis.arch.cut import Cut
from analysis.arch.window import Window
from analysis.core.errors import HeadscopeError, InputError
from analysis.score.longcontext import KV_QUALITY_MARKERS
from bench._results import save_results

GOAL_RATIO = 0.5


def scores_of(loaded, path: str | None, *, window: Window, log=print):
    """analysis.score.kvscores.KVScores, measured under `window` (and saved to `path`) or read back from `path`
    (when it was measured under the same window)."""
    from analysis.score.kvscores import KVScores, measure_kv_scores
    if path and Path(path).exists():
        d = json.loads(Path(path).read_text())
        if (d["sinks"], d["recent"]) == (window.sinks, window.recent):
            log(f"heads' scores read back from {path}")
            return KVScores(np.array(d["streaming"]), np.array(d["retrieval"]), np.array(d["importance"]), {},
                            prune_tokens=d["prune_tokens"])
    t0 = time.perf_counter()
    s = measure_kv_scores(loaded, window=window, prune=True)
    log(f"heads' scores measured in {time.perf_counter() - t0:.0f} s")
    if path:
        Path(path).write_text(json.dumps(dict(**window.as_dict(), streaming=s.streaming.tolist(),
                                              retrieval=s.retrieval.tolist(), importance=s.importance.tolist(),
                                              prune_tokens=s.prune_tokens)))
    return s


def plans_of(loaded, scores, args) -> dict:
    from analysis.score.kvscores import plan_from_scores
    from bench.bench_kv_policies import default_plans
    g, name, window = loaded.geometry, loaded.name, Window(args.sinks, args.recent)
    common = dict(window=window, model=name, keep_retrieval=True)
    return {
        "cut": default_plans(loaded, cut=args.cut, window_share=0.0, prune_share=0.0, window=window)["cut"],
        "duo": plan_from_scores(g, scores, window_share=args.window_share, **common),
        "duo+": plan_from_scores(g, scores, window_share=args.wider_share, **common),
        "mix": plan_from_scores(g, scores, window_share=args.window_share, prune_share=args.prune_share, **common),
    }


def _all(rep) -> dict:
    """{probe: the all-depths row} of a report."""
    return {c.probe: c.row() for c in rep.changes if c.depth == "all"}


def row_of(name: str, plan, rep, length: int, seconds: float) -> dict:
    out = {"name": name, "counts": plan.counts(), "describe": plan.describe(), "kv_ratio": plan.kv_ratio(length),
           "seconds": seconds, "cells": rep.rows(), "lost": [(c.probe, c.depth) for c in rep.lost]}
    out["inside_dense_ci"] = {p: bool(r["dense_low"] <= r["cut_accuracy"] <= r["dense_high"])
                              for p, r in _all(rep).items()}
    return out


def _ci(r: dict, side: str, what: str = "accuracy") -> str:
    key = f"{side}_{what}" if what == "accuracy" else f"{side}_exact"
    low, high = (f"{side}_low", f"{side}_high") if what == "accuracy" else (f"{key}_low", f"{key}_high")
    return "-" if key not in r else f"{r[key]:.2f} [{r[low]:.2f}, {r[high]:.2f}]"


def markdown(out: dict) -> str:
    a = out["args"]
    lines = [KV_QUALITY_MARKERS[0], "",
             f"## What per-head KV plans keep at {a['length']:,} tokens (bench/bench_kv_quality.py)", "",
             f"Measured {out['when'][:16].replace('T', ' ')} UTC on {out['machine']}, {a['threads']} torch thread(s), "
             f"load average at the end {tuple(round(x, 2) for x in out['load'])}; {out['model']}, the long-context probe(s) "
             f"{', '.join(a['probe'])} at {a['length']:,} tokens, depths {a['depths']}, {a['items']} sequences per "
             f"depth (seed 0), dense and every plan on the same rows (paired 95 % bootstrap CIs over sequences). "
             f"Plans from the heads' scores (streaming at 2,048 tokens with {a['sinks']} sink + {a['recent']} recent "
             "tokens, retrieval at 1,024 and 2,048, KV-group ablation on 256 tokens), KV heads holding a retrieval "
             f"head kept full; the cut is MP-G's groups policy at {a['cut']:.0%}. Command: `{out['command']}`.", "",
             "| plan | full / window / prune | KV (x dense) | probe | accuracy [95 % CI] | exact [95 % CI] | inside dense's CI | lost cells | time |",
             "|---|---|---:|---|---:|---:|---|---|---:|"]
    dense = out["dense"]
    for p, r in dense["all"].items():
        lines.append(f"| dense | all full | 1.000 | {r['label']} | {_ci(r, 'dense')} | {_ci(r, 'dense', 'exact')} | "
                     f"- | - | {dense['seconds']:.0f} s |")
    for row in out["rows"]:
        c = row["counts"]
        alls = {r["probe"]: r for r in row["cells"] if r["depth"] == "all"}
        for p, r in alls.items():
            lost = [d for q, d in row["lost"] if q == p]
            lines.append(f"| {row['name']} | {c['full']} / {c['window']} / {c['prune']} | {row['kv_ratio']:.3f} | "
                         f"{r['label']} | {_ci(r, 'cut')} | {_ci(r, 'cut', 'exact')} | "
                         f"{'yes' if row['inside_dense_ci'][p] else 'no'} | {', '.join(lost) or 'none'} | "
                         f"{row['seconds']:.0f} s |")
    lines += ["", "Per depth (accuracy [95 % CI]; LOST = the plan's CI below dense's accuracy):", "",
              "| probe | depth | dense | " + " | ".join(r["name"] for r in out["rows"]) + " |",
              "|---|---|---:|" + "---:|" * len(out["rows"])]
    by = {(r["probe"], r["depth"]): r for r in out["dense"]["cells"]}
    for (p, d), r in by.items():
        cells = []
        for row in out["rows"]:
            mine = next(x for x in row["cells"] if (x["probe"], x["depth"]) == (p, d))
            cells.append(_ci(mine, "cut") + (" **LOST**" if mine.get("lost") else ""))
        lines.append(f"| {r['label']} | {d} | {_ci(r, 'dense')} | " + " | ".join(cells) + " |")
    lines += ["", *goal_lines(out), "", KV_QUALITY_MARKERS[1]]
    return "\n".join(lines) + "\n"


def goal_lines(out: dict) -> list[str]:
    probe = out["args"]["probe"][0]
    met = [r for r in out["rows"] if r["kv_ratio"] <= GOAL_RATIO and r["inside_dense_ci"].get(probe)]
    missed = [r for r in out["rows"] if r not in met]
    lines = [f"- Goal (KV <= {GOAL_RATIO}x of dense with {probe} accuracy inside dense's CI at "
             f"{out['args']['length']:,} tokens): " + ("met by " + ", ".join(f"{r['name']} ({r['kv_ratio']:.3f}x)"
                                                                             for r in met) if met else "met by no plan")
             + "."]
    for r in missed:
        why = []
        if r["kv_ratio"] > GOAL_RATIO:
            why.append(f"its KV is {r['kv_ratio']:.3f}x")
        if not r["inside_dense_ci"].get(probe):
            why.append(f"its {probe} accuracy is outside dense's CI")
        lines.append(f"- {r['name']} misses it: " + " and ".join(why) + ".")
    return lines


def finish(out: dict, args) -> None:
    save_results(out, args, markdown=markdown, markers=KV_QUALITY_MARKERS, ready="rows" in out and "dense" in out)


def main(argv=None) -> int:
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS
    from analysis.measure.long_options import DEFAULT_DEPTHS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--probe", action="append", default=None, help="long-context probe (repeatable; default passkey)")
    p.add_argument("--items", type=int, default=4, help="sequences per depth")
    p.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cut", type=float, default=0.5)
    p.add_argument("--window-share", dest="window_share", type=float, default=0.5)
    p.add_argument("--wider-share", dest="wider_share", type=float, default=0.55)
    p.add_argument("--prune-share", dest="prune_share", type=float, default=0.25)
    p.add_argument("--sinks", type=int, default=DEFAULT_SINKS)
    p.add_argument("--recent", type=int, default=DEFAULT_RECENT)
    p.add_argument("--only", default=None, help="comma-separated plans to measure (default: all)")
    p.add_argument("--scores", default=None, help="the heads' scores: read from / saved to this JSON")
    p.add_argument("--out", default=None)
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--render-only", dest="render_only", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    args.probe = args.probe or ["passkey"]
    if args.render_only:
        out = json.loads(Path(args.render_only).read_text())
        print(markdown(out))
        finish(out, argparse.Namespace(out=None, write_docs=args.write_docs))
        return 0
    import torch

    from analysis.arch.models import load_model
    from analysis.measure.evaluation import context_length
    from analysis.measure.probes.longcontext import build_long
    from analysis.score.longcontext import long_context_report
    from bench._timing import load_average
    torch.set_num_threads(args.threads)
    try:
        depths = tuple(float(d) for d in args.depths.split(",") if d)
        loaded = load_model(args.model, cache_dir=args.cache_dir)
        limit = context_length(loaded.model)
        built = build_long(args.probe, loaded.tokenizer, loaded.kind, (args.length,), depths=depths,
                           n_items=args.items, limit=limit)
        scores = scores_of(loaded, args.scores, window=Window(args.sinks, args.recent))
        plans = plans_of(loaded, scores, args)
        if args.only:
            unknown = sorted(set(args.only.split(",")) - set(plans))
            if unknown:
                raise InputError(f"--only names no plan {unknown[0]!r}; the plans are {', '.join(plans)}.")
            plans = {k: v for k, v in plans.items() if k in args.only.split(",")}
    except HeadscopeError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    out = {}
    out.update(args=vars(args), model=args.model, machine=platform.processor() or platform.machine(),
               command="python -m bench.bench_kv_quality " + " ".join(argv if argv is not None else sys.argv[1:]),
               plans={n: p.as_dict() for n, p in plans.items()})
    out["rows"] = []
    for n, plan in plans.items():
        print(f"{n}: {plan.describe()}; KV {plan.kv_ratio(args.length):.3f}x of dense at {args.length:,} tokens",
              flush=True)
    rows = sum(items.ids.shape[0] for (_, _, items) in built.values())
    t0 = time.perf_counter()
    print(f"dense: {rows} rows of {args.length:,} tokens ...", flush=True)
    rep = long_context_report(loaded, built=built)
    dense_scores = rep.dense
    out["dense"] = {"seconds": time.perf_counter() - t0, "cells": rep.rows(),
                    "all": {p: r for p, r in _all(rep).items()}}
    print(f"dense: {out['dense']['seconds']:.0f} s; " + "; ".join(
        f"{r['label']} {_ci(r, 'dense')}" for r in out["dense"]["all"].values()), flush=True)
    finish(out, args)
    for n, plan in plans.items():
        t0 = time.perf_counter()
        rep = long_context_report(loaded, built=built, dense=dense_scores, cut=Cut.of_plan(plan))
        row = row_of(n, plan, rep, args.length, time.perf_counter() - t0)
        out["rows"].append(row)
        out.update(load=load_average(), when=datetime.now(timezone.utc).isoformat())
        print(f"{n}: {row['seconds']:.0f} s; KV {row['kv_ratio']:.3f}x; " + "; ".join(
            f"{r['label']} {_ci(r, 'cut')} (inside dense's CI: {row['inside_dense_ci'][r['probe']]})"
            for r in row["cells"] if r["depth"] == "all") + f"; lost: {row['lost'] or 'none'}", flush=True)
        finish(out, args)
    out.update(load=load_average(), when=datetime.now(timezone.utc).isoformat())
    finish(out, args)
    print("\n" + markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
