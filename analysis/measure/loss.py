"""The language-model loss: token negative log-likelihood, defined once.

Every module that needs an LM loss (scorers, the ablation sweeps, attribution, perplexity)
calls these helpers, so "the loss" means the same numbers everywhere:

- `token_nll(logits, targets)`: the NLL of each target token under its logits, computed in at
  least float32 (half-precision logits are upcast; float64 stays float64). Keeps the graph.
- `next_token_nll(logits, ids)`: a causal LM's per-position NLL of the next token.
- `lm_sequence_losses(model, kind, ids, ...)`: mean token NLL per sequence for a causal LM (next
  token) or a masked LM (a seeded 15% of the positions masked, at least one, scored there only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from analysis.arch.adapters import input_device
from analysis.core.errors import InputError, UnsupportedModelError, check_seed

LM_KINDS = ("causal-lm", "masked-lm")
MLM_PROBABILITY = 0.15


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token NLL. logits [..., V], targets [...] (int) -> [...] float32 (float64 for float64 logits)."""
    logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")  # [N]
    return nll.reshape(targets.shape)                                    # [...]


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Causal NLL of each next token. logits [B, T, V], ids [B, T] -> [B, T-1]."""
    return token_nll(logits[:, :-1], ids[:, 1:])                        # [B, T-1]


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row summed NLL in float64. logits [R, T', V], targets [R, T'] -> [R]."""
    return token_nll(logits, targets).double().sum(-1)                   # [R]


def masked_positions(shape: torch.Size, seed: int = 0) -> torch.Tensor:
    """The seeded MLM_PROBABILITY share of positions [B, T] to mask, at least one per row (bool)."""
    g = torch.Generator().manual_seed(check_seed(seed, "The masking seed"))
    chosen = torch.rand(shape, generator=g) < MLM_PROBABILITY            # [B, T]
    chosen[:, 0] |= ~chosen.any(dim=1)
    return chosen


def lm_sequence_losses(model, kind: str, ids: torch.Tensor, *, mask_token_id: int | None = None,
                       seed: int = 0) -> torch.Tensor:
    """Mean token NLL of each sequence of ids [B, T] -> [B] (keeps the graph).

    kind "causal-lm": next-token NLL over positions 1..T-1; "masked-lm": the seeded positions of
    `masked_positions` replaced by `mask_token_id` and scored there only. The ids go to the
    model's input device; the losses are float32 at least, on that device."""
    ids = ids.to(input_device(model))                                    # [B, T]
    if kind == "causal-lm":
        logits = model(input_ids=ids, use_cache=False).logits            # [B, T, V]
        return next_token_nll(logits, ids).mean(dim=1)                   # [B]
    if kind == "masked-lm":
        if mask_token_id is None:
            raise InputError("Masked-LM calibration needs the tokenizer's mask token; load the model "
                             "with load_model(...) so its tokenizer comes along.")
        chosen = masked_positions(ids.shape, seed).to(ids.device)        # [B, T]
        logits = model(input_ids=ids.masked_fill(chosen, mask_token_id)).logits  # [B, T, V]
        nll = token_nll(logits, ids)                                     # [B, T]
        return (nll * chosen).sum(dim=1) / chosen.sum(dim=1)             # [B]
    raise UnsupportedModelError(f"A language-model loss needs an LM head; a {kind!r} model has none.")
