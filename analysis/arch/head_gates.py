"""Head gates (torch hooks): the one mechanism that turns heads off, for every architecture.

(`analysis.score.masks` plans *which* heads to prune, in numpy; this module applies a plan to a model.)

A forward pre-hook on each layer's attention output projection multiplies head h's slice
(columns h*d .. (h+1)*d - 1 of O's input) by gate[l, h]. Gate 0 computes exactly the function
of the model with head h's O columns zeroed (and hence its Q rows, and for an emptied group its
K/V rows: nothing downstream of them is left). Gates can be fractional (for gradient or
integrated-gradient importance) and can require grad.

With a batch of B gate vectors ([B, L, H]) and an input batch of B*n sequences, gate row b
applies to input rows b*n .. (b+1)*n - 1, so one forward pass evaluates B masks.

Hooks live only inside the `head_mask` context and are removed in `finally`: the (possibly
cached and shared) model is never changed. The hook is a plain forward pre-hook, so it composes
with accelerate's dispatch hooks (which wrap `forward` itself): it sees O's input where the
previous module left it, and moves the gate there.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from analysis.arch.hooks import attached
from analysis.arch.adapters import Adapter, adapter_for
from analysis.arch.geometry import kv_groups_emptied  # noqa: F401  (numpy only: the mask planner's too)
from analysis.core.errors import InputError


def as_gates(gates, geometry) -> torch.Tensor:
    """Validate gates against the geometry; returns a float tensor [L, H] or [B, L, H].

    A torch tensor is used as is (so it may require grad); arrays and lists are converted."""
    g = gates if isinstance(gates, torch.Tensor) else torch.as_tensor(np.asarray(gates, dtype=np.float32))
    if not g.is_floating_point():
        g = g.float()
    want = (geometry.n_layers, geometry.n_heads)
    if g.dim() not in (2, 3) or tuple(g.shape[-2:]) != want:
        raise InputError(f"Gates must have shape [{want[0]}, {want[1]}] (layers x heads) or "
                         f"[batch, {want[0]}, {want[1]}]; got {list(g.shape)}.")
    if not torch.isfinite(g.detach()).all():
        raise InputError("Gates contain NaN or infinity; use 1 to keep a head and 0 to prune it.")
    return g


def gates_from_mask(pruned) -> torch.Tensor:
    """Boolean pruned-mask [L, H] (or [B, L, H]) -> gates 1 - pruned (float32)."""
    return 1.0 - torch.as_tensor(np.asarray(pruned, dtype=bool)).float()


_FULL_PRECISION = (torch.float32, torch.float64)


def _gate_for(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gate on x's device (under a device_map each layer's input may be elsewhere), in x's
    dtype for float32/64 inputs and in float32 for half types: the product is then formed in
    float32 and rounded once, and a gate's gradient is reduced in float32, not in bfloat16."""
    return gate.to(device=x.device, dtype=x.dtype if x.dtype in _FULL_PRECISION else torch.float32)


def _scale_heads(x: torch.Tensor, gate: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Multiply each head's slice of O's input by its gate.

    x: [N, ..., H*d]; gate: [H] or [B, H] with N = B * n. Returns x's shape and dtype."""
    *lead, width = x.shape
    d = width // n_heads
    xh = x.reshape(*lead, n_heads, d)                                  # [N, ..., H, d]
    g = _gate_for(gate, x)
    if gate.dim() == 1:
        return (xh * g[:, None]).reshape(x.shape).to(x.dtype)          # gate [H, 1]
    B = gate.shape[0]
    N = lead[0]
    if N % B:
        raise InputError(f"Input batch {N} is not a multiple of the {B} gate vectors; repeat each "
                         "input once per mask (all copies for mask 0 first).")
    xb = xh.reshape(B, N // B, *lead[1:], n_heads, d)                  # [B, n, ..., H, d]
    g = g.reshape(B, *([1] * len(lead)), n_heads, 1)                   # [B, 1, ..., H, 1]
    return (xb * g).reshape(x.shape).to(x.dtype)


@contextmanager
def head_mask(model, gates, *, adapter: Adapter | None = None):
    """Inside this context, `model` runs with head h of layer l scaled by gates[..., l, h].

    gates: [L, H] or [B, L, H] (1 keep, 0 prune). Layers whose gates are all exactly 1 get no
    hook (bit-identical to the dense model). Hooks are removed even if the body raises."""
    adapter = adapter or adapter_for(model)
    geometry = adapter.geometry(model)
    g = as_gates(gates, geometry)
    width = geometry.n_heads * geometry.head_dim

    def make_hook(layer_gate):
        def hook(module, args):
            x = args[0]
            if x.shape[-1] != width:
                raise InputError(f"Output projection input has width {x.shape[-1]}, expected H*d = {width}.")
            return (_scale_heads(x, layer_gate, geometry.n_heads), *args[1:])
        return hook

    with attached() as hooks:
        for layer in range(geometry.n_layers):
            layer_gate = g[..., layer, :]                              # [H] or [B, H]
            if not layer_gate.requires_grad and bool((layer_gate == 1).all()):
                continue
            hooks.before(adapter.o_proj(model, layer), make_hook(layer_gate))
        yield model


def zero_heads(model, pruned, *, adapter: Adapter | None = None):
    """Weight-space twin of `head_mask`: zero pruned heads IN PLACE (call it on a copy you own).

    Zeroes each pruned head's Q rows and Q bias and O columns; for KV groups whose query heads
    are all pruned, their K/V rows and biases. O's bias is shared and kept. Returns `model`."""
    adapter = adapter or adapter_for(model)
    geometry = adapter.geometry(model)
    p = np.asarray(pruned, dtype=bool)
    if p.shape != (geometry.n_layers, geometry.n_heads):
        raise InputError(f"Mask must have shape [{geometry.n_layers}, {geometry.n_heads}]; got {list(p.shape)}.")
    empty = kv_groups_emptied(p, geometry.group_size)                  # [L, H_kv]
    for layer in range(geometry.n_layers):
        if not p[layer].any():
            continue
        hw = adapter.read_heads(model, layer, geometry)
        heads, groups = torch.from_numpy(p[layer]), torch.from_numpy(empty[layer])
        hw.q[heads] = 0                                                # [H, d, D]
        hw.o[heads] = 0                                                # [H, d, D_out]
        hw.k[groups] = 0                                               # [H_kv, d, D]
        hw.v[groups] = 0
        for bias, sel in ((hw.q_bias, heads), (hw.k_bias, groups), (hw.v_bias, groups)):
            if bias is not None:
                bias[sel] = 0
        adapter.write_heads(model, layer, hw)
    return model
