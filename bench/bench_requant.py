"""Benchmark: what requantizing the built-in SmolLM2 costs, type by type, and why (issue 35; a result,
not a test).

The built-in SmolLM2-135M ships as a Q4_1 GGUF file, dequantized once to float32 (DESIGN.md): every
32-value block of its weights holds at most 16 distinct values, min + k * d. Writing it again at another
llama.cpp type requantizes a lattice, and how much that costs depends on how the new grid meets the
old one, not only on the bits. For each --types the dense model is exported by headscope's GGUF export
(self-checked as any export), then:
- the file is read back into PyTorch by transformers' GGUF loader (dequantized, rope rows permuted
  back): the weight error against the source (relative Frobenius norm, per tensor kind and in all);
- perplexity of that dequantized model in PyTorch (float32 activations) and of the file in llama.cpp
  (its own kernels, 8-bit activations for the quantized types), on the same --tokens held-out tokens
  in windows of --window: when both move together, the cost is in the weights, not in the runtime.
Printed first: the lattice of the source (`frontier.prior_lattice`: the share of 32-value blocks with at
most 16 distinct values) and, per old 4-bit code, where 5-bit requantization errs (`error_by_code`).

Usage: nice -n 10 .venv/bin/python -m bench.bench_requant [--types f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_1,q4_0]
       [--tokens 4096] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from analysis.arch.models import load_model
from analysis.compress.export import export
from analysis.compress.export.gguf import llamacpp
from analysis.compress.export.gguf.deploy import gguf_facts
from analysis.compress.recover.frontier import linear_blocks, prior_lattice
from analysis.core.text import evaluation_text
from analysis.measure.evaluation import CausalPerplexity, token_ids
from bench._timing import load_average

KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def error_by_code(model, max_blocks: int = 4096) -> dict:
    """Where 5-bit requantization of a 4-bit (Q4_1) lattice errs: for each old code k (0..15, min + k * d
    in its block) the share of weights and the mean |error| / step of Q5_1 (min + j * range / 31, the
    same endpoints: code k lands at 2k + k/15 of the new grid, k/15 of a step off) and of Q5_0 (a grid
    around 0, step = the block's largest magnitude / 16, not anchored to the old one), both written as
    ggml's reference quantizers write them (the bytes llama.cpp's quantizer writes), in float64."""
    w = np.concatenate([b.double().numpy() for b in linear_blocks(model, max_blocks)])   # [n, 32]
    lo, hi = w.min(1, keepdims=True), w.max(1, keepdims=True)                             # [n, 1]
    code = np.rint((w - lo) / ((hi - lo) / 15)).astype(int)                               # [n, 32]
    step1 = (hi - lo) / 31
    err1 = np.abs(np.floor((w - lo) / step1 + 0.5) * step1 + lo - w) / step1              # Q5_1
    amax = np.take_along_axis(w, np.abs(w).argmax(1)[:, None], 1)                         # [n, 1] signed
    step0 = amax / -16
    err0 = np.abs((np.minimum(31, np.trunc(w / step0 + 16.5)) - 16) * step0 - w) / np.abs(step0)   # Q5_0
    return {"share": [float((code == k).mean()) for k in range(16)],
            "q5_1": [float(err1[code == k].mean()) for k in range(16)],
            "q5_0": [float(err0[code == k].mean()) for k in range(16)],
            "rms_per_step": {"q5_1": float(np.sqrt((err1 ** 2).mean())), "q5_0": float(np.sqrt((err0 ** 2).mean()))},
            "step_ratio_q5_1_to_q5_0": float((step1 / np.abs(step0)).mean())}


def distinct_tensors(state: dict) -> dict:
    """The state dict without tensors that share storage with an earlier one (a tied lm_head)."""
    seen, out = set(), {}
    for name, w in state.items():
        if w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            out[name] = w
    return out


def weight_error(source: dict, back: dict) -> dict:
    """Relative Frobenius error of the read-back 2-D weights, per kind (KINDS) and in all."""
    num, den = {}, {}
    for name, w in distinct_tensors(source).items():
        if w.dim() != 2 or name not in back:
            continue
        kind = next((k for k in KINDS if k in name), "other")
        ref = w.double()
        num[kind] = num.get(kind, 0.0) + float(((back[name].double() - ref) ** 2).sum())
        den[kind] = den.get(kind, 0.0) + float((ref ** 2).sum())
    out = {k: (num[k] / den[k]) ** 0.5 for k in num}
    out["all"] = (sum(num.values()) / sum(den.values())) ** 0.5
    return out


def read_back(path: Path):
    """The GGUF file as a float32 transformers model (dequantized, rope rows permuted back)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                trust_remote_code=False).eval()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="f16,q8_0,q6_k,q5_k_m,q4_k_m,q4_1,q4_0")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
    source = {k: v.detach().clone() for k, v in distinct_tensors(loaded.model.state_dict()).items()}
    ids = token_ids(loaded.tokenizer, evaluation_text(), max_tokens=args.tokens)               # [N]
    evaluator = CausalPerplexity(window=args.window, stride=args.window, batch_size=8)

    def torch_ppl(model) -> float:
        sums, _, counts = evaluator.window_stats(model, ids)                                   # [1, W], [W]
        return float(np.exp(sums.sum() / counts.sum()))

    lat = prior_lattice(loaded.model)
    print(f"source lattice (linear layers, the output head apart): {lat['share']:.1%} of {lat['blocks']:,} 32-value "
          f"blocks hold at most 16 distinct values, {lat['distinct']:.1f} on average", flush=True)
    by_code = error_by_code(loaded.model)
    print("requantizing the 4-bit lattice at 5 bits, per old code k = 0..15:\n"
          f"  share of weights  {' '.join(f'{v:.3f}' for v in by_code['share'])}\n"
          f"  Q5_1 |err|/step   {' '.join(f'{v:.3f}' for v in by_code['q5_1'])}\n"
          f"  Q5_0 |err|/step   {' '.join(f'{v:.3f}' for v in by_code['q5_0'])}\n"
          f"  rms error / step: Q5_1 {by_code['rms_per_step']['q5_1']:.3f}, Q5_0 {by_code['rms_per_step']['q5_0']:.3f} "
          f"(uniform rounding: {12 ** -0.5:.3f}); Q5_1's step is {by_code['step_ratio_q5_1_to_q5_0']:.3f}x Q5_0's", flush=True)
    rows = {"source": {"torch_ppl": torch_ppl(loaded.model)}}
    print(f"source (float32): PyTorch perplexity {rows['source']['torch_ppl']:.3f} on {len(ids):,} tokens", flush=True)
    dense = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool)
    with tempfile.TemporaryDirectory(prefix="bench-requant-") as tmp:
        for t in [t for t in args.types.split(",") if t]:
            written = export("gguf", loaded.model, dense, tmp, t, tokenizer=loaded.tokenizer, gguf_type=t)
            path = written.path / "model.gguf"
            back = read_back(path)
            row = {"bytes": path.stat().st_size, "tensor_types": gguf_facts(path)["tensor_types"],
                   "weight_error": weight_error(source, back.state_dict()), "torch_ppl": torch_ppl(back),
                   "llama_ppl": llamacpp.perplexity(path, ids.tolist(), window=args.window, threads=args.threads).value}
            del back
            rows[t] = row
            e = row["weight_error"]
            print(f"{t}: {row['bytes'] / 2**20:.1f} MiB; weight error {e['all']:.2e} (attention q/k/v/o "
                  f"{e.get('q_proj', 0):.2e}/{e.get('k_proj', 0):.2e}/{e.get('v_proj', 0):.2e}/{e.get('o_proj', 0):.2e}, "
                  f"mlp gate/up/down {e.get('gate_proj', 0):.2e}/{e.get('up_proj', 0):.2e}/{e.get('down_proj', 0):.2e}, "
                  f"embedding {e.get('embed_tokens', 0):.2e}); perplexity PyTorch {row['torch_ppl']:.3f}, "
                  f"llama.cpp {row['llama_ppl']:.3f}; {row['tensor_types']}", flush=True)
    print(f"load average at end: {load_average()}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "lattice": lat, "by_code": by_code, "rows": rows,
                                              "load": load_average()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
