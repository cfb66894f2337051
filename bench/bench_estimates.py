"""Benchmark: each long job's time estimate (what the app shows before it starts) against its measured time,
on the built-in SmolLM2, with the app's own estimator (components/jobs.py: the Board's pace, the pipeline's
PhaseClock) and the app's own cached calls (components/cache.py).

Each job runs three times, at sizes 1x, 2x and 1.5x:
  run 1  the estimate is the prior: this machine's measured forward speed (one short probe per model)
         times the job's forward tokens per unit of work;
  run 2  the estimate is the pace run 1 measured for that kind of job, proportional to the new size;
  run 3  a fixed cost plus a cost per unit, fitted to runs 1 and 2.
Jobs: the Prune page's perplexity check (dense + masked), the z sweep, the single-head ablation, and a
Pipeline run (one-shot cut plus recovery, INT8 with --int8) whose estimate is phase by phase; for the
pipeline the time left is also read at a quarter and at half of the measured run (the clock as the page
shows it while it runs) and compared with what was really left. Printed: estimate, measured, their ratio
(target: within 1.5x, i.e. 0.67 .. 1.5, on a quiet machine) and the load average (the machine may be shared).

    .venv/bin/python -m bench.bench_estimates [--int8] [--jobs check,sweep,ablation,pipeline]   (15-40 minutes)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGET = 1.5


def _row(name: str, run: int, estimate: float | None, measured: float) -> dict:
    ratio = None if estimate is None else estimate / measured
    return {"job": name, "run": run, "estimate": estimate, "measured": measured, "ratio": ratio,
            "load": os.getloadavg()[0]}


def timed_job(board, key, kind: str, work: float, fn) -> tuple[float | None, float]:
    """(the estimate before, the measured seconds) of one job; its pace recorded like the app's `tracked`."""
    estimate = board.estimate(kind, repr(key), work)
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    board.record(kind, repr(key), work, seconds)
    return estimate, seconds


def pipeline_job(board, key, lm, *, target: float, recovery: int, eval_tokens: int, int8: bool, run: int) -> list[dict]:
    from analysis.compress.recover.distill import DistillConfig
    from analysis.compress.recover.pipeline import PipelineConfig, round_counts
    from analysis.compress.recover.report import compression_report
    from components import jobs
    g = lm.geometry
    config = PipelineConfig(target_sparsity=target, step=target, recovery_steps=recovery, scorer="mp-g",
                            scorer_params={"z": 2.0}, policy="groups", eval_tokens=eval_tokens,
                            distill=DistillConfig(lr=1e-4, batch_size=2, seq_len=64))
    rounds = len(round_counts(config.target_sparsity, config.step, g.n_total_heads))
    from analysis.measure.probes.breaks import build_applicable, prompt_tokens
    built, _ = build_applicable(lm, None, options={"seed": 0})        # what the report's probes run
    units = jobs.pipeline_units(rounds=rounds, recovery_steps=recovery, batch=2, seq_len=64,
                                eval_tokens=eval_tokens, int8=int8, recovering=recovery > 0,
                                probe_tokens=prompt_tokens(built))
    clock = jobs.PhaseClock(board, repr(key), units)
    estimate = clock.total_s()
    lefts: list[tuple[float, float | None]] = []          # (elapsed, clock's time left) every progress report
    t0 = time.perf_counter()

    def progress(fraction: float, message: str) -> None:
        clock.update(fraction)
        lefts.append((time.perf_counter() - t0, clock.left_s()))

    compression_report(lm, config, int8=int8, progress=progress)
    clock.finish()
    total = time.perf_counter() - t0
    rows = [_row(f"pipeline ({'with' if int8 else 'no'} INT8)", run, estimate, total)]
    for phase, seconds in clock.measured.items():
        rows.append(_row(f"  phase {phase}", run, clock.expected.get(phase), seconds))
    for share in (0.25, 0.5):                              # what the bar said when that share had passed
        seen = [(e, left) for e, left in lefts if e <= share * total]
        if seen and seen[-1][1] is not None:
            elapsed, left = seen[-1]
            rows.append(_row(f"  its time left at {share:.0%} of the run", run, left, total - elapsed))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int8", action="store_true", help="the pipeline runs its INT8 stages too (minutes more)")
    parser.add_argument("--jobs", default="check,sweep,ablation,pipeline")
    args = parser.parse_args()
    wanted = set(args.jobs.split(","))

    import numpy as np

    from analysis.score import sweep
    from components import cache, jobs, state

    key = state.ModelKey("smollm2-135m")
    lm = cache.load(key)
    board = jobs.board()
    cache.profile(key)
    probe = time.perf_counter()
    cache.forward_rate(key)
    print(f"forward-speed probe: {time.perf_counter() - probe:.2f} s ({cache.forward_rate(key):,.0f} tokens/s)")
    g = lm.geometry
    mask = np.zeros((2, g.n_layers, g.n_heads), bool)
    mask[1, :, : g.n_heads // 3] = True
    options = cache.params_key(dict(scorer="mp-g", scope="layer", ord=2, a_q=1.0, a_kv=1.0, std="population",
                                    policy="global", min_per_layer=1))
    rows: list[dict] = []

    def show(new: list[dict]) -> None:
        for r in new:
            est = "—" if r["estimate"] is None else f"{r['estimate']:.1f}"
            ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
            print(f"  {r['job']:52s} {r['run']:3d} {est:>11} {r['measured']:11.1f} {ratio:>6} {r['load']:10.2f}",
                  flush=True)
        rows.extend(new)

    print(f"Time estimates vs measured, SmolLM2 on this machine ({os.cpu_count()} CPUs; shared: see the load)")
    print(f"  {'job':52s} {'run':>3} {'estimate s':>11} {'measured s':>11} {'ratio':>6} {'load 1 min':>10}", flush=True)
    for run, scale in ((1, 1.0), (2, 2.0), (3, 1.5)):
        if "check" in wanted:
            tokens = int(256 * scale)
            est, sec = timed_job(board, key, "evaluate", 2 * tokens,
                                 lambda: cache.evaluate_masks(key, mask, None, tokens))
            show([_row(f"perplexity check, {tokens} tokens", run, est, sec)])
        if "sweep" in wanted:
            tokens = int(64 * scale)
            est, sec = timed_job(board, key, "sweep", 2 * tokens * len(sweep.z_grid()),
                                 lambda: cache.z_sweep(key, 0.3, options, tokens))
            show([_row(f"z sweep, {tokens} tokens per split", run, est, sec)])
        if "ablation" in wanted:
            tokens = int(16 * scale)
            est, sec = timed_job(board, key, "ablation", tokens * g.n_total_heads,
                                 lambda: cache.ablation(key, None, tokens))
            show([_row(f"ablation, {tokens} tokens x {g.n_total_heads} heads", run, est, sec)])
        if "pipeline" in wanted:
            show(pipeline_job(board, key, lm, target=round(0.1 * scale, 2), recovery=int(4 * scale), eval_tokens=64,
                              int8=args.int8, run=run))
    ok = all(r["ratio"] is None or 1 / TARGET <= r["ratio"] <= TARGET for r in rows if not r["job"].startswith("  phase"))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; target: every estimate within "
          f"{TARGET}x of the measured time on a quiet machine: {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
