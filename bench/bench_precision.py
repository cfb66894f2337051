"""Benchmark: perplexity throughput of SmolLM2 in bfloat16 vs float32, and offloaded vs in-memory.

Same tokens (the first --tokens of the built-in evaluation text), same evaluator, one process;
the contenders alternate every round (`bench/_timing.alternate_times`) so machine load hits all
alike, and medians are compared. "offloaded" is float32 placed by accelerate with
--offload-mib of CPU budget (the other blocks read from an offload folder on every forward).

    .venv/bin/python -m bench.bench_precision [--tokens 512] [--repeats 3] [--offload-mib 420]
No target: bfloat16 speed on a CPU depends on its bfloat16 units (AVX512-BF16 / AMX), which this
script reports from /proc/cpuinfo; the perplexities are printed next to the times.
"""
import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._timing import alternate_times, compare  # noqa: E402


def cpu_bf16_units() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(found) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--offload-mib", dest="offload_mib", type=int, default=420)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    import torch
    from analysis.measure.evaluation import CausalPerplexity, token_ids
    from analysis.arch.models import load_model
    from analysis.core.text import evaluation_text

    with tempfile.TemporaryDirectory(prefix="headscope-offload-") as folder:
        models = {"float32": load_model("smollm2-135m"),
                  "bfloat16": load_model("smollm2-135m", dtype="bfloat16"),
                  "offloaded": load_model("smollm2-135m", max_memory=f"cpu={args.offload_mib}MiB",
                                          offload_folder=folder)}
        disk = sum(1 for v in models["offloaded"].model.hf_device_map.values() if v == "disk")
        ids = token_ids(models["float32"].tokenizer, evaluation_text(), max_tokens=args.tokens)   # [N]
        ev = CausalPerplexity(batch_size=args.batch_size)
        print(f"SmolLM2-135M, {ids.numel()} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"CPU bfloat16 units: {cpu_bf16_units()}; offloaded: {disk} modules on the disk "
              f"(cpu budget {args.offload_mib} MiB)")
        values = {}

        def run(name):
            def call():
                values[name] = float(ev.measure(models[name].model, ids).value)
            return call

        times = alternate_times({name: run(name) for name in models}, args.repeats, collect=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    for name in models:
        print(f"{name:>10}: {ids.numel() / median[name]:8.1f} tokens/s  (median {median[name]:.2f} s of "
              f"{args.repeats}), perplexity {values[name]:.4f}")
    # the ratios from interleaved pairs (bench/_timing.compare), judged on their medians
    for other in ("bfloat16", "offloaded"):
        cmp = compare({"float32": run("float32"), other: run(other)}, min_pairs=args.repeats,
                      max_pairs=4 * args.repeats + 1, collect=True)
        cmp.report(f"{other} vs float32, seconds per evaluation (float32 / {other} = {other}'s throughput gain)",
                   unit=1.0, unit_name="s")
    print(f"perplexity ratio bfloat16 / float32 {values['bfloat16'] / values['float32']:.4f}; offloaded equals "
          f"in-memory: {values['offloaded'] == values['float32']}")


if __name__ == "__main__":
    main()
