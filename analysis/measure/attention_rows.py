"""A few rows of attention at long context: where the last query positions of a text look, for every head,
computed from the post-RoPE query / key / value that analysis.arch.spans taps (one forward pass; never
the eager [T, T] probabilities of every layer), and what a window (sinks + recent tokens) would change.

For the last Q queries of ids [T] and every (layer, query head):
- `mass` [L, H, T]: the attention over the keys, averaged over the Q queries (each row sums to 1);
- `top1` [L, H, Q]: the key each query attends to most;
- `window_change` [L, H]: how much the head's output (its attention-weighted values, before W_O) changes
  when it reads only the band of analysis.arch.spans (key j < sinks or i - j < recent): ||o - o_w|| / ||o||,
  averaged over the Q queries. The windowed output is the softmax restricted to the band, which is the
  full softmax renormalised over the band's keys, so both come from the same scores.

The scores are q k^T times the attention module's own `scaling` (head_dim^-0.5 where it has none); a
family that soft-caps its logits (Gemma 2) is approximated without the cap. Used by the Walkthrough to show
sinks, windows and retrieval with a real head.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from analysis.arch.adapters import adapter_for, input_device
from analysis.arch.spans import attention_layers, band, check_band, tapped
from analysis.core.errors import InputError, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report

MAX_QUERIES = 64


@dataclass(frozen=True)
class AttentionRows:
    """The last `queries` rows of every head's attention on one text (see the module docstring)."""
    mass: np.ndarray            # [L, H, T] float64, mean over the queries
    top1: np.ndarray            # [L, H, Q] int: the most-attended key of each query
    window_change: np.ndarray   # [L, H] float: relative change of the head's output under the window
    sinks: int
    recent: int
    queries: int

    @property
    def n_tokens(self) -> int:
        return int(self.mass.shape[-1])

    def share(self, start: int, stop: int) -> np.ndarray:
        """[L, H] attention mass on keys start .. stop - 1."""
        return self.mass[..., max(start, 0):max(stop, 0)].sum(-1)

    def regions(self) -> dict[str, np.ndarray]:
        """[L, H] mass on the sink tokens, on the recent window of the last query, and on everything between."""
        T = self.n_tokens
        first_recent = max(T - self.recent, self.sinks)
        sinks = self.share(0, min(self.sinks, T))
        recent = self.share(first_recent, T)
        return {"sinks": sinks, "recent": recent, "far": np.clip(1.0 - sinks - recent, 0.0, 1.0)}


def attention_rows(model, ids: torch.Tensor, *, queries: int = 8, sinks: int = 4, recent: int = 256,
                   progress: Progress | None = None, should_stop: ShouldStop | None = None) -> AttentionRows:
    """AttentionRows of ids [T] (one sequence starting at token 0) for the last `queries` positions."""
    queries = check_whole_number(queries, "The number of query rows", low=1, high=MAX_QUERIES)
    sinks, recent = check_band(sinks, recent)
    ids = torch.as_tensor(ids).flatten()                                   # [T]
    T = ids.numel()
    if T < queries:
        raise InputError(f"The text has {T} tokens, fewer than the {queries} query rows asked for.")
    modules = attention_layers(model)
    g = adapter_for(model).geometry(model)
    L, H = len(modules), g.n_heads
    mass = np.zeros((L, H, T))
    top1 = np.zeros((L, H, queries), np.int64)
    change = np.zeros((L, H))
    positions = torch.arange(T)
    q_pos = positions[T - queries:]                                        # [Q]
    causal = positions[None, :] <= q_pos[:, None]                          # [Q, T]
    kept = band(q_pos, positions, sinks, recent)                           # [Q, T]

    def tap(layer: int, query, key, value) -> None:
        check_stop(should_stop, "Reading the attention rows")
        scaling = float(getattr(modules[layer], "scaling", query.shape[-1] ** -0.5))
        G = query.shape[1] // key.shape[1]
        dt = torch.float64 if query.dtype == torch.float64 else torch.float32
        q = query[0, :, -queries:].to("cpu", dt)                          # [H, Q, d]
        k = key[0].to("cpu", dt).repeat_interleave(G, 0)                   # [H, T, d]
        v = value[0].to("cpu", dt).repeat_interleave(G, 0)                 # [H, T, d_v]
        scores = (q @ k.transpose(1, 2)) * scaling                         # [H, Q, T]
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)  # [H, Q, T]
        pw = p * kept                                                      # [H, Q, T] the band's share
        pw = pw / pw.sum(-1, keepdim=True)
        out, out_w = p @ v, pw @ v                                         # [H, Q, d_v]
        rel = (out - out_w).norm(dim=-1) / out.norm(dim=-1).clamp_min(1e-12)   # [H, Q]
        mass[layer] = p.mean(1).double().numpy()
        top1[layer] = p.argmax(-1).numpy()
        change[layer] = rel.mean(-1).double().numpy()
        report(progress, (layer + 1) / L, f"layer {layer + 1} of {L}")

    with torch.no_grad(), tapped(model, tap):
        model(input_ids=ids[None].to(input_device(model)), use_cache=False)
    return AttentionRows(mass, top1, change, sinks, recent, queries)
