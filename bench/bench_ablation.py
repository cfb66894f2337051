"""Benchmark: the fast single-head ablation sweep vs the naive loop, on the built-in SmolLM2.

Three runs sweep the same heads (every query head, plus every KV group) of the same layers on the
same tokens, in one process. One call of a run is a whole sweep, its one-off dense work included;
the three are timed in rounds (bench/_timing.compare_rounds: every round runs each once, the order
rotated, until the spread of every per-round ratio is known), and min / median / max of each run
and of each per-round ratio are printed with the load average; the target is judged on the median:
  naive      one full masked forward per ablation (analysis.measure.ablation.naive_layer_deltas)
  fast-1     prefix reuse only: layers l..L-1 from the cached input, one ablation per pass
  fast       prefix reuse + batched gates (all ablations of a layer in one pass, the default)
naive / fast-1 is what prefix reuse buys, fast-1 / fast what batching buys. The LM head
(a 576 x 49152 projection per token and ablation) cannot be shared; its median share of each run's
time is printed too (hooks on the output embeddings time it in the naive run).

    .venv/bin/python -m bench.bench_ablation [--tokens 64] [--layer-step 1] [--repeats 3] [--max-rounds 13]
--layer-step k sweeps layers 0, k, 2k, ... (evenly spread, so the average suffix length stays
representative) to fit a slow machine; --repeats is the least number of rounds. Target: naive /
fast >= 1.5x (median per-round ratio), same numbers (max |difference| <= 1e-4 of the largest effect).
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
    parser.add_argument("--repeats", type=int, default=3, help="least number of rounds (each run once per round)")
    parser.add_argument("--max-rounds", type=int, default=None, help="most rounds (default 4 x --repeats + 1)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from analysis.measure.ablation import FastAblation, full_forward_loss, naive_layer_deltas
    from analysis.measure.evaluation import token_ids
    from analysis.arch.models import load_model
    from analysis.core.text import evaluation_text
    from bench._timing import compare_rounds

    lm = lm or load_model("smollm2-135m")
    device = next(lm.model.parameters()).device
    x = token_ids(lm.tokenizer, evaluation_text(), max_tokens=args.tokens).unsqueeze(0).to(device)   # [1, T]
    layers = list(range(0, lm.geometry.n_layers, args.layer_step))
    n_ablations = len(layers) * (lm.geometry.n_heads + lm.geometry.n_kv_heads)
    print(f"{lm.name} on {device}, {x.shape[1]} tokens, layers {layers[0]}..{layers[-1]} step {args.layer_step}: "
          f"{n_ablations} ablations (heads + KV groups), torch threads {torch.get_num_threads()}")

    model = lm.model
    timer = _HeadTimer(model.get_output_embeddings())
    deltas = {}                                     # run -> layer -> [R] loss changes of its last sweep
    shares = {}                                     # run -> [(lm_head s, suffix layers s, prefix s, total s)]

    def naive():
        t0 = time.perf_counter()
        base = full_forward_loss(model, x)
        prefix_s, head_before = time.perf_counter() - t0, timer.total
        deltas["naive"] = {layer: naive_layer_deltas(model, x, layer, base) for layer in layers}
        shares.setdefault("naive", []).append((timer.total - head_before, 0.0, prefix_s, time.perf_counter() - t0))
        print(f"  naive sweep {shares['naive'][-1][3]:.2f} s", flush=True)

    def fast_run(name, runner):
        def run():
            t0 = time.perf_counter()
            prep = runner.prepare(model, x)
            prefix_s, parts = time.perf_counter() - t0, {}
            deltas[name] = {layer: runner.layer_deltas(model, prep, layer, parts) for layer in layers}
            shares.setdefault(name, []).append((parts.get("lm_head", 0.0), parts.get("layers", 0.0), prefix_s,
                                                time.perf_counter() - t0))
            print(f"  {name} sweep {shares[name][-1][3]:.2f} s", flush=True)
        return run

    runs = {"naive": naive, "fast-1": fast_run("fast-1", FastAblation(batch_size=1)),
            "fast": fast_run("fast", FastAblation())}
    try:
        cmps = compare_rounds(runs, [("naive", "fast-1"), ("fast-1", "fast"), ("naive", "fast")],
                              min_rounds=args.repeats, max_rounds=args.max_rounds or 4 * args.repeats + 1,
                              max_seconds=600.0)
    finally:
        timer.close()

    want = np.concatenate([deltas["naive"][l] for l in layers])

    def err(name):
        got = np.concatenate([deltas[name][l] for l in layers])
        return np.abs(got - want).max() / np.abs(want).max()

    def share(name, i):
        return statistics.median(s[i] / s[3] for s in shares[name])

    print(f"where each run's time goes (median share over its calls; {len(shares['naive']) - 1} timed + 1 warm-up):")
    print(f"  naive : LM head {share('naive', 0):.0%}, dense loss {share('naive', 2):.0%}; {n_ablations} full forwards")
    for name in ("fast-1", "fast"):
        print(f"  {name:6s}: LM head {share(name, 0):.0%}, suffix layers {share(name, 1):.0%}, dense prefix + probes "
              f"{share(name, 2):.0%}; max |diff| / max |effect| vs naive = {err(name):.1e}")
    cmps[("naive", "fast-1")].report("prefix reuse: naive vs fast-1 (whole sweeps)", unit=1.0, unit_name="s")
    cmps[("fast-1", "fast")].report("batching on top: fast-1 vs fast (whole sweeps)", unit=1.0, unit_name="s")
    headline = cmps[("naive", "fast")]
    headline.report("naive vs fast (whole sweeps)", unit=1.0, unit_name="s", target=f">= {TARGET}x")
    ok = headline.ratio >= TARGET and err("fast") <= 1e-4
    print(f"naive / fast median per-round ratio = {headline.ratio:.2f}x (target >= {TARGET}x, same numbers) -> "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    main()
