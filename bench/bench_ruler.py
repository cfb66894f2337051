"""Benchmark: RULER on SmolLM2, dense vs headscope's KV plans vs kvpress's presses on the very same rows (issue 45
items 3-5; a result, not a test).

What runs, per length (--lengths, default 4,096 and 8,192 tokens; RULER's offline tasks, --samples rows each):
- dense: the model as it is (the harness bridge's greedy generations, one prompt at a time);
- headscope's plans, each generating with its compact cache on the physically pruned twin
  (analysis.compress.kvruntime.physical: the memory it promises is the memory the cache holds, measured per row):
    cut    MP-G's groups-policy cut at 50 % as a KV plan (every KV group it empties pruned, the rest full);
    duo+   55 % of the KV heads windowed, lowest streaming score first, KV heads holding a retrieval head full;
    mix    25 % pruned by importance, 50 % windowed, retrieval heads full;
    <score>@<kv>  plans at kvpress's grid: the KV heads with the lowest <score> windowed until the KV cache is <kv>
           of dense at this length (0.75 / 0.5 / 0.25), for each score of --scores-for-grid (the plain-text
           streaming score; the retrieval-aware score when analysis.score.kvscores has it);
- kvpress's presses (--kvpress: bench/peers/kvpress_ruler.py in .venv-kvpress, bench/peers/setup_kvpress.sh) on
  the rows headscope exports (the same token ids): StreamingLLM, SnapKV, ExpectedAttention at compression ratios
  0.25 / 0.5 / 0.75 (KV 0.75 / 0.5 / 0.25 of dense), and DuoAttentionPress fed headscope's own grid plans.
Every config is scored on the same rows as dense, paired (analysis.measure.ruler.score_cell: bootstrap over
rows, the same resamples): per task and averaged over tasks, the change against dense with its CI, LOST where
the config's CI lies below dense's mean; next to each row's real KV memory (bytes the cache holds after the
prompt, over dense's) and decode speed. The goal line: at KV <= 0.5x of dense, headscope's best plan inside
dense's CI on the RULER average (at 4,096 tokens) and at or above every kvpress press at equal KV.

Usage: nice -n 10 .venv/bin/python -m bench.bench_ruler [--lengths 4096,8192] [--samples 25] [--tasks ...]
       [--configs dense,cut,duo+,...] [--kvpress] [--presses streaming,snapkv,expected] [--ratios 0.5,0.25,0.75]
       [--threads 2] [--scores FILE.json] [--out FILE.json] [--write-docs] [--render-only FILE.json]
--out is rewritten after every config: a run stopped part way keeps what it measured, and a rerun with the same
--out skips what is there (resume). The rows are written next to it (rows-<length>.jsonl) for kvpress.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from analysis.core.errors import HeadscopeError, InputError
from bench._results import save_results

ROOT = Path(__file__).resolve().parents[1]
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"
RULER_MARKERS = ("<!-- ruler-kv:begin -->", "<!-- ruler-kv:end -->")
GOAL_RATIO = 0.5
GOAL_SLACK = 0.01                    # a grid plan made for 0.5 at the median prompt holds 0.5 +- a little per row
GRID = (0.75, 0.5, 0.25)                    # kvpress's grid, as KV of dense
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")


# -- plans ---------------------------------------------------------------------------------------------------

def window_share_for(ratio: float, length: int, window, n_kv: int) -> float:
    """The share of KV heads to window so that the KV cache at `length` tokens is at most `ratio` of dense (every
    other head full): a windowed head keeps window.kept(length) of `length` tokens."""
    keep = window.kept(length) / length
    share = (1.0 - ratio) / (1.0 - keep) if keep < 1.0 else 0.0
    heads = min(n_kv, int(np.ceil(share * n_kv - 1e-9)))                  # the fewest that reach the ratio
    return min(1.0, (heads + 0.5) / n_kv)                                 # plan_kv windows floor(share * n) heads


def grid_plans(loaded, scores: dict, length: int, window) -> dict:
    """{"<score>@<kv>": plan}: for each score [L, Hkv] (higher = keep full), the lowest windowed to each KV ratio at
    `length` tokens (the rows' median prompt: what the cache holds when the answer starts, as kvpress's ratio)."""
    from analysis.score.kvscores import plan_kv
    g = loaded.geometry
    out = {}
    for name, values in scores.items():
        for ratio in GRID:
            share = window_share_for(ratio, length, window, g.n_layers * g.n_kv_heads)
            plan = plan_kv(g, values, window_share=share, window=window, model=loaded.name)
            out[f"{name}@{ratio:g}"] = plan.with_modes(plan.modes, f"windowed: the lowest {name} scores, {share:.0%} "
                                                                   f"of the KV heads (KV {ratio:g}x of dense at "
                                                                   f"{length:,} tokens, the rows' median prompt)")
    return out


def plans_for(loaded, kv_scores, length: int, window, args, prompt: int) -> dict:
    from bench.bench_kv_quality import plans_of
    named = plans_of(loaded, kv_scores, argparse.Namespace(cut=0.5, window_share=0.5, wider_share=0.55,
                                                            prune_share=0.25, sinks=window.sinks,
                                                            recent=window.recent))
    plans = {k: named[k] for k in ("cut", "duo+", "mix")}
    grid_scores = {"streaming": kv_scores.streaming, "retrieval-aware": kv_scores.retrieval_aware}
    plans.update(grid_plans(loaded, {k: v for k, v in grid_scores.items() if v is not None}, prompt, window))
    return plans


def retrieval_aware_of(loaded, path: str | None, *, window, log=print):
    """[L, Hkv] the retrieval-aware score (analysis.measure.retrieval_aware) under `window`, measured (and saved to
    `path`) or read back from `path` when it was measured under the same window."""
    from analysis.score.kvscores import measure_kv_scores
    if path and Path(path).exists():
        d = json.loads(Path(path).read_text())
        if (d["sinks"], d["recent"]) == (window.sinks, window.recent):
            log(f"retrieval-aware scores read back from {path}")
            return np.array(d["retrieval_aware"])
    t0 = time.perf_counter()
    scores = measure_kv_scores(loaded, window=window, window_score="retrieval-aware", retrieval=False)
    log(f"retrieval-aware scores measured in {time.perf_counter() - t0:.0f} s")
    if path:
        Path(path).write_text(json.dumps(dict(**window.as_dict(), retrieval_aware=scores.retrieval_aware.tolist())))
    return scores.retrieval_aware


# -- runs ----------------------------------------------------------------------------------------------------

def _row_values(run, rows, length: int) -> dict:
    """{task: [score per row]} (rows in doc order) of a harness run of RULER's rows."""
    out = {}
    for task in rows.tasks:
        logged = {s["doc_id"]: s for s in run.samples[task]}
        out[task] = [float(logged[i]["metrics"][str(length)]) for i in rows.doc_ids(task, length)]
    return out


