"""Attention spans per key/value head, and taps on the attention inputs, for the length of a `with` block.

A KV head either reads every earlier token (**full**) or only a **window** (analysis.arch.window.Window:
the first `sinks` tokens and the `recent` latest ones; its `reads` is the one rule). The unit is the KV
head: all G query heads of a GQA group share their keys and values, so they share the span. A pruned head
is not a span: it is the mask (analysis.arch.head_gates), which composes with this; a compact cache does
not even keep its keys (below).

Mechanism: one attention function, "headscope-spans", registered in transformers' AttentionInterface
(as arch/attention.py registers "sdpa-float32"; `register`, once, when the first block opens: importing this
module pulls no transformers modeling code), with the sdpa mask builder registered under the same
name so padding masks survive. `spans(model, ...)` switches the model to it for the block (restored in
`finally`) and puts the block's per-layer spans in a context variable keyed by the attention module;
the function splits each layer's KV heads into full and windowed ones and runs the model's own kernel
(sdpa or eager) on each part, the windowed part with the band above as its mask. A thread that runs
the same model without a block (the app serialises jobs per model, so only by mistake) finds no state
and gets the plain kernel: nothing leaks between callers, nothing is written into the model.

Taps: `spans(model, tap=fn)` calls fn(layer, query [B, H, q, d], key [B, Hkv, S, d], value [B, Hkv, S,
d]) in every layer with the post-RoPE tensors the kernel receives (after a cache update: all keys so
far), before it runs. Measurements that need a few rows of attention at long context (retrieval and
streaming heads: analysis.measure) read them there instead of asking the eager kernel for [B, H, T, T]
probabilities of every layer.

Positions: keys are numbered by their index in `key` (0 .. S-1, what a plain forward or transformers'
own caches hand the kernel), queries are the last q of them. Rows must therefore start at token 0:
right padding (what the probes and the evaluation use) is fine, left padding would make the pad tokens
the sinks.

Families: those whose attention goes through transformers' AttentionInterface with a plain sdpa or
eager kernel (llama, mistral, qwen2, qwen3, gemma, olmo, starcoder2, phi3, ...). A model on another
kernel (flash attention, custom code) or without `layer_idx` on its attention modules is refused with
one line.

Compact layers: inside a block the masked path above still holds every token of a windowed head (the
band is a mask over the whole sequence). A compact cache (analysis.arch.kvcache.CompactCache) holds only
what the band reads: its layer's `update` hands the kernel a `CompactKV` instead of a key tensor, with
the full heads' keys / values [B, h_full, S, d] and the windowed heads' [B, h_win, n, d] (n <= sinks +
recent - 1 + the new tokens) with the absolute position of each of them; a KV head the plan prunes
(`dropped`) keeps nothing and its query heads' output is zero (the head mask gates it off anyway). The kernel then runs the full
heads as before and the windowed heads on those keys only, with the band computed from the positions,
so nothing of length S is built for them. A step with many queries (a prefill) runs the windowed heads
in blocks of `block_size(window)` queries: each block reads the sink keys and the keys from `recent - 1`
before its first query to its last one (`banded_attention`), so its cost grows with sinks + recent, not
with the sequence. A tap needs every head's keys and is refused on a compact layer.
"""
from __future__ import annotations

import contextvars
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Callable, Iterator

import numpy as np
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.attention import SDPA_FLOAT32, attention_implementation, current_implementation, sdpa_float32
from analysis.arch.window import Window
from analysis.core.errors import InputError

SPANS = "headscope-spans"
BASES = ("sdpa", "eager", SDPA_FLOAT32)   # kernels the spans function can split (the model's own is used; sdpa in
                                          # float32 under bf16 autocast: arch/attention.py)

Tap = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LayerSpan:
    """One layer inside a `spans` block: its index, which of its KV heads are windowed, the window."""
    layer: int
    windowed: torch.Tensor | None       # [Hkv_l] bool (None: every head full)
    window: Window | None


