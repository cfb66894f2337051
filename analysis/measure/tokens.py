"""Token batches, as every measurement reads them.

`as_sequences`: the one preamble of a measurement over token ids (one sequence [T] becomes a batch of
one, [1, T]; every sequence needs at least two tokens, one clear line otherwise). `split_sequences` /
`text_sequences`: a text (None = the built-in evaluation text) cut into equal sequences.
`calibration_ids`: the calibration split (or a given text) as [n, T] (what the calibration scorers and
the INT8 outlier search read).
"""
from __future__ import annotations

import torch

from analysis.core.errors import InputError
from analysis.core.text import calibration_text, tokenize


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


def calibration_ids(tokenizer, n_sequences: int = 8, seq_len: int = 128, text: str | None = None) -> torch.Tensor:
    """Token ids [n_sequences, seq_len] cut from the calibration text (the built-in split by default).

    InputError when the text has fewer than n_sequences * seq_len tokens.
    """
    n_sequences, seq_len = int(n_sequences), int(seq_len)
    if n_sequences < 1 or seq_len < 2:
        raise InputError(f"Calibration needs at least 1 sequence of at least 2 tokens; got "
                         f"{n_sequences} x {seq_len}.")
    if tokenizer is None:
        raise InputError("Calibration needs the model's tokenizer; load the model with load_model(...).")
    need = n_sequences * seq_len
    text = calibration_text(max_chars=need * 12) if text is None else text
    ids = tokenize(tokenizer, text, max_tokens=need)[0]  # [T]
    if ids.numel() < need:
        raise InputError(f"The calibration text has {ids.numel()} tokens but {n_sequences} sequences of "
                         f"{seq_len} tokens need {need}. Give a longer text, or lower the number or length "
                         "of the calibration sequences.")
    return ids[:need].long().reshape(n_sequences, seq_len)  # [n, T]
