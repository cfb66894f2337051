"""Head attribution with Captum Integrated Gradients over the head gates.

Every head gets a gate g in [0, 1] through `analysis.arch.head_gates.head_mask` (gate tensors may
require grad). With f(g) = mean next-token NLL of the text under gates g, Integrated Gradients
from the baseline g = 0 (every head off) to g = 1 (the dense model) attributes
f(1) - f(0) to the heads:  attr_h = integral over a in [0, 1] of df/dg_h at g = a * 1.
Completeness: sum_h attr_h = f(1) - f(0) up to the quadrature error (Captum's convergence
delta). Importance = -attr (a head whose gate lowers the loss is important). This is the
path-integrated version of Michel et al.'s head-gate gradient (docs/DEFINITIONS.md, baselines).
`integrated_gate_gradients` is the one Captum call; the "gate-ig" scorer uses it too.

`rank_correlation` compares any importance view with the ablation oracle (Spearman's rho).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from analysis.measure.tokens import as_sequences, text_sequences
from analysis.arch.adapters import adapter_for, input_device
from analysis.core.errors import InputError
from analysis.arch.head_gates import head_mask
from analysis.measure.loss import lm_sequence_losses
from analysis.core.progress import Progress, ShouldStop, check_stop, report


@dataclass(frozen=True)
class Attribution:
    importance: np.ndarray     # [L, H] -attribution: loss increase the head's gate path prevents
    attribution: np.ndarray    # [L, H] raw IG attribution of f = mean NLL
    loss_dense: float          # f(1)
    loss_baseline: float       # f(baseline), every head off by default
    convergence_delta: float   # sum(attribution) - (f(1) - f(baseline))
    n_steps: int


def gate_loss_fn(model, ids: torch.Tensor, geometry, *, kind: str = "causal-lm", mask_token_id: int | None = None,
                 adapter=None, on_call=None):
    """f(gates [B, L*H]) -> mean LM loss per gate row [B] over ids [n, T] (differentiable in gates).

    The loss is `analysis.measure.loss.lm_sequence_losses` of `kind`, averaged over the n sequences."""
    x = as_sequences(ids, "Attribution").to(input_device(model))       # [n, T]

    def f(flat_gates: torch.Tensor) -> torch.Tensor:
        if on_call is not None:
            on_call()
        B = flat_gates.shape[0]
        gates = flat_gates.reshape(B, geometry.n_layers, geometry.n_heads)  # [B, L, H]
        with head_mask(model, gates, adapter=adapter):
            losses = lm_sequence_losses(model, kind, x.repeat(B, 1), mask_token_id=mask_token_id)  # [B*n]
        return losses.reshape(B, -1).mean(1).cpu()                       # [B] where the gates are (the CPU)
    return f


def integrated_gate_gradients(f, geometry, *, n_steps: int, baseline: float = 0.0,
                              method: str = "gausslegendre", internal_batch_size: int | None = None,
                              with_delta: bool = False) -> tuple[torch.Tensor, float | None]:
    """Captum Integrated Gradients of f(gates [B, L*H]) -> [B] from gates = baseline to gates = 1.

    Returns the attribution [L, H] (detached) and, with `with_delta`, the convergence delta
    sum(attr) - (f(1) - f(baseline)) (two extra evaluations of f), else None. Captum
    differentiates with torch.autograd.grad w.r.t. the gates only: no parameter's .grad is
    written, so a shared model is not touched."""
    from captum.attr import IntegratedGradients
    ones = torch.ones(1, geometry.n_total_heads)                        # [1, L*H]
    base = torch.full_like(ones, float(baseline))                       # [1, L*H]
    with torch.enable_grad():
        out = IntegratedGradients(f).attribute(ones, baselines=base, n_steps=n_steps, method=method,
                                               internal_batch_size=internal_batch_size,
                                               return_convergence_delta=with_delta)
    attr, delta = out if with_delta else (out, None)
    attr = attr.detach().reshape(geometry.n_layers, geometry.n_heads)   # [L, H]
    return attr, None if delta is None else float(delta.reshape(-1)[0])


class GateAttribution:
    """Integrated Gradients over head gates (Captum); one verb: attribute."""

    def __init__(self, n_steps: int = 16, batch_size: int = 4, baseline: float = 0.0,
                 method: str = "gausslegendre"):
        if n_steps < 1:
            raise InputError(f"n_steps = {n_steps}; Integrated Gradients needs at least one step.")
        self.n_steps, self.batch_size, self.baseline, self.method = n_steps, max(1, batch_size), baseline, method

    def attribute(self, model, ids, *, progress: Progress | None = None,
                  should_stop: ShouldStop | None = None) -> Attribution:
        x = as_sequences(ids, "Attribution")                           # [n, T]
        adapter = adapter_for(model)
        geo = adapter.geometry(model)
        n_calls = -(-self.n_steps // self.batch_size)
        calls = [0]

        def on_call():
            check_stop(should_stop, "Head attribution")
            calls[0] += 1
            report(progress, min(calls[0] / n_calls, 1.0), "head attribution: integrated gradients")

        f = gate_loss_fn(model, x, geo, adapter=adapter, on_call=on_call)
        attr, delta = integrated_gate_gradients(f, geo, n_steps=self.n_steps, baseline=self.baseline,
                                                method=self.method, internal_batch_size=self.batch_size,
                                                with_delta=True)        # [L, H]
        with torch.no_grad():
            ones = torch.ones(1, geo.n_total_heads)                    # [1, L*H]
            ends = f(torch.cat([ones, torch.full_like(ones, float(self.baseline))]))  # [2]: f(1), f(baseline)
        a = attr.double().cpu().numpy()
        return Attribution(-a, a, float(ends[0]), float(ends[1]), delta, self.n_steps)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho between two [L, H] importance arrays (NaN entries of either are dropped)."""
    from scipy.stats import spearmanr
    x, y = np.asarray(a, dtype=float).reshape(-1), np.asarray(b, dtype=float).reshape(-1)
    if x.shape != y.shape:
        raise InputError(f"Cannot compare importance arrays of {x.size} and {y.size} heads.")
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        raise InputError("Rank correlation needs at least three heads with finite values in both arrays.")
    return float(spearmanr(x[keep], y[keep]).statistic)


def head_attribution(loaded, text: str | bytes | None = None, *, max_tokens: int = 64, seq_len: int = 64,
                     n_steps: int = 16, batch_size: int = 4, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> Attribution:
    """Integrated-gradients head importance of a causal LM on `text` (None = built-in text)."""
    if loaded.kind != "causal-lm":
        raise InputError(f"Head attribution needs a causal LM's loss; a {loaded.kind} model is not supported. "
                         "Use the single-head ablation view instead.")
    ids = text_sequences(loaded.tokenizer, text, max_tokens=max_tokens, seq_len=seq_len)  # [n, T]
    return GateAttribution(n_steps, batch_size).attribute(loaded.model, ids, progress=progress,
                                                          should_stop=should_stop)
