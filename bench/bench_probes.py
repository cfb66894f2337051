"""Benchmark: the capability probes on the built-in SmolLM2, side by side (issue 34's two targets).

1. All probes for one mask: the cut's passes over every probe's items (the dense side is computed once
   per model and kept, as the app and the CLI keep it) against one dense perplexity check
   (analysis.measure.evaluation.evaluate) of as many tokens of the built-in evaluation text, timed in
   interleaved pairs (bench/_timing.compare). Target: the probes in at most 3 s (the median) on 2 CPU
   cores; the ratio says what the probes cost against a perplexity check of the same tokens (> 1: the
   overhead of many short prompts and of reading the logits at their positions).
2. The per-head map of one probe: the fast sweep (analysis.measure.probes.circuit.probe_map) against the
   naive loop (one full masked forward per ablation over all the probe's rows, the same readout) over the
   same heads and KV groups of evenly spread layers (--layer-step k: layers k//2, k//2 + k, ..., so the
   mean number of layers an ablation replays stays about L/2, as for the whole map; every layer with
   1), each a whole map, in interleaved pairs. Target: naive / fast >= 5x (median per-pair ratio), same numbers (max |diff|
   over max |drop|, printed).

    nice -n 5 .venv/bin/python -m bench.bench_probes [--cache-dir DIR] [--threads 2] [--sparsity 0.25]
                                                      [--map-probe ioi] [--map-items 16] [--layer-step 6]
"""
import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROBES_TARGET_S = 3.0
MAP_TARGET = 5.0


def main(argv=None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sparsity", type=float, default=0.25, help="the mask: MP-G at this sparsity, default policy")
    parser.add_argument("--map-probe", default="ioi")
    parser.add_argument("--map-items", type=int, default=16)
    parser.add_argument("--layer-step", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=5, help="least number of interleaved pairs")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="per comparison, after the least pairs")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: probes, map")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from analysis.arch.models import load_model
    from analysis.measure.evaluation import evaluate
    from analysis.measure.probes.breaks import build_applicable, dense_scores, prompt_tokens
    from analysis.measure.probes.circuit import probe_map
    from analysis.measure.probes.measure import build_items, measure_probes
    from analysis.score.masks import default_policy, plan_mask
    from analysis.score.scoring import get_scorer
    from bench._timing import compare, load_average, load_text

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
        cmp = compare({"probes (one mask)": lambda: measure_probes(lm.model, built, pruned=plan.pruned),
                       "perplexity (same tokens)": lambda: evaluate(lm, max_tokens=n_tokens)},
                      min_pairs=args.pairs, max_seconds=args.max_seconds)
        cmp.report(f"all probes for the MP-G {args.sparsity:.0%} mask vs a dense perplexity check of {n_tokens} tokens",
                   unit=1.0, unit_name="s")
        probes_s = float(np.median(cmp.times["probes (one mask)"]))
        passed = probes_s <= PROBES_TARGET_S
        ok &= passed
        print(f"probes for one mask: median {probes_s:.2f} s (target <= {PROBES_TARGET_S} s) -> "
              f"{'PASS' if passed else 'FAIL'}; {cmp.ratio:.2f}x a perplexity check of the same tokens", flush=True)
    if "map" not in skip:
        spec, _, items = build_items([args.map_probe], lm.tokenizer, lm.kind,
                                     options=dict(n_items=args.map_items))[args.map_probe]
        layers = list(range(args.layer_step // 2, lm.geometry.n_layers, args.layer_step))   # centred: mean suffix ~ L/2
        maps = {}

        def run(method):
            def go():
                maps[method] = probe_map(lm.model, spec, items, method=method, layers=layers)
            return go
        print(f"map of {args.map_probe}: {items.n_items} items, {items.n_tokens} tokens, layers {layers} "
              f"({len(layers) * (lm.geometry.n_heads + lm.geometry.n_kv_heads)} ablations)", flush=True)
        cmp = compare({"naive": run("naive"), "fast": run("fast")}, min_pairs=args.pairs,
                      max_seconds=args.max_seconds)
        cmp.report(f"per-head map of {args.map_probe}: naive loop vs fast sweep (whole maps)", unit=1.0,
                   unit_name="s", target=f">= {MAP_TARGET}x")
        a, b = maps["naive"].drop[layers], maps["fast"].drop[layers]
        err = float(np.abs(a - b).max() / np.abs(a).max())
        passed = cmp.ratio >= MAP_TARGET and err <= 1e-4
        ok &= passed
        print(f"naive / fast median per-pair ratio = {cmp.ratio:.2f}x (target >= {MAP_TARGET}x), max |diff| / max "
              f"|drop| = {err:.1e} -> {'PASS' if passed else 'FAIL'}; top heads {maps['fast'].top(3)}", flush=True)
    print(f"load average at the end {load_text(load_average())}")
    return ok


if __name__ == "__main__":
    import sys
    sys.exit(0 if main() else 1)
