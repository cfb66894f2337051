"""Benchmark: llama.cpp's Q8_0 as the CPU INT8 route, against the F32 GGUF of the same model (issue 35's
targets; a result, not a test).

The dense SmolLM2-135M is written by headscope's GGUF export at F32 and at Q8_0 (the Q8_0 file
self-checked as any export; headscope's writer quantizes every 2-D tensor to Q8_0 itself, the tied token
embedding / output tensor included: the format's embedding type applies only to the k-quants and Q4_x,
which llama.cpp's quantizer makes, so --embedding-types takes "auto" for Q8_0). Each Q8_0 file is compared with the F32 one by `analysis.compress.recover.quantize
.compare_gguf`, both run by llama.cpp on this CPU: top-1 agreement and perplexity ratio on --tokens
tokens of the evaluation split (windows of --window), file size, and prefill (--context tokens) and
decode (--decode tokens) speed in --rounds interleaved rounds after warm-up, per-round spread.

Targets (issue 35): agreement >= 0.95, perplexity <= 1.01x, prefill and decode >= 1.5x, file <= 0.27x.
The CPU features of the llama.cpp build in use are printed first (setup.sh builds it with GGML_NATIVE=OFF:
AVX2, FMA, F16C; a native build, e.g. `CMAKE_ARGS=-DGGML_NATIVE=ON pip install --target DIR
llama-cpp-python`, run with PYTHONPATH=DIR, uses what this CPU has).

Usage: nice -n 10 .venv/bin/python -m bench.bench_gguf_int8 [--tokens 16384] [--rounds 6] [--threads 2]
       [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from analysis.arch.models import load_model
from analysis.compress.export import export
from analysis.compress.recover.quantize import compare_gguf
from analysis.core.text import evaluation_text
from bench._timing import load_average

TARGETS = {"top1_agreement": (">=", 0.95), "perplexity_ratio": ("<=", 1.01), "size_ratio": ("<=", 0.27)}
SPEED_TARGET = 1.5


def build_features() -> str:
    """What the llama.cpp build in use was compiled for (its system info line)."""
    import llama_cpp
    info = llama_cpp.llama_print_system_info()
    return (info.decode() if isinstance(info, bytes) else str(info)).strip() + f" ({Path(llama_cpp.__file__).parent})"


def met(value: float, rule: tuple[str, float]) -> str:
    op, bound = rule
    ok = value >= bound if op == ">=" else value <= bound
    return f"{'met' if ok else 'NOT met'} ({op} {bound:g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--context", type=int, default=512, help="prefill tokens of the speed rounds")
    p.add_argument("--decode", type=int, default=32, help="decode steps of the speed rounds")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--embedding-types", dest="embedding_types", default="auto")
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    print(f"llama.cpp build: {build_features()}", flush=True)
    print(f"load average at start: {load_average()}", flush=True)
    loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
    g = loaded.geometry
    dense = np.zeros((g.n_layers, g.n_heads), bool)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-q8-") as tmp:
        f32 = export("gguf", loaded.model, dense, tmp, "f32", tokenizer=loaded.tokenizer, gguf_type="f32").path
        for emb in [e for e in args.embedding_types.split(",") if e]:
            q8 = export("gguf", loaded.model, dense, tmp, f"q8-{emb}", tokenizer=loaded.tokenizer, gguf_type="q8_0",
                        gguf_embedding_type=emb)
            print(f"[q8_0, embedding {emb}] {q8.checks[-1]['line'] if q8.checks else ''}", flush=True)
            c = compare_gguf(loaded, f32 / "model.gguf", q8.path / "model.gguf", evaluation_text(),
                             max_tokens=args.tokens, window=args.window, context=args.context,
                             decode_tokens=args.decode, rounds=args.rounds, threads=args.threads)
            rows[emb] = c
            s = c["speedups"]
            print(f"  {c['n_tokens']} tokens: top-1 agreement {c['top1_agreement']:.4f} "
                  f"{met(c['top1_agreement'], TARGETS['top1_agreement'])}; perplexity {c['perplexity_fp32']:.3f} -> "
                  f"{c['perplexity_int8']:.3f} = {c['perplexity_ratio']:.4f}x {met(c['perplexity_ratio'], TARGETS['perplexity_ratio'])}; "
                  f"file {c['size_ratio']:.3f}x {met(c['size_ratio'], TARGETS['size_ratio'])}", flush=True)
            for part in ("prefill", "decode"):
                r = s[part]
                print(f"  {part}: {c[f'{part}_tok_s_int8']:.1f} vs {c[f'{part}_tok_s_fp32']:.1f} tok/s = {r['median']:.2f}x "
                      f"(per round {r['min']:.2f}-{r['max']:.2f}, {r['rounds']} rounds) "
                      f"{'met' if r['median'] >= SPEED_TARGET else 'NOT met'} (>= {SPEED_TARGET}x)", flush=True)
    print(f"load average at end: {load_average()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"features": build_features(), "args": vars(args), "rows": rows,
                                              "load": load_average()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
