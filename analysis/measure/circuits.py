"""Weight circuits of single heads: the copying score of the OV circuit (Elhage et al. 2021).

Head h's OV circuit maps an input token to output logits through the head alone:
    M_h = U diag(gamma_f) W_O^h W_V^g diag(gamma_l) E^T        [V, V]
with E the token embedding [V, D], gamma_l the scale of layer l's input norm, W_V^g the value rows
of h's KV group [d, D], W_O^h its O columns [D, d], gamma_f the final norm's scale and U the
unembedding [V, D]. A copying head maps every token mostly to itself, i.e. M_h has mostly
positive eigenvalues. The copying score is Elhage et al.'s
    copying(h) = sum_i Re(lambda_i) / sum_i |lambda_i|      in [-1, 1] (1: all eigenvalues positive)
over M_h's eigenvalues. M_h has rank <= d, and the non-zero eigenvalues of A B equal those of B A,
so they are the eigenvalues of the d x d matrix
    K_h = W_V^g diag(gamma_l) (E^T U) diag(gamma_f) W_O^h     [d, d]
with E^T U [D, D] formed once: the score is exact over the WHOLE vocabulary (SmolLM2's 49,152
tokens included), with no trace proxy and no token sample. Layer norms' mean removal, their
biases and the norms' per-token scale are left out (the usual convention: they do not depend on
the token being copied). A head whose gate is 0 (or that was removed) has a zero circuit: score 0.

Decoders only (the unembedding comes from analysis.measure.dla.final_readout, which refuses
encoders with one clear line).
"""
from __future__ import annotations

import numpy as np
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.dla import final_readout
from analysis.measure.headmaps import Detection, gates_array, head_slots, layer_geometry, place, zero_pruned

_INPUT_NORMS = ("input_layernorm", "ln_1", "ln_attn", "self_attn_layer_norm", "input_layer_norm")


def copying_score(k: torch.Tensor) -> float:
    """sum Re(lambda) / sum |lambda| of a square matrix k (0 when it is zero)."""
    lam = torch.linalg.eigvals(k.double())                             # [d] complex
    mag = float(lam.abs().sum())
    return float(lam.real.sum()) / mag if mag > 0 else 0.0


def _input_gamma(layer_module, D: int) -> torch.Tensor:
    for name in _INPUT_NORMS:
        norm = getattr(layer_module, name, None)
        if norm is not None:
            w = getattr(norm, "weight", None)
            g = torch.ones(D, dtype=torch.float64) if w is None else w.detach().double().cpu()
            return g + 1.0 if type(norm).__name__.startswith("Gemma") else g
    return torch.ones(D, dtype=torch.float64)


def ov_circuits(model, layout=None) -> list[list[torch.Tensor]]:
    """K_h [d, d] (float64) for every head the model holds, per layer (see the module docstring)."""
    readout = final_readout(model)
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    emb = model.get_input_embeddings().weight.detach().double().cpu()  # [V, D]
    eu = emb.T @ readout.unembed                                       # [D, D]
    gf = readout.gamma                                                 # [D]
    layers = adapter.layers(model)
    out = []
    for l in range(geo.n_layers):
        lg = layer_geometry(model, l, geo, adapter)
        if lg.n_heads == 0:
            out.append([])
            continue
        hw = adapter.read_heads(model, l, lg)
        gl = _input_gamma(layers[l], emb.shape[1])
        mid = (gl[:, None] * eu) * gf[None, :]                          # [D, D] diag(gl) E^T U diag(gf)
        ks = []
        for h in range(lg.n_heads):
            v = hw.v[h // lg.group_size].double().cpu()                # [d, D]
            o = hw.o[h].double().cpu()                                 # [d, D]: W_O^h transposed
            ks.append(v @ mid @ o.T)                                   # [d, d]
        out.append(ks)
    return out


class CopyingDetector:
    """Copying score of every head's OV circuit (weights only); one verb: detect."""
    name = "copying"
    threshold = 0.7
    unit = "eigenvalue share"

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        geo = adapter_for(model).geometry(model)
        slots = head_slots(model, layout)
        circuits = ov_circuits(model, layout)
        per_layer = []
        for l, ks in enumerate(circuits):
            check_stop(should_stop, "Copying scores")
            per_layer.append([copying_score(k) for k in ks] or None)
            report(progress, (l + 1) / len(circuits), "copying scores: OV circuits")
        scores = zero_pruned(place(per_layer, slots, geo.n_heads), gates_array(model, gates))
        return Detection(self.name, scores, self.threshold, self.unit,
                         dict(method="exact eigenvalues of the d x d factor of the full-vocabulary OV circuit"))


# Ordinal sequences for successor heads (Gould et al. 2023, "Successor Heads"): each list in order.
ORDINALS = (
    [str(i) for i in range(1, 10)],
    ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"],
    ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"],
    ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
     "November", "December"],
    [chr(c) for c in range(ord("A"), ord("Z") + 1)],
)
MIN_ORDINALS = 3