def _row_costs(run, rows, length: int) -> dict:
    """{task: [generation record per row]} in doc order."""
    out = {}
    for task in rows.tasks:
        gens = {g["doc_id"]: g for g in run.generations.get(task, [])}
        out[task] = [gens[i] for i in rows.doc_ids(task, length)]
    return out


def cells_of(dense: dict, other: dict, costs: tuple, length: int, seed: int) -> list[dict]:
    """Per task and the average over tasks: dense vs the config on the same rows (analysis.measure.ruler.score_cell:
    paired bootstrap). dense / other: {task: [score per row]}; costs: (dense's, the config's) {task: [records]}."""
    from analysis.measure.ruler import AVERAGE, RULER_TASKS, score_cell
    cells, stacked = [], []
    for task in dense:
        values = np.array([dense[task], other[task]], dtype=np.float64)          # [2, n]
        stacked.append(values)
        cells.append(score_cell(task, RULER_TASKS[task].label, length, values,
                                [costs[0][task], costs[1][task]], seed).row())
    values = np.mean(stacked, axis=0)                                           # [2, n]: row i's mean over tasks
    gens = [[g for t in dense for g in c[t]] for c in costs]
    cells.append(score_cell(AVERAGE, "Average over tasks", length, values, gens, seed).row())
    return cells


