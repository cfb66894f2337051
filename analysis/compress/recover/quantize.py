"""INT8 of the final (pruned, recovered) model: which layers stay float, PyTorch's INT8 route, and
measurements of INT8 files against float32.

The ONNX files themselves are written by the "onnx-int8" export format
(`analysis.compress.export.onnx_int8`: methods, u8 weights, the self-check); which layers every
integer route keeps float is `analysis.measure.outliers` (the outlier layers and the LM head; what
the outlier search found on SmolLM2 and which variants were measured: docs/EXPORT.md).

PyTorch: `quantize_linear(model, keep_float)` is `torch.ao.quantization.quantize_dynamic` of every
nn.Linear but those kept float, per-channel INT8 weights, on a copy (the input model is not changed;
its activations are quantized to 7 bits, so fbgemm's u8 x s8 kernels cannot saturate on AVX2);
`torch_int8_report` measures it against float32 in PyTorch (prefill and KV-cache decode).

`compare_onnx` measures an INT8 ONNX file against its float32 source (`export.onnx.OnnxLM` runs
both): next-token top-1 agreement and perplexity on the same text, file sizes, prefill and 1-token
latency (alternating calls: analysis.compress.timing.alternating_times).
"""
from __future__ import annotations

import copy
import io
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch
from torch import nn

from analysis.measure.evaluation import evaluate, token_ids
from analysis.measure.outliers import int8_keep_float_for
from analysis.compress.export.onnx import OnnxLM
from analysis.compress.timing import DecodeSteps, alternating_times
from analysis.core.threads import torch_threads

def quantize_linear(model: nn.Module, keep_float: Sequence[str] = (), *, per_channel: bool = True) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are PyTorch dynamic INT8 (CPU inference only): INT8
    weights (per output channel by default), activations quantized per tensor on the fly, integer
    matmuls (fbgemm / onednn). keep_float: module names left float (`sensitive_linears`)."""
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic
    twin = copy.deepcopy(model).eval()
    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    spec = {name: qconfig for name, m in twin.named_modules()       # an emptied layer's 0-row Linear stays as it is
            if type(m) is nn.Linear and name not in set(keep_float) and m.weight.numel()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch.ao.quantization's deprecation notice
        return quantize_dynamic(twin, spec, dtype=torch.qint8)


def state_bytes(model: nn.Module) -> int:
    """Bytes of torch.save(state_dict) (quantized Linear layers store packed INT8 weights)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


@dataclass
class QuantComparison:
    """INT8 vs float32 on the same text (ONNX Runtime)."""
    top1_agreement: float
    perplexity_fp32: float
    perplexity_int8: float
    bytes_fp32: int
    bytes_int8: int
    latency_ms_fp32: float
    latency_ms_int8: float
    n_tokens: int
    accuracy_fp32: float | None = None    # next-token top-1 accuracy on the text
    accuracy_int8: float | None = None
    one_token_ms_fp32: float | None = None  # a 1-token forward: the weight-bound work of a decode step
    one_token_ms_int8: float | None = None  # (the ONNX export has no KV cache, so no real decode)
    keep_float: tuple = ()
    # {"prefill" | "one_token": {"min", "median", "max", "rounds"}} of the per-round fp32 / int8 time
    # ratios (the rounds alternate the four calls): the speed-ups as a bench prints and judges them
    speedups: dict = field(default_factory=dict)

    @property
    def size_ratio(self) -> float:
        return self.bytes_int8 / self.bytes_fp32

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_int8 / self.perplexity_fp32

    def as_dict(self) -> dict:
        return {**asdict(self), "size_ratio": self.size_ratio, "perplexity_ratio": self.perplexity_ratio}


@torch.no_grad()
def top1_agreement(a: nn.Module, b: nn.Module, ids: torch.Tensor, window: int = 256) -> float:
    """Fraction of positions where a and b predict the same next token; ids [N] in windows."""
    same, total = 0, 0
    for begin in range(0, ids.numel() - 1, window):
        x = ids[begin:begin + window].unsqueeze(0)                         # [1, T]
        if x.shape[1] < 2:
            break
        pa, pb = a(input_ids=x).logits.argmax(-1), b(input_ids=x).logits.argmax(-1)  # [1, T]
        same += int((pa == pb).sum())
        total += pa.numel()
    return same / total


def compare_onnx(loaded, fp32, int8, text=None, *, max_tokens: int = 1024, window: int = 256,
                 latency_tokens: int = 128, repeats: int = 5, threads: int | None = None) -> QuantComparison:
    """INT8 ONNX `int8` vs float32 ONNX `fp32` (folders or files) of `loaded`'s (pruned) model."""
    config = loaded.model.config
    a, b = OnnxLM(fp32, config, threads), OnnxLM(int8, config, threads)
    ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens)   # [N]
    agree = top1_agreement(a, b, ids, window)
    evs = [evaluate(replace(loaded, model=m), text, max_tokens=max_tokens) for m in (a, b)]
    x, x1 = ids[:latency_tokens].unsqueeze(0), ids[:1].unsqueeze(0)         # [1, T], [1, 1]
    with torch_threads(threads):
        times = alternating_times({"fp32": lambda: a(input_ids=x), "int8": lambda: b(input_ids=x),
                                   "fp32-1": lambda: a(input_ids=x1), "int8-1": lambda: b(input_ids=x1)},
                                  repeats=repeats, warmup=1)
    ms = times.median_ms("wall")
    return QuantComparison(top1_agreement=agree, perplexity_fp32=evs[0].value, perplexity_int8=evs[1].value,
                           bytes_fp32=a.path.stat().st_size, bytes_int8=b.path.stat().st_size,
                           latency_ms_fp32=ms["fp32"], latency_ms_int8=ms["int8"], n_tokens=int(ids.numel()),
                           accuracy_fp32=evs[0].accuracy, accuracy_int8=evs[1].accuracy,
                           one_token_ms_fp32=ms["fp32-1"], one_token_ms_int8=ms["int8-1"],
                           speedups={"prefill": times.ratio_spread("fp32", "int8"),
                                     "one_token": times.ratio_spread("fp32-1", "int8-1")})


