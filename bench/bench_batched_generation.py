"""Benchmark: the harness's generations batched vs one prompt at a time, rows per minute at 4,096 tokens (issue 52
item 6; a result, not a test).

What runs: RULER's niah_single_1 test rows (analysis.measure.ruler.build_ruler, --rows of them at --length
tokens, seed 0) on the built-in `smollm2-135m` (analysis.arch.models.load_model, float32), through the harness
bridge (analysis.measure.harness.run_harness: the harness's prompts, stop rules and scoring) twice in one
process, side by side: generation_batch=1 (one prompt at a time, what RULER's report runs) and
generation_batch=--batch (the rows left padded in one batch, analysis.measure.decode_rows). Each side's wall
seconds are the whole run_harness call (generation dominates; the scoring of 8 rows is milliseconds); rows per
minute = rows / seconds x 60. The check: every generated text is identical on both sides (exit 1 otherwise), and
so is the score. Each side also reports its summed per-row prefill and decode seconds (a batch's rows record
their share of the batch's: analysis.measure.decode_rows).

Usage: nice -n 10 .venv/bin/python -m bench.bench_batched_generation [--rows 8] [--length 4096] [--batch 8]
       [--threads 2] [--order batched-first] [--out FILE.json]

Measured (2026-12-08 00:48-01:03 UTC, this repository's shared 2-core CPU machine, torch 2.13 CPU, transformers
5.23, float32, sdpa, 2 threads, `nice -n 10`, --rows 8 --batch 8, one-at-a-time side first; one run; other work
was running: `uptime` load average 6.18 / 4.94 / 3.60 before, 8.93 / 7.65 / 6.12 after, on 2 cores):

    8 rows of niah_single_1 at 4096 tokens (prompts 3829-3838 tokens), smollm2-135m
     generation_batch  seconds  rows/min  prefill s  decode s new tokens  score
                    1    506.7      0.95      274.2     231.2        106  {'4096': 1.0}
                    8    381.2      1.26      266.7     102.9        106  {'4096': 1.0}
    batched / one at a time: 1.33x rows per minute; texts identical: True

The batch pays in the decode steps (231 -> 103 s summed over rows: one forward feeds every unfinished row);
the prefill is each prompt alone in both (analysis.measure.decode_rows: a padded 4k prefill measured 60 s vs 38 s
per row for 2 rows on this CPU, sdpa off its causal fast path). RULER's answers are short (13 tokens a row), so
on this CPU the prefill bounds the gain; longer answers, or a GPU where a decode step of 8 rows costs about one
row's, gain more. With a load of 6-9 on 2 cores the seconds are noisy; the ratio held on a smaller smoke run
(2 rows: 1.13x with the padded batch prefill of that time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _run(loaded, rows, batch: int) -> dict:
    """One harness run of the rows with `batch` prompts generated together: its texts (doc order), score, wall
    seconds and the summed per-row prefill / decode seconds and new tokens."""
    from analysis.measure.harness import run_harness
    task = rows.tasks[0]
    start = time.perf_counter()
    run = run_harness(loaded.model, loaded.tokenizer, rows.prepared, batch_size=1, keep_samples=True,
                      generation_batch=batch)
    seconds = time.perf_counter() - start
    samples = sorted(run.samples[task], key=lambda s: s["doc_id"])
    gens = run.generations[task]
    return dict(batch=batch, generation_batch=run.generation_batch, seconds=seconds,
                rows_per_minute=len(samples) / seconds * 60.0, texts=[s["generation"] for s in samples],
                score={m: v for m, (v, _) in run.metrics[task].items()},
                prefill_s=sum(g["prefill_s"] for g in gens), decode_s=sum(g["decode_s"] for g in gens),
                new_tokens=sum(g["new_tokens"] for g in gens),
                prompt_tokens=[g["prompt_tokens"] for g in gens])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--order", choices=("batched-first", "one-first"), default="one-first")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from analysis.arch.models import load_model
    from analysis.measure.ruler import build_ruler
    from bench._timing import load_average
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype="float32")
    rows = build_ruler([args.task], loaded.tokenizer, (args.length,), samples=args.rows, seed=0)
    load_before = load_average()
    sides = (1, args.batch) if args.order == "one-first" else (args.batch, 1)
    runs = {batch: _run(loaded, rows, batch) for batch in sides}
    load_after = load_average()
    one, batched = runs[1], runs[args.batch]
    same = one["texts"] == batched["texts"]
    out = dict(model=args.model, task=args.task, rows=args.rows, length=args.length, threads=args.threads,
               attention=loaded.model.config._attn_implementation, load_before=load_before, load_after=load_after,
               identical_texts=same, speedup=batched["rows_per_minute"] / one["rows_per_minute"],
               runs={str(k): {n: v for n, v in r.items() if n != "texts"} for k, r in runs.items()},
               texts=one["texts"])
    print(f"{args.rows} rows of {args.task} at {args.length} tokens (prompts {min(one['prompt_tokens'])}-"
          f"{max(one['prompt_tokens'])} tokens), {args.model}, {args.threads} threads, load {load_before} -> "
          f"{load_after}")
    print(f"{'generation_batch':>17} {'seconds':>8} {'rows/min':>9} {'prefill s':>10} {'decode s':>9} "
          f"{'new tokens':>10}  score")
    for r in runs.values():
        print(f"{r['generation_batch']:>17} {r['seconds']:>8.1f} {r['rows_per_minute']:>9.2f} {r['prefill_s']:>10.1f} "
              f"{r['decode_s']:>9.1f} {r['new_tokens']:>10}  {r['score']}")
    print(f"batched / one at a time: {out['speedup']:.2f}x rows per minute; texts identical: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if same and one["score"] == batched["score"] else 1


if __name__ == "__main__":
    sys.exit(main())