def headscope_runs(loaded, rows, length: int, plans: dict, out: dict, save, log) -> None:
    from analysis.arch.cut import Cut
    from analysis.compress.kvruntime import physical
    from analysis.measure.harness import run_harness
    entry = out["lengths"].setdefault(str(length), {"configs": {}})
    run = lambda **kw: run_harness(loaded.model, loaded.tokenizer, rows.prepared, batch_size=1, keep_samples=True,
                                   generation_batch=1, **kw)      # per-row seconds, compared across configs
    if "dense" not in entry:
        t0 = time.perf_counter()
        log(f"{length}: dense, {rows.n_rows()} rows ...")
        dense = run()
        entry["dense"] = dict(values=_row_values(dense, rows, length), costs=_row_costs(dense, rows, length),
                              seconds=time.perf_counter() - t0)
        save()
    dense = entry["dense"]
    for name, plan in plans.items():
        if name in entry["configs"]:
            continue
        t0 = time.perf_counter()
        log(f"{length}: {name}: {plan.describe()}; KV {plan.kv_ratio(length):.3f}x ...")
        cut = physical(Cut.of_plan(plan), loaded)
        got = run(cut=cut)
        values, costs = _row_values(got, rows, length), _row_costs(got, rows, length)
        entry["configs"][name] = dict(tool="headscope", plan=plan.as_dict(), kv_planned=plan.kv_ratio(length),
                                      values=values, costs=costs, seconds=time.perf_counter() - t0,
                                      cells=cells_of(dense["values"], values, (dense["costs"], costs), length,
                                                     rows.seed))
        save()
        log(f"{length}: {name}: {summary(entry['configs'][name])}")


