"""Greedy decoding with any KV cache: a prompt's prefill, then one token a step (the model's own argmax).

The one decode loop of headscope: the KV plan's tests and speed report (analysis.compress.kvruntime re-exports
`greedy`) and the long-context probes' generated answers (analysis.measure.probes.longcontext) run it.

    run = greedy(model, ids, steps, cache=None)          # prefill ids [B, T], then `steps` tokens
    last, cache = prefill(model, ids, cache=None)        # or in two halves, to branch the cache in between
    run = decode(model, last, cache, steps)

`cache` is whatever the model takes as `past_key_values`: None (the model's own DynamicCache), or a cut's
cache (analysis.arch.cut.Cut.new_cache: a KV plan's compact cache, used inside `cut.running()`). Rows of a
batch share their length (no padding: a windowed head's band starts at token 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from analysis.arch.adapters import input_device


@dataclass
class GreedyRun:
    """A greedy decode: the prompt's last logits and each step's, the tokens chosen, the cache's bytes."""
    tokens: torch.Tensor                 # [B, steps] chosen tokens
    logits: torch.Tensor                 # [B, steps, V] the logits each token was chosen from
    kv_bytes: list[int]                  # after the prompt, then after each step that fed a token


@torch.no_grad()
def prefill(model: nn.Module, ids: torch.Tensor, *, cache=None) -> tuple[torch.Tensor, object]:
    """Run the prompt ids [B, T] into `cache` (None: the model's own): (the last position's logits [B, V], the
    cache), the LM head on that position only."""
    out = model(input_ids=ids.to(input_device(model)), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], out.past_key_values                         # [B, V]


@torch.no_grad()
def decode(model: nn.Module, last: torch.Tensor, cache, steps: int, *,
           kv_bytes: Callable[[object], int] | None = None) -> GreedyRun:
    """`steps` greedy tokens from the logits last [B, V] of the prompt in `cache`: each step takes the argmax and
    feeds it (the last one is chosen, not fed). kv_bytes(cache) is recorded before every step."""
    sizes, chosen, logits = [], [], []
    for step in range(steps):
        if kv_bytes is not None:
            sizes.append(kv_bytes(cache))
        token = last.argmax(-1, keepdim=True)                             # [B, 1]
        chosen.append(token)
        logits.append(last)
        if step + 1 < steps:
            last = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]   # [B, V]
    if not steps:
        return GreedyRun(last.new_zeros((last.shape[0], 0), dtype=torch.long), last.new_zeros((last.shape[0], 0,
                                                                                               last.shape[-1])), sizes)
    return GreedyRun(torch.cat(chosen, 1), torch.stack(logits, 1), sizes)


def greedy(model: nn.Module, ids: torch.Tensor, steps: int, *, cache=None,
           kv_bytes: Callable[[object], int] | None = None) -> GreedyRun:
    """Prefill `ids` [B, T] and decode `steps` tokens greedily, one step each, with `cache` (None: the
    model's own DynamicCache). kv_bytes(cache) is recorded after the prompt and after every step."""
    last, cache = prefill(model, ids, cache=cache)
    return decode(model, last, cache, steps, kv_bytes=kv_bytes)
