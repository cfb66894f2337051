"""Which attention kernel a Hugging Face model runs, switched for the length of a `with` block.

transformers dispatches attention through `AttentionInterface` by the name in
`config._attn_implementation` ("eager", "sdpa", ...). Two switches live here, each restored in
`finally`:
- `eager_attention(model)`: the eager kernel, the only one that returns attention probabilities
  (analysis.measure.roles).
- `float32_attention(model)`: "sdpa" -> "sdpa-float32", PyTorch's scaled-dot-product attention run
  in float32 even inside a bfloat16 autocast region (queries, keys and values upcast, autocast off
  for the kernel; the output stays float32 and the next Linear casts it as usual). Why: on CPUs the
  bfloat16 backward of SDPA is slower than the float32 one (SmolLM2-135M, a 4 x 128 batch, 2
  threads: 220 ms vs 64 ms a training step over its 30 layers, torch 2.13), so bf16 recovery
  (analysis.compress.recover.distill) keeps the attention core in float32 while its Linear layers run in
  bfloat16. Models whose attention is not "sdpa" (eager, custom code) are left as they are.

"sdpa-float32" is registered in transformers' AttentionInterface (the documented way to add a kernel) once, the
first time a model is switched to it (`register`), not at import: importing this module (the stored results' code
digest names it) must not pull transformers' modeling stack (about 2 s of imports). Nothing else is written outside
the model.

`precision_block(model, precision)` is the long passes' precision (the long-context scan, a plan's probes, their
time estimate): bfloat16 autocast with `float32_attention`, offered where `core.placement.fast_bfloat16`.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch

SDPA_FLOAT32 = "sdpa-float32"


def sdpa_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with autocast off on q [B, H, T, d], k / v [B, H_kv, T, d], half
    precision upcast to float32 (float32 / float64 kept: outside autocast it is the stock kernel).
    Returns (output [B, T, H, d], None) like `sdpa_attention_forward`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    query, key, value = (_at_least_float32(x) for x in (query, key, value))
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(query.dtype)               # [B, 1, T, S] additive mask
    with torch.autocast(query.device.type, enabled=False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision x upcast to float32; float32 and float64 as they are (never a downcast)."""
    return x.float() if x.element_size() < 4 else x


@cache
def register() -> None:
    """Add "sdpa-float32" to transformers' AttentionInterface, once per process (functools.cache: later calls
    return at once; its lock-free first call only writes the same entry twice if two threads race)."""
    from transformers import AttentionInterface
    AttentionInterface.register(SDPA_FLOAT32, sdpa_float32)


def current_implementation(model) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


@contextmanager
def attention_implementation(model, name: str, *, only_from: tuple[str, ...] | None = None):
    """Run `model` with attention implementation `name` inside the block, the original restored after.
    Nothing changes for a model without an implementation name, one already on `name`, or (with
    `only_from`) one whose implementation is not listed there."""
    original = current_implementation(model)
    switch = (original is not None and original != name
              and (only_from is None or original in only_from))
    try:
        if switch:
            model.set_attn_implementation(name)
        yield model
    finally:
        if switch:
            model.set_attn_implementation(original)


def eager_attention(model):
    """The eager kernel inside the block (it returns attention probabilities)."""
    return attention_implementation(model, "eager")


def float32_attention(model):
    """SDPA in float32 inside the block (for bfloat16 autocast training); other kernels untouched."""
    register()
    return attention_implementation(model, SDPA_FLOAT32, only_from=("sdpa",))


def check_precision(precision: str, device) -> None:
    """InputError for a precision other than core.placement.PASS_PRECISIONS, or bfloat16 where this machine has no
    native bfloat16 matrix kernels (core.placement.fast_bfloat16: it would be slower than float32 there)."""
    from analysis.core.errors import InputError
    from analysis.core.placement import PASS_PRECISIONS, fast_bfloat16
    if precision not in PASS_PRECISIONS:
        raise InputError(f"The precision of the long passes is one of {', '.join(PASS_PRECISIONS)}; got {precision!r}.")
    if precision == "bfloat16" and not fast_bfloat16(getattr(device, "type", str(device))):
        raise InputError("This machine has no fast bfloat16 matrix kernels (AVX-512 BF16 or AMX on a CPU, or a GPU "
                         "with bfloat16): bfloat16 would be slower than float32 here; use float32.")


@contextmanager
def precision_block(model, precision: str):
    """The passes of the block in `precision`: float32, the model as it is; bfloat16, torch.autocast (matrix products
    in bfloat16, the model's weights untouched) with the attention kernel in float32 (`float32_attention`: on a CPU
    bfloat16 SDPA was slower than float32's, 1.45x on SmolLM2), restored after."""
    if precision == "float32":
        yield
        return
    device = next(model.parameters()).device
    check_precision(precision, device)
    with torch.autocast(device.type, dtype=torch.bfloat16), float32_attention(model):
        yield