def kvpress_runs(rows_file: Path, length: int, model_dir: str, args, out: dict, duo: dict, save, log) -> None:
    """kvpress's presses on the exported rows (its own environment), scored against headscope's dense rows."""
    entry = out["lengths"][str(length)]
    want = [f"{p}@{1 - r:g}" for p in args.presses.split(",") for r in map(float, args.ratios.split(","))]
    todo = [w for w in want if f"kvpress:{w}" not in entry["configs"]]
    duo_todo = {n: d for n, d in duo.items() if f"kvpress:duo({n})" not in entry["configs"]}
    if not todo and not duo_todo:
        return
    if not KVPRESS_PYTHON.exists():
        raise InputError(f"kvpress's environment is not there ({KVPRESS_PYTHON}): run bash bench/peers/setup_kvpress.sh")
    result = rows_file.with_suffix(".kvpress.json")
    presses = sorted({w.split("@")[0] for w in todo})
    ratios = sorted({1 - float(w.split("@")[1]) for w in todo})
    cmd = [str(KVPRESS_PYTHON), "-m", "bench.peers.kvpress_ruler", "--rows", str(rows_file), "--model-dir",
           model_dir, "--presses", ",".join(presses) or "none",
           "--ratios", ",".join(f"{r:g}" for r in ratios) or "0.5", "--threads", str(args.threads), "--out", str(result)]
    for d in duo_todo.values():
        cmd += ["--duo", str(d)]
    log(f"{length}: kvpress: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    peer = json.loads(result.read_text())
    dense = entry["dense"]
    settings = _peer_settings(peer, duo_todo)
    for name, records in settings.items():
        values = {t: [None] * len(v) for t, v in dense["values"].items()}
        costs = {t: [None] * len(v) for t, v in dense["values"].items()}
        for r in records:
            values[r["task"]][r["index"]] = float(r["score"])
            costs[r["task"]][r["index"]] = dict(kv_bytes_prompt=r["kv_bytes_held"], kv_bytes_read=r["kv_bytes_read"],
                                                kv_bytes_dense=r["kv_bytes_dense"],
                                                tokens_per_s=r.get("decode_tokens_per_s"),
                                                prefill_s=r.get("prefill_s"), decode_s=None, new_tokens=None)
        entry["configs"][f"kvpress:{name}"] = dict(
            tool="kvpress", values=values, costs=costs, seconds=seconds / len(settings),   # the run's share
            cells=cells_of(dense["values"], values, (dense["costs"], costs), length, args.seed))
    save()


def _peer_settings(peer: dict, duo: dict) -> dict:
    """{our config name: [row results]} of the runner's JSON (settings named like press@kv; duo folders by plan)."""
    folders = {Path(d).name: n for n, d in duo.items()}
    out = {}
    for row in peer["results"]:
        setting = row["setting"]
        if setting.startswith("duo:"):
            name = f"duo({folders.get(setting[4:], setting[4:])})"
        elif setting == "none":
            name = "none@1"
        else:
            press, ratio = setting.rsplit("@", 1)
            name = f"{press}@{1 - float(ratio):g}"
        out.setdefault(name, []).append(row)
    return out


# -- report --------------------------------------------------------------------------------------------------

def _avg(cfg: dict) -> dict:
    return next(c for c in cfg["cells"] if c["task"] == "average")


def kv_measured(cfg: dict, dense: dict) -> tuple[float, float | None]:
    """(KV held / dense, KV read / dense): mean over rows of the cache's bytes after the prompt over dense's."""
    held, read = [], []
    for task, recs in cfg["costs"].items():
        for rec, base in zip(recs, dense["costs"][task]):
            if rec is None:
                continue
            ref = rec.get("kv_bytes_dense") or base["kv_bytes_prompt"]
            held.append(rec["kv_bytes_prompt"] / ref)
            read.append(rec.get("kv_bytes_read", rec["kv_bytes_prompt"]) / ref)
    return float(np.mean(held)), float(np.mean(read)) if read else None


def minutes(cfg: dict) -> str:
    """The config's run in minutes ('-' where it was not timed)."""
    return "-" if cfg.get("seconds") is None else f"{cfg['seconds'] / 60:.0f}"


def speed(cfg: dict) -> float | None:
    xs = [r.get("tokens_per_s") for recs in cfg["costs"].values() for r in recs if r and r.get("tokens_per_s")]
    return float(np.median(xs)) if xs else None


def summary(cfg: dict) -> str:
    a = _avg(cfg)
    return (f"average {a['cut_score']:.3f} [{a['cut_low']:.3f}, {a['cut_high']:.3f}] vs dense {a['dense_score']:.3f}"
            f" (change {a['change']:+.3f} [{a['change_low']:+.3f}, {a['change_high']:+.3f}])"
            + (" LOST" if a["lost"] else ""))


def inside_dense_ci(a: dict) -> bool:
    return a["dense_low"] <= a["cut_score"] <= a["dense_high"] or a["cut_score"] >= a["dense_score"]


def markdown(out: dict) -> str:
    a = out["args"]
    lines = [RULER_MARKERS[0], "", "## RULER: what KV plans and kvpress's presses keep (bench/bench_ruler.py)", "",
             f"Measured {out.get('when', '')[:16].replace('T', ' ')} UTC on {out['machine']}, {a['threads']} torch "
             f"thread(s), load average at the end {tuple(round(x, 2) for x in out.get('load', ()))}; {out['model']} "
             f"({a['dtype']}), RULER's offline tasks ({', '.join(out['tasks'])}) with {a['samples']} rows each per "
             f"length (seed {a['seed']}), every config on the same rows as dense (paired 95 % bootstrap CIs over rows). "
             "Score = RULER's string_match_all. KV held = the bytes the cache holds after the prompt over dense's; "
             "KV read = what attention reads (kvpress's DuoAttentionPress hides keys but frees nothing: held = 1). "
             "headscope's plans generate with their compact cache on the physically pruned twin; kvpress compresses "
             "the context after its full prefill and reads the question through the compressed cache (its own "
             f"benchmark's setting). Minutes: the config's whole run on these rows (kvpress: its process's share). "
             f"Last command: `{out['command']}`.", ""]
    if out.get("note"):
        lines += [out["note"], ""]
    for length, entry in out["lengths"].items():
        if "dense" not in entry:
            continue
        dense = entry["dense"]
        tasks = list(dense["values"])
        base = next(iter(entry["configs"].values()), None)
        lines += [f"### {int(length):,} tokens", "",
                  "| config | tool | minutes | KV held | KV read | decode tok/s | " + " | ".join(tasks)
                  + " | average [95 % CI] | - dense [95 % CI] | inside dense's CI |",
                  "|---|---|---:|---:|---:|---:|" + "---:|" * len(tasks) + "---:|---:|---|"]
        if base is not None:
            d = {c["task"]: c for c in base["cells"]}
            lines.append(f"| dense | - | {minutes(dense)} | 1.000 | 1.000 | {speed(dense) or 0:.1f} | "
                         + " | ".join(f"{d[t]['dense_score']:.2f}" for t in tasks)
                         + f" | {d['average']['dense_score']:.3f} [{d['average']['dense_low']:.3f}, "
                           f"{d['average']['dense_high']:.3f}] | - | - |")
        order = sorted(entry["configs"].items(), key=lambda kv: (-kv_measured(kv[1], dense)[0], kv[0]))
        for name, cfg in order:
            c = {x["task"]: x for x in cfg["cells"]}
            avg = c["average"]
            held, read = kv_measured(cfg, dense)
            lines.append(f"| {name} | {cfg['tool']} | {minutes(cfg)} | {held:.3f} | {read:.3f} | {speed(cfg) or 0:.1f} | "
                         + " | ".join(f"{c[t]['cut_score']:.2f}" + (" **L**" if c[t]["lost"] else "") for t in tasks)
                         + f" | {avg['cut_score']:.3f} [{avg['cut_low']:.3f}, {avg['cut_high']:.3f}] | "
                           f"{avg['change']:+.3f} [{avg['change_low']:+.3f}, {avg['change_high']:+.3f}] | "
                           f"{'yes' if inside_dense_ci(avg) else '**no**'} |")
        lines += ["", *goal_lines(entry, int(length)), ""]
    lines.append(RULER_MARKERS[1])
    return "\n".join(lines) + "\n"


def goal_lines(entry: dict, length: int) -> list[str]:
    """The goal at this length, said from the cells: headscope's plans at KV held <= 0.5x (within GOAL_SLACK: the
    rows' prompts differ, so a plan made for 0.5x at their median holds a little more on the shorter ones) inside
    dense's CI on the average, and at or above every kvpress press whose KV read is as small."""
    dense = entry["dense"]
    ours = {n: c for n, c in entry["configs"].items() if c["tool"] == "headscope"
            and kv_measured(c, dense)[0] <= GOAL_RATIO * (1 + GOAL_SLACK)}
    theirs = {n: c for n, c in entry["configs"].items() if c["tool"] == "kvpress"
              and (kv_measured(c, dense)[1] or 1.0) <= GOAL_RATIO * (1 + GOAL_SLACK)}
    if not ours:
        return [f"- Goal at {length:,} tokens: no headscope plan at KV <= {GOAL_RATIO}x (within {GOAL_SLACK:.0%}) "
                "measured yet."]
    best_name, best = max(ours.items(), key=lambda kv: _avg(kv[1])["cut_score"])
    a = _avg(best)
    lines = [f"- headscope's best plan at KV <= {GOAL_RATIO}x (within {GOAL_SLACK:.0%}; it holds "
             f"{kv_measured(best, dense)[0]:.3f}): {best_name}, average {a['cut_score']:.3f} "
             f"[{a['cut_low']:.3f}, {a['cut_high']:.3f}] against dense {a['dense_score']:.3f} "
             f"[{a['dense_low']:.3f}, {a['dense_high']:.3f}]: " + ("inside dense's CI." if inside_dense_ci(a)
                                                                    else "**outside dense's CI (goal missed)**.")]
    for name, cfg in sorted(theirs.items()):
        b = _avg(cfg)
        lines.append(f"- against {name} (average {b['cut_score']:.3f}): headscope's {best_name} is "
                     + ("at or above it." if a["cut_score"] >= b["cut_score"] else "**below it**."))
    return lines


def finish(out: dict, args) -> None:
    save_results(out, args, markdown=markdown, markers=RULER_MARKERS, ready=bool(out.get("lengths")))


def main(argv=None) -> int:
    from analysis.arch.window import DEFAULT_RECENT, DEFAULT_SINKS, Window
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sinks", type=int, default=DEFAULT_SINKS)
    p.add_argument("--recent", type=int, default=DEFAULT_RECENT)
    p.add_argument("--configs", default=None, help="comma-separated headscope configs to run (default: all)")
    p.add_argument("--kvpress", action="store_true", help="also run kvpress's presses (.venv-kvpress)")
    p.add_argument("--presses", default="streaming,snapkv,expected")
    p.add_argument("--ratios", default="0.5,0.25,0.75", help="kvpress compression ratios (share removed)")
    p.add_argument("--duo-grid", dest="duo_grid", default="0.5", help="KV ratios whose grid plans kvpress's "
                                                                     "DuoAttentionPress also runs")
    p.add_argument("--scores", default=None, help="the heads' scores: read from / saved to this JSON (and its "
                                                  "-retrieval-aware.json beside it)")
    p.add_argument("--no-retrieval-aware", dest="no_retrieval_aware", action="store_true",
                   help="skip the retrieval-aware score (its grid plans)")
    p.add_argument("--out", default=None)
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--render-only", dest="render_only", default=None, metavar="FILE.json")
    p.add_argument("--note", default=None, help="a paragraph kept with the results and shown under the header (what "
                                                "the run was sized to, what it left out)")
    args = p.parse_args(argv)
    if args.render_only:
        out = json.loads(Path(args.render_only).read_text())
        if args.note is not None:
            out["note"] = args.note
        print(markdown(out))
        finish(out, argparse.Namespace(out=args.render_only if args.note is not None else None,
                                       write_docs=args.write_docs))
        return 0
    import torch

    from analysis.arch.models import load_model
    from analysis.measure.ruler import build_ruler, export_rows, rows_jsonl
    from bench._timing import load_average
    from bench.bench_kv_quality import scores_of
    torch.set_num_threads(args.threads)
    log = lambda m: print(m, flush=True)                                      # noqa: E731
    out = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else {}
    out.setdefault("lengths", {})
    out.update(args=vars(args), model=args.model, machine=platform.processor() or platform.machine(),
               command="python -m bench.bench_ruler " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.note is not None:
        out["note"] = args.note

    def save():
        out.update(load=load_average(), when=datetime.now(timezone.utc).isoformat())
        finish(out, args)
    try:
        loaded = load_model(args.model, cache_dir=args.cache_dir, dtype=args.dtype)
        window = Window(args.sinks, args.recent)
        kv_scores = scores_of(loaded, args.scores, window=window, log=log)
        if not args.no_retrieval_aware:
            kv_scores.retrieval_aware = retrieval_aware_of(
                loaded, None if args.scores is None else args.scores.replace(".json", "") + "-retrieval-aware.json",
                window=window, log=log)
        tasks = [t for t in args.tasks.split(",") if t]
        out["tasks"] = tasks
        for length in (int(n) for n in args.lengths.split(",")):
            rows = build_ruler(tasks, loaded.tokenizer, (length,), samples=args.samples, seed=args.seed)
            rows_file = Path(args.out or "bench_ruler.json").with_name(f"rows-{length}.jsonl")
            rows_file.write_text(rows_jsonl(export_rows(rows, loaded.tokenizer)))
            from analysis.measure.ruler import prompt_lengths
            prompt = int(np.median(list(prompt_lengths(rows, loaded.tokenizer).values())))
            plans = plans_for(loaded, kv_scores, length, window, args, prompt)
            if args.configs:
                keep = set(args.configs.split(","))
                unknown = sorted(keep - set(plans) - {"dense"})
                if unknown:
                    raise InputError(f"--configs names no config {unknown[0]!r}; they are {', '.join(plans)}.")
                plans = {k: v for k, v in plans.items() if k in keep}
            headscope_runs(loaded, rows, length, plans, out, save, log)
            if args.kvpress:
                duo = {}
                for ratio in args.duo_grid.split(","):
                    for name in [n for n in plans if n.endswith(f"@{float(ratio):g}")]:
                        from analysis.compress.export.duo import pattern_from_plan, write_pattern
                        folder = rows_file.with_name(f"duo-{name}-{length}")
                        if not folder.exists():
                            write_pattern(folder, pattern_from_plan(plans[name]), plan=plans[name])
                        duo[name] = folder
                kvpress_runs(rows_file, length, str(loaded.source), args, out, duo, save, log)
    except HeadscopeError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    save()
    print("\n" + markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
