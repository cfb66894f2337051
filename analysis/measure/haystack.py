"""Long contexts built offline: a haystack of real text with a needle placed at a chosen depth.

One home for what the long-context probes (analysis/measure/probes/) and the retrieval / streaming head
measurements read. The haystack is English Wikipedia lead paragraphs from the built-in evaluation half
(analysis.core.text; CC BY-SA 4.0) for test rows, the calibration half for calibration rows
(analysis.measure.splits), drawn in a seeded order and tokenized article by article until it
holds the tokens asked for, so items with different seeds read different text and no item needs the
whole corpus tokenized. A needle (any token ids) goes in at a depth in [0, 1] of the haystack, right
after the sentence end nearest that depth, so it never splits a word.

Shapes: a haystack is ids [N]; `place` returns ids [N + k] and where the needle starts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from analysis.core.errors import InputError
from analysis.core.progress import ShouldStop, check_stop
from analysis.core.text import ARTICLE_SEPARATOR, calibration_articles, evaluation_articles
from analysis.measure.splits import TEST, salted, text_half

MAX_HAYSTACK_TOKENS = 2**20          # 1 M tokens: far beyond any model this runs on, far below the corpus


def haystack(tokenizer, n_tokens: int, *, seed: int = 0, split: str = TEST,
             should_stop: ShouldStop | None = None) -> torch.Tensor:
    """ids [n_tokens] of articles in a seeded order (separated as the corpus joins them): the evaluation half of
    the built-in text for the test split, the calibration half for calibration rows (analysis.measure.splits). A
    cancel point before every article (a fraction of a millisecond each), so Ctrl-C or Stop ends the build of a
    long context at once, not after the dozens of 8k-token haystacks a run builds."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 1 <= n_tokens <= MAX_HAYSTACK_TOKENS:
        raise InputError(f"A haystack holds 1 to {MAX_HAYSTACK_TOKENS} tokens; got {n_tokens!r}.")
    articles = calibration_articles() if text_half(split) == "calibration" else evaluation_articles()
    order = list(range(len(articles)))
    random.Random(salted(split, f"headscope-haystack:{seed}")).shuffle(order)
    pieces, have = [], 0
    for i in order:
        check_stop(should_stop, "Building the long contexts")
        ids = tokenizer(articles[i].text + ARTICLE_SEPARATOR, add_special_tokens=False, verbose=False)["input_ids"]
        pieces.append(torch.tensor(ids, dtype=torch.long))
        have += len(ids)
        if have >= n_tokens:
            return torch.cat(pieces)[:n_tokens]                        # [n_tokens]
    raise InputError(f"The built-in text holds {have} tokens for this tokenizer, fewer than the {n_tokens} asked for.")


def sentence_ends(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """Indices i of `ids` [N] after which a sentence or paragraph ends (token i ends with '.', '!', '?' or
    holds a line break): where a needle can go without splitting a word."""
    pieces = tokenizer.convert_ids_to_tokens(ids.tolist())
    text = [tokenizer.convert_tokens_to_string([p]) for p in pieces]
    return torch.tensor([i for i, t in enumerate(text) if t.rstrip(" ").endswith((".", "!", "?")) or "\n" in t],
                        dtype=torch.long)


@dataclass(frozen=True)
class Placed:
    """A needle in a haystack: ids [N + k], the needle at ids[start:start + k]."""
    ids: torch.Tensor
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def place(filler: torch.Tensor, needle, depth: float, *, ends: torch.Tensor | None = None) -> Placed:
    """`needle` (ids [k]) inserted into `filler` (ids [N]) after the boundary nearest depth * N (any index
    when `ends` is None or empty; depth 0 puts it first, 1 last)."""
    if not 0.0 <= float(depth) <= 1.0:
        raise InputError(f"A needle's depth is a fraction of the context, 0 to 1; got {depth}.")
    needle = torch.as_tensor(needle, dtype=torch.long).flatten()       # [k]
    N = filler.numel()
    at = round(float(depth) * N)
    if ends is not None and ends.numel() and 0 < at < N:
        at = int(ends[(ends + 1 - at).abs().argmin()]) + 1             # just after the nearest sentence end
    ids = torch.cat([filler[:at], needle, filler[at:]])                 # [N + k]
    return Placed(ids, at, needle.numel())
