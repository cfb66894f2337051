"""GPU check: the claims that need a GPU, measured in one run (< 5 minutes on one GPU), printed as ratios.

Items (each prints its numbers and PASS / FAIL / SKIP; a failing item does not stop the others):
1. exactness on the device in float32 / bfloat16 / float16: masked (gates 0) == zeroed weights ==
   physically pruned logits of a 50 % MP-G mask (relative max difference within the dtype's tolerance);
2. MP-G scoring (row-norm profile + scores) vs one read of the same attention weights (target <= 3x);
3. perplexity throughput vs the plain Hugging Face loop (bench/bench_perplexity.py, target >= 1x);
4. fast vs naive single-head ablation (bench/bench_ablation.py, target >= 1.5x, same numbers);
5. pruned vs masked prefill: measured time saving >= 70 % of the FLOP-predicted saving (as bench/bench_surgery.py);
6. the multi-process ablation sweep (`python -m analysis ablate` under `accelerate launch`) on every
   visible GPU vs one process: the same numbers (==) and the speed-up (target >= 0.8 x N for N > 1 GPUs).

    .venv/bin/python -m bench.gpu_check                       # on a GPU machine (device cuda)
    .venv/bin/python -m bench.gpu_check --device cpu --quick  # smoke test anywhere: a tiny random model

Timings synchronize the device around every timed call; every ratio comes from interleaved rounds
(bench/_timing.compare_rounds: min / median / max of each side and of the per-round ratio, the load
average) and is judged on its median. On the CPU the ratios are printed but the
speed targets are GPU targets (the CPU claims have their own bench scripts). Exit status 1 when an
item fails. Whenever a GPU machine is at hand, this output is what the GPU claims rest on.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from analysis.core.clock import synchronize  # noqa: E402
from analysis.core.errors import first_line  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# relative max |difference| / max |logit| allowed between masked, zeroed and pruned logits
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}
SCORING_TARGET = 3.0
SPEEDUP_FRACTION = 0.8


def sync(device: str) -> None:
    synchronize(device)                       # analysis.core.clock: CUDA / MPS wait for their kernels


def synced(fn, device: str):
    """`fn` as a self-timed callable: the device synchronized before and after, its seconds returned."""
    def timed_on_device() -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0
    return timed_on_device


def device_rounds(fns: dict, ratios: list[tuple[str, str]], repeats: int, device: str) -> dict:
    """{(a, b): Comparison} of device-synchronized calls in rotated rounds (bench/_timing.compare_rounds:
    one untimed warm-up each, at least `repeats` rounds, more until the ratios' spread is known, at
    most 60 s); each Comparison prints min / median / max of both sides and of the per-round ratio."""
    from bench._timing import compare_rounds

    return compare_rounds({k: synced(fn, device) for k, fn in fns.items()}, ratios, min_rounds=repeats,
                          max_rounds=max(repeats, 15), max_seconds=60.0, self_timed=True)


def load(args, dtype=torch.float32):
    """The check's model on the device in `dtype` (load_model's device option only off the CPU)."""
    from analysis.arch.models import load_model

    placement = {} if args.device == "cpu" else {"device": args.device}
    return load_model(args.model, dtype=dtype, **placement)


def eval_ids(lm, n: int) -> torch.Tensor:
    from analysis.measure.evaluation import token_ids
    from analysis.core.text import evaluation_text

    return token_ids(lm.tokenizer, evaluation_text(), max_tokens=n)   # [n]


def half_mask(lm) -> np.ndarray:
    from analysis.score.masks import plan_mask
    from analysis.score.scoring import MPGScorer

    return plan_mask(MPGScorer(z=2.0).score(lm.model), 0.5, group_size=lm.geometry.group_size).pruned  # [L, H]


def speed_verdict(args, ok: bool) -> bool | None:
    """A speed target's verdict: judged on a GPU; on the CPU the ratio is printed only (None)."""
    if args.device == "cpu":
        print("  (a GPU target: on the CPU the ratio above is printed, not judged)")
        return None
    return ok


# ---------------------------------------------------------------------------------------------
# The items: each returns True (pass), False (fail) or None (skipped / not judged), printing its numbers
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def check_exactness(args) -> bool:
    from analysis.arch.head_gates import gates_from_mask, head_mask, zero_heads
    from analysis.compress.surgery import prune_heads

    ok = True
    for name in args.dtypes:
        lm = load(args, DTYPES[name])
        model = lm.model
        pruned = half_mask(lm)
        x = eval_ids(lm, args.exact_tokens).unsqueeze(0).to(next(model.parameters()).device)   # [1, T]
        dense = model(input_ids=x).logits.float()                                            # [1, T, V]
        with head_mask(model, gates_from_mask(pruned)):
            masked = model(input_ids=x).logits.float()
        zeroed = zero_heads(copy.deepcopy(model), pruned)(input_ids=x).logits.float()
        smaller = prune_heads(model, pruned)[0]
        small = smaller(input_ids=x).logits.float()
        scale = masked.abs().max().item()
        d_zero = (masked - zeroed).abs().max().item() / scale
        d_pruned = (masked - small).abs().max().item() / scale
        moved = (masked - dense).abs().max().item() / scale
        good = d_zero <= TOLERANCE[name] and d_pruned <= TOLERANCE[name] and moved > 10 * TOLERANCE[name]
        ok &= good
        print(f"  {name:9s} {int(pruned.sum())} heads gated: |masked - zeroed| {d_zero:.1e}, |masked - pruned| "
              f"{d_pruned:.1e}, |masked - dense| {moved:.1e} (relative to max |logit| {scale:.1f}; tolerance "
              f"{TOLERANCE[name]:.0e}) -> {'PASS' if good else 'FAIL'}")
        del lm, model, smaller
    return ok


