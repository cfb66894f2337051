"""Benchmark: the capability probes on the built-in SmolLM2, side by side (issues 34 and 42's two targets).

1. All probes for one mask: the cut's passes over every probe's items (the dense side is computed once
   per model and kept, as the app and the CLI keep it), timed in rounds (bench/_timing.compare_rounds)
   with two references: the layout before issue 42 ("one pass per probe": each probe's rows in one padded
   pass of their own) and one dense perplexity check (analysis.measure.evaluation.evaluate) of as many
   tokens of the built-in evaluation text. Target: the probes in at most 3 s (the median) on 2 CPU cores.
   Printed beside it: the passes and padded tokens of both layouts, the largest difference of their item
   values (float32 rounding: the same items), and, per probe, the cut's CI widths with all items and how
   many units (sequences) a prefix of the items needs for CIs as narrow (why the probes keep every item).
2. The per-head map of one probe: the fast sweep (analysis.measure.probes.circuit.probe_map) against the
   naive loop (one full masked forward per ablation over all the probe's rows, the same readout) over the
   same heads and KV groups of evenly spread layers (--layer-step k: layers k//2, k//2 + k, ..., so the
   mean number of layers an ablation replays stays about L/2, as for the whole map; every layer with
   1), each a whole map, in interleaved pairs. Target: naive / fast >= 5x (median per-pair ratio), same
   numbers (max |diff| over max |drop|, printed). Printed beside it: the multiply-adds of both (the linear
   layers and the LM head, from the items' shapes), whose ratio is what an exact sweep can gain at this
   depth whatever its overheads.

--clock cpu times each call by the process's CPU time (all its threads) instead of the wall clock: on a
machine shared with other work (load average above the cores) wall times swing several-fold and only the
ratios of interleaved rounds mean anything; CPU time at --threads 1 moves far less. The 3 s target is a
wall-clock target and is judged only with --clock wall.

    nice -n 5 .venv/bin/python -m bench.bench_probes [--cache-dir DIR] [--threads 2] [--sparsity 0.25]
                                                      [--map-probe ioi[,code]] [--map-items 16] [--layer-step 6]
                                                      [--clock wall|cpu]
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROBES_TARGET_S = 3.0
MAP_TARGET = 5.0
BEFORE_PASS_TOKENS = 2**40        # the layout before issue 42: as few passes as fit, per probe
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def clocked(fn, clock: str):
    """fn as a self-timed callable (bench/_timing.compare_rounds(self_timed=True)): its seconds on `clock`."""
    now = CLOCKS[clock]

    def run() -> float:
        start = now()
        fn()
        return now() - start
    return run


def one_pass_per_probe(model, built, gates):
    """The probes' scores the way they were laid out before issue 42: each probe on its own, its rows in as
    few padded passes as fit in BATCH_TOKENS (one, for the built-in probes)."""
    from analysis.measure.probes.measure import item_values, score_items
    out = {}
    for name, (spec, probe, items) in built.items():
        diff, nll = item_values(model, items, gates, pass_tokens=BEFORE_PASS_TOKENS)
        out[name] = score_items(spec, probe, items, diff, nll)
    return out


def padded(items, passes) -> int:
    return sum(len(p) * int(items.lengths[p].max()) for p in passes)


def units_for_width(diff, items, n_boot: int = 1000):
    """(accuracy CI width, logit-difference CI width) of the cut with all items, and the fewest units (in
    the items' seeded order, at least MIN_ITEMS: a bootstrap of fewer is narrow by chance) whose CIs are
    both as narrow (None: only all of them)."""
    import numpy as np
    from analysis.measure.probes.items import MIN_ITEMS
    from analysis.measure.probes.measure import bootstrap
    s = items.scored.numpy()
    d, u = diff[0, s], items.unit.numpy()[s]
    order = list(dict.fromkeys(u.tolist()))

    def widths(k):
        keep = np.isin(u, order[:k])
        _, acc = bootstrap((d[None, keep] > 0).astype(np.float64), u[keep], n_boot=n_boot)
        _, mean = bootstrap(d[None, keep], u[keep], n_boot=n_boot)
        return float(acc[0, 1] - acc[0, 0]), float(mean[0, 1] - mean[0, 0])

    full = widths(len(order))
    need = next((k for k in range(MIN_ITEMS, len(order)) if all(w <= f for w, f in zip(widths(k), full))), None)
    return full, need, len(order)


def map_work(model, items, layers, groups_r: int, buckets) -> tuple[float, float]:
    """Multiply-adds (linear layers and LM head) of the naive loop and of the fast sweep for one map."""
    import torch
    from analysis.arch.adapters import adapter_for
    blocks = adapter_for(model).layers(model)
    layer = sum(p.numel() for p in blocks[0].parameters() if p.dim() == 2)       # per token per layer
    head = model.get_output_embeddings().weight.numel()                           # per read position
    L = len(blocks)
    rows = sorted(set(items.row[items.scored].tolist()))
    forward = len(rows) * int(items.lengths[rows].max()) * (L * layer + head)     # one padded full forward
    naive = forward * (1 + len(layers) * groups_r)
    fast = 0.0
    for b in buckets:
        tokens = len(b) * int(items.lengths[b].max())
        read = int((items.scored & torch.isin(items.row, torch.tensor(b))).sum())
        fast += tokens * (L * layer + 2 * head)                                   # dense pass + tail check
        fast += sum(groups_r * (tokens * (L - l) * layer + read * head) for l in layers)
    return float(naive), float(fast)


def main(argv=None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sparsity", type=float, default=0.25, help="the mask: MP-G at this sparsity, default policy")
    parser.add_argument("--map-probe", default="ioi", help="comma-separated probes to map (each its own comparison)")
    parser.add_argument("--map-items", type=int, default=16)
    parser.add_argument("--layer-step", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=5, help="least number of interleaved pairs / rounds")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="per comparison, after the least pairs")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: probes, map")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall clock or process CPU time")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from analysis.arch.models import load_model
    from analysis.measure.ablation import ablation_gates
    from analysis.measure.evaluation import evaluate, gate_batch
    from analysis.measure.probes.breaks import build_applicable, dense_scores, prompt_tokens
    from analysis.measure.probes.circuit import length_buckets, probe_map
    from analysis.measure.probes.measure import BATCH_TOKENS, build_items, layout, measure_probes, pool, pooled_values
    from analysis.score.masks import default_policy, plan_mask
    from analysis.score.scoring import get_scorer
    from bench._timing import compare, compare_rounds, load_average, load_text

    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
    skip = set(filter(None, args.skip.split(",")))
    print(f"{lm.name}, torch threads {torch.get_num_threads()}, load average {load_text(load_average())}", flush=True)
    ok = True
    if "probes" not in skip:
        g = lm.geometry
        plan = plan_mask(get_scorer("mp-g").score(lm), args.sparsity, group_size=g.group_size,
                         policy=default_policy(g.group_size))
        t0 = time.perf_counter()
        built, skipped = build_applicable(lm, None)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        dense_scores(lm, built)
        dense_s = time.perf_counter() - t0
        n_tokens = prompt_tokens(built)
        print(f"probes: {', '.join(f'{n} {it.n_items} items / {it.n_tokens} tokens' for n, (_, _, it) in built.items())}"
              f" = {n_tokens} tokens; items built in {build_s:.2f} s (once per model), dense side {dense_s:.2f} s "
              f"(once per model){'; skipped ' + ', '.join(skipped) if skipped else ''}", flush=True)
        items_list = [it for _, _, it in built.values()]
        pooled, _ = pool(items_list)
        now = layout(pooled.lengths.tolist())
        before = [layout(it.lengths.tolist(), pass_tokens=BEFORE_PASS_TOKENS) for it in items_list]
        print(f"layout: {len(now)} shared passes, {padded(pooled, now)} padded tokens; before: "
              f"{sum(map(len, before))} passes (one per probe), {sum(padded(it, p) for it, p in zip(items_list, before))}"
              f" padded tokens (batch_tokens {BATCH_TOKENS})", flush=True)
        gates = gate_batch(lm.model, None, plan.pruned)
        new_scores, old_scores = measure_probes(lm.model, built, gates=gates), one_pass_per_probe(lm.model, built, gates)
        diff = max(float(np.abs(new_scores[n].logit_diff - old_scores[n].logit_diff).max()) for n in built)
        same_ci = all(np.array_equal(new_scores[n].accuracy_ci, old_scores[n].accuracy_ci) for n in built)
        print(f"same items, both layouts: max |mean logit difference change| {diff:.1e} (float32 rounding); "
              f"accuracy CIs {'identical' if same_ci else 'DIFFER'}", flush=True)
        fns = {"probes (one mask)": lambda: measure_probes(lm.model, built, pruned=plan.pruned),
               "one pass per probe (before)": lambda: one_pass_per_probe(lm.model, built, gates),
               "perplexity (same tokens)": lambda: evaluate(lm, max_tokens=n_tokens)}
        cmps = compare_rounds({k: clocked(fn, args.clock) for k, fn in fns.items()},
                              [("probes (one mask)", "one pass per probe (before)"),
                               ("probes (one mask)", "perplexity (same tokens)")],
                              min_rounds=args.pairs, max_seconds=args.max_seconds, self_timed=True)
        for (a, b), cmp in cmps.items():
            cmp.report(f"all probes for the MP-G {args.sparsity:.0%} mask: {a} vs {b} ({n_tokens} tokens)",
                       unit=1.0, unit_name=f"s ({args.clock})")
        probes_s = float(np.median(cmps[("probes (one mask)", "perplexity (same tokens)")].times["probes (one mask)"]))
        passed = probes_s <= PROBES_TARGET_S
        ok &= passed or args.clock != "wall"
        verdict = ("PASS" if passed else "FAIL") if args.clock == "wall" else "not judged on CPU time"
        print(f"probes for one mask: median {probes_s:.2f} s {args.clock} (target <= {PROBES_TARGET_S} s wall) -> "
              f"{verdict}; {cmps[('probes (one mask)', 'one pass per probe (before)')].ratio:.2f}x "
              f"the layout before, {cmps[('probes (one mask)', 'perplexity (same tokens)')].ratio:.2f}x a perplexity "
              f"check of the same tokens", flush=True)
        values = pooled_values(lm.model, items_list, gates)
        print("fewer items? the cut's 95 % CI widths (accuracy, logit difference) with all items, and the fewest "
              "units (sequences, in the items' seeded order) whose CIs are as narrow:", flush=True)
        for (name, (_, _, items)), (d, _) in zip(built.items(), values):
            (acc_w, mean_w), need, units = units_for_width(d, items)
            print(f"    {name:>10}: widths {acc_w:.3f}, {mean_w:.2f} with all {units} units; as narrow with "
                  f"{need if need is not None else 'no fewer'} units", flush=True)
    if "map" not in skip:
        for name in filter(None, args.map_probe.split(",")):
            ok &= _map(lm, name, args, build_items, probe_map, length_buckets, ablation_gates, compare)
    print(f"load average at the end {load_text(load_average())}")
    return ok


def _map(lm, name, args, build_items, probe_map, length_buckets, ablation_gates, compare) -> bool:
    import numpy as np
    spec, _, items = build_items([name], lm.tokenizer, lm.kind, options=dict(n_items=args.map_items))[name]
    layers = list(range(args.layer_step // 2, lm.geometry.n_layers, args.layer_step))   # centred: mean suffix ~ L/2
    R = ablation_gates(lm.geometry, 0, groups=True).shape[0]
    buckets = length_buckets(items, R)
    naive_work, fast_work = map_work(lm.model, items, layers, R, buckets)
    maps = {}

    def run(method):
        def go():
            maps[method] = probe_map(lm.model, spec, items, method=method, layers=layers)
        return go
    print(f"map of {name}: {items.n_items} items, {items.n_tokens} tokens (lengths {int(items.lengths.min())}-"
          f"{int(items.lengths.max())}), layers {layers} ({len(layers) * R} ablations); fast: {len(buckets)} "
          f"length buckets; multiply-adds naive {naive_work / 1e12:.2f} T, fast {fast_work / 1e12:.2f} T: "
          f"{naive_work / fast_work:.2f}x (the most an exact sweep gains here, overheads aside)", flush=True)
    cmp = compare({"naive": clocked(run("naive"), args.clock), "fast": clocked(run("fast"), args.clock)},
                  min_pairs=args.pairs, max_seconds=args.max_seconds, self_timed=True)
    cmp.report(f"per-head map of {name}: naive loop vs fast sweep (whole maps)", unit=1.0,
               unit_name=f"s ({args.clock})", target=f">= {MAP_TARGET}x")
    a, b = maps["naive"].drop[layers], maps["fast"].drop[layers]
    err = float(np.abs(a - b).max() / np.abs(a).max())
    passed = cmp.ratio >= MAP_TARGET and err <= 1e-4
    print(f"{name}: naive / fast median per-pair ratio = {cmp.ratio:.2f}x (target >= {MAP_TARGET}x; multiply-adds "
          f"{naive_work / fast_work:.2f}x), max |diff| / max |drop| = {err:.1e} -> {'PASS' if passed else 'FAIL'}; "
          f"top heads {maps['fast'].top(3)}", flush=True)
    return passed


if __name__ == "__main__":
    import sys
    sys.exit(0 if main() else 1)
