"""Simulated INT8 in PyTorch (fake quantization, no runtime): which activation scale would let integer
INT8 agree with float32 on SmolLM2? (issue 23; a measurement, not a timed test)

Every nn.Linear but those kept float gets per-channel symmetric INT8 weights and its input rounded by
one of the activation quantizers below; the score is next-token top-1 agreement with the float32
model on --tokens held-out tokens in windows of --window. ONNX Runtime's dynamic route is "tensor"
(one asymmetric 8-bit scale per tensor per call: measure.outliers.fake_int8); "token-sym" / "token-asym"
give every token (row) its own scale, symmetric or asymmetric. Kept float: "head" (the LM head) or
"sensitive" (measure.outliers.int8_keep_float: the outlier layers and the head). "weights" rounds only the
weights (the ceiling any activation scheme can reach with these weights); "activations" only the
inputs.

Usage: nice -n 10 .venv/bin/python -m bench.sim_int8_activations [--tokens 2048] [--window 256]
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn


from analysis.arch.models import load_model  # noqa: E402
from analysis.measure.outliers import fake_int8, int8_keep_float_for, output_head_names
from analysis.core.threads import torch_threads  # noqa: E402
from analysis.core.text import evaluation_text  # noqa: E402
from analysis.measure.evaluation import token_ids  # noqa: E402


def weight_int8(w: torch.Tensor) -> torch.Tensor:
    """w [D_out, D_in] rounded to symmetric INT8 per output channel."""
    return fake_int8(torch.zeros(1), w)[1]


def per_tensor(x: torch.Tensor) -> torch.Tensor:
    return fake_int8(x, torch.zeros(1, 1))[0]


def per_token_symmetric(x: torch.Tensor) -> torch.Tensor:
    """x [.., D] with one symmetric scale per row (max |x| / 127)."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127                    # [.., 1]
    return (x / scale).round().clamp(-127, 127) * scale


def per_token_asymmetric(x: torch.Tensor) -> torch.Tensor:
    """x [.., D] with one asymmetric 8-bit scale per row over [min(x, 0), max(x, 0)], zero exact."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)   # [.., 1]
    step = ((hi - lo) / 255).clamp(min=1e-12)
    zero = (-lo / step).round()
    return ((x / step).round() + zero).clamp(0, 255).sub(zero).mul(step)


ACTIVATIONS = {"tensor": per_tensor, "token-sym": per_token_symmetric, "token-asym": per_token_asymmetric}

# label -> (activation quantizer or None, weights rounded?, which layers stay float)
VARIANTS = {
    "weights only (head float)": (None, True, "head"),
    "activations only, token-asym (head float)": ("token-asym", False, "head"),
    "tensor (sensitive float: the shipped dynamic route)": ("tensor", True, "sensitive"),
    "tensor (head float)": ("tensor", True, "head"),
    "token-sym (head float)": ("token-sym", True, "head"),
    "token-asym (head float)": ("token-asym", True, "head"),
    "token-asym (sensitive float)": ("token-asym", True, "sensitive"),
}


@torch.no_grad()
def predictions(model, windows: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(input_ids=row.unsqueeze(0)).logits[0].argmax(-1) for row in windows])   # [N]


@torch.no_grad()
def agreement(model, windows, reference, activation, round_weights, keep) -> float:
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n not in keep}
    saved = {n: m.weight.detach().clone() for n, m in linears.items()}
    hooks = []
    try:
        for n, m in linears.items():
            if round_weights:
                m.weight.copy_(weight_int8(saved[n]))
            if activation is not None:
                hooks.append(m.register_forward_pre_hook(lambda mod, args, f=ACTIVATIONS[activation]: (f(args[0]),)))
        return float((predictions(model, windows) == reference).float().mean())
    finally:
        for h in hooks:
            h.remove()
        for n, m in linears.items():
            m.weight.copy_(saved[n])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with torch_threads(args.threads):
        loaded = load_model("smollm2-135m")
        model = copy.deepcopy(loaded.model)            # rounded in place, restored after each
        ids = token_ids(loaded.tokenizer, evaluation_text(), max_tokens=args.tokens)          # [N]
        n = ids.numel() // args.window
        windows = ids[:n * args.window].reshape(n, args.window)                                 # [n, W]
        reference = predictions(model, windows)                                                 # [n * W]
        keep = {"head": set(output_head_names(model)),
                "sensitive": set(int8_keep_float_for(model, loaded.tokenizer))}
        print(f"SmolLM2-135M dense, {reference.numel()} tokens, windows of {args.window}; kept float: head "
              f"{len(keep['head'])} layer, sensitive {len(keep['sensitive'])} layers")
        for label, (activation, round_weights, kept) in VARIANTS.items():
            print(f"  {label}: top-1 agreement {agreement(model, windows, reference, activation, round_weights, keep[kept]):.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
