"""Benchmark: does physically removing heads make SmolLM2-135M faster, as much as the FLOPs say?

At 50% of the heads removed, prefill of 512 tokens is timed for the dense model, the masked model
(dense + head_mask hooks: the paper's zeroing) and the physically pruned model, in one session
with rotating order, a warm-up and a fixed torch thread count. Ratios are medians over rounds of
within-round ratios, so load that drifts between rounds (other work on a shared machine)
cancels; they are given for wall-clock time and for process CPU time (steadier when the machine
is busy: time spent descheduled is not counted).
The FLOP prediction counts the whole forward (attention projections + causal scores + MLP + LM head,
analysis.compress.cost.forward_flops). Pass: measured time saving of pruned over masked >= 70% of the
FLOP-predicted saving. Masked vs dense is reported too (expected ~1.0: zeroing saves nothing).

Masks (MP-G scores, z = 2.0; 135 of 270 heads each):
  uniform        5 heads pruned in even layers, 4 in odd (lowest scores of each layer); layers
                 left with uneven GQA groups get expanded K/V (kv_policy auto)
  group-aligned  1 KV group (3 heads) pruned in even layers, 2 groups in odd (lowest group sums)
  global         the plain global ranking at sparsity 0.5 (per-layer counts vary)

Surgery cost (first, per mask): `prune_heads` (a structural twin: untouched tensors shared)
against a deep copy then `apply_layout` of the same layout (what prune_heads did before).
- memory: peak RSS growth during the call (VmHWM reset just before, minus the RSS before; the
  result is still alive at the peak read), with glibc's mmap threshold pinned so freed tensors
  go back to the OS (bench/_memory.py), over the model's tensor bytes (unique storages);
  "new" is the exact count of tensor bytes the result does not share with the original. SmolLM2
  is deep-copied into anonymous memory first (load_model memory-maps its cached checkpoint,
  whose file pages would fault in during the first call that reads them).
  Also shown: share=False (the twin then owns every weight: the training path) and
  in_place=True on a copy made beforehand (its growth: new projections minus the freed ones).
  target: prune_heads peak growth / model <= 0.3
- time: prune_heads vs deep copy + apply_layout, alternating order every round, a garbage
  collection before and the result freed after each timed call (bench/_timing.py); ratio =
  median over rounds of deep-copy time / prune_heads time. target >= 2x

Usage: .venv/bin/python -m bench.bench_surgery [--threads 1] [--repeats 9] [--seq 512] [--full]
       [--tiny]   (a 4-layer random Llama instead of SmolLM2, for developing the script)
       [--cost-only]   (only the surgery cost, no prefill timing)
--masks uniform,global picks masks; --full adds analysis.compress.timing.measure's report for the first
mask (prefill 128/512/1024, decode).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import numpy as np
import torch


from analysis.arch.adapters import adapter_for  # noqa: E402
from analysis.score.masks import plan_mask  # noqa: E402
from analysis.score.scoring import MPGScorer  # noqa: E402
from analysis.arch.cut import Cut  # noqa: E402
from analysis.arch.models import count_parameters  # noqa: E402
from analysis.compress.cost import forward_flops  # noqa: E402
from analysis.compress.timing import alternating_times, cut_call, measure, saving_ratio  # noqa: E402
from analysis.core.threads import torch_threads  # noqa: E402
from analysis.compress.surgery import HeadLayout, apply_layout, prune_heads  # noqa: E402
from bench._memory import fixed_mmap_threshold, peak_growth  # noqa: E402
from bench._timing import alternate_times  # noqa: E402

PASS_FRACTION = 0.70
MEMORY_TARGET = 0.30        # prune_heads peak RSS growth / model tensor bytes
SPEEDUP_TARGET = 2.0        # deep copy + apply_layout time / prune_heads time


def load(tiny: bool):
    if tiny:
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = LlamaConfig(hidden_size=288, intermediate_size=768, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=32, num_hidden_layers=4, vocab_size=4096, max_position_embeddings=2048)
        torch.manual_seed(0)
        return "tiny-llama", AutoModelForCausalLM.from_config(cfg, trust_remote_code=False).eval()
    from analysis.arch.models import load_model
    lm = load_model("smollm2-135m")
    # load_model memory-maps its cached checkpoint: file-backed pages fault in on first read (and
    # the kernel may drop them), which the RSS would count against whichever call reads first. A
    # deep copy holds every weight in anonymous memory, as any model built in RAM does.
    return lm.name, copy.deepcopy(lm.model)


def masks(scores: np.ndarray, group_size: int) -> dict[str, np.ndarray]:
    """The three 50% masks of the module doc, from scores [L, H] (higher = keep)."""
    L, H = scores.shape
    uniform = np.zeros((L, H), bool)
    aligned = np.zeros((L, H), bool)
    group_scores = scores.reshape(L, H // group_size, group_size).sum(-1)        # [L, H_kv]
    for layer in range(L):
        per_layer = int(np.ceil(H / 2)) if layer % 2 == 0 else H // 2
        uniform[layer, np.argsort(scores[layer], kind="stable")[:per_layer]] = True
        n_groups = (H // group_size) // 2 + (layer % 2)                            # 1 (even) / 2 (odd) of 3
        for g in np.argsort(group_scores[layer], kind="stable")[:n_groups]:
            aligned[layer, g * group_size:(g + 1) * group_size] = True
    out = {"uniform": uniform, "group-aligned": aligned,
           "global": plan_mask(scores, 0.5, group_size=group_size).pruned}
    return out


def _storages(model) -> dict[int, int]:
    """{storage address: bytes} of every parameter and buffer (tied tensors once)."""
    tensors = (*model.parameters(), *model.buffers())
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def surgery_cost(model, chosen: dict[str, np.ndarray], adapter, repeats: int, threads: int, pinned: bool) -> int:
    """Print the memory and time of prune_heads vs deep copy + apply_layout per mask (see the
    module doc); returns the number of targets missed."""
    size = sum(_storages(model).values())
    g = adapter.geometry(model)
    print(f"surgery cost: model tensors {size / 2**20:.0f} MiB; peak RSS growth per call / model tensor bytes "
          f"(glibc mmap threshold pinned: {pinned}); time: {repeats} alternating rounds + 1 warm-up, "
          f"torch threads {threads}")
    header = (f"{'mask':14} {'new/model':>9} {'peak: twin':>10} {'deep copy':>9} {'share=False':>11} "
              f"{'in_place':>8} {'verdict':>7} | {'twin ms':>7} {'deep ms':>7} {'deep/twin':>9} {'verdict':>7}")
    print(header)
    print("-" * len(header))
    missed = 0
    for label, pruned in chosen.items():
        layout = HeadLayout.from_mask(pruned, g, adapter.model_type)
        calls = {"twin": lambda p=pruned: prune_heads(model, p, adapter=adapter),
                 "deep": lambda lay=layout: apply_layout(copy.deepcopy(model), lay, adapter=adapter),
                 "own": lambda p=pruned: prune_heads(model, p, adapter=adapter, share=False)}
        growth = {}
        for name, call in calls.items():
            growth[name], result = peak_growth(call)
            if name == "twin":
                original = _storages(model)
                new = sum(n for ptr, n in _storages(result[0]).items() if ptr not in original)
            del result
        victim = copy.deepcopy(model)
        growth["in_place"], result = peak_growth(lambda: prune_heads(victim, pruned, adapter=adapter, in_place=True))
        del result, victim
        with torch_threads(threads):
            times = alternate_times({k: calls[k] for k in ("twin", "deep")}, repeats, collect=True, untimed_free=True)
        ratio = statistics.median(d / t for d, t in zip(times["deep"], times["twin"]))
        memory_ok, time_ok = growth["twin"] / size <= MEMORY_TARGET, ratio >= SPEEDUP_TARGET
        missed += (not memory_ok) + (not time_ok)
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"{label:14} {new / size:>9.3f} {growth['twin'] / size:>10.3f} {growth['deep'] / size:>9.3f} "
              f"{growth['own'] / size:>11.3f} {growth['in_place'] / size:>8.3f} {'PASS' if memory_ok else 'FAIL':>7} | "
              f"{ms['twin']:>7.0f} {ms['deep']:>7.0f} {ratio:>9.2f} {'PASS' if time_ok else 'FAIL':>7}")
    print(f"targets: twin peak growth / model <= {MEMORY_TARGET}, deep copy time / twin time >= {SPEEDUP_TARGET}; "
          f"'new/model' = tensor bytes the twin does not share (exact count)\n")
    return missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--cost-only", dest="cost_only", action="store_true", help="only the surgery cost")
    ap.add_argument("--masks", default="uniform,group-aligned,global",
                    help="comma-separated subset of: uniform, group-aligned, global")
    args = ap.parse_args(argv)

    pinned = fixed_mmap_threshold()            # before the model's allocations (bench/_memory.py)
    name, model = load(args.tiny)
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    scores = MPGScorer(z=2.0).score(model).scores                                  # [L, H]
    chosen = {k: v for k, v in masks(scores, g.group_size).items() if k in args.masks.split(",")}
    ids = torch.randint(0, int(model.config.vocab_size), (1, args.seq), generator=torch.Generator().manual_seed(0))

    print(f"model {name}: {g.n_layers} layers x {g.n_heads} heads ({g.n_kv_heads} KV), "
          f"{count_parameters(model) / 1e6:.1f}M parameters; attention {model.config._attn_implementation}")
    missed = surgery_cost(model, chosen, adapter, args.repeats, args.threads, pinned)
    if args.cost_only:
        return 1 if missed else 0
    print(f"prefill {args.seq} tokens, batch 1, torch threads {args.threads}; per mask, dense / masked / pruned "
          f"run in rotating order, 1 warm-up round + {args.repeats} timed rounds; ratios are medians over rounds "
          f"of within-round ratios (wall clock, and process CPU time)\n")
    dense_flops = forward_flops(model, args.seq, args.seq, adapter=adapter)
    header = (f"{'mask':14} {'pruned':>6} {'KV/layer':>8} {'params':>7} {'dense ms':>8} {'masked ms':>9} "
              f"{'pruned ms':>9} {'dense/masked':>12} {'FLOP-pred':>9} {'measured':>8} {'saving/pred':>11} "
              f"{'verdict':>7} | {'CPU: measured':>13} {'saving/pred':>11} {'verdict':>7}")
    print(header)
    print("-" * len(header))
    failures, started = 0, time.perf_counter()
    pruned_models = {}
    for label, pruned in chosen.items():
        smaller, layout = prune_heads(model, pruned, adapter=adapter)
        pruned_models[label] = (smaller, layout, pruned)
        calls = {"dense": lambda: model(input_ids=ids),
                 "masked": cut_call(Cut.of_mask(pruned), model, lambda m: m(input_ids=ids)),
                 "pruned": lambda m=smaller: m(input_ids=ids)}
        with torch_threads(args.threads):
            times = alternating_times(calls, repeats=args.repeats, warmup=1)
        ms = times.median_ms("wall")
        predicted = dense_flops.total / forward_flops(smaller, args.seq, args.seq, adapter=adapter).total
        verdicts = []
        for clock in ("wall", "cpu"):
            measured = times.paired_ratio("masked", "pruned", clock)
            ratio = saving_ratio(measured, predicted)
            verdicts.append((measured, ratio, "PASS" if ratio >= PASS_FRACTION else "FAIL"))
        failures += verdicts[0][2] == "FAIL"
        kv = layout.kv_cache_report()
        kv_text = f"{np.mean(kv['kv_heads_after']):.1f}/{g.n_kv_heads}"
        (m_wall, r_wall, v_wall), (m_cpu, r_cpu, v_cpu) = verdicts
        print(f"{label:14} {int(pruned.sum()):>6} {kv_text:>8} {count_parameters(smaller) / 1e6:>6.1f}M "
              f"{ms['dense']:>8.0f} {ms['masked']:>9.0f} {ms['pruned']:>9.0f} "
              f"{times.paired_ratio('dense', 'masked'):>12.3f} {predicted:>9.3f} {m_wall:>8.3f} {r_wall:>11.2f} "
              f"{v_wall:>7} | {m_cpu:>13.3f} {r_cpu:>11.2f} {v_cpu:>7}")
        spread = {k: 1e3 * (max(v) - min(v)) for k, v in times.wall.items()}
        best = min(times.wall["masked"]) / min(times.wall["pruned"])
        print(f"{'':14} wall spread (max - min ms): " + ", ".join(f"{k} {v:.0f}" for k, v in spread.items())
              + f"; fastest masked / fastest pruned {best:.3f}")
    print(f"\ntiming took {time.perf_counter() - started:.0f} s. 'FLOP-pred' = dense / pruned FLOPs of the whole "
          f"forward ({dense_flops.total / 1e9:.1f} GFLOP dense, attention share "
          f"{dense_flops.attention / dense_flops.total:.0%}); 'measured' = masked / pruned time; 'saving/pred' = "
          f"measured time saving / predicted saving, PASS at >= {PASS_FRACTION:.2f} (exit status: wall clock). "
          f"'dense/masked' = dense time / masked time (masked speedup; 1.0 = zeroing saves nothing). 'KV/layer' = mean KV heads "
          f"per layer after pruning (expanded groups raise it).")

    if args.full:
        smaller, layout, pruned = pruned_models[next(iter(pruned_models))]
        print("\nfull report, uniform mask (analysis.compress.timing.measure):")
        report = measure(model, Cut.of_mask(pruned), threads=args.threads, repeats=max(3, args.repeats // 2),
                         decode_steps=16)
        for row in report.rows():
            print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
        print(f"  CPU ms: {report.cpu_ms}")
        print(f"  parameters {report.parameters}, file bytes {report.file_bytes}")
        print(f"  attention parameters {report.attention_parameters}; KV cache bytes after "
              f"{report.kv_bytes} (predicted {report.kv_bytes_predicted})")
        if report.skipped:
            print(f"  skipped: {report.skipped}")
    return 1 if failures or missed else 0


if __name__ == "__main__":
    sys.exit(main())
