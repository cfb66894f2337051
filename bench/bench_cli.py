"""Benchmark: how long the CLI takes to answer what needs no model (issue 42), against `import torch`.

Each contender is a whole process started from outside (start-up and imports included), timed in
rounds that run every contender once, the order rotated every round so a drifting machine load hits
all alike (`bench._timing.compare_rounds`): `--help`, `score --help`, `probes --help`, `export --help`,
a refusal the declarations judge (`mask --sparsity 2`), one the parser judges (`score --scorer nope`),
`probes --list`, and the yardstick `python -c "import torch"` (what every call cost before: building
the parser imported every scorer, torch and transformers included). Prints min / median / max of each
and each one's median ratio to `import torch`.

    .venv/bin/python -m bench.bench_cli [--rounds 7] [--headscope]
Target: every CLI call above <= 1 s wall on 2 cores (median), and below `import torch` alone.
"""
import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench._timing import compare_rounds, load_average, load_text

ROOT = Path(__file__).resolve().parents[1]
CALLS = {
    "--help": ["--help"],
    "score --help": ["score", "--help"],
    "probes --help": ["probes", "--help"],
    "export --help": ["export", "--help"],
    "mask --sparsity 2 (refused)": ["mask", "--sparsity", "2"],
    "score --scorer nope (refused)": ["score", "--scorer", "nope"],
    "probes --list": ["probes", "--list"],
}
TORCH = "import torch"
TARGET_S = 1.0


def _runner(argv: list[str], expect: int):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

    def run():
        done = subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if done.returncode != expect:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}, not {expect}: {done.stderr[-500:]}")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds (every contender once per round)")
    parser.add_argument("--headscope", action="store_true",
                        help="time the installed `headscope` command instead of `python -m analysis`")
    args = parser.parse_args()
    prefix = [str(Path(sys.executable).with_name("headscope"))] if args.headscope else [sys.executable, "-m", "analysis"]
    fns = {label: _runner(prefix + argv, 2 if "refused" in label else 0) for label, argv in CALLS.items()}
    fns[TORCH] = _runner([sys.executable, "-c", "import torch"], 0)
    ratios = [(label, TORCH) for label in CALLS]
    result = compare_rounds(fns, ratios, min_rounds=args.rounds, max_rounds=args.rounds, max_seconds=None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch_times = result[ratios[0]].times[TORCH]
    print(f"{' '.join(prefix)} ...: {args.rounds} rounds (order rotated), wall seconds of the whole process, "
          f"{cores} cores, load average {load_text(result[ratios[0]].load_before)} before, "
          f"{load_text(load_average())} after")
    print(f"{'call':>32}  {'min':>6}  {'median':>6}  {'max':>6}  {'/ import torch':>14}")
    worst = 0.0
    for label in CALLS:
        c = result[(label, TORCH)]
        times = c.times[label]
        worst = max(worst, statistics.median(times))
        print(f"{label:>32}  {min(times):6.2f}  {statistics.median(times):6.2f}  {max(times):6.2f}  {c.ratio:13.2f}x")
    print(f"{TORCH:>32}  {min(torch_times):6.2f}  {statistics.median(torch_times):6.2f}  {max(torch_times):6.2f}")
    print(f"slowest CLI median {worst:.2f} s (target <= {TARGET_S:g} s) -> {'OK' if worst <= TARGET_S else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
