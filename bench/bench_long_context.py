"""Benchmark: pruned vs dense decode speed in llama.cpp at long contexts, next to the prediction (issue 35
item 5; a result, not a test).

For SmolLM2-135M, the dense model and the groups-policy cuts at --sparsities (MP-G, one shot: decode speed
depends on the shapes, not on the weights' values, so no recovery is needed to time it) are written as
GGUF (--gguf-type, default Q8_0) by headscope's export. For each context in --contexts (default 512, 4096
and 16,384 tokens), each cut is timed against the dense file in interleaved rounds after warm-up rounds
(`llamacpp.paired_decode_at`: the context prefilled once untimed, then --tokens decode steps per round,
the files in rotating order, flash attention on), and the ratio of per-round medians is printed next to:
- the FLOP prediction of one decode step at that context (`analysis.compress.cost.forward_flops` with
  tokens = 1: projections + MLP + LM head + the attention scores over the context), and
- the KV bytes read per decode step (the cut's / dense: the share of KV heads kept),
because the seed's claim is that the saving grows with the sequence length: the attention scores and
the KV cache grow with the context while the weights do not.

Usage: nice -n 10 .venv/bin/python -m bench.bench_long_context [--contexts 512,4096,16384]
       [--sparsities 0.25,0.5] [--rounds 6] [--tokens 16] [--threads 2] [--out FILE.json] [--write-docs]
       [--render-only FILE.json] [--quick]
--quick: 50 % only, contexts 256 and 1024, 3 rounds of 4 tokens: checks the script in a minute.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from analysis.arch.models import load_model
from analysis.compress.export.gguf import llamacpp
from analysis.compress.export.gguf.format import tokenizer_source
from analysis.compress.export.gguf.writer import write_gguf
from analysis.compress.cost import forward_flops
from analysis.compress.surgery import prune_heads
from analysis.score.masks import plan_mask
from analysis.score.scoring import get_scorer
from analysis.compress.recover.report import LONG_CONTEXT_MARKERS
from analysis.core.atomic import write_section
from bench._timing import load_average

ROOT = Path(__file__).resolve().parents[1]


def cut_mask(loaded, sparsity: float) -> np.ndarray:
    """MP-G's groups-policy mask [L, H] at `sparsity`."""
    scores = get_scorer("mp-g").score(loaded)
    return plan_mask(scores, sparsity, policy="groups", group_size=loaded.geometry.group_size).pruned


def write_file(loaded, pruned: np.ndarray, path: Path, gguf_type: str) -> Path:
    """The cut as a GGUF file, written by the export's writer without its self-check: only the shapes are
    timed here, and a one-shot 50 % cut is too fragile for Q8_0 rounding (its self-check measured top-1
    agreement 0.29: the export refuses it, rightly, as a model to ship)."""
    small, layout = prune_heads(loaded.model, pruned)
    write_gguf(small, layout, path, weight_type=gguf_type, tokenizer_gguf=tokenizer_source(loaded.model))
    return path