def compare_gguf(loaded, f32, quantized, text=None, *, max_tokens: int = 1024, window: int = 256,
                 context: int = 128, decode_tokens: int = 16, rounds: int = 5, threads: int = 2) -> dict:
    """A quantized GGUF file (e.g. Q8_0: llama.cpp's CPU INT8 route, activations quantized per block of 32
    values with their own scale) against the F32 GGUF of the same model, both run by llama.cpp on this
    CPU: next-token top-1 agreement and perplexity on the same tokens (windows of `window`), file sizes,
    and prefill / decode tokens/s in interleaved rounds after warm-up (`llamacpp.paired_speed`) with the
    per-round speed-ups. Keys as `QuantComparison.as_dict` where they mean the same."""
    from pathlib import Path
    from analysis.compress.export.gguf import llamacpp
    from analysis.compress.export.gguf.format import llamacpp_logits
    from analysis.compress.export.selfcheck import CheckText, check_causal
    f32, quantized = Path(f32), Path(quantized)
    ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens).numpy()       # [N]
    windows = CheckText([ids[b:b + window] for b in range(0, len(ids) - 1, window) if len(ids[b:b + window]) >= 2],
                        "evaluation tokens")
    n_ctx = max(len(w) for w in windows.windows)
    check = check_causal(llamacpp_logits(f32, n_ctx), llamacpp_logits(quantized, n_ctx), windows, bits=8,
                         artifact_name=quantized.name, reference_name=f32.name)
    speed = llamacpp.paired_speed({"fp32": f32, "int8": quantized}, context, decode_tokens=decode_tokens,
                                  rounds=rounds, threads=threads)
    bytes_fp32, bytes_int8 = f32.stat().st_size, quantized.stat().st_size
    return {"top1_agreement": check.agreement, "perplexity_fp32": check.reference_perplexity,
            "perplexity_int8": check.perplexity, "perplexity_ratio": check.perplexity_ratio,
            "accuracy_fp32": check.reference_accuracy, "accuracy_int8": check.accuracy,
            "bytes_fp32": bytes_fp32, "bytes_int8": bytes_int8, "size_ratio": bytes_int8 / bytes_fp32,
            "n_tokens": check.n_tokens, "context": context, "threads": threads,
            "prefill_tok_s_fp32": speed.median("prefill", "fp32"), "prefill_tok_s_int8": speed.median("prefill", "int8"),
            "decode_tok_s_fp32": speed.median("decode", "fp32"), "decode_tok_s_int8": speed.median("decode", "int8"),
            "speedups": {"prefill": speed.ratio("prefill", "int8", "fp32"),
                         "decode": speed.ratio("decode", "int8", "fp32")}}


def evaluation_text_or(text):
    from analysis.core.text import evaluation_text
    return evaluation_text() if text is None else text


def torch_int8_report(loaded, model: nn.Module, text=None, *, max_tokens: int = 512, latency_tokens: int = 128,
                      repeats: int = 5, threads: int | None = None, keep_float: Sequence[str] | None = None,
                      window: int = 256) -> dict:
    """PyTorch dynamic INT8 of `model`'s Linear layers (`quantize_linear`; keep_float None = the
    sensitive layers and the LM head, `int8_keep_float` on the calibration split) vs the float32
    model in the same runtime: size, prefill and decode latency (alternating), metric, top-1."""
    if keep_float is None:
        keep_float = int8_keep_float_for(model, loaded.tokenizer)
    q = quantize_linear(model, keep_float)
    evs = {name: evaluate(replace(loaded, model=m), text, max_tokens=max_tokens) for name, m in (("fp32", model),
                                                                                               ("int8", q))}
    all_ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens)   # [N]
    ids = all_ids[:latency_tokens].unsqueeze(0)                            # [1, T]
    with torch.inference_mode(), torch_threads(threads):
        agree = top1_agreement(model, q, all_ids, window)
        times = alternating_times({"fp32": lambda: model(input_ids=ids), "int8": lambda: q(input_ids=ids)},
                                  repeats=repeats, warmup=1)
        decode = alternating_times({"fp32": DecodeSteps(model, ids, 8), "int8": DecodeSteps(q, ids, 8)},
                                   repeats=max(1, repeats), warmup=0, self_timed=True)   # per-token medians
    ms, decode_ms = times.median_ms("wall"), decode.median_ms("wall")
    sizes = {"fp32": state_bytes(model), "int8": state_bytes(q)}
    return {"metric_fp32": evs["fp32"].value, "metric_int8": evs["int8"].value, "bytes_fp32": sizes["fp32"],
            "accuracy_fp32": evs["fp32"].accuracy, "accuracy_int8": evs["int8"].accuracy, "top1_agreement": agree,
            "bytes_int8": sizes["int8"], "size_ratio": sizes["int8"] / sizes["fp32"],
            "latency_ms_fp32": ms["fp32"], "latency_ms_int8": ms["int8"],
            "decode_ms_fp32": decode_ms["fp32"], "decode_ms_int8": decode_ms["int8"],
            "speedups": {"prefill": times.ratio_spread("fp32", "int8"), "decode": decode.ratio_spread("fp32", "int8")},
            "keep_float": list(keep_float), "model": q}
