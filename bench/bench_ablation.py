"""Benchmark: the fast single-head ablation sweep vs the naive loop, on the built-in SmolLM2.

Both sides sweep the same heads (every query head, plus every KV group) of the same layers on
the same tokens, in one process, interleaved layer by layer in rotating order so a busy machine
slows all three alike. Three runs:
  naive      one full masked forward per ablation (analysis.ablation.naive_sweep)
  fast-1     prefix reuse only: layers l..L-1 from the cached input, one ablation per pass
  fast       prefix reuse + batched gates (all ablations of a layer in one pass, the default)
naive / fast-1 is what prefix reuse buys, fast-1 / fast what batching buys. The LM head
(a 576 x 49152 projection per token and ablation) cannot be shared; its share of each run's
time is printed too (hooks on the output embeddings time it in the naive run).

    .venv/bin/python bench/bench_ablation.py [--tokens 64] [--layer-step 1]
--layer-step k sweeps layers 0, k, 2k, ... (evenly spread, so the average suffix length stays
representative) to fit a slow machine. Target: naive / fast >= 1.5x, same numbers (max
|difference| <= 1e-4 of the largest effect).
"""
import argparse
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the built-in evaluation text")
    parser.add_argument("--layer-step", type=int, default=1, help="sweep every k-th layer")
    args = parser.parse_args()

    import numpy as np
    import torch

    from analysis.ablation import FastAblation, full_forward_loss, naive_layer_deltas
    from analysis.evaluation import token_ids
    from analysis.models import load_model
    from analysis.text import evaluation_text

    lm = load_model("smollm2-135m")
    x = token_ids(lm.tokenizer, evaluation_text(), max_tokens=args.tokens).unsqueeze(0)   # [1, T]
    layers = list(range(0, lm.geometry.n_layers, args.layer_step))
    n_ablations = len(layers) * (lm.geometry.n_heads + lm.geometry.n_kv_heads)
    print(f"SmolLM2-135M, {x.shape[1]} tokens, layers {layers[0]}..{layers[-1]} step {args.layer_step}: "
          f"{n_ablations} ablations (heads + KV groups), torch threads {torch.get_num_threads()}")

    model = lm.model
    fast1, fast = FastAblation(batch_size=1), FastAblation()
    t0 = time.perf_counter()
    base = full_forward_loss(model, x)
    t_base = time.perf_counter() - t0
    preps, t = {}, {"naive": t_base, "fast-1": 0.0, "fast": 0.0}
    parts = {name: {"layers": 0.0, "lm_head": 0.0} for name in ("fast-1", "fast")}
    for name, runner in (("fast-1", fast1), ("fast", fast)):
        t0 = time.perf_counter()
        preps[name] = runner.prepare(model, x)
        t[name] += time.perf_counter() - t0
        parts[name]["prefix"] = time.perf_counter() - t0
    timer = _HeadTimer(model.get_output_embeddings())
    deltas = {name: {} for name in t}
    runs = [("naive", None), ("fast-1", fast1), ("fast", fast)]
    for i, layer in enumerate(layers):           # interleaved, rotating order: same machine load for all
        for name, runner in runs[i % 3:] + runs[:i % 3]:
            before = timer.total
            t0 = time.perf_counter()
            if runner is None:
                deltas[name][layer] = naive_layer_deltas(model, x, layer, base)
            else:
                deltas[name][layer] = runner.layer_deltas(model, preps[name], layer, parts[name])
            t[name] += time.perf_counter() - t0
            if runner is None:
                parts.setdefault("naive", {"lm_head": 0.0})["lm_head"] += timer.total - before
        print(f"  layer {layer:2d} done: " + ", ".join(f"{k} {v:.1f}s" for k, v in t.items()), flush=True)
    timer.close()

    want = np.concatenate([deltas["naive"][l] for l in layers])

    def err(name):
        got = np.concatenate([deltas[name][l] for l in layers])
        return np.abs(got - want).max() / np.abs(want).max()

    print(f"{'run':8s} {'seconds':>8s} {'vs naive':>9s} {'LM head':>8s}  where the rest goes")
    print(f"{'naive':8s} {t['naive']:8.1f} {1.0:8.2f}x {parts['naive']['lm_head'] / t['naive']:8.0%}  "
          f"{n_ablations} full forwards")
    for name in ("fast-1", "fast"):
        p = parts[name]
        print(f"{name:8s} {t[name]:8.1f} {t['naive'] / t[name]:8.2f}x {p['lm_head'] / t[name]:8.0%}  "
              f"suffix layers {p['layers'] / t[name]:.0%}, dense prefix + probes {p['prefix'] / t[name]:.0%}; "
              f"max |diff| / max |effect| = {err(name):.1e}")
    print(f"prefix reuse: {t['naive'] / t['fast-1']:.2f}x, batching on top: {t['fast-1'] / t['fast']:.2f}x")
    ratio = t["naive"] / t["fast"]
    ok = ratio >= TARGET and err("fast") <= 1e-4
    print(f"naive / fast = {ratio:.2f}x (target >= {TARGET}x, same numbers) -> {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
