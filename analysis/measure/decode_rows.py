"""Greedy decoding of several prompts at once: B prompts of different lengths, left padded, one batch.

The batched sibling of analysis.measure.decode (whose `greedy` runs one prompt, or rows of one length). Here

    run = greedy_rows(model, prompts, steps, stops=None, cache=None)   # prompts: B lists of ids, any lengths

pads every prompt on the left to the longest (`left_padded`), hands the model the attention mask (pads are
never read by a real token; `padding_mask`; the 2-D mask for a model with sliding layers, whose own masks
transformers builds from it) and each row's own position ids (its first real token is position 0, so RoPE sees what the
row alone would see), prefills the batch, then feeds every unfinished row's argmax one step at a time, the mask
growing by one column and each row's position by one. So each row's logits are its one-row run's, up to the
summation order of kernels over a longer, padded row (float32 rounding: tests/test_batched_generation.py bounds
it), and its greedy tokens are the one-row tokens wherever the top two logits are further apart than that.

The prefill: with the model's own cache (None) and no sliding-window layers, each prompt is prefilled alone
(`prefill_one_by_one`, the default: no padding, so the kernel keeps its causal fast path, e.g. sdpa's flash
kernel, and the first token's logits are the one-row logits bit for bit) and the B caches are left padded with
zero keys / values (never read: masked) and stacked into one; a long prompt fills the device alone, and a padded
batch prefill would pay for its pads and, on CPU, for a materialized mask. Otherwise (a cut's cache, a model
with sliding layers, or prefill_one_by_one=False) one padded prefill runs the batch. Batching pays in the decode
steps: one forward feeds every unfinished row.

Per row: a budget of tokens (`steps`, one number or one per row) and a `Stop` (analysis.measure.decode.Stop:
EOS ids, the harness's stop-sequence rules, judged on the row's own sequence: its unpadded prompt + its new
tokens). A row that is done (its budget, an EOS, a stop rule; the token that stopped it kept) leaves the batch:
its rows of the cache, the mask and the positions are dropped (`Cache.batch_select_indices`), so later steps
neither compute it nor change the others. Prompts of one length get no mask and no position ids (exactly the
calls of `decode.greedy`).

The cache: None (the model's own DynamicCache) or a cut's cache whose rows may be left padded: a cache that
keeps every token of the heads it keeps (DynamicCache; a KV plan's CompactCache without windowed heads). A
windowed head's cache or band numbers keys from index 0 (analysis.arch.spans, analysis.arch.kvcache), so left
padding would make pads its sinks: such a cache is refused here for prompts of different lengths
(`check_paddable`); run those one at a time (the harness does). A windowed plan on the masked path (spans
windows over a DynamicCache) cannot be told from its cache: its caller must not batch it either.

What is recorded (`RowsRun`), per row, from shared batch costs:
- `kv_bytes[i]` = (after the prompt, before the row's last choice): the cache's bytes x the row's own tokens /
  (rows in the batch x the padded length): the row's share by its tokens, which is exactly its one-row bytes
  for a cache whose bytes grow by a fixed amount per token and row (every cache this module accepts);
- `seconds(i)` = (row i's own prefill seconds when prefilled one by one, else the batch prefill's wall seconds
  / B; the sum over the decode calls that fed row i of each call's wall seconds / the rows it fed): the batch's
  seconds split evenly over the rows that shared each forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from analysis.arch.adapters import input_device
from analysis.core.clock import Clock
from analysis.core.errors import InputError
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.decode import Stop


@dataclass
class RowsRun:
    """A batched greedy decode (module docstring): per row its tokens, logits, why it ended, its share of the
    cache's bytes; the batch's seconds and which rows each decode call fed."""
    tokens: list[list[int]]                       # per row: the chosen ids (the one that stopped it included)
    logits: list[torch.Tensor] | None             # per row [n_i, V]: the logits each token was chosen from
    stopped: list[str]                            # per row: one of analysis.measure.decode.STOPPED
    kv_bytes: list[tuple[int, int]] | None        # per row: its share after the prompt, before its last choice
    prefill_seconds: tuple[float, float] | None = None                      # (wall, CPU) of the whole prefill
    step_seconds: list[tuple[float, float]] = field(default_factory=list)   # (wall, CPU) of each decode call
    step_rows: list[tuple[int, ...]] = field(default_factory=list)          # the rows each decode call fed
    row_prefill: list[tuple[float, float]] | None = None    # (wall, CPU) of each row's own prefill (one by one)

    def seconds(self, row: int) -> tuple[float, float]:
        """(prefill, decode) wall seconds of `row`: its own prefill (prefilled one by one) or its even share of
        the batch's, and its even share of every decode call that fed it."""
        if self.row_prefill is not None:
            prefill = self.row_prefill[row][0]
        else:
            prefill = self.prefill_seconds[0] / len(self.tokens) if self.prefill_seconds is not None else 0.0
        decode = sum(wall / len(rows) for (wall, _), rows in zip(self.step_seconds, self.step_rows) if row in rows)
        return prefill, decode


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int,
                device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B prompts of ids -> (ids [B, T] left padded with pad_id, mask [B, T] (1: a real token), positions [B, T]
    (each row's real tokens 0 .. n_i - 1, its pads 0)); T is the longest prompt."""
    lengths = [len(p) for p in prompts]
    if not prompts or min(lengths) < 1:
        raise InputError("Batched generation needs at least one prompt, each of at least one token.")
    T = max(lengths)
    ids = torch.full((len(prompts), T), int(pad_id), dtype=torch.long)             # [B, T]
    mask = torch.zeros((len(prompts), T), dtype=torch.long)                         # [B, T]
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.as_tensor(list(p), dtype=torch.long)            # [n_i]
        mask[i, T - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)                                  # [B, T]
    return ids.to(device), mask.to(device), positions.to(device)


def padding_mask(mask: torch.Tensor, queries: int, model: nn.Module) -> torch.Tensor:
    """The attention mask to hand the model for the last `queries` positions of rows whose real tokens are
    mask [b, S] (1: real): [b, 1, q, S], causal, no pad key read by a real query, and each pad query reading
    itself (a row of pads with nothing to read would be all -inf in an eager kernel's float32 softmax and give
    NaNs, which the real queries' zero weights would carry on: 0 x NaN); additive (0 / the dtype's min) for
    an eager kernel, bool (True: read) otherwise. A flash kernel, and a model with sliding layers (whose masks
    transformers builds per layer), take the 2-D mask [b, S] as it is."""
    from analysis.arch.attention import current_implementation
    implementation = current_implementation(model) or "eager"
    if implementation.startswith("flash") or _slides(model):
        return mask
    S = mask.shape[1]
    q_index = torch.arange(S - queries, S, device=mask.device)                     # [q]
    k_index = torch.arange(S, device=mask.device)                                   # [S]
    causal = k_index[None, :] <= q_index[:, None]                                   # [q, S]
    itself = k_index[None, :] == q_index[:, None]                                   # [q, S]
    allowed = causal[None] & ((mask[:, None, :] == 1) | itself[None])              # [b, q, S]
    allowed = allowed[:, None]                                                      # [b, 1, q, S]
    if implementation != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)                       # [b, 1, q, S]


def _slides(model: nn.Module) -> bool:
    """Whether some layer of the model reads a sliding window of its own (Mistral's sliding_window, Gemma-2/3's
    sliding layers): transformers must build those layers' masks from the 2-D mask, and their caches keep a
    window only."""
    cfg = model.config.get_text_config()
    types = getattr(cfg, "layer_types", None) or ()
    uses = getattr(cfg, "use_sliding_window", None)
    return any(t != "full_attention" for t in types) or (getattr(cfg, "sliding_window", None) is not None
                                                         and uses is not False)


def _prefill_one_by_one(model: nn.Module, prompts, T: int, clock: Clock | None, should_stop, what: str):
    """Each prompt's prefill alone (no padding: the kernel's causal fast path, the one-row logits exactly), its
    cache then left padded with zeros to T slots and stacked into the first row's DynamicCache (the mask hides
    the padded slots). -> (the last logits [B, V], the cache, each row's (wall, CPU) prefill seconds)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    device = input_device(model)
    lasts, caches, seconds = [], [], []
    for p in prompts:
        check_stop(should_stop, what)
        start = clock.now() if clock is not None else None
        out = model(input_ids=torch.as_tensor([list(p)], device=device), past_key_values=DynamicCache(),
                    use_cache=True, logits_to_keep=1)
        seconds.append(clock.since(start) if clock is not None else (0.0, 0.0))
        lasts.append(out.logits[:, -1])                                             # [1, V]
        caches.append(out.past_key_values)
    merged = caches[0]
    for l, layer in enumerate(merged.layers):
        if type(layer) is not DynamicLayer:
            raise InputError(f"Layer {l}'s cache is a {type(layer).__name__}; prompts prefilled one by one stack "
                             f"only DynamicLayers.")
        for name in ("keys", "values"):
            rows = [getattr(c.layers[l], name) for c in caches]                     # [1, h, n_i, d] each
            padded = [torch.nn.functional.pad(t, (0, 0, T - t.shape[-2], 0)) for t in rows]   # [1, h, T, d] each
            setattr(layer, name, torch.cat(padded, dim=0))                          # [B, h, T, d]
    return torch.cat(lasts, dim=0), merged, seconds                                 # [B, V]


def check_paddable(cache) -> None:
    """InputError for a cache that numbers keys from index 0 (a compact cache with windowed heads: left padding
    would make pads their sinks); None and every other cache pass."""
    from analysis.arch.kvcache import CompactCache
    if isinstance(cache, CompactCache) and any(layer.window_heads for layer in cache.layers):
        raise InputError("A KV plan with windowed heads generates one prompt at a time: its compact cache numbers "
                         "keys from the row's first slot, so left padding would make pads its sinks.")


def _share(total: int, own: int, rows: int, length: int) -> int:
    """A row's share of a cache of `total` bytes holding `rows` rows of `length` slots, by its `own` tokens."""
    return total * own // (rows * length)


@torch.no_grad()
def greedy_rows(model: nn.Module, prompts: Sequence[Sequence[int]], steps: int | Sequence[int], *,
                stops: Sequence[Stop | None] | None = None, cache=None, pad_id: int = 0,
                prefill_one_by_one: bool = True, kv_bytes: Callable[[object], int] | None = None,
                clock: Clock | None = None,
                keep_logits: bool = True, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, what: str = "The generation") -> RowsRun:
    """Up to steps[i] greedy tokens for each of the B prompts (lists of ids, any lengths), in one left-padded
    batch (module docstring). stops[i]: row i's Stop (None: its budget only); its `until` rules see the row's own
    prompt + new tokens [1, n_i + k]. kv_bytes(cache): the cache's bytes, read before every choice and shared out
    per row; `clock` times the prefill and every decode call; `progress` reports the fraction of the largest
    budget; `should_stop` is checked before the prefill and every decode call. prefill_one_by_one (with the
    model's own cache, no sliding layers): each prompt's prefill alone, the caches then stacked left padded
    (module docstring); False: one padded prefill of the batch."""
    B = len(prompts)
    budgets = [int(steps)] * B if isinstance(steps, int) else [int(s) for s in steps]
    stops = [None] * B if stops is None else list(stops)
    if len(budgets) != B or len(stops) != B or min(budgets, default=1) < 1:
        raise InputError(f"Batched generation needs one budget (>= 1) and one stop rule per prompt; got "
                         f"{len(budgets)} budgets and {len(stops)} stop rules for {B} prompts.")
    device = input_device(model)
    lengths = [len(p) for p in prompts]
    ids, mask, positions = left_padded(prompts, pad_id, device)                    # [B, T] each
    padded = len(set(lengths)) > 1
    if padded:
        check_paddable(cache)
    seqs = [torch.as_tensor([list(p)], dtype=torch.long) if s is not None and s.until else None
            for p, s in zip(prompts, stops)]                                        # [1, n_i] each (or None)
    check_stop(should_stop, what)
    row_prefill = None
    start = clock.now() if clock is not None else None
    if padded and prefill_one_by_one and cache is None and not _slides(model):   # alone, then one padded cache
        last, cache, row_prefill = _prefill_one_by_one(model, prompts, ids.shape[1], clock, should_stop, what)
    else:
        first = padding_mask(mask, ids.shape[1], model) if padded else None         # [B, 1, T, T] (or None)
        out = model(input_ids=ids, attention_mask=first, position_ids=positions if padded else None,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        last, cache = out.logits[:, -1], out.past_key_values                        # [B, V]
    prefill_seconds = clock.since(start) if clock is not None else None
    alive = list(range(B))                                # the batch's rows, as indices into `prompts`
    tokens, kept = [[] for _ in range(B)], [[] for _ in range(B)]
    stopped, sizes = ["length"] * B, [[0, 0] for _ in range(B)]
    step_seconds, step_rows, step = [], [], 0
    while True:
        if kv_bytes is not None:
            total = kv_bytes(cache)
            for i in alive:
                sizes[i][1] = _share(total, lengths[i] + len(tokens[i]), len(alive), mask.shape[1])
                if not tokens[i]:
                    sizes[i][0] = sizes[i][1]
        chosen = last.argmax(-1)                                                    # [b]
        keep = []
        for j, i in enumerate(alive):
            token = int(chosen[j])
            tokens[i].append(token)
            if keep_logits:
                kept[i].append(last[j])                                             # [V]
            why = None
            if stops[i] is not None:
                if seqs[i] is not None:
                    seqs[i] = torch.cat([seqs[i], chosen[j:j + 1, None].cpu()], dim=1)   # [1, n_i + k]
                why = stops[i].why(seqs[i], token)
            if why is not None:
                stopped[i] = why
            elif len(tokens[i]) < budgets[i]:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(alive):                        # finished rows leave the batch: cache, mask, positions
            index = torch.tensor(keep, device=device)                               # [b']
            cache.batch_select_indices(index)
            chosen, mask, positions = chosen[index], mask[index], positions[index]  # [b'], [b', S], [b', S]
            alive = [alive[j] for j in keep]
        step += 1
        check_stop(should_stop, what)
        report(progress, step / max(budgets), f"{step} tokens")
        mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)            # [b, S + 1]
        positions = positions[:, -1:] + 1                                           # [b, 1]
        start = clock.now() if clock is not None else None
        step_mask = padding_mask(mask, 1, model) if padded else None                # [b, 1, 1, S + 1]
        last = model(input_ids=chosen[:, None], attention_mask=step_mask,
                     position_ids=positions if padded else None, past_key_values=cache,
                     use_cache=True).logits[:, -1]                                  # [b, V]
        if clock is not None:
            step_seconds.append(clock.since(start))
        step_rows.append(tuple(alive))
    logits = [torch.stack(k) for k in kept] if keep_logits else None                # [n_i, V] each
    return RowsRun(tokens, logits, stopped, [tuple(s) for s in sizes] if kv_bytes is not None else None,
                   prefill_seconds, step_seconds, step_rows, row_prefill)
