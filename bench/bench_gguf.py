"""Benchmark: SmolLM2-135M in llama.cpp, dense vs head-pruned + distilled GGUF files (the "edge" results).

    nice -n 10 .venv/bin/python -m bench.bench_gguf [--cache-dir DIR] [--recovery-steps 36]
        [--recovery-minutes 2.5] [--ppl-tokens 512] [--threads 1] [--out results.json] [--quick] [--write-docs]

1. The edge table: the built-in Q4_1 file, SmolLM2 dense, and the pruned + distilled models of the
   pipeline (analysis.compress.recover.pipeline.run_pipeline: MP-G, one round to the target, then
   --recovery-steps distillation steps capped at --recovery-minutes; policies "groups" and
   "balanced", 12.5 / 25 / 50 %) written by headscope's GGUF export at Q8_0 and Q4_K_M. Per file
   (analysis.compress.export.gguf.deploy.measure_gguf, all measured by llama.cpp): file size, perplexity on the
   first --ppl-tokens tokens of the built-in evaluation split (headscope's evaluator's ids; the
   pipeline's own PyTorch perplexity of the same ids next to it), prefill and decode tokens/s at
   --speed-context tokens of context, KV cache at 4096 and 8192 tokens.
2. Speed vs context: dense vs groups-50% (distilled) at Q8_0, prefill of 512 and 4096 tokens and
   decode of 8 tokens after them, timed in interleaved pairs by bench/_timing.compare (min / median /
   max of each side and of the per-pair ratio, load average), next to the FLOP prediction of
   analysis.compress.cost.forward_flops (whole forward: projections + MLP + LM head + causal scores), the
   seed's claim being that the saving grows with the context.
Timing: llama.cpp at a fixed thread count; on a shared machine the tokens/s are noisy (the ratios of
interleaved pairs less so).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


from analysis.arch.models import load_model                                      # noqa: E402
from analysis.compress.export.gguf import llamacpp
from analysis.compress.export.gguf.deploy import gguf_facts, measure_gguf                    # noqa: E402
from analysis.compress.recover.distill import DistillConfig                              # noqa: E402
from analysis.compress.export.gguf.writer import source_gguf, write_gguf                # noqa: E402
from analysis.compress.recover.pipeline import PipelineConfig, run_pipeline              # noqa: E402
from analysis.compress.cost import forward_flops                                 # noqa: E402
from analysis.compress.surgery import prune_heads                                # noqa: E402
from analysis.measure.evaluation import default_text, token_ids                  # noqa: E402
from bench._timing import compare, load_average                                  # noqa: E402

SPARSITIES = (0.125, 0.25, 0.5)
POLICIES = ("groups", "balanced")
# (weight type, token embedding type): the third is Q4_K_M with llama.cpp's token_embedding_type /
# output_tensor_type set to Q4_0 (its own choice for SmolLM2's tied 576-wide embedding is Q8_0)
TYPES = (("q8_0", "auto"), ("q4_k_m", "auto"), ("q4_k_m", "q4_0"))
SPEED_CONTEXTS = (512, 4096)
DECODE_TOKENS = 8


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def pipeline_config(args, sparsity: float, policy: str) -> PipelineConfig:
    """One round to the target (MP-G), then the small recovery budget of this bench."""
    distill = DistillConfig(steps=args.recovery_steps, lr=args.lr, batch_size=4, seq_len=128, warmup_steps=2,
                            temperature=1.0, precision="auto", max_seconds=60 * args.recovery_minutes)
    return PipelineConfig(target_sparsity=sparsity, step=sparsity, recovery_steps=args.recovery_steps,
                          policy=policy, eval_tokens=args.ppl_tokens, distill=distill)


def build_cuts(lm, args):
    """Yields (name, physically pruned model, layout, facts of the pipeline run), "dense" first; one
    cut at a time (each pipeline run keeps a full-shape model of its own)."""
    g = lm.geometry
    yield ("dense", *prune_heads(lm.model, np.zeros((g.n_layers, g.n_heads), bool)), {"n_pruned": 0})
    for policy in POLICIES:
        for s in (SPARSITIES[-1:] if args.quick else SPARSITIES):
            t0 = time.perf_counter()
            result = run_pipeline(lm, pipeline_config(args, s, policy))
            r = result.rounds[-1]
            small, layout = result.smaller(share=False)
            info = {"n_pruned": int(result.pruned.sum()), "policy": result.config.policy,
                    "headscope_ppl_cut": r.metric_cut, "headscope_ppl": r.metric, "steps": len(r.history),
                    "recovery_s": r.recovery_seconds, "precision": r.precision,
                    "pipeline_s": time.perf_counter() - t0}
            del result
            print(json.dumps({"cut": f"{policy}-{s:g}", **info}), flush=True)
            yield f"{policy}-{s:g}", small, layout, info


def _speed_fns(llm, context: int, rng) -> tuple:
    """(prefill of `context` tokens, decode of DECODE_TOKENS after them) as callables on a loaded Llama;
    decode rewinds the KV cache to the prompt first (Llama.eval drops everything after n_tokens)."""
    prompt = rng.integers(4, llm.n_vocab(), size=context).tolist()
    steps = rng.integers(4, llm.n_vocab(), size=DECODE_TOKENS).tolist()

    def prefill():
        llm.reset()
        llm.eval(prompt)

    def decode():
        if llm.n_tokens < context:
            prefill()
        llm.n_tokens = context
        for token in steps:
            llm.eval([token])

    return prefill, decode


def speed_vs_context(lm, dense_path: Path, cut_path: Path, small, args) -> list[dict]:
    out = []
    for context in SPEED_CONTEXTS:
        llms = {k: llamacpp.load(p, n_ctx=context + DECODE_TOKENS + 8, logits_all=False, threads=args.threads,
                                 n_batch=min(context, 512)) for k, p in (("dense", dense_path), ("pruned", cut_path))}
        fns = {k: _speed_fns(llm, context, np.random.default_rng(0)) for k, llm in llms.items()}
        pairs = dict(min_pairs=5, max_pairs=15, max_seconds=90.0) if context <= 512 else \
            dict(min_pairs=3, max_pairs=5, max_seconds=60.0)
        row = {"context": context}
        for part, index in (("prefill", 0), ("decode", 1)):
            c = compare({"dense": fns["dense"][index], "pruned": fns["pruned"][index]}, **pairs)
            c.report(f"{part} at context {context}, dense / pruned seconds (> 1 = pruned faster)")
            n = context if part == "prefill" else DECODE_TOKENS
            row[part] = {"speedup": c.ratio, "speedup_min": min(c.ratios), "speedup_max": max(c.ratios),
                         "pairs": len(c.ratios), "converged": c.converged,
                         "dense_tok_s": n / float(np.median(c.times["dense"])),
                         "pruned_tok_s": n / float(np.median(c.times["pruned"])),
                         **{f"{k}_s": [min(c.times[k]), float(np.median(c.times[k])), max(c.times[k])]
                            for k in ("dense", "pruned")},
                         "load": [c.load_before, c.load_after]}
        del llms
        pre_dense = forward_flops(lm.model, context, context, logits=1)      # llama.cpp's prefill: the last logits
        pre_cut = forward_flops(small, context, context, logits=1)
        dec_dense, dec_cut = forward_flops(lm.model, 1, context), forward_flops(small, 1, context)
        row["prefill_flop_speedup"] = pre_dense.total / pre_cut.total
        row["decode_flop_speedup"] = dec_dense.total / dec_cut.total
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON results here")
    parser.add_argument("--cache-dir", default=None, help="headscope cache holding the converted SmolLM2")
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (1 on a shared machine: with 2 threads on 2 busy cores its "
                             "barriers spin and decode collapses to <1 tok/s)")
    parser.add_argument("--speed-context", type=int, default=512, help="context of the edge table's tokens/s")
    parser.add_argument("--ppl-tokens", type=int, default=512,
                        help="evaluation tokens of both perplexities (llama.cpp's and the pipeline's)")
    parser.add_argument("--recovery-steps", type=int, default=36, help="distillation steps per cut")
    parser.add_argument("--recovery-minutes", type=float, default=2.5, help="most minutes of distillation per cut")
    parser.add_argument("--lr", type=float, default=2e-4, help="distillation learning rate")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of the distillation (1 on a shared 2-core machine: two processes "
                             "with 2 spinning threads each ran a step in ~44 s instead of ~4 s)")
    parser.add_argument("--quick", action="store_true", help="only 50%% cuts")
    parser.add_argument("--write-docs", action="store_true", help="put the tables into docs/results.md's edge section")
    parser.add_argument("--from-json", default=None,
                        help="render the tables from numbers saved by --out (nothing is measured)")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows, speed, wall = saved["edge"], saved["speed"], saved["wall_s"]
        args = argparse.Namespace(**{**vars(args), **saved["args"]})
    else:
        rows, speed, wall = measure_all(args)
    for line in table_lines(rows, speed, args):
        print(line)
    if args.write_docs:
        write_docs(rows, speed, args, wall)
    return 0


def measure_all(args) -> tuple[list[dict], list[dict], float]:
    import torch
    torch.set_num_threads(args.torch_threads)
    started = time.perf_counter()
    lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
    ids = token_ids(lm.tokenizer, default_text(), max_tokens=args.ppl_tokens).tolist()
    work = Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    print(f"files in {work}", flush=True)
    tok = source_gguf("smollm2-135m")
    measure = dict(threads=args.threads, speed_context=args.speed_context, decode_tokens=DECODE_TOKENS, repeats=1,
                   window=min(512, args.ppl_tokens))
    rows = [{"model": "built-in Q4_1 (dense)", "type": "q4_1", **measure_gguf(tok, ids, **measure)}]
    print(json.dumps(rows[-1]), flush=True)
    speed_cut = None
    for name, smaller, layout, info in build_cuts(lm, args):
        if name == "groups-0.5":
            speed_cut = smaller
        for t, emb in TYPES:
            path = work / f"{name}-{t}{'' if emb == 'auto' else '-emb-' + emb}.gguf"
            t0 = time.perf_counter()
            write_gguf(smaller, layout, path, weight_type=t, tokenizer_gguf=tok, name=f"smollm2-135m {name}",
                       embedding_type=emb)
            row = {"model": name, "type": t if emb == "auto" else f"{t}, embedding {emb}", **info, "write_s": time.perf_counter() - t0,
                   "heads_per_layer": gguf_facts(path)["head_counts"], **measure_gguf(path, ids, **measure)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    speed = speed_vs_context(lm, work / "dense-q8_0.gguf", work / "groups-0.5-q8_0.gguf", speed_cut, args)
    wall = time.perf_counter() - started
    print(f"\nwall {wall:.0f} s, load average {load_average()}", flush=True)
    if args.out:
        settings = {**{k: v for k, v in vars(args).items() if k not in ("out", "write_docs", "from_json")},
                    "argv": " ".join(sys.argv[1:])}
        Path(args.out).write_text(json.dumps({"edge": rows, "speed": speed, "wall_s": wall, "args": settings},
                                             indent=1))
    return rows, speed, wall


def table_lines(rows: list[dict], speed: list[dict], args) -> list[str]:
    lines = [f"| model | type | heads | file MiB (MB) | token_embd | llama.cpp ppl | headscope ppl (one-shot -> distilled) "
             f"| prefill tok/s @{args.speed_context} | decode tok/s | KV MiB @4096 | KV MiB @8192 |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        hs = (f"{r['headscope_ppl_cut']:.2f} -> {r['headscope_ppl']:.2f} ({r['steps']} steps, {r['recovery_s']:.0f} s)"
              if "headscope_ppl" in r else "")
        lines.append(f"| {r['model']} | {r['type']} | {r['heads']} | {_mib(r['bytes'])} ({r['bytes'] / 1e6:.1f}) | "
                     f"{r.get('embedding_type')} | {r['perplexity']:.2f} | {hs} | "
                     f"{r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} | {r['kv_mib_4096']:.1f} | "
                     f"{r['kv_mib_8192']:.1f} |")
    lines += ["", "| context | part | dense s: min / median / max | pruned s: min / median / max "
              "| dense/pruned time: min / median / max (pairs) | FLOP-predicted | load average before ; after |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for sp in speed:
        for part in ("prefill", "decode"):
            r = sp[part]
            sides = {k: " / ".join(f"{x:.3g}" for x in r[f"{k}_s"]) if f"{k}_s" in r else "" for k in ("dense", "pruned")}
            load = " ; ".join("/".join(f"{x:.2f}" for x in avg) for avg in r["load"])
            lines.append(f"| {sp['context']} | {part} | {sides['dense']} | {sides['pruned']} | "
                         f"{r['speedup_min']:.2f} / **{r['speedup']:.2f}** / {r['speedup_max']:.2f} ({r['pairs']}) | "
                         f"{sp[part + '_flop_speedup']:.2f} | {load} |")
    return lines


def goal_line(rows: list[dict]) -> str:
    """What the rows say about the goal "a pruned Q4_K_M under 85 MB" (decimal megabytes)."""
    def smallest(kind):
        found = [r for r in rows if r["model"] not in ("dense",) and not r["model"].startswith("built-in")
                 and r["type"] == kind]
        return min(found, key=lambda r: r["bytes"]) if found else None
    parts = []
    for kind, label in (("q4_k_m", "plain Q4_K_M"), ("q4_k_m, embedding q4_0", "Q4_K_M with a Q4_0 embedding")):
        r = smallest(kind)
        if r is not None:
            under = [x["model"] for x in rows if x["type"] == kind and x["model"] != "dense" and x["bytes"] < 85e6]
            parts.append(f"{label}: smallest pruned file {r['bytes'] / 1e6:.1f} MB ({r['model']}); under 85 MB: "
                         f"{', '.join(under) if under else 'none'}")
    return "Goal \"a pruned Q4_K_M under 85 MB\": " + "; ".join(parts) + "."


def write_docs(rows: list[dict], speed: list[dict], args, wall: float) -> None:
    from analysis.compress.recover.report import EDGE_MARKERS
    from analysis.core.atomic import write_section
    argv = getattr(args, "argv", None) or " ".join(sys.argv[1:])
    argv += "" if "--write-docs" in argv else " --write-docs"
    n_tok = rows[0]["n_tokens"]
    lines = [EDGE_MARKERS[0], "## Edge: SmolLM2 in llama.cpp (bench/bench_gguf.py)", "", "Regenerated by:", "",
             "```", f"nice -n 10 .venv/bin/python -m bench.bench_gguf {argv}".rstrip(), "```", "",
             "Every number in the first table is measured by llama.cpp (llama-cpp-python 0.3.36, CPU, "
             f"{args.threads} thread(s)) on GGUF files written by headscope's gguf export; perplexity on the first "
             f"{args.ppl_tokens} tokens of the built-in evaluation split ({n_tok} scored tokens; headscope's "
             "evaluator's ids and windows), KV cache as llama.cpp allocates it (f16, flash attention). The cuts are "
             "the **pipeline's pruned + distilled models** (`run_pipeline`: MP-G z = 2, one round to the target, "
             f"then a deliberately small recovery budget: at most {args.recovery_steps} distillation steps of 4 x 128 "
             f"tokens, lr {args.lr:g}, T = 1, capped at {args.recovery_minutes:g} minutes per cut, so the whole run fits "
             f"in ~40 minutes on a shared 2-core machine; this run took {wall / 60:.0f} minutes). \"headscope ppl\" is "
             "the pipeline's own PyTorch perplexity of the same ids, right after the cut and after the recovery "
             "(llama.cpp's number for the Q8_0 file should sit next to the distilled one). The recovery is far from "
             "converged: docs/results.md's recovery section shows what 300 steps do. Tokens/s come from a shared "
             "2-core machine with other work running: the first table's tokens/s are one timed run per file after one "
             "warm-up (noisy: under a load average of 5 to 8 a single run can halve, e.g. the decode columns; read them "
             "as indicative, the paired ratios below are the speed result).", ""]
    lines += table_lines(rows, [], args)[:len(rows) + 2]
    lines += ["", "Pruned (groups 50%, distilled) vs dense, both Q8_0: dense time / pruned time of the same work "
              f"(> 1 = pruned faster; prefill of the context, then decode of {DECODE_TOKENS} tokens after it), timed in "
              "interleaved pairs (bench/_timing.compare, median in bold), next to the FLOP prediction of the whole "
              "forward (analysis.compress.cost.forward_flops). Pairs: 5 to 15 at 512 tokens (stopped at 90 s), 3 to 5 at "
              "4096 (stopped at 60 s): at 4096 tokens one prefill takes 1 to 2 minutes here, so the 4096 ratios rest on "
              "3 to 4 pairs and their spread is not settled; the load average (before ; after) says how busy the machine "
              "was:", ""]
    lines += table_lines([], speed, args)[3:]
    lines += ["", "Notes: " + goal_line(rows) + " SmolLM2's width 576 is not a multiple of the k-quants' 256-value "
              "super-block, so llama.cpp's quantizer falls back for most tensors at Q4_K_M and stores the tied "
              "embedding as Q8_0 (the types are listed in docs/EXPORT.md, \"Q4_K_M on SmolLM2\"); the rows "
              "\"q4_k_m, embedding q4_0\" are the same Q4_K_M mix with llama.cpp's token_embedding_type / "
              "output_tensor_type set to Q4_0 (the gguf format's `gguf_embedding_type` option): still a Q4_K_M file "
              "(general.file_type), its token_embd Q4_0, every other tensor as in the Q4_K_M row. The FLOP "
              "prediction counts the causal attention scores (S (S + 1) / 2 (query, key) pairs per head for a prefill "
              "of S tokens, C for a decode step at context C) and a prefill's LM head on its last token, as llama.cpp "
              "computes them (docs/DEFINITIONS.md, \"FLOPs\").", EDGE_MARKERS[1]]
    write_section(Path(__file__).resolve().parents[1] / "docs" / "results.md", "\n".join(lines), *EDGE_MARKERS,
                  what="docs/results.md")


if __name__ == "__main__":
    raise SystemExit(main())
