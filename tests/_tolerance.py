"""Tolerances for comparing two computations of the same model output: one home.

Claims of equality ("the cut model computes what the masked model computes") are tested in
float64, where rounding is ~1e-16 relative, and asserted with EXACT (1e-12, absolute): a real
difference (a wrong head, a lost bias) is >= 1e-3 on these models, far above it, and no CPU's
summation order can reach it.

Checks that must stay in a lower precision (ONNX Runtime float32, bf16/fp16 precision paths,
offloaded float32) use `forward_tolerance`, derived rather than tuned:

    |a - b| <= eps(dtype) * width * depth * scale

- eps(dtype): the unit roundoff (torch.finfo(dtype).eps: 1.19e-7 float32, 7.8e-3 bf16).
- width: the longest dot product in one layer (hidden or intermediate size). A length-K dot
  product computed in two different summation orders differs by at most ~K * eps relative to
  sum |a_i b_i| (Higham, "Accuracy and Stability of Numerical Algorithms", eq. 3.5, gamma_K).
- depth: the number of layers; each adds its own rounding to the residual stream, which the
  next layers carry (to first order the errors add, hence linear in depth).
- scale: the largest |value| compared (e.g. max |logit| of the reference), as the bound is
  relative to the magnitudes involved.

A caveat on "float64": Llama-family RMSNorms (Llama, Qwen, Mistral, SmolLM2...) compute in
float32 whatever the model's dtype and cast back. Both sides of an equality claim then round the
same float64 residual stream to float32; the sides differ only if a value lies within the float64
difference (~1e-16 relative) of a float32 rounding boundary (~1e-7 apart), about 1e-9 per
element: the float32 part cannot make an EXACT claim fail except by that rare tie, on any CPU.
Where a test compares a computation against a hand-written float64 reference on such a model
(the calibration scorers), float64 does not help and the float32 bound below is used.

What a float64 Hugging Face model still computes in float32 (transformers 5.23, read in its modeling
files): the eager attention probabilities (`softmax(..., dtype=torch.float32)` in Llama, Mistral, Qwen,
Gemma, Phi-3, GPT-NeoX, Bloom, OPT, ...), the rotary cos/sin (built from a float32 `inv_freq`), the
RMSNorms (upcast to float32), Bloom's ALiBi slopes. Two computations that hand these parts the same
values in the same shapes get the same float32 bits (one kernel, one lane layout), so an equality
claim between them stays EXACT (up to the tie caveat above). Two computations that hand them
different shapes do not: a cached decode step scores 1-2 query rows against the keys so far, the
full forward 12 rows with the future masked, and the vectorised float32 exp / sum / cos round a row
differently when its length, lane count (8 on AVX2, 16 on AVX-512) or tail differs. Measured: on an
AMD EPYC (Zen 3, AVX2 only), and here with torch forced to its AVX2 kernels
(`ATEN_CPU_CAPABILITY=avx2`), the cached decode of a float64 tiny Llama differs from its full
forward by 4.3e-8 (Gemma-2 1.1e-7, Phi-3 5.1e-9, Bloom 3.3e-10, OPT 1.7e-9), while AVX-512 happened
to give 0. Such comparisons are bounded by `float32_inside_tolerance`: the float32 worst case over
the model's width and depth.

It is the worst case, not the typical one (which is ~sqrt(K) smaller), so it holds whatever
order a CPU's kernels (AVX2, AVX-512, AMX, AMD or Intel) sum in; it still catches real bugs,
which change the output by a fraction of the scale, not by eps.
"""
from __future__ import annotations

import torch

EXACT = 1e-12   # float64 equality claims: absolute, for values of scale <= ~100


def forward_tolerance(dtype: torch.dtype, *, width: int, depth: int, scale: float) -> float:
    """The worst-case summation-order difference of a depth-`depth` network whose longest dot
    product has `width` terms, on outputs of magnitude `scale` (see the module docstring)."""
    return torch.finfo(dtype).eps * width * depth * max(float(scale), 1.0)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| as a Python float (in float64, so the subtraction adds no rounding)."""
    return (a.double() - b.double()).abs().max().item()


def float32_inside_tolerance(model, scale: float) -> float:
    """The bound for two computations of one float64 HF model whose float32 parts (attention softmax,
    rotary cos/sin, RMSNorm: the module docstring) see different shapes, e.g. a cached decode step vs
    the full forward: `forward_tolerance(float32, ...)` over the model's longest dot product (hidden
    or intermediate size) and its number of layers."""
    cfg = model.config.get_text_config()
    names = ("hidden_size", "n_embd", "intermediate_size", "n_inner", "ffn_dim")
    width = max(int(getattr(cfg, name, 0) or 0) for name in names)
    return forward_tolerance(torch.float32, width=width, depth=int(cfg.num_hidden_layers), scale=scale)