def ordinal_token_ids(tokenizer) -> list[list[int]]:
    """The ORDINALS lists as single-token ids (a leading-space form where the tokenizer has one,
    else the bare word); words that are not one token are dropped, lists left under 3 are dropped."""
    out = []
    for words in ORDINALS:
        for form in (" {}", "{}"):
            ids = [tokenizer(form.format(w), add_special_tokens=False)["input_ids"] for w in words]
            run = [i[0] for i in ids if len(i) == 1]
            if len(run) == len(words):
                out.append(run)
                break
        else:
            run = [i[0] for i in ids if len(i) == 1]
            if len(run) >= MIN_ORDINALS:
                out.append(run)
    return out


class SuccessorDetector:
    """Successor heads from the OV circuit: does the head map an ordinal token (1, Monday, January,
    ...) to the NEXT one (2, Tuesday, February)? Score = share of ordinal tokens whose highest
    OV-circuit logit among the tokens of the same list is their successor (chance = 1 / list length).
    Uses the raw token embeddings (through the layer's input-norm scale); Gould et al. read the
    embeddings after the first MLP, so this is the direct-path version. Weights only, decoders only;
    one verb: detect."""
    name = "successor"
    threshold = 0.5
    unit = "share of ordinals"

    def __init__(self, categories: list[list[int]] | None = None, tokenizer=None, **_):
        self.categories = categories if categories is not None else (
            ordinal_token_ids(tokenizer) if tokenizer is not None else None)

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        from analysis.core.errors import InputError
        cats = [list(map(int, c)) for c in (self.categories or []) if len(c) >= MIN_ORDINALS]
        if not cats:
            raise InputError("The successor detector needs ordinal tokens (a tokenizer with single-token digits, "
                             "days or months); this model's tokenizer gives none.")
        readout = final_readout(model)
        adapter = adapter_for(model)
        geo = adapter.geometry(model)
        slots = head_slots(model, layout, adapter)
        emb = model.get_input_embeddings().weight.detach().double().cpu()   # [V, D]
        layers = adapter.layers(model)
        per_layer = []
        for l in range(geo.n_layers):
            check_stop(should_stop, "Successor scores")
            lg = layer_geometry(model, l, geo, adapter)
            if lg.n_heads == 0:
                per_layer.append(None)
                continue
            hw = adapter.read_heads(model, l, lg)
            gl = _input_gamma(layers[l], emb.shape[1])
            scores = np.zeros(lg.n_heads)
            for h in range(lg.n_heads):
                v = hw.v[h // lg.group_size].double().cpu()            # [d, D]
                o = hw.o[h].double().cpu()                             # [d, D]
                hits, total = 0, 0
                for cat in cats:
                    idx = torch.as_tensor(cat)
                    src = (emb[idx] * gl) @ v.T                        # [k, d] values of the ordinal tokens
                    out = (src @ o) * readout.gamma                    # [k, D] written, through the final scale
                    logits = out @ readout.unembed[idx].T              # [k, k] row i: input token i
                    best = logits[:-1].argmax(-1)                      # [k-1]
                    hits += int((best == torch.arange(1, len(cat))).sum())
                    total += len(cat) - 1
                scores[h] = hits / total
            per_layer.append(scores)
            report(progress, (l + 1) / geo.n_layers, "successor scores: OV circuits")
        scores = zero_pruned(place(per_layer, slots, geo.n_heads), gates_array(model, gates))
        return Detection(self.name, scores, self.threshold, self.unit,
                         dict(categories=len(cats), ordinal_tokens=sum(len(c) for c in cats)))
