"""Helpers for the evaluation/ablation/roles/redundancy/attribution tests (issue 4).

Tiny random-weight models wrapped as LoadedModel with a real built-in tokenizer (so text paths
run end to end), a plain Hugging Face perplexity loop, and a pseudo-perplexity reference with
one full forward per masked copy. References here never call the code under test.
"""
import numpy as np
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.models import LoadedModel

from ._tiny import tiny_model


def tiny_loaded(model_type: str, tokenizer, kind: str, seed: int = 0, **overrides) -> LoadedModel:
    """A tiny model of `model_type` sized to `tokenizer`'s vocabulary, as a LoadedModel."""
    model = tiny_model(model_type, seed=seed, vocab_size=len(tokenizer), **overrides)
    adapter = adapter_for(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=f"tiny-{model_type}", kind=kind,
                       adapter=adapter, geometry=adapter.geometry(model), source="in-process")


@torch.no_grad()
def hf_loop_perplexity(model, ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """The Hugging Face perplexity guide's loop (model's own shifted loss), counting the tokens
    the shifted loss really averages over. ids [N]."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    N = ids.numel()
    for begin in range(0, N, stride):
        end = min(begin + window, N)
        trg_len = end - prev_end
        x = ids[begin:end].unsqueeze(0)                       # [1, T]
        y = x.clone()
        y[:, :-trg_len] = -100
        loss = model(input_ids=x, labels=y).loss
        valid = int((y[:, 1:] != -100).sum())
        nll_sum += float(loss) * valid
        n_tokens += valid
        prev_end = end
        if end == N:
            break
    return float(np.exp(nll_sum / n_tokens)), n_tokens


@torch.no_grad()
def reference_pseudo_perplexity(model, ids: torch.Tensor, positions, mask_id: int) -> float:
    """Salazar et al. straight from the definition: one full forward per masked copy. ids [T]."""
    nll = []
    for p in positions:
        x = ids.clone()
        x[p] = mask_id
        logits = model(input_ids=x.unsqueeze(0)).logits[0, p]  # [V]
        nll.append(-torch.log_softmax(logits.double(), -1)[ids[p]].item())
    return float(np.exp(np.mean(nll)))