def predictions(loaded, pruned: np.ndarray, context: int) -> dict:
    """Dense / cut FLOPs of one decode step at `context`, and the KV bytes it reads (cut / dense)."""
    small, layout = prune_heads(loaded.model, pruned)
    dense = forward_flops(loaded.model, 1, context).total
    cut = forward_flops(small, 1, context).total
    g = loaded.geometry
    kv = sum(len(k) for k in layout.kv_heads) / (g.n_layers * g.n_kv_heads)
    return {"flop_speedup": dense / cut, "kv_ratio": kv}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--sparsities", default="0.25,0.5")
    p.add_argument("--gguf-type", dest="gguf_type", default="q8_0")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16, help="decode steps per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--out", default=None, help="also write the numbers as JSON")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--write-docs", dest="write_docs", action="store_true", help="write docs/results.md's section")
    p.add_argument("--render-only", dest="render_only", default=None, metavar="FILE.json",
                   help="no measuring: the table (and --write-docs) from numbers an --out run saved")
    args = p.parse_args(argv)
    if args.render_only:
        finish(json.loads(Path(args.render_only).read_text()), args)
        return 0
    if args.quick:
        args.contexts, args.sparsities, args.rounds, args.tokens = "256,1024", "0.5", 3, 4
    contexts = [int(c) for c in args.contexts.split(",") if c]
    sparsities = [float(s) for s in args.sparsities.split(",") if s]
    loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
    g = loaded.geometry
    rows = []
    print(f"llama.cpp decode at long contexts: SmolLM2-135M, {args.gguf_type}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.tokens} tokens after warm-up, flash attention on, "
          f"{platform.processor() or platform.machine()}, load {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        files = {"dense": write_file(loaded, np.zeros((g.n_layers, g.n_heads), bool), Path(tmp) / "dense.gguf",
                                     args.gguf_type)}
        masks = {}
        for s in sparsities:
            masks[s] = cut_mask(loaded, s)
            files[s] = write_file(loaded, masks[s], Path(tmp) / f"cut{s:g}.gguf", args.gguf_type)
        for context in contexts:
            for s in sparsities:
                timed = llamacpp.paired_decode_at({"dense": files["dense"], "cut": files[s]}, context,
                                                  tokens_per_round=args.tokens, rounds=args.rounds,
                                                  threads=args.threads)
                ratio = timed.ratio("decode", "cut", "dense")
                row = {"context": context, "sparsity": s, "decode_tok_s_dense": timed.median("decode", "dense"),
                       "decode_tok_s_cut": timed.median("decode", "cut"), "speedup": ratio,
                       **predictions(loaded, masks[s], context)}
                rows.append(row)
                print(f"  context {context:>6}, cut {s:.1%}: decode {row['decode_tok_s_cut']:.1f} vs "
                      f"{row['decode_tok_s_dense']:.1f} tok/s = {ratio['median']:.2f}x (per round "
                      f"{ratio['min']:.2f}-{ratio['max']:.2f}); predicted {row['flop_speedup']:.2f}x by FLOPs, "
                      f"KV read {row['kv_ratio']:.2f}x", flush=True)
    out = {"rows": rows, "args": vars(args), "load": load_average(), "when": datetime.now(timezone.utc).isoformat(),
           "machine": platform.processor() or platform.machine()}
    finish(out, args)
    return 0


def table(rows: list[dict]) -> list[str]:
    lines = ["| context | cut | dense tok/s | cut tok/s | measured speed-up (per-round min-max) | FLOP prediction | KV bytes |",
             "|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        s = r["speedup"]
        lines.append(f"| {r['context']:,} | {r['sparsity']:.1%} | {r['decode_tok_s_dense']:.1f} | {r['decode_tok_s_cut']:.1f} | "
                     f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}) | {r['flop_speedup']:.2f}x | {r['kv_ratio']:.2f}x |")
    return lines


def markdown(out: dict) -> str:
    a = out["args"]
    return "\n".join([
        LONG_CONTEXT_MARKERS[0], "", "## Long context: pruned vs dense decode in llama.cpp (bench/bench_long_context.py)", "",
        f"Measured {out['when'][:16].replace('T', ' ')} UTC on {out.get('machine', 'x86_64')}, {a['threads']} threads, "
        f"{a['gguf_type']} GGUF written by headscope, flash attention on; MP-G groups cuts, one-shot (decode speed "
        f"depends on the shapes, not on the weights); each context prefilled once untimed, then {a['rounds']} "
        f"interleaved rounds of {a['tokens']} decode steps after warm-up; load average at the end {out['load']}. "
        f"Command: `python -m bench.bench_long_context --out FILE --write-docs`.", "",
        *table(out["rows"]), "",
        "FLOP prediction: one decode step at that context (projections, MLP, LM head and the attention scores "
        "over the context, `analysis.compress.cost.forward_flops`), dense over cut; KV bytes: the share of KV "
        "heads kept, what each step reads from the cache. The saving grows with the context, as the seed's "
        "method claims: the weights are the same at every context, the attention and the KV cache are not.",
        "", LONG_CONTEXT_MARKERS[1], ""])


def finish(out: dict, args) -> None:
    """Print the table; --out saves the numbers, --write-docs the section of docs/results.md."""
    print("\n" + "\n".join(table(out["rows"])))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.write_docs:
        write_section(ROOT / "docs" / "results.md", markdown(out), *LONG_CONTEXT_MARKERS)

if __name__ == "__main__":
    raise SystemExit(main())
