"""Benchmark: the fast single-head ablation sweep vs the naive loop, on the built-in SmolLM2.

Both sides sweep the same heads (every query head, plus every KV group) of the same layers on
the same tokens, in one process, interleaved layer by layer in rotating order, each layer timed
--repeats times keeping the best (a shared machine's load spikes otherwise decide). Runs:
  naive      one full masked forward per ablation (analysis.measure.ablation.naive_sweep)
  fast-1     prefix reuse only: layers l..L-1 from the cached input, one ablation per pass
  fast       prefix reuse + batched gates (all ablations of a layer in one pass, the default)
naive / fast-1 is what prefix reuse buys, fast-1 / fast what batching buys. The LM head
(a 576 x 49152 projection per token and ablation) cannot be shared; its share of each run's
time is printed too (hooks on the output embeddings time it in the naive run).

    .venv/bin/python bench/bench_ablation.py [--tokens 64] [--layer-step 1] [--repeats 2]
--layer-step k sweeps layers 0, k, 2k, ... (evenly spread, so the average suffix length stays
representative) to fit a slow machine. Target: naive / fast >= 1.5x, same numbers (max
|difference| <= 1e-4 of the largest effect).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 1.5


class _HeadTimer:
    """Accumulates the wall time spent inside one module (pre/post forward hooks)."""

    def __init__(self, module):
        self.total, self._start = 0.0, None
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.total += time.perf_counter() - self._start

    def close(self):
        for h in self.handles:
            h.remove()


def main(argv=None, lm=None) -> bool:
    """Run the comparison (argv: the options above; lm: a LoadedModel to use instead of SmolLM2 on
    the CPU, e.g. on a GPU from bench/gpu_check.py). Returns whether it passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the built-in evaluation text")
    parser.add_argument("--layer-step", type=int, default=1, help="sweep every k-th layer")
    parser.add_argument("--repeats", type=int, default=2, help="time each layer this often, keep the best")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from analysis.measure.ablation import FastAblation, full_forward_loss, naive_layer_deltas
    from analysis.measure.evaluation import token_ids
    from analysis.arch.models import load_model
    from analysis.core.text import evaluation_text

    lm = lm or load_model("smollm2-135m")
    device = next(lm.model.parameters()).device
    x = token_ids(lm.tokenizer, evaluation_text(), max_tokens=args.tokens).unsqueeze(0).to(device)   # [1, T]
    layers = list(range(0, lm.geometry.n_layers, args.layer_step))
    n_ablations = len(layers) * (lm.geometry.n_heads + lm.geometry.n_kv_heads)
    print(f"{lm.name} on {device}, {x.shape[1]} tokens, layers {layers[0]}..{layers[-1]} step {args.layer_step}: "
          f"{n_ablations} ablations (heads + KV groups), torch threads {torch.get_num_threads()}")

    model = lm.model
    fast1, fast = FastAblation(batch_size=1), FastAblation()
    runners = {"naive": None, "fast-1": fast1, "fast": fast}
    best = {name: {} for name in runners}          # name -> layer -> (seconds, lm_head s, layers s)
    deltas = {name: {} for name in runners}
    prefix = {}
    for name, runner in runners.items():            # the one-off dense work of each run
        t0 = time.perf_counter()
        prefix[name] = full_forward_loss(model, x) if runner is None else runner.prepare(model, x)
        prefix[name + " s"] = time.perf_counter() - t0
    base = prefix["naive"]
    timer = _HeadTimer(model.get_output_embeddings())
    names = list(runners)
    for i, layer in enumerate(layers):              # interleaved, rotating order, best of --repeats
        for rep in range(args.repeats):
            k = (i + rep) % 3
            for name in names[k:] + names[:k]:
                runner, parts = runners[name], {}
                before = timer.total
                t0 = time.perf_counter()
                if runner is None:
                    deltas[name][layer] = naive_layer_deltas(model, x, layer, base)
                    parts = {"lm_head": timer.total - before}
                else:
                    deltas[name][layer] = runner.layer_deltas(model, prefix[name], layer, parts)
                seconds = time.perf_counter() - t0
                if layer not in best[name] or seconds < best[name][layer][0]:
                    best[name][layer] = (seconds, parts.get("lm_head", 0.0), parts.get("layers", 0.0))
        print(f"  layer {layer:2d}: " + ", ".join(f"{n} {best[n][layer][0]:.2f}s" for n in names), flush=True)
    timer.close()
    t = {n: prefix[n + " s"] + sum(b[0] for b in best[n].values()) for n in names}
    head = {n: sum(b[1] for b in best[n].values()) for n in names}
    suffix = {n: sum(b[2] for b in best[n].values()) for n in names}

    want = np.concatenate([deltas["naive"][l] for l in layers])

    def err(name):
        got = np.concatenate([deltas[name][l] for l in layers])
        return np.abs(got - want).max() / np.abs(want).max()

    print(f"{'run':8s} {'seconds':>8s} {'vs naive':>9s} {'LM head':>8s}  where the rest goes")
    print(f"{'naive':8s} {t['naive']:8.1f} {1.0:8.2f}x {head['naive'] / t['naive']:8.0%}  "
          f"{n_ablations} full forwards")
    for name in ("fast-1", "fast"):
        print(f"{name:8s} {t[name]:8.1f} {t['naive'] / t[name]:8.2f}x {head[name] / t[name]:8.0%}  "
              f"suffix layers {suffix[name] / t[name]:.0%}, dense prefix + probes "
              f"{prefix[name + ' s'] / t[name]:.0%}; max |diff| / max |effect| = {err(name):.1e}")
    print(f"prefix reuse: {t['naive'] / t['fast-1']:.2f}x, batching on top: {t['fast-1'] / t['fast']:.2f}x")
    # every layer costs the naive loop the same (its ablations are full forwards), so the median
    # layer times the layer count is a spike-proof naive total; the ratio uses the smaller one
    steady = prefix["naive s"] + statistics.median(b[0] for b in best["naive"].values()) * len(layers)
    print(f"naive total from its median layer: {steady:.1f} s ({steady / t['fast']:.2f}x fast)")
    ratio = min(t["naive"], steady) / t["fast"]
    ok = ratio >= TARGET and err("fast") <= 1e-4
    print(f"naive / fast = {ratio:.2f}x (target >= {TARGET}x, same numbers) -> {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    main()
