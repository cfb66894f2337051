"""Greedy decoding with any KV cache: a prompt's prefill, then one token a step (the model's own argmax).

The one decode loop of headscope. Its callers keep their own outputs:
- the harness's one-prompt generations (analysis.measure.harness.generate_greedy: stop rules, seconds, KV bytes
  per row; the harness's own generate_until runs analysis.measure.decode_rows, this loop's batched sibling);
- the long-context probes' generated answers (analysis.measure.probes.longcontext: a prefill, a branch of the
  cache for the teacher-forced digits, then `decode`);
- the KV plan's tests (analysis.compress.kvruntime re-exports `greedy`);
- the speed report's decode timing (analysis.compress.timing: `clock=`, the seconds of every step).

    run = greedy(model, ids, steps, cache=None)          # prefill ids [B, T], then up to `steps` tokens
    last, cache = prefill(model, ids, cache=None)        # or in two halves, to branch the cache in between
    run = decode(model, last, cache, steps)

Each step takes the argmax of the last logits and feeds it; the last token chosen is not fed (`steps` tokens
cost `steps - 1` decode calls after the prefill). Optional, per call:
- `stop` (`Stop`, one row): a token in `stop.eos` ends the run, or a rule of the whole sequence so far (the
  prompt + the new tokens: lm-eval's stop sequences); the token that stopped it is kept, as transformers'
  generate keeps it;
- `clock` (analysis.core.clock.Clock): the (wall, CPU) seconds of the prefill and of every decode call's forward,
  each read after the device has finished (CUDA / MPS synchronized), so a GPU's queued kernels are inside them;
- `kv_bytes(cache)`: recorded before every choice (after the prompt, then after each fed token);
- `progress` / `should_stop`: a report and a cancel check before every decode call.

`cache` is whatever the model takes as `past_key_values`: None (the model's own DynamicCache), or a cut's
cache (analysis.arch.cut.Cut.new_cache: a KV plan's compact cache, used inside `cut.running()`). Rows of a
batch share their length (no padding: a windowed head's band starts at token 0). Prompts of different lengths
in one batch (left padded, a stop rule per row): analysis.measure.decode_rows.greedy_rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from analysis.arch.adapters import input_device
from analysis.core.clock import Clock
from analysis.core.progress import Progress, ShouldStop, check_stop, report

STOPPED = ("length", "eos", "until")         # why a run ended: its budget of tokens, an EOS token, a stop rule


@dataclass(frozen=True)
class Stop:
    """When a one-row generation ends before its budget: its new token is in `eos`, or one of `until` (callables
    of the whole sequence so far [1, T + k] and None, as lm-eval's MultiTokenEOSCriteria is called) says so."""
    eos: tuple = ()
    until: tuple = ()

    def why(self, seq: torch.Tensor | None, token: int) -> str | None:
        """"eos", "until" or None for the new `token` ending the sequence `seq` [1, T + k]."""
        if token in self.eos:
            return "eos"
        if any(bool(rule(seq, None)) for rule in self.until):
            return "until"
        return None


@dataclass
class GreedyRun:
    """A greedy decode: the tokens chosen, the logits they were chosen from, the cache's bytes, why it ended and,
    with a clock, what it took."""
    tokens: torch.Tensor                 # [B, n] chosen tokens (n = steps unless a stop rule ended it)
    logits: torch.Tensor | None          # [B, n, V] the logits each token was chosen from (None: not kept)
    kv_bytes: list[int]                  # after the prompt, then after each step that fed a token
    stopped: str = "length"              # one of STOPPED
    prefill_seconds: tuple[float, float] | None = None          # (wall, CPU) of the prompt's forward (`greedy`)
    step_seconds: list[tuple[float, float]] = field(default_factory=list)   # (wall, CPU) of each decode call


@torch.no_grad()
def prefill(model: nn.Module, ids: torch.Tensor, *, cache=None) -> tuple[torch.Tensor, object]:
    """Run the prompt ids [B, T] into `cache` (None: the model's own): (the last position's logits [B, V], the
    cache), the LM head on that position only."""
    out = model(input_ids=ids.to(input_device(model)), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], out.past_key_values                         # [B, V]


@torch.no_grad()
def decode(model: nn.Module, last: torch.Tensor, cache, steps: int, *,
           kv_bytes: Callable[[object], int] | None = None, stop: Stop | None = None,
           prompt: torch.Tensor | None = None, clock: Clock | None = None, keep_logits: bool = True,
           progress: Progress | None = None, should_stop: ShouldStop | None = None,
           what: str = "The generation") -> GreedyRun:
    """Up to `steps` greedy tokens from the logits last [B, V] of the prompt in `cache`: each step takes the argmax
    and feeds it (the last one is chosen, not fed). `stop` (one row) may end it earlier; its `until` rules see
    `prompt` [1, T] + the new tokens. kv_bytes(cache) is recorded before every choice; `clock` times every decode
    call's forward (module docstring)."""
    if stop is not None and last.shape[0] != 1:
        raise ValueError(f"Stop rules judge one row; got a batch of {last.shape[0]}.")
    seq = prompt.to(last.device) if stop is not None and stop.until else None     # [1, T]
    sizes, chosen, kept, seconds, stopped = [], [], [], [], "length"
    for step in range(steps):
        if kv_bytes is not None:
            sizes.append(kv_bytes(cache))
        token = last.argmax(-1, keepdim=True)                             # [B, 1]
        chosen.append(token)
        if keep_logits:
            kept.append(last)
        if stop is not None:
            seq = None if seq is None else torch.cat([seq, token.to(seq.device)], dim=1)   # [1, T + k]
            stopped = stop.why(seq, int(token)) or stopped
            if stopped != "length":
                break
        if step + 1 == steps:
            break
        check_stop(should_stop, what)
        report(progress, (step + 1) / steps, f"{step + 1} tokens")
        start = clock.now() if clock is not None else None
        last = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]   # [B, V]
        if clock is not None:
            seconds.append(clock.since(start))
    B, V = last.shape
    tokens = torch.cat(chosen, 1) if chosen else last.new_zeros((B, 0), dtype=torch.long)
    logits = (torch.stack(kept, 1) if kept else last.new_zeros((B, 0, V))) if keep_logits else None
    return GreedyRun(tokens, logits, sizes, stopped, step_seconds=seconds)


def greedy(model: nn.Module, ids: torch.Tensor, steps: int, *, cache=None,
           kv_bytes: Callable[[object], int] | None = None, stop: Stop | None = None, clock: Clock | None = None,
           keep_logits: bool = True, progress: Progress | None = None, should_stop: ShouldStop | None = None,
           what: str = "The generation") -> GreedyRun:
    """Prefill `ids` [B, T] and decode up to `steps` tokens greedily with `cache` (None: the model's own
    DynamicCache); the options are `decode`'s, and `clock` times the prefill too."""
    check_stop(should_stop, what)
    start = clock.now() if clock is not None else None
    last, cache = prefill(model, ids, cache=cache)
    prefill_seconds = clock.since(start) if clock is not None else None
    run = decode(model, last, cache, steps, kv_bytes=kv_bytes, stop=stop, prompt=ids, clock=clock,
                 keep_logits=keep_logits, progress=progress, should_stop=should_stop, what=what)
    run.prefill_seconds = prefill_seconds
    return run
