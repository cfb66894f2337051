"""The compact KV cache of a per-head plan: each KV head keeps only the tokens its span reads.

transformers' DynamicCache keeps every token of every KV head; under `analysis.arch.spans.windowed` a
windowed head only *reads* its band, so its cache still grows with the context. `CompactCache` keeps:
- a **full** KV head: every token (as DynamicCache does), [B, h_full, S, d];
- a **windowed** KV head: its window's `sinks` first tokens and `recent` latest ones, [B, h_win, n, d] with
  n = Window.kept(S): a ring (slots by Window.slot, one rule), so a new token overwrites the one that just
  left every later query's window and the stored tensors never grow past sinks + recent tokens;
- a **pruned** KV head (a plan run on the dense model, its pruned groups gated off by the head mask):
  nothing; its query heads' attention output is zero;
- a layer with no KV head (a layer that surgery emptied): nothing, only the count of tokens.
A plan's rows are its mode codes per layer (analysis.arch.kvplan.mode_rows: the dense model's KV heads, or
a physically pruned twin's own, where the pruned groups no longer exist at all).

So the bytes of the K and V tensors it holds after S tokens are exactly
`analysis.arch.kvplan.KVPlan.kv_bytes(S, ...)` of the plan it runs: `CompactCache.kv_bytes()` counts the
real tensors. The positions of a ring's slots are not stored: they follow from S
(`analysis.arch.spans.ring_positions`).

Each layer's `update` returns a `analysis.arch.spans.CompactKV` instead of key / value tensors; only the
"headscope-spans" kernel reads it, so a model runs this cache inside `analysis.arch.spans.spans(...)`
(`compact(model, rows, window)` below does both; analysis.arch.cut.Cut.new_cache for a cut). With windowed
heads, rows must start at token 0 and share their length (a batch of prompts of one length, or right padding
during a prefill): a ring's slots and sinks are numbered from index 0, so left padding would make pads the
sinks; batched generation (analysis.measure.decode_rows) refuses such a cache and the harness generates a
windowed plan one prompt at a time. A cache without windowed heads (full and pruned KV heads) holds every
token of its full heads as DynamicCache does, so it takes left-padded rows (the model's mask hides the pads);
`batch_select_indices` drops finished rows. Decode steps append one token to every row.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from analysis.arch.kvplan import FULL, PRUNE, WINDOW
from analysis.arch.spans import CompactKV, ring_positions, spans
from analysis.arch.window import Window
from analysis.core.errors import InputError


class CompactLayer(CacheLayerMixin):
    """One layer of a CompactCache: modes [Hkv_l] (analysis.arch.kvplan codes: full / window / prune), the
    window."""
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, modes: np.ndarray, window: Window, block: int = 0):
        super().__init__()
        self.block = int(block)
        modes = np.asarray(modes).reshape(-1)
        self.n_kv_heads = int(modes.size)
        self.full_heads = tuple(int(j) for j in np.flatnonzero(modes == FULL))      # KV heads
        self.window_heads = tuple(int(j) for j in np.flatnonzero(modes == WINDOW))
        self.pruned_heads = tuple(int(j) for j in np.flatnonzero(modes == PRUNE))
        self.window = window
        self.length = 0                                                   # tokens seen
        self.value_dim = 0
        self.ring_keys = self.ring_values = None                          # [B, h_win, n, d]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _split(self, states: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor | None:
        """states [B, Hkv, q, d] -> the given KV heads [B, h, q, d] (a view when they are consecutive)."""
        if not heads:
            return None
        if len(heads) == self.n_kv_heads:
            return states
        if heads == tuple(range(heads[0], heads[-1] + 1)):
            return states[:, heads[0]:heads[-1] + 1]
        return states.index_select(1, torch.tensor(heads, device=states.device))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key / value [B, Hkv, q, d] of this step's q tokens -> (CompactKV, CompactKV) for the kernel."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.value_dim = int(value_states.shape[-1])
        start, q = self.length, key_states.shape[-2]
        self.length += q
        if not self.n_kv_heads:                                           # an emptied layer: a count only
            return key_states, value_states
        if key_states.shape[1] != self.n_kv_heads:
            raise InputError(f"The compact KV cache was made for {self.n_kv_heads} KV heads in this layer; the model "
                             f"gives {key_states.shape[1]}. Make the cache for the model that runs it.")
        full_k, full_v = self._split(key_states, self.full_heads), self._split(value_states, self.full_heads)
        if full_k is not None:                                            # a copy: never a view of the step's keys
            self.keys = full_k.clone() if self.keys is None else torch.cat([self.keys, full_k], dim=-2)
            self.values = full_v.clone() if self.values is None else torch.cat([self.values, full_v], dim=-2)
        win = self._window_update(self._split(key_states, self.window_heads),
                                  self._split(value_states, self.window_heads), start)
        view = CompactKV(self.n_kv_heads, self.full_heads, self.window_heads, self.keys, self.values, *win,
                         query_start=start, length=self.length, window=self.window, value_dim=self.value_dim,
                         block=self.block)
        return view, view

    def _window_update(self, k: torch.Tensor | None, v: torch.Tensor | None, start: int):
        """Store this step's windowed keys in the ring; (keys, values, positions or None: the ring's) this step's
        queries read."""
        if k is None:
            return None, None, None
        q, size, window = k.shape[-2], self.window.size, self.window
        if self.ring_keys is None:
            self.ring_keys, self.ring_values = k[..., :0, :], v[..., :0, :]
        if q == 1 and start >= size:                                      # steady decode: overwrite in place
            slot = window.slot(start)
            self.ring_keys[..., slot:slot + 1, :] = k
            self.ring_values[..., slot:slot + 1, :] = v
            return self.ring_keys, self.ring_values, None
        if start + q <= size:                                             # still filling: slot == position
            self.ring_keys = torch.cat([self.ring_keys, k], dim=-2)
            self.ring_values = torch.cat([self.ring_values, v], dim=-2)
            return self.ring_keys, self.ring_values, None
        # many tokens past the ring's size: the queries read the old ring and every new token; keep the band's
        keys = torch.cat([self.ring_keys, k], dim=-2)                     # [B, h_win, n_old + q, d]
        values = torch.cat([self.ring_values, v], dim=-2)
        positions = torch.cat([ring_positions(start, window), torch.arange(start, self.length)])
        kept = torch.nonzero((positions < window.sinks) | (positions >= self.length - window.recent)).flatten()
        order = torch.empty_like(kept)
        order[window.slot(positions[kept])] = kept                        # slot -> index into keys
        self.ring_keys = keys.index_select(-2, order.to(keys.device))     # [B, h_win, sinks + recent, d]
        self.ring_values = values.index_select(-2, order.to(values.device))
        return keys, values, positions

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask transformers builds: every token so far (the full heads')."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.ring_keys = self.ring_values = None
        self.length = 0
        self.is_initialized = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` [b'] of the batch (a batched generation's finished rows leave it)."""
        for name in ("keys", "values", "ring_keys", "ring_values"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, indices.to(t.device)))       # [b', h, n, d]

    def crop(self, tokens_to_remove: int) -> None:
        raise InputError("A compact KV cache cannot be rolled back: a windowed head has dropped the tokens.")

    def tensors(self) -> list[torch.Tensor]:
        """The K and V tensors this layer holds."""
        return [t for t in (self.keys, self.values, self.ring_keys, self.ring_values) if t is not None]