def check_scoring(args) -> bool:
    from analysis.measure.profiles import profile_model
    from analysis.score.scoring import MPGScorer

    lm = load(args)
    model, adapter = lm.model, lm.adapter
    weights = [m.weight for l in range(lm.geometry.n_layers) for m in adapter.projection_modules(model, l).values()]

    def read_once():
        return torch.stack([w.sum(dtype=torch.float32) for w in weights]).sum().item()

    def score():
        return MPGScorer(z=2.0).score(profile_model(model, adapter=adapter)).scores

    c = device_rounds({"mp-g": score, "read": read_once}, [("mp-g", "read")], args.repeats, args.device)[("mp-g", "read")]
    c.report("  MP-G scoring vs one read of the attention weights", target=f"<= {SCORING_TARGET}x")
    ok = c.ratio <= SCORING_TARGET
    print(f"  MP-G scoring / one read: median {c.ratio:.2f}x (target <= {SCORING_TARGET}x) -> {'PASS' if ok else 'FAIL'}")
    return speed_verdict(args, ok)


def check_perplexity(args) -> bool:
    from bench import bench_perplexity

    tokens, window, stride = (256, 64, 32) if args.quick else (4096, 512, 256)
    return speed_verdict(args, bench_perplexity.main(["--tokens", str(tokens), "--window", str(window), "--stride",
                                                      str(stride), "--repeats", str(args.repeats)], lm=load(args)))


def check_ablation(args) -> bool:
    from bench import bench_ablation

    tokens, step = (32, 1) if args.quick else (256, 3)
    return speed_verdict(args, bench_ablation.main(["--tokens", str(tokens), "--layer-step", str(step), "--repeats", "1"],
                                                   lm=load(args)))


@torch.no_grad()
def check_prefill(args) -> bool:
    from analysis.arch.cut import Cut
    from analysis.compress.cost import forward_flops
    from analysis.compress.timing import cut_call, saving_ratio
    from analysis.compress.surgery import prune_heads
    from bench.bench_surgery import PASS_FRACTION

    lm = load(args)
    model, adapter = lm.model, lm.adapter
    pruned = half_mask(lm)
    smaller, _ = prune_heads(model, pruned, adapter=adapter)
    seq = 128 if args.quick else 1024
    x = eval_ids(lm, 4 * seq)[:seq].unsqueeze(0).to(next(model.parameters()).device)       # [1, seq]
    calls = {"masked": cut_call(Cut.of_mask(pruned), model, lambda m: m(input_ids=x)),
             "pruned": lambda: smaller(input_ids=x), "dense": lambda: model(input_ids=x)}
    rounds = device_rounds(calls, [("masked", "pruned"), ("dense", "pruned")], args.repeats * 3, args.device)
    for (a, b), c in rounds.items():
        c.report(f"  prefill {x.shape[1]} tokens, {int(pruned.sum())} heads pruned: {a} vs {b}")
    predicted = forward_flops(model, seq, seq, adapter=adapter).total / \
        forward_flops(smaller, seq, seq, adapter=adapter).total
    measured = rounds[("masked", "pruned")].ratio               # the median of the per-round ratios
    ratio = saving_ratio(measured, predicted)
    ok = ratio >= PASS_FRACTION
    print(f"  masked / pruned median {measured:.3f}x, FLOP "
          f"prediction {predicted:.3f}x, saving / predicted {ratio:.2f} (target >= {PASS_FRACTION}) -> "
          f"{'PASS' if ok else 'FAIL'}")
    return speed_verdict(args, ok)


def _ablate(args, processes: int, out: Path) -> dict:
    """`python -m analysis ablate` on `processes` processes (accelerate launch when > 1); its JSON."""
    cli = ["-m", "analysis", "ablate", "--model", args.model, "--max-tokens", str(args.ablate_tokens),
           "--seq-len", str(args.ablate_seq), "--quiet", "--out", str(out)]
    if args.device != "cpu":
        cli += ["--device", "cuda"]            # each process: cuda:LOCAL_RANK (analysis.core.distributed.team)
    if processes == 1:
        cmd = [sys.executable, *cli]
    else:
        cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes",
               str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *cli]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_NUM_THREADS", "1")     # what the launcher gives each of its processes: 1 vs N alike
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed: "
                           + next((l for l in proc.stderr.splitlines() if l.startswith("error:")), proc.stderr[-500:]))
    return json.loads(out.read_text())