@dataclass(frozen=True)
class _Entry:
    """What the kernel reads for one attention module inside a block."""
    base: str                          # the model's own kernel: "sdpa" | "eager"
    span: LayerSpan
    tap: Tap | None = None


# id(attention module) -> _Entry, for the blocks open in this thread / task (nothing is written into the model)
_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("headscope_spans", default=None)


def band(q_positions: torch.Tensor, k_positions: torch.Tensor, window: Window) -> torch.Tensor:
    """[q, S] bool: query at q_positions[i] reads key at k_positions[j] (Window.reads, causal included)."""
    return window.reads(q_positions, k_positions)                        # [q, S]


def causal(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """[q, S] bool: the plain causal rule, key j <= query i."""
    return k_positions[None, :] <= q_positions[:, None]                 # [q, S]


def _kernel(base: str, module) -> Callable:
    """The model's own attention kernel: transformers' sdpa (or headscope's sdpa in float32), or the family's eager
    function."""
    if base == SDPA_FLOAT32:
        return sdpa_float32
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise InputError(f"{type(module).__name__} has no eager attention function that per-head spans can call.")
    return eager


def _as_mask(allowed: torch.Tensor, base: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = read) in the form the kernel takes: bool for sdpa, additive for eager."""
    if base != "eager":
        return allowed
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def _allowed(attention_mask: torch.Tensor | None, q: int, S: int, device) -> torch.Tensor:
    """The causal (and padding) mask the model handed in, as bool [B or 1, 1, q, S] (True = read)."""
    if attention_mask is None:
        pos = torch.arange(S, device=device)
        return causal(pos[S - q:], pos)[None, None]                    # [1, 1, q, S]
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., :S]
    return attention_mask[..., :S] == 0                                 # additive: 0 = read


def _spans_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """The registered kernel: query [B, H, q, d], key / value [B, Hkv, S, d] (or one CompactKV from a compact
    cache) -> ([B, q, H, d], None)."""
    entry = (_ACTIVE.get() or {}).get(id(module))
    if isinstance(key, CompactKV):
        if entry is not None and entry.tap is not None:
            raise InputError("A tap reads every head's keys; a compact KV cache keeps only the windows. Run the "
                             "tap without the compact cache.")
        base = entry.base if entry is not None else "sdpa"
        return compact_attention(_kernel(base, module), base, module, query, key, attention_mask, *args, **kwargs)
    if entry is None:                                                   # no block in this thread: plain kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    span = entry.span
    if entry.tap is not None:
        entry.tap(span.layer, query, key, value)
    kernel = _kernel(entry.base, module)
    q, S = query.shape[2], key.shape[2]
    allowed = None
    if entry.base == "eager":                                           # eager adds its mask: always give one
        allowed = _allowed(attention_mask, q, S, key.device)            # [b, 1, q, S]
        attention_mask = _as_mask(allowed, entry.base, query.dtype)
    if span.windowed is None:
        return kernel(module, query, key, value, attention_mask, *args, **kwargs)
    B, H = query.shape[:2]
    G = H // key.shape[1]
    windowed = span.windowed.to(key.device)
    if allowed is None:
        allowed = _allowed(attention_mask, q, S, key.device)            # [b, 1, q, S]
    pos = torch.arange(S, device=key.device)
    banded = _as_mask(allowed & band(pos[S - q:], pos, span.window), entry.base, query.dtype)
    out = query.new_empty(B, q, H, value.shape[-1])                     # [B, q, H, d_v]
    for kv_heads, mask in ((~windowed, attention_mask), (windowed, banded)):
        kv = torch.nonzero(kv_heads).flatten()                          # [h_kv] KV heads of this part
        if not kv.numel():
            continue
        heads = (kv[:, None] * G + torch.arange(G, device=kv.device)).flatten()   # [h_kv * G] their query heads
        part, _ = kernel(module, query[:, heads], key[:, kv], value[:, kv], mask, *args, **kwargs)  # [B, q, h, d_v]
        out[:, :, heads] = part.to(out.dtype)          # under bf16 autocast the kernel answers in bf16: lossless
    return out, None


# ---------------------------------------------------------------------------------------------
# Compact layers: the windowed heads' keys only, with their positions
# ---------------------------------------------------------------------------------------------

MIN_BLOCK = 64                      # queries per block of a banded prefill, at least


def ring_positions(length: int, window: Window, device=None) -> torch.Tensor:
    """[window.kept(length)] long: the position held in each ring slot after `length` tokens (the inverse of
    Window.slot over the tokens kept)."""
    if length <= window.size:
        return torch.arange(length, device=device)
    positions = torch.cat([torch.arange(window.sinks, device=device),
                           torch.arange(length - window.recent, length, device=device)])   # [size] kept
    out = torch.empty_like(positions)
    out[window.slot(positions)] = positions
    return out


@dataclass(frozen=True)
class CompactKV:
    """What a compact cache layer hands the kernel for one step (analysis.arch.kvcache). Heads are the
    layer's KV heads; the query heads of KV head j are j*G .. j*G + G - 1."""
    n_kv_heads: int
    full_heads: tuple[int, ...]          # KV heads that read every token
    window_heads: tuple[int, ...]        # KV heads that read the window
    full_keys: torch.Tensor | None       # [B, h_full, S, d] every token so far, this step's included
    full_values: torch.Tensor | None     # [B, h_full, S, d_v]
    window_keys: torch.Tensor | None     # [B, h_win, n, d] the tokens the band may read, in any order; for a
    window_values: torch.Tensor | None   # one-query step exactly the keys its band reads [B, h_win, n, d_v]
    window_positions: torch.Tensor | None    # [n] long: the position of each; None: the ring's (ring_positions)
    query_start: int                     # position of this step's first query (tokens before it)
    length: int                          # S: tokens so far, this step's included
    window: Window
    value_dim: int                       # d_v (a layer whose KV heads are all dropped still answers zeros of it)
    block: int = 0                       # queries per block of a banded prefill (0: block_size(window))

    @property
    def dropped(self) -> bool:
        """Whether some KV head keeps nothing (a pruned KV head of a plan run on the dense model)."""
        return len(self.full_heads) + len(self.window_heads) < self.n_kv_heads

    def positions(self, device) -> torch.Tensor:
        """[n] the position of each windowed key."""
        if self.window_positions is not None:
            return self.window_positions.to(device)
        return ring_positions(self.length, self.window, device)


def block_size(window: Window) -> int:
    """Queries per block of a banded prefill: about one window, so a block reads ~ sinks + 2 * recent keys."""
    return max(MIN_BLOCK, int(window.recent))


@lru_cache(maxsize=4096)
def query_heads(kv_heads: tuple[int, ...], group: int, device: str = "cpu"):
    """The query heads of some KV heads (G = group per KV head): a slice when the KV heads are consecutive (a
    view of the query, no gather), else an index tensor [h * G]."""
    if kv_heads == tuple(range(kv_heads[0], kv_heads[-1] + 1)):
        return slice(kv_heads[0] * group, (kv_heads[-1] + 1) * group)
    return torch.tensor([h * group + g for h in kv_heads for g in range(group)], device=device)


def _padding(attention_mask, rows: slice, positions: torch.Tensor) -> torch.Tensor | None:
    """The model's mask [b, 1, q, S] at query rows `rows` and key columns `positions`, as bool (True = read);
    None without a mask (no padding: the band alone decides)."""
    if attention_mask is None:
        return None
    part = attention_mask[:, :, rows][..., positions.to(attention_mask.device)]    # [b, 1, q', n]
    return part if part.dtype == torch.bool else part == 0


def banded_attention(kernel: Callable, base: str, module, query, keys, values, q_positions, k_positions,
                     window: Window, attention_mask=None, *args, block: int = 0, **kwargs) -> torch.Tensor:
    """Windowed attention on the keys a window can read: query [B, h, q, d] at absolute q_positions [q],
    keys / values [B, h_kv, n, d] at k_positions [n] (any order) -> [B, q, h, d_v]. More queries than
    `block` (default `block_size(window)`) run block by block, each on its sink keys and the keys of its own
    window span (gathered, so a block costs ~ block * (sinks + recent + block)); attention_mask: the model's
    [b, 1, q, S] over absolute positions (padding), or None."""
    q = query.shape[2]
    sinks, recent = window.sinks, window.recent
    block = block or block_size(window)
    out = []
    for start in range(0, q, block if q > block else q):
        stop = min(q, start + block)
        qp = q_positions[start:stop]                                      # [q']
        if q > block:                                                     # this block's keys only
            near = (k_positions < sinks) | ((k_positions > qp[0] - recent) & (k_positions <= qp[-1]))
            index = torch.nonzero(near).flatten()                         # [m]
            k, v, kp = keys.index_select(2, index), values.index_select(2, index), k_positions[index]
        else:
            k, v, kp = keys, values, k_positions
        allowed = band(qp, kp, window)[None, None]                        # [1, 1, q', m]
        pad = _padding(attention_mask, slice(start, stop), kp)
        if pad is not None:
            allowed = allowed & pad                                       # [b, 1, q', m]
        part, _ = kernel(module, query[:, :, start:stop], k, v, _as_mask(allowed, base, query.dtype), *args,
                         **kwargs)                                        # [B, q', h, d_v]
        out.append(part)
    return out[0] if len(out) == 1 else torch.cat(out, 1)                 # [B, q, h, d_v]


def _windowed_part(kernel, base, module, query, kv: CompactKV, attention_mask, *args, **kwargs) -> torch.Tensor:
    """The windowed heads of a compact layer: query [B, h, q, d] -> [B, q, h, d_v]."""
    q = query.shape[2]
    if q == 1 and attention_mask is None:          # a decode step: the cache holds exactly its band, read it all
        return kernel(module, query, kv.window_keys, kv.window_values, None, *args, **kwargs)[0]
    q_positions = torch.arange(kv.query_start, kv.query_start + q, device=query.device)   # [q]
    return banded_attention(kernel, base, module, query, kv.window_keys, kv.window_values, q_positions,
                            kv.positions(query.device), kv.window, attention_mask, *args, block=kv.block, **kwargs)


def compact_attention(kernel: Callable, base: str, module, query, kv: CompactKV, attention_mask, *args, **kwargs):
    """The kernel on a compact layer: query [B, H, q, d] -> ([B, q, H, d_v], None); full heads over every key
    (the model's own mask), windowed heads on the keys the cache kept (`banded_attention`; a decode step
    without padding reads them all, no mask), dropped heads (a pruned KV head's group) zeros."""
    B, H, q = query.shape[:3]
    G = H // kv.n_kv_heads
    full_mask = attention_mask
    if base == "eager" and kv.full_heads:                                 # eager adds its mask: always give one
        full_mask = _as_mask(_allowed(attention_mask, q, kv.length, query.device), base, query.dtype)
    if not kv.dropped:
        if not kv.window_heads:                                           # every head full: one call
            return kernel(module, query, kv.full_keys, kv.full_values, full_mask, *args, **kwargs)[0], None
        if not kv.full_heads:                                             # every head windowed
            return _windowed_part(kernel, base, module, query, kv, attention_mask, *args, **kwargs), None
    out = (query.new_zeros if kv.dropped else query.new_empty)(B, q, H, kv.value_dim)   # [B, q, H, d_v]
    if kv.full_heads:
        heads = query_heads(kv.full_heads, G, str(query.device))
        out[:, :, heads] = kernel(module, query[:, heads], kv.full_keys, kv.full_values, full_mask, *args,
                                  **kwargs)[0].to(out.dtype)
    if kv.window_heads:
        heads = query_heads(kv.window_heads, G, str(query.device))
        out[:, :, heads] = _windowed_part(kernel, base, module, query[:, heads], kv, attention_mask, *args,
                                          **kwargs).to(out.dtype)
    return out, None


@cache
def register() -> None:
    """Add "headscope-spans" (and its mask builder, sdpa's) to transformers' interfaces, once per process, the first
    time a `spans` block opens (not at import: module docstring)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(SPANS, _spans_attention)
    AttentionMaskInterface.register(SPANS, sdpa_mask)


def attention_layers(model) -> list:
    """The attention module of every layer, each with the `layer_idx` transformers gives it; InputError
    for a family whose attention modules carry none (its kernel calls cannot be told apart)."""
    adapter = adapter_for(model)
    modules = [adapter.attention(model, l) for l in range(len(adapter.layers(model)))]
    if any(not isinstance(getattr(m, "layer_idx", None), int) for m in modules):
        raise InputError(f"Per-head attention spans need transformers' attention interface with a layer index; "
                         f"{adapter.model_type} models do not give one.")
    return modules


def _windows(windowed, modules) -> list[torch.Tensor | None]:
    """windowed: [L, Hkv] bool array-like, or one [Hkv_l] array per layer (a pruned twin's own KV heads)."""
    if windowed is None:
        return [None] * len(modules)
    rows = (list(windowed) if not isinstance(windowed, (np.ndarray, torch.Tensor)) or np.ndim(windowed) == 2
            else None)
    if rows is None or len(rows) != len(modules):
        raise InputError(f"The window plan must give one row per layer ({len(modules)}); got "
                         f"{len(rows) if rows is not None else np.shape(windowed)}.")
    out = []
    for l, (row, m) in enumerate(zip(rows, modules)):
        r = torch.as_tensor(np.asarray(row, dtype=bool))
        want = _kv_heads(m)
        if r.dim() != 1 or (want is not None and r.numel() != want):
            raise InputError(f"Layer {l} has {want} key/value heads; the window plan gives {list(r.shape)}.")
        out.append(r if bool(r.any()) else None)
    return out


def _kv_heads(module) -> int | None:
    """The KV heads a layer's attention module computes, from its K projection's width."""
    for name in ("k_proj", "key", "k"):
        proj = getattr(module, name, None)
        weight = getattr(proj, "weight", None)
        head_dim = getattr(module, "head_dim", None)
        if weight is not None and isinstance(head_dim, int) and head_dim:
            return int(weight.shape[0]) // head_dim
    return None


@contextmanager
def spans(model, *, windowed=None, window: Window | None = None, tap: Tap | None = None) -> Iterator:
    """Inside the block, `model` runs with windowed[l][j] = True KV heads reading only `window`, and `tap` (if
    given) sees every layer's query / key / value. windowed: [L, Hkv] bool (or per-layer rows for a model whose
    layers differ); None = all full. Everything is restored in `finally`."""
    base = current_implementation(model)
    if base == SPANS:
        raise InputError("Attention spans are already active on this model; give the window and the tap in one block.")
    if base not in BASES:
        raise InputError(f"Per-head attention spans split the sdpa or eager kernel; this model runs {base!r}. "
                         f"Load it with attn_implementation='sdpa'.")
    can_switch = getattr(model, "_can_set_attn_implementation", None)
    if can_switch is None or not can_switch():
        raise InputError(f"Per-head attention spans need a model whose attention goes through transformers' "
                         f"attention interface; {type(model).__name__} computes its own.")
    modules = attention_layers(model)
    rows = _windows(windowed, modules)
    if any(r is not None for r in rows) and not isinstance(window, Window):
        raise InputError("A windowed head needs its window (analysis.arch.window.Window: sinks and recent tokens).")
    active = dict(_ACTIVE.get() or {})
    for l, (m, r) in enumerate(zip(modules, rows)):
        active[id(m)] = _Entry(base, LayerSpan(l, r, window), tap)
    register()
    token = _ACTIVE.set(active)
    try:
        with attention_implementation(model, SPANS):
            yield model
    finally:
        _ACTIVE.reset(token)


def windowed(model, rows, window: Window):
    """`spans` with a window plan only: rows [L, Hkv] bool (windowed KV heads), their window."""
    return spans(model, windowed=rows, window=window)


def tapped(model, tap: Tap):
    """`spans` with a tap only (every head full): tap(layer, query, key, value) in every layer."""
    return spans(model, tap=tap)