class CompactCache(Cache):
    """A transformers Cache with one CompactLayer per model layer (module docstring): rows [L][Hkv_l] of mode
    codes (analysis.arch.kvplan.mode_rows), the window of the windowed heads."""

    def __init__(self, rows, window: Window, *, block: int = 0):
        if not isinstance(window, Window):
            raise InputError("A compact KV cache needs the plan's window (analysis.arch.window.Window).")
        super().__init__(layers=[CompactLayer(r, window, block) for r in rows])
        self.window = window

    def kv_bytes(self) -> int:
        """Bytes of the K and V tensors the cache holds (what KVPlan.kv_bytes predicts)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors())

    def kept_tokens(self) -> list[list[int]]:
        """[L][Hkv_l]: tokens each KV head holds now."""
        out = []
        for layer in self.layers:
            row = [0] * layer.n_kv_heads
            for j in layer.full_heads:
                row[j] = 0 if layer.keys is None else int(layer.keys.shape[-2])
            for j in layer.window_heads:
                row[j] = 0 if layer.ring_keys is None else int(layer.ring_keys.shape[-2])
            out.append(row)
        return out


def kv_cache_bytes(cache) -> int:
    """Bytes of the K and V tensors a cache holds: a CompactCache's own count, or for transformers' caches
    (a DynamicCache: every token of every head) the sum over their layers' keys and values."""
    if isinstance(cache, CompactCache):
        return cache.kv_bytes()
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def windowed_rows(rows) -> list[np.ndarray]:
    """[L][Hkv_l] bool: the windowed KV heads of mode rows (what the spans kernel splits)."""
    return [np.asarray(r).reshape(-1) == WINDOW for r in rows]


def mode_rows_of(windowed) -> list[np.ndarray]:
    """Mode rows (full / window) of windowed [L][Hkv_l] bool rows (a plan without pruned heads)."""
    return [np.where(np.asarray(r, dtype=bool).reshape(-1), WINDOW, FULL).astype(np.int8) for r in windowed]


@contextmanager
def compact(model, rows, window: Window, *, block: int = 0) -> Iterator[CompactCache]:
    """Inside the block `model` runs the plan's windows (`analysis.arch.spans.spans`) and the yielded
    CompactCache holds only what it reads: pass it as `past_key_values` (with use_cache=True). rows: [L][Hkv_l]
    mode codes (pruned KV heads keep nothing: gate them off with the head mask, or run a twin without them).
    A cache serves one sequence of calls (one prompt and its decode steps); make another with
    CompactCache(rows, window) inside the same block. block: queries per block of a banded prefill (0: the
    default, `analysis.arch.spans.block_size(window)`)."""
    with spans(model, windowed=windowed_rows(rows), window=window):
        yield CompactCache(rows, window, block=block)
