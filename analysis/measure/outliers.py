"""Which Linear layers 8-bit activations would break: the outlier search of the integer INT8 routes.

Integer INT8 (ONNX Runtime's dynamic route, PyTorch's dynamic INT8) quantizes each Linear layer's input
to 8 bits with one scale per tensor per call. The inputs of some layers carry a few huge values (on
SmolLM2 mostly the MLP down projections: layer 11 reaches 3066 at an RMS of 5 on 256 calibration
tokens), so one 8-bit step is larger than the typical value and the rest rounds to 0. What stays float
(`int8_keep_float`): the layers whose calibration input has an 8-bit step above `OUTLIER_STEP` x its
RMS (`sensitive_linears`, from one forward pass on the calibration split) and the LM head
(`output_head_names`), whose errors go straight into the logits. `int8_output_errors` /
`worst_linears` rank the layers by their simulated INT8 output error (`fake_int8`); the outlier rule
keeps almost exactly the worst ones (docs/EXPORT.md, bench/bench_int8_variants.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from analysis.arch.hooks import attached
from analysis.measure.tokens import calibration_ids

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

    with attached() as hooks:
        for n, m in model.named_modules():
            if type(m) is nn.Linear:
                hooks.before(m, hook(n))
        model(input_ids=torch.as_tensor(ids).long())
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


def outlier_calibration(tokenizer, shape: tuple[int, int] = CALIBRATION_SHAPE) -> torch.Tensor:
    """Token ids [n, T] of the built-in calibration split that the outlier search reads (`CALIBRATION_SHAPE`)."""
    return calibration_ids(tokenizer, n_sequences=shape[0], seq_len=shape[1])


def int8_keep_float(model: nn.Module, ids: torch.Tensor, threshold: float = OUTLIER_STEP) -> list[str]:
    """What integer INT8 keeps float: the outlier layers (`sensitive_linears` on ids [n, T]) and the
    LM head (`output_head_names`)."""
    return sorted(set(sensitive_linears(model, ids, threshold)) | set(output_head_names(model)))


def int8_keep_float_for(model: nn.Module, tokenizer) -> list[str]:
    """`int8_keep_float` on the built-in calibration split; without a tokenizer, the LM head alone
    (the outlier layers need calibration text to be found)."""
    if tokenizer is None:
        return output_head_names(model)
    return int8_keep_float(model, outlier_calibration(tokenizer))


def fake_int8(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    are rounded as dynamic INT8 rounds them (`fake_int8`), per token ||y_q - y|| / ||y|| averaged
    over tokens (a whole-tensor norm would be dominated by the few tokens that carry a massive
    activation, while every token's prediction counts), the largest over the sequences of ids
    [B, T] (one forward each: one activation scale per call, as in ONNX Runtime). The layers to
    keep float are the largest of these."""
    errors: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            xq, wq = fake_int8(inputs[0].detach().float(), module.weight.float())
            yq = nn.functional.linear(xq, wq, None if module.bias is None else module.bias.float())
            y = output.detach().float()                                                # [1, T, D_out]
            err = float(((yq - y).norm(dim=-1) / y.norm(dim=-1).clamp(min=1e-12)).mean())   # per token [1, T]
            errors[name] = max(errors.get(name, 0.0), err)
        return record

    with attached() as hooks:
        for n, m in model.named_modules():
            if type(m) is nn.Linear and m.weight.numel():
                hooks.after(m, hook(n))
        for row in torch.as_tensor(ids).long():                                        # [T]
            model(input_ids=row.unsqueeze(0))
    return errors


def worst_linears(model: nn.Module, ids: torch.Tensor, k: int) -> list[str]:
    """The k nn.Linear layers with the largest `int8_output_errors` on ids [B, T]."""
    errors = int8_output_errors(model, ids)
    return sorted(sorted(errors, key=errors.get, reverse=True)[:k])
