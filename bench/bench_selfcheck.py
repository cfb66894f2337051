"""Benchmark: what the self-check measures on correct files of the built-in SmolLM2 (a result, not a test).

Every lossy export of the dense model (INT8 ONNX by both methods, GGUF at every type below F32) is
written and self-checked as a user's export would be; prints each check's line and how long the export
and its check took, so that the floors in analysis/compress/export/selfcheck.py can be compared with
what correct files of a small (hard to quantize) model keep (docs/EXPORT.md, "Self-check").

Usage: nice -n 10 .venv/bin/python -m bench.bench_selfcheck [--cache-dir DIR] [--types q8_0,q4_k_m,...]
       [--onnx dynamic,weight-only]
"""
from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from analysis.arch.models import load_model
from analysis.compress.export import export
from analysis.compress.export.gguf.writer import WEIGHT_TYPES
from bench._timing import load_average


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--types", default=",".join(t for t, spec in WEIGHT_TYPES.items() if spec[2] < 32))
    p.add_argument("--onnx", default="dynamic,weight-only")
    args = p.parse_args()
    loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
    pruned = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool)
    jobs = [("onnx-int8", {"int8_method": m}) for m in args.onnx.split(",") if m]
    jobs += [("gguf", {"gguf_type": t}) for t in args.types.split(",") if t]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-selfcheck-") as root:
        for i, (fmt, options) in enumerate(jobs):
            start = time.perf_counter()
            result = export(fmt, loaded.model, pruned, root, f"e{i}", tokenizer=loaded.tokenizer, **options)
            seconds = time.perf_counter() - start
            for check in result.checks:
                print(check["line"], f"({seconds:.0f} s for the export and its check)", flush=True)
            last = result.checks[-1]
            rows.append((fmt, options, last, seconds))
    print(f"\nload average {load_average()}")
    print("| file | top-1 agreement | perplexity | floor | export + check |\n|---|---:|---:|---|---:|")
    for fmt, options, c, seconds in rows:
        what = f"{fmt} {next(iter(options.values()))}"
        print(f"| {what} | {c['agreement']:.3f} | {c['perplexity_ratio']:.3f}x | "
              f"{c['floor']['agreement']:.2f} / {c['floor']['perplexity_ratio']:.2f}x | {seconds:.0f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
