"""Token batches, as every measurement reads them.

`as_sequences`: the one preamble of a measurement over token ids (one sequence [T] becomes a batch of
one, [1, T]; every sequence needs at least two tokens, one clear line otherwise). `split_sequences` /
`text_sequences`: a text (None = the built-in evaluation text) cut into equal sequences.
"""
from __future__ import annotations

import torch

from analysis.core.errors import InputError


def as_sequences(ids, what: str = "This measurement") -> torch.Tensor:
    """ids [T] or [n, T] -> long [n, T]; InputError naming `what` when a sequence has fewer than two tokens."""
    x = torch.as_tensor(ids, dtype=torch.long)
    x = x.unsqueeze(0) if x.dim() == 1 else x                           # [n, T]
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 2:
        raise InputError(f"{what} needs token sequences of at least two tokens ([n, T] with T >= 2); got shape "
                         f"{list(x.shape)}. Use a longer text.")
    return x


def split_sequences(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """ids [N] -> [n, T] equal-length sequences with T <= seq_len; drops fewer than n tail tokens."""
    N = ids.numel()
    n = max(1, -(-N // seq_len))
    T = N // n
    return ids[: n * T].reshape(n, T)                                    # [n, T]


def text_sequences(tokenizer, text: str | bytes | None, *, max_tokens: int, seq_len: int) -> torch.Tensor:
    """The first `max_tokens` tokens of `text` (None = the built-in evaluation text) as [n, T], T <= seq_len."""
    from analysis.measure.evaluation import default_text, token_ids
    ids = token_ids(tokenizer, default_text() if text is None else text, max_tokens=max_tokens)  # [N]
    return split_sequences(ids, seq_len)
