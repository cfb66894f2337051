"""Direct logit attribution (DLA): how much each head, on its own path, pushes up the logit of the
token that really comes next.

The residual stream that enters the final norm is a sum of parts: the embeddings (the input of
layer 0, position embeddings and any scaling included), and per layer its heads' outputs
z_h W_O^h (head h's slice of the output projection's input times O's columns h*d..h*d+d-1), O's
shared bias, and the rest of the layer (the MLP: the layer's output minus its input minus
O's output). Freezing the final norm at the value it has on the full residual (its per-token
scale 1 / rms(x), or 1 / std(x) with the mean removed for a LayerNorm) makes the readout linear,
so each part c gets the logit
    DLA(c)[t] = U[y_{t+1}] . (gamma * P(c_t) / s_t)
with U the unembedding, gamma the norm's scale, P the LayerNorm's mean removal (identity for
RMSNorm), s_t the frozen scale and y_{t+1} the correct next token. The norm's bias and the
unembedding's bias are one constant part. The parts sum to the logit of the frozen readout
exactly (tested in float64); a head's DLA averaged over the text's predictions is its L x H map
entry. Follows Elhage et al. 2021 ("A Mathematical Framework for Transformer Circuits") and
TransformerLens' `decompose_resid` / `stack_head_results` with `apply_ln`.

Decoders only: an encoder has no unembedding after a final norm (MiniLM has no LM head at all,
BERT's MLM head has a non-linear transform), so DLA refuses it with one clear line. A final norm
that is neither an RMSNorm nor a LayerNorm, logit soft-capping, or a projection between the norm
and the unembedding is refused too, and every run checks that the parts rebuild the captured
final residual and norm output (so an architecture this module misreads fails loudly).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from analysis.arch.hooks import attached
from analysis.measure.tokens import as_sequences
from analysis.arch.adapters import adapter_for, input_device
from analysis.arch.models import model_kind
from analysis.core.errors import InputError, UnsupportedModelError
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.headmaps import (Detection, gates_array, head_slots, layer_geometry, masked,
                                       zero_pruned)

_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "decoder.final_layer_norm")
RESIDUAL_CHECK = 1e-3     # relative error allowed between the rebuilt and the captured final residual


@dataclass
class Readout:
    """The final norm and the unembedding, as the frozen linear readout needs them (float64, CPU)."""
    norm: nn.Module
    centered: bool                 # LayerNorm (mean removed) vs RMSNorm
    eps: float
    gamma: torch.Tensor            # [D] effective scale
    beta: torch.Tensor | None      # [D]
    unembed: torch.Tensor          # [V, D]
    unembed_bias: torch.Tensor | None   # [V]

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen per-token scale s [..., 1] of residuals x [..., D] (float64)."""
        if self.centered:
            return (x.var(-1, unbiased=False, keepdim=True) + self.eps).sqrt()
        return (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's output on x [..., D] in float64 (what the frozen decomposition sums to)."""
        c = x - x.mean(-1, keepdim=True) if self.centered else x
        y = self.gamma * c / self.scale(x)
        return y if self.beta is None else y + self.beta

    def directions(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """dir [..., D] with DLA(c) = c . dir for residuals x [..., D] and target tokens [...]."""
        w = self.gamma * self.unembed[targets]                         # [..., D]
        if self.centered:
            w = w - w.mean(-1, keepdim=True)
        return w / self.scale(x)

    def constant(self, targets: torch.Tensor) -> torch.Tensor:
        """Logit from the norm's bias and the unembedding's bias, [...] per target."""
        out = torch.zeros(targets.shape, dtype=torch.float64)
        if self.beta is not None:
            out = out + self.unembed[targets] @ self.beta
        if self.unembed_bias is not None:
            out = out + self.unembed_bias[targets]
        return out


def _find(root: nn.Module, path: str):
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def final_readout(model) -> Readout:
    """The model's final norm + unembedding, or one clear line saying why it has none."""
    kind = model_kind(model.config)
    if kind != "causal-lm":
        raise InputError(f"Direct logit attribution and the copying score need an unembedding (a language-model "
                         f"head right after a final norm); this model is a {kind}, which has none. Use a decoder "
                         f"(causal LM) such as smollm2-135m.")
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None):
        raise UnsupportedModelError("This model soft-caps its logits (tanh), so they are not a sum of the "
                                    "components' contributions; direct logit attribution does not apply.")
    base = model.base_model
    if getattr(_find(base, "decoder") or base, "project_out", None) is not None:
        raise UnsupportedModelError("This model projects the residual between its final norm and the "
                                    "unembedding; direct logit attribution is not supported for it.")
    norm = next((m for m in (_find(base, p) for p in _FINAL_NORMS) if isinstance(m, nn.Module)), None)
    head = model.get_output_embeddings()
    if norm is None or not isinstance(head, nn.Linear):
        raise UnsupportedModelError("headscope cannot find this model's final norm and linear unembedding, so "
                                    "direct logit attribution is not available for it.")
    centered = isinstance(norm, nn.LayerNorm) or "LayerNorm" in type(norm).__name__
    weight = getattr(norm, "weight", None)
    D = head.weight.shape[1]
    gamma = torch.ones(D, dtype=torch.float64) if weight is None else weight.detach().double().cpu()
    if not centered and type(norm).__name__.startswith("Gemma"):
        gamma = gamma + 1.0                                            # Gemma's RMSNorm scales by (1 + w)
    bias = getattr(norm, "bias", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-5
    return Readout(norm, centered, float(eps), gamma,
                   None if bias is None else bias.detach().double().cpu(),
                   head.weight.detach().double().cpu(),
                   None if head.bias is None else head.bias.detach().double().cpu())


@dataclass
class DLAParts:
    """Per-prediction logit parts of one batch, t = 0 .. T-2 predicting token t+1 (float64)."""
    heads: np.ndarray        # [n, T-1, L, H] (0 for pruned / removed heads)
    embed: np.ndarray        # [n, T-1]
    o_bias: np.ndarray       # [n, T-1, L]
    mlp: np.ndarray          # [n, T-1, L] the rest of each layer (MLP, its bias)
    constant: np.ndarray     # [n, T-1] final norm bias + unembedding bias
    logit: np.ndarray        # [n, T-1] the frozen readout's logit of the correct token
    model_logit: np.ndarray  # [n, T-1] the model's own logit (differs only by the norm's precision)

    def total(self) -> np.ndarray:
        """Sum of all parts [n, T-1] (equals `logit`)."""
        return (self.heads.sum((2, 3)) + self.embed + self.o_bias.sum(2) + self.mlp.sum(2) + self.constant)


def _first(x):
    return x[0] if isinstance(x, tuple) else x


@torch.no_grad()
def logit_parts(model, ids: torch.Tensor, *, gates=None, layout=None) -> DLAParts:
    """DLA parts of the model on ids [n, T] (T >= 2), under the mask `gates` [L, H] (1 keep)."""
    x = as_sequences(ids, "Direct logit attribution (a next token to predict)")  # [n, T]
    readout = final_readout(model)
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    g = gates_array(model, gates)
    cap, final, out = _capture(model, x, g, adapter, geo.n_layers, readout)
    tgt = x[:, 1:]                                                     # [n, T-1] correct next tokens
    xf = _d64(final["x"])                                              # [n, T, D]
    direction = readout.directions(xf[:, :-1], tgt)                    # [n, T-1, D]
    embed, rebuilt, head_dla, o_bias, mlp = _layer_parts(model, cap, direction, adapter, geo)
    y_hat = _checked_readout(readout, rebuilt, xf, _d64(final["y"]), final["x"].dtype)
    heads = _in_slots(head_dla, head_slots(model, layout, adapter), x.shape, geo)   # [n, T-1, L, H]
    if g is not None:
        heads = heads * (g.detach().cpu().numpy() != 0)                # gate 0: exactly nothing (already 0)
    logit = (y_hat[:, :-1] * readout.unembed[tgt]).sum(-1)            # the norm's bias is inside y_hat
    if readout.unembed_bias is not None:
        logit = logit + readout.unembed_bias[tgt]
    model_logit = out.logits.detach().double().cpu()[:, :-1].gather(-1, tgt[..., None])[..., 0]
    return DLAParts(heads, embed.numpy(), o_bias, mlp, readout.constant(tgt).numpy(), logit.numpy(),
                    model_logit.numpy())


def _d64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().cpu()


def _capture(model, x: torch.Tensor, g, adapter, L: int, readout) -> tuple[dict, dict, object]:
    """One masked forward of x [n, T] that keeps each layer's input and output, each O's input z
    (gated: read after head_mask's gate) and output, and the final norm's input and output."""
    cap = dict(inp=[None] * L, out=[None] * L, z=[None] * L, o=[None] * L)
    final = {}

    def keep(key, l, value):
        cap[key][l] = value.detach()

    layers = adapter.layers(model)
    with masked(model, g), attached() as hooks:
        for l in range(L):
            hooks.before(layers[l], lambda m, a, kw, l=l: keep("inp", l, a[0] if a else kw["hidden_states"]),
                         with_kwargs=True)
            hooks.after(layers[l], lambda m, a, o, l=l: keep("out", l, _first(o)))
            o_proj = adapter.o_proj(model, l)
            hooks.before(o_proj, lambda m, a, l=l: keep("z", l, a[0]))  # after head_mask's gate: sees gated z
            hooks.after(o_proj, lambda m, a, o, l=l: keep("o", l, _first(o)))
        hooks.before(readout.norm, lambda m, a: final.__setitem__("x", a[0].detach()))
        hooks.after(readout.norm, lambda m, a, o: final.__setitem__("y", _first(o).detach()))
        out = model(input_ids=x.to(input_device(model)), use_cache=False)
    return cap, final, out


def _layer_parts(model, cap: dict, direction: torch.Tensor, adapter, geo):
    """Per layer: each head's DLA ([n, T-1, H_l] or None), O's bias and the MLP's part [n, T-1, L], from
    the captured residuals; also the embedding's part [n, T-1] and the residual rebuilt from the parts."""
    dot = lambda c: (_d64(c)[:, :-1] * direction).sum(-1)              # noqa: E731  [n, T-1]
    n, T = cap["inp"][0].shape[:2]
    L = geo.n_layers
    embed = dot(cap["inp"][0])
    rebuilt = _d64(cap["inp"][0]).clone()
    head_dla, o_bias, mlp = [], np.zeros((n, T - 1, L)), np.zeros((n, T - 1, L))
    for l in range(L):
        lg = layer_geometry(model, l, geo, adapter)
        delta = _d64(cap["out"][l]) - _d64(cap["inp"][l])              # [n, T, D]
        rebuilt += delta
        o_out = torch.zeros_like(delta) if cap["o"][l] is None else _d64(cap["o"][l])
        mlp[:, :, l] = dot(delta - o_out).numpy()
        if lg.n_heads == 0 or cap["z"][l] is None:
            head_dla.append(None)
            o_bias[:, :, l] = dot(o_out).numpy()
            continue
        hw = adapter.read_heads(model, l, lg)
        if hw.o_bias is not None:
            o_bias[:, :, l] = (direction @ hw.o_bias.double().cpu()).numpy()
        z = _d64(cap["z"][l])[:, :-1].reshape(n, T - 1, lg.n_heads, lg.head_dim)  # [n, T-1, H_l, d]
        back = torch.einsum("hde,nte->nthd", hw.o.double().cpu(), direction)      # [n, T-1, H_l, d]
        head_dla.append((z * back).sum(-1).numpy())                               # [n, T-1, H_l]
    return embed, rebuilt, head_dla, o_bias, mlp


def _checked_readout(readout, rebuilt: torch.Tensor, xf: torch.Tensor, y: torch.Tensor, dtype) -> torch.Tensor:
    """The frozen final norm applied to xf [n, T, D], after checking that the parts rebuild the residual
    and that the frozen norm reproduces the model's (UnsupportedModelError otherwise)."""
    scale = xf.abs().max().clamp_min(1e-12)
    tol = max(RESIDUAL_CHECK, 8 * torch.finfo(dtype).eps)              # bfloat16 / float16 sums round more
    if float((rebuilt - xf).abs().max() / scale) > tol:
        raise UnsupportedModelError("The layers' outputs do not add up to the residual that enters the final norm "
                                    "in this model, so direct logit attribution cannot decompose it.")
    y_hat = readout.apply(xf)
    if float((y_hat - y).abs().max() / y_hat.abs().max().clamp_min(1e-12)) > tol:
        raise UnsupportedModelError("This model's final norm is not an RMSNorm or LayerNorm headscope can freeze, "
                                    "so direct logit attribution is not available for it.")
    return y_hat


def _in_slots(head_dla: list, slots: list, shape, geo) -> np.ndarray:
    """Per-layer head DLA (kept heads of a pruned layout) in the original head slots: [n, T-1, L, H]."""
    n, T = shape
    heads = np.zeros((n, T - 1, geo.n_layers, geo.n_heads))
    for l, (vals, kept) in enumerate(zip(head_dla, slots)):
        if vals is not None and kept:
            heads[:, :, l, kept] = vals
    return heads


class DirectLogitDetector:
    """Each head's direct logit attribution to the correct next token on the text; one verb: detect."""
    name = "dla"
    threshold = 0.1        # logits: a head "writes the answer" when it adds >= 0.1 to it on average
    unit = "logit"

    def __init__(self, batch_size: int = 2):
        self.batch_size = max(1, batch_size)

    def detect(self, model, ids: torch.Tensor, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        x = as_sequences(ids, "Direct logit attribution (a next token to predict)")  # [n, T]
        total, count, parts = None, 0, None
        for s in range(0, x.shape[0], self.batch_size):
            check_stop(should_stop, "Direct logit attribution")
            p = logit_parts(model, x[s:s + self.batch_size], gates=gates, layout=layout)
            parts = parts or p
            block = p.heads.sum((0, 1))                                # [L, H]
            total = block if total is None else total + block
            count += p.heads.shape[0] * p.heads.shape[1]
            report(progress, min(s + self.batch_size, x.shape[0]) / x.shape[0], "direct logit attribution")
        scores = zero_pruned(total / count, gates_array(model, gates))
        first = parts.heads[0]                                         # [T-1, L, H] of the first sequence
        return Detection(self.name, scores, self.threshold, self.unit,
                         dict(per_token=first, targets=x[0, 1:].tolist(), n_predictions=count,
                              mean_logit=float(parts.logit.mean())))
