"""Benchmark: what costs integer INT8 its top-1 agreement on SmolLM2 (issue 23; a result, not a test).

The dense model exported to ONNX once; each variant quantized from it and measured against that
float32 file in ONNX Runtime on the same text: next-token top-1 agreement and perplexity ratio on
--tokens evaluation tokens (windows of 256), prefill@128 and 1-token forward speed ratios
(bench/_timing.compare: interleaved pairs, min / median / max of each side and of the ratio, load
average). Variants:
- keep-k: dynamic INT8 (per-channel weights, per-tensor asymmetric activations) with the LM head
  and the k Linear layers of the largest simulated INT8 output error (measure.outliers.int8_output_errors
  on the calibration split) kept float; "outliers" is the current default (measure.outliers.int8_keep_float:
  8-bit step / input RMS above 0.3).
- per-tensor weights, reduce_range (7-bit weights), at the default keep set.
- weights: u8 (what the onnx-int8 export writes: right on every x86 CPU), s8 (before: saturates on
  CPUs without VNNI) and 7-bit s8 (reduce_range), at the default keep set (docs/EXPORT.md).
- static QDQ (quantize_static, per-channel weights, MinMax or Percentile calibration on the
  calibration split), at the default keep set.

Usage: nice -n 10 .venv/bin/python -m bench.bench_int8_variants [--tokens 2048] [--ks 0,8,16,29,48]
       [--variants keep,options,static,weights] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench._timing import compare, load_average
from analysis.arch.models import load_model
from analysis.compress.export import export
from analysis.compress.export.onnx import OnnxLM
from analysis.compress.export.onnx_int8 import quiet_logs, weight_matmuls
from analysis.measure.outliers import int8_keep_float, int8_output_errors, outlier_calibration, output_head_names
from analysis.core.threads import torch_threads
from analysis.core.text import evaluation_text
from analysis.measure.evaluation import token_ids


def windows_of(ids: torch.Tensor, window: int = 256) -> list[torch.Tensor]:
    return [ids[b:b + window].unsqueeze(0) for b in range(0, ids.numel() - 1, window)
            if ids[b:b + window].numel() >= 2]                                       # each [1, T]


def predictions(model, wins) -> tuple[np.ndarray, float]:
    """(argmax next tokens, summed NLL, token count) over the windows."""
    preds, nll, n = [], 0.0, 0
    for x in wins:
        logits = model(input_ids=x).logits[0].double()                             # [T, V]
        preds.append(logits.argmax(-1)[:-1].numpy())
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="sum"))
        n += x.shape[1] - 1
    return np.concatenate(preds), nll / n


def dynamic(src, dst, keep, per_channel=True, reduce_range=False, weights="s8"):
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    nodes, _ = weight_matmuls(onnx.load(str(src), load_external_data=False), keep)
    quantize_dynamic(str(src), str(dst), weight_type={"s8": QuantType.QInt8, "u8": QuantType.QUInt8}[weights],
                     nodes_to_quantize=nodes, per_channel=per_channel, reduce_range=reduce_range)


def static(src, dst, keep, calib, method):
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)
    nodes, _ = weight_matmuls(onnx.load(str(src), load_external_data=False), keep)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.rows = iter([{"input_ids": r[None].numpy(), "attention_mask": np.ones((1, r.numel()), np.int64)}
                              for r in calib.long()])

        def get_next(self):
            return next(self.rows, None)

    quantize_static(str(src), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, nodes_to_quantize=nodes,
                    op_types_to_quantize=["MatMul"], calibrate_method=getattr(CalibrationMethod, method),
                    extra_options={"MatMulConstBOnly": True})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ks", default="0,8,16,29,48")
    p.add_argument("--variants", default="keep,options,static")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    args = p.parse_args()
    variants = set(args.variants.split(","))
    rows = []
    with torch_threads(args.threads), tempfile.TemporaryDirectory(prefix="int8-variants-") as folder:
        loaded = load_model("smollm2-135m", cache_dir=args.cache_dir)
        calib = outlier_calibration(loaded.tokenizer)                                    # [2, 256]
        errors = int8_output_errors(loaded.model, calib)
        ranked = sorted(errors, key=errors.get, reverse=True)
        print("worst simulated INT8 output errors:", ", ".join(f"{n} {errors[n]:.3f}" for n in ranked[:12]))
        head = output_head_names(loaded.model)
        default_keep = int8_keep_float(loaded.model, calib)
        print(f"default keep ({len(default_keep)}):", default_keep)
        print("default keep's ranks by output error:", sorted(ranked.index(n) for n in default_keep if n in errors))
        pruned = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool)
        fp32 = export("onnx", loaded.model, pruned, folder, "fp32").path / "model.onnx"
        a = OnnxLM(fp32, loaded.model.config, args.threads)
        ids = token_ids(loaded.tokenizer, evaluation_text(), max_tokens=args.tokens)  # [N]
        wins = windows_of(ids)
        ref, ref_nll = predictions(a, wins)
        x, x1 = ids[:128].unsqueeze(0), ids[:1].unsqueeze(0)                           # [1, 128], [1, 1]
        cases = []
        if "keep" in variants:
            cases.append(("outliers (default)", lambda d: dynamic(fp32, d, default_keep), len(default_keep)))
            for k in [int(v) for v in args.ks.split(",")]:
                keep = sorted(set(head) | set(ranked[:k]))
                cases.append((f"worst {k} + head", lambda d, keep=keep: dynamic(fp32, d, keep), len(keep)))
        if "weights" in variants:          # issue 31: which weight type is right on every CPU, at what speed
            cases.append(("u8 weights (shipped)", lambda d: dynamic(fp32, d, default_keep, weights="u8"),
                          len(default_keep)))
            cases.append(("s8 weights (before: saturates without VNNI)", lambda d: dynamic(fp32, d, default_keep),
                          len(default_keep)))
            cases.append(("s8 7-bit weights (reduce_range)",
                          lambda d: dynamic(fp32, d, default_keep, reduce_range=True), len(default_keep)))
        if "options" in variants:
            cases.append(("per-tensor weights", lambda d: dynamic(fp32, d, default_keep, per_channel=False),
                          len(default_keep)))
            cases.append(("reduce_range", lambda d: dynamic(fp32, d, default_keep, reduce_range=True),
                          len(default_keep)))
        if "static" in variants:
            for method in ("MinMax", "Percentile"):
                cases.append((f"static QDQ {method}", lambda d, m=method: static(fp32, d, default_keep, calib, m),
                              len(default_keep)))
        for i, (label, make, n_keep) in enumerate(cases):
            dst = Path(folder) / f"v{i}.onnx"
            start = time.perf_counter()
            try:
                with warnings.catch_warnings(), quiet_logs():
                    warnings.simplefilter("ignore")
                    make(dst)
            except Exception as err:                       # a variant ORT cannot build is reported, not fatal
                print(f"  {label}: not built: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
                continue
            qtime = time.perf_counter() - start
            b = OnnxLM(dst, loaded.model.config, args.threads)
            pred, nll = predictions(b, wins)
            agree = float((pred == ref).mean())
            pre = compare({"fp32": lambda: a(input_ids=x), "int8": lambda: b(input_ids=x)},
                          min_pairs=5, max_pairs=11, max_seconds=20)
            one = compare({"fp32": lambda: a(input_ids=x1), "int8": lambda: b(input_ids=x1)},
                          min_pairs=5, max_pairs=21, max_seconds=10)
            pre.report(f"  {label}: prefill@128")
            one.report(f"  {label}: 1-token forward")
            row = {"label": label, "kept": n_keep, "agree": agree, "ppl": float(np.exp(nll - ref_nll)),
                   "prefill": pre.ratio, "one": one.ratio, "mb": dst.stat().st_size / 2 ** 20, "quantize_s": qtime}
            rows.append(row)
            print(f"  {label}: kept float {n_keep}, top-1 agreement {agree:.3f}, ppl {row['ppl']:.3f}x, prefill "
                  f"{pre.ratio:.2f}x, 1-token {one.ratio:.2f}x, {row['mb']:.0f} MB ({qtime:.0f} s)", flush=True)
            del b
    print(f"\n{ids.numel()} tokens, {len(wins)} windows; load average {load_average()}")
    print("| variant | Linear layers kept float | top-1 agreement | perplexity | prefill@128 | 1-token | file |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['label']} | {r['kept']} | {r['agree']:.3f} | {r['ppl']:.3f}x | {r['prefill']:.2f}x | "
              f"{r['one']:.2f}x | {r['mb']:.0f} MB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
