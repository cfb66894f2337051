"""INT8 of the final (pruned, recovered) model: which layers stay float, PyTorch's INT8 route, and
measurements of INT8 files against float32.

The ONNX files themselves are written by the "onnx-int8" export format
(`analysis.compress.export.onnx_int8`: methods, u8 weights, the self-check). What it and the other
integer routes keep float (`int8_keep_float`): the LM head, and the Linear layers whose calibration
input has outliers (`sensitive_linears`: 8-bit step / input RMS above `OUTLIER_STEP`; on SmolLM2
mostly MLP down projections, whose inputs carry a few huge values: layer 11 max 3066 at an RMS of 5 on
256 calibration tokens, so one per-tensor 8-bit step is larger than the typical value). Measured on
dense SmolLM2 (512 evaluation tokens, ONNX Runtime, 2 threads): every MatMul per tensor: top-1
agreement 0.56, perplexity 1.81x; weight MatMuls per channel: 0.63, 1.73x; + down projections float:
0.88, 1.01x; + the 29 layers above step/RMS 0.3 float: 0.87, 1.02x; + layers above 0.15 and the LM
head float: 0.92, 1.006x. SmoothQuant scales (alpha 0.5) made it worse (0.875, 1.06x).
`int8_output_errors` ranks the Linear layers by their simulated INT8 output error (`_fake_int8`): the
outlier rule keeps almost exactly the worst ones (docs/EXPORT.md, bench/bench_int8_variants.py).

PyTorch: `quantize_linear(model, keep_float)` is `torch.ao.quantization.quantize_dynamic` of every
nn.Linear but those kept float, per-channel INT8 weights, on a copy (the input model is not changed;
its activations are quantized to 7 bits, so fbgemm's u8 x s8 kernels cannot saturate on AVX2);
`torch_int8_report` measures it against float32 in PyTorch (prefill and KV-cache decode).

`compare_onnx` measures an INT8 ONNX file against its float32 source (`export.onnx.OnnxLM` runs
both): next-token top-1 agreement and perplexity on the same text, file sizes, prefill and 1-token
latency (alternating calls: speed.alternating_times).
"""
from __future__ import annotations

import copy
import io
import math
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch
from torch import nn

from analysis.measure.evaluation import evaluate, token_ids
from analysis.compress.export.onnx import OnnxLM
from analysis.compress.speed import alternating_times
from analysis.core.threads import torch_threads

OUTLIER_STEP = 0.3     # 8-bit step / input RMS above which a Linear layer stays float
CALIBRATION_SHAPE = (2, 256)   # sequences x tokens of the calibration split that find the sensitive layers


@torch.no_grad()
def activation_steps(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """For every nn.Linear of `model`: the step of a per-tensor 8-bit activation quantizer
    ((max - min) / 255 of its input) over the input's RMS, on ids [B, T]. Above ~1 the typical input
    value is below one step, so dynamic INT8 of that layer rounds most of its input to zero."""
    steps: dict[str, float] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().float()                                 # [B, T, D_in]
            rms = float(x.pow(2).mean().sqrt())
            steps[name] = max(steps.get(name, 0.0), float(x.max() - x.min()) / 255 / rms if rms else math.inf)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if type(m) is nn.Linear]
    try:
        model(input_ids=torch.as_tensor(ids).long())
    finally:
        for h in handles:
            h.remove()
    return steps


def sensitive_linears(model: nn.Module, ids: torch.Tensor, threshold: float = OUTLIER_STEP) -> list[str]:
    """Names of the nn.Linear layers whose calibration input (ids [B, T]) has an 8-bit step above
    `threshold` x its RMS (`activation_steps`): the layers dynamic INT8 keeps in float."""
    return sorted(name for name, step in activation_steps(model, ids).items() if step > threshold)


