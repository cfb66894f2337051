"""Benchmark: `analysis.measure.evaluation` perplexity vs the plain Hugging Face loop, on SmolLM2.

Same tokens (the first --tokens of the built-in evaluation text), same windows (--window,
--stride), same model, one process, runs alternating (HF, ours, ours, HF, ...) so both see the
same machine load; medians are compared. The plain loop is the perplexity guide's: one window
per forward with labels (-100 on the overlap), the model's own loss. Ours batches windows of
the same shape and computes logits only at the scored positions (`logits_to_keep`).

    .venv/bin/python -m bench.bench_perplexity [--tokens 1024] [--window 256] [--stride 128]
Target: throughput ratio ours / HF >= 1.0 with the same perplexity (relative difference <= 1e-4).
"""
import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._timing import compare  # noqa: E402

TARGET = 1.0


def hf_loop(model, ids, window: int, stride: int) -> float:
    """The HF perplexity guide's loop over ids [N] (the reference the tests also use)."""
    from tests._evalkit import hf_loop_perplexity
    return hf_loop_perplexity(model, ids, window, stride)[0]


def main(argv=None, lm=None) -> bool:
    """Run the comparison (argv: the options above; lm: a LoadedModel to use instead of SmolLM2 on
    the CPU, e.g. on a GPU from bench/gpu_check.py). Returns whether it passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    from analysis.measure.evaluation import CausalPerplexity, token_ids
    from analysis.arch.models import load_model
    from analysis.core.text import evaluation_text

    lm = lm or load_model("smollm2-135m")
    ids = token_ids(lm.tokenizer, evaluation_text(), max_tokens=args.tokens)               # [N]
    device_ids = ids.to(next(lm.model.parameters()).device)                                # the HF loop's input
    ours = CausalPerplexity(window=args.window, stride=args.stride, batch_size=args.batch_size)
    n_windows = len(ours.plan(lm.model, ids.numel()))
    print(f"{lm.name}, {ids.numel()} tokens, window {args.window}, stride {args.stride}: "
          f"{n_windows} windows, batch {args.batch_size}")

    values = {}

    def hf():
        values["hf"] = hf_loop(lm.model, device_ids, args.window, args.stride)

    def mine():
        values["ours"] = ours.measure(lm.model, ids).value

    # interleaved pairs (bench/_timing.compare); throughput ours / HF = time HF / time ours per pair
    cmp = compare({"HF loop": hf, "ours": mine}, min_pairs=args.repeats, max_pairs=4 * args.repeats + 1)
    cmp.report("perplexity: HF loop vs ours (seconds per evaluation)", unit=1.0, unit_name="s",
               target=f">= {TARGET}x")
    n = ids.numel() - 1
    rel = abs(values["ours"] - values["hf"]) / values["hf"]
    print(f"HF loop : median {n / statistics.median(cmp.times['HF loop']):7.1f} tokens/s  perplexity {values['hf']:.5f}")
    print(f"ours    : median {n / statistics.median(cmp.times['ours']):7.1f} tokens/s  perplexity {values['ours']:.5f}")
    ratio = cmp.ratio
    ok = ratio >= TARGET and rel <= 1e-4
    print(f"throughput ours / HF = {ratio:.2f}x (median of {len(cmp.ratios)} interleaved pairs; target >= {TARGET}x), "
          f"perplexity rel. diff {rel:.1e} -> {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    main()