def check_multiprocess(args) -> bool | None:
    if args.skip_multiprocess:
        print("  skipped (--skip-multiprocess)")
        return None
    n = args.processes or (torch.cuda.device_count() if args.device != "cpu" else 2)
    from bench._timing import compare

    runs = {1: [], n: []}                      # every run's JSON: the numbers of all of them must agree

    def sweep(processes: int):
        def run() -> float:                    # self-timed: the sweep's own seconds, not start-up and loading
            with tempfile.TemporaryDirectory() as tmp:
                runs[processes].append(_ablate(args, processes, Path(tmp) / "out.json"))
            return runs[processes][-1]["seconds"]["total"]
        return run

    if n > 1:                                  # 1 vs n processes in interleaved pairs (A B, B A, B A ...)
        c = compare({"1 process": sweep(1), f"{n} processes": sweep(n)}, min_pairs=args.mp_pairs,
                    max_pairs=args.mp_pairs, warm=False, self_timed=True, max_seconds=None)
        c.report("  ablation sweep, 1 process vs " + f"{n}", unit=1.0, unit_name="s", caches="cold (no warm-up run)")
        speedup = c.ratio
    else:
        sweep(1)()
        speedup = 1.0
    one = runs[1][0]
    t1, tn = statistics.median(r["seconds"]["total"] for r in runs[1]), \
        statistics.median(r["seconds"]["total"] for r in runs[n])
    same = all(r[k] == one[k] for r in runs[1] + runs[n] for k in ("base", "n_tokens", "head_delta", "group_delta"))
    judged = args.device != "cpu" and n > 1
    ok = same and (speedup >= SPEEDUP_FRACTION * n if judged else True)
    verdict = "PASS" if ok else "FAIL"
    note = (f"target >= {SPEEDUP_FRACTION * n:.1f}x" if judged else
            "one process only: exactness checked, no speed-up to judge" if n == 1 else
            "CPU processes share the cores: speed not judged")
    print(f"  ablation sweep (seconds of the sweep itself, without start-up and loading; "
          f"{one['n_tokens']} predictions, {len(one['head_delta'])} layers): 1 process {t1:.2f} s, "
          f"{n} processes {tn:.2f} s (medians): {speedup:.2f}x, median of the pairs ({note}); numbers {'identical' if same else 'DIFFER'} -> {verdict}")
    return ok


ITEMS = {
    "exactness": check_exactness,
    "scoring": check_scoring,
    "perplexity": check_perplexity,
    "ablation": check_ablation,
    "prefill": check_prefill,
    "multiprocess": check_multiprocess,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny random model and small sizes (smoke test)")
    parser.add_argument("--model", default=None, help="default smollm2-135m (--quick: a tiny random Llama)")
    parser.add_argument("--items", default=",".join(ITEMS), help=f"comma-separated subset of {', '.join(ITEMS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="dtypes of the exactness item")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--exact-tokens", dest="exact_tokens", type=int, default=256)
    parser.add_argument("--ablate-tokens", dest="ablate_tokens", type=int, default=1024)
    parser.add_argument("--ablate-seq", dest="ablate_seq", type=int, default=256)
    parser.add_argument("--processes", type=int, default=None, help="default: every visible GPU (2 on the CPU)")
    parser.add_argument("--skip-multiprocess", dest="skip_multiprocess", action="store_true")
    parser.add_argument("--mp-pairs", dest="mp_pairs", type=int, default=3,
                        help="interleaved pairs of 1-process and N-process sweeps (item multiprocess)")
    parser.add_argument("--launch-timeout", dest="launch_timeout", type=float, default=240)
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.repeats = min(args.repeats, 2)
            args.exact_tokens, args.ablate_tokens, args.ablate_seq = 48, 64, 16
            if args.model is None:
                from tests._apptools import tiny_model_dir
                args.model = str(tiny_model_dir(Path(tmp) / "tiny-llama", num_hidden_layers=4))
        args.model = args.model or "smollm2-135m"
        gpu = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else "no GPU"
        print(f"gpu check: device {args.device} ({gpu}, {torch.cuda.device_count()} visible), model {args.model}, "
              f"torch {torch.__version__}{', quick' if args.quick else ''}")
        started, verdicts = time.perf_counter(), {}
        for name in [i for i in args.items.split(",") if i]:
            print(f"[{name}]", flush=True)
            t0 = time.perf_counter()
            try:
                verdicts[name] = ITEMS[name](args)
            except Exception as err:          # one item's failure is reported and the rest still run
                print(f"  FAIL: {first_line(err, 400)}")
                verdicts[name] = False
            print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    failed = [k for k, v in verdicts.items() if v is False]
    skipped = [k for k, v in verdicts.items() if v is None]
    print(f"gpu check: {len(verdicts) - len(failed) - len(skipped)} passed, {len(failed)} failed"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}, {len(skipped)} skipped, "
          f"{time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    if not __package__:       # run as a file: bench/ and tests/ are then not importable
        sys.exit("run it as a module from the repository root: python -m bench.gpu_check " + " ".join(sys.argv[1:]))
    sys.exit(main())