def output_head_names(model: nn.Module) -> list[str]:
    """The module name(s) of the LM head (tied to the embedding in SmolLM2): kept float by default,
    it is the last projection, whose errors go straight into the logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules() if head is not None and m is head]


def calibration_ids(tokenizer, shape: tuple[int, int] = CALIBRATION_SHAPE) -> torch.Tensor:
    """Token ids [n, T] of the built-in calibration split (the scorers' `scoring.calibration_ids`)."""
    from analysis.score.scoring import calibration_ids as scorer_calibration
    return scorer_calibration(tokenizer, n_sequences=shape[0], seq_len=shape[1])


def int8_keep_float(model: nn.Module, ids: torch.Tensor, threshold: float = OUTLIER_STEP) -> list[str]:
    """What integer INT8 keeps float: the outlier layers (`sensitive_linears` on ids [n, T]) and the
    LM head (`output_head_names`)."""
    return sorted(set(sensitive_linears(model, ids, threshold)) | set(output_head_names(model)))


def int8_keep_float_for(model: nn.Module, tokenizer) -> list[str]:
    """`int8_keep_float` on the built-in calibration split; without a tokenizer, the LM head alone
    (the outlier layers need calibration text to be found)."""
    if tokenizer is None:
        return output_head_names(model)
    return int8_keep_float(model, calibration_ids(tokenizer))


def _fake_int8(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w) rounded as the dynamic integer route rounds them: x [.., D_in] to 8-bit asymmetric
    steps over its whole range (one scale per tensor, zero exact), w [D_out, D_in] to symmetric
    INT8 per output channel."""
    lo, hi = float(x.min().clamp(max=0)), float(x.max().clamp(min=0))
    step = (hi - lo) / 255 or 1.0
    zero = round(-lo / step)
    xq = ((x / step).round() + zero).clamp(0, 255).sub(zero).mul(step)                # [.., D_in]
    ws = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127                          # [D_out, 1]
    return xq, (w / ws).round().clamp(-127, 127) * ws                                  # [.., D_in], [D_out, D_in]


@torch.no_grad()
def int8_output_errors(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """For every nn.Linear of `model`: the relative error of its output when its input and weight
    are rounded as dynamic INT8 rounds them (`_fake_int8`), per token ||y_q - y|| / ||y|| averaged
    over tokens (a whole-tensor norm would be dominated by the few tokens that carry a massive
    activation, while every token's prediction counts), the largest over the sequences of ids
    [B, T] (one forward each: one activation scale per call, as in ONNX Runtime). The layers to
    keep float are the largest of these."""
    errors: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            xq, wq = _fake_int8(inputs[0].detach().float(), module.weight.float())
            yq = nn.functional.linear(xq, wq, None if module.bias is None else module.bias.float())
            y = output.detach().float()                                                # [1, T, D_out]
            err = float(((yq - y).norm(dim=-1) / y.norm(dim=-1).clamp(min=1e-12)).mean())   # per token [1, T]
            errors[name] = max(errors.get(name, 0.0), err)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if type(m) is nn.Linear and m.weight.numel()]
    try:
        for row in torch.as_tensor(ids).long():                                        # [T]
            model(input_ids=row.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return errors


def worst_linears(model: nn.Module, ids: torch.Tensor, k: int) -> list[str]:
    """The k nn.Linear layers with the largest `int8_output_errors` on ids [B, T]."""
    errors = int8_output_errors(model, ids)
    return sorted(sorted(errors, key=errors.get, reverse=True)[:k])


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


def evaluation_text_or(text):
    from analysis.core.text import evaluation_text
    return evaluation_text() if text is None else text


def torch_int8_report(loaded, model: nn.Module, text=None, *, max_tokens: int = 512, latency_tokens: int = 128,
                      repeats: int = 5, threads: int | None = None, keep_float: Sequence[str] | None = None,
                      window: int = 256) -> dict:
    """PyTorch dynamic INT8 of `model`'s Linear layers (`quantize_linear`; keep_float None = the
    sensitive layers and the LM head, `int8_keep_float` on the calibration split) vs the float32
    model in the same runtime: size, prefill and decode latency (alternating), metric, top-1."""
    from analysis.compress.speed import _decode_step
    if keep_float is None:
        keep_float = int8_keep_float(model, calibration_ids(loaded.tokenizer))
    q = quantize_linear(model, keep_float)
    evs = {name: evaluate(replace(loaded, model=m), text, max_tokens=max_tokens) for name, m in (("fp32", model),
                                                                                               ("int8", q))}
    all_ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens)   # [N]
    ids = all_ids[:latency_tokens].unsqueeze(0)                            # [1, T]
    with torch.inference_mode(), torch_threads(threads):
        agree = top1_agreement(model, q, all_ids, window)
        times = alternating_times({"fp32": lambda: model(input_ids=ids), "int8": lambda: q(input_ids=ids)},
                                  repeats=repeats, warmup=1)
        decode = alternating_times({"fp32": _decode_step(model, ids, 8), "int8": _decode_step(q, ids, 8)},
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
