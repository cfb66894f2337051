"""Redundant heads: heads that do nearly the same thing as another head and matter little alone.

Similarity between every pair of heads (all layers, flat index l * H + h) over real text:
- "output": cosine similarity of the heads' contributions to the residual stream, i.e. head
  h's slice of the O-projection input times its O columns, z_h W_O[:, h]^T ([tokens, D_out]),
  flattened over all tokens. Every head writes into the same residual space, so heads of
  different layers compare too. Exact: a Gram matrix accumulated sequence by sequence.
- "pattern": cosine similarity of the heads' attention maps minus uniform attention over each
  query's context, flattened (raw probability maps are all positive, so every pair of diffuse
  heads would look alike; a uniform head has nothing left and is similar to no head).

Near-duplicate groups are the connected components of the graph "similarity >= threshold"
(single linkage). A head is redundant when its most similar other head is at least
`threshold` similar AND its single-head ablation effect |delta loss| is at most
`effect_threshold` (so removing it alone costs little because a twin covers for it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from analysis.arch.hooks import attached
from analysis.measure.tokens import as_sequences, text_sequences
from analysis.arch.adapters import adapter_for, input_device
from analysis.core.errors import InputError
from analysis.core.progress import Progress, ShouldStop, check_stop, report

DEFAULT_THRESHOLD = 0.9
DEFAULT_EFFECT_THRESHOLD = 0.01   # nats of loss change


@dataclass
class Redundancy:
    similarity: np.ndarray          # [L*H, L*H] cosine similarity, flat index l * H + h
    nearest: np.ndarray             # [L, H] similarity to the most similar other head
    partner: np.ndarray             # [L, H, 2] (layer, head) of that head
    groups: list[list[tuple[int, int]]]  # near-duplicate groups (>= 2 heads), largest first
    redundant: np.ndarray | None    # [L, H] bool, None without ablation effects
    kind: str                       # "output" | "pattern"
    threshold: float
    effect_threshold: float


def _stacked_o(model, adapter, geometry) -> torch.Tensor:
    """O columns of every head: [L, H, d, D_out] (on the CPU, in the model's dtype)."""
    return torch.stack([adapter.read_heads(model, l, geometry).o.cpu() for l in range(geometry.n_layers)])


@torch.no_grad()
def head_output_gram(model, ids: torch.Tensor, *, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> torch.Tensor:
    """Gram matrix [L*H, L*H] (float64) of the heads' residual contributions over ids [n, T]."""
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    L, H, d = geo.n_layers, geo.n_heads, geo.head_dim
    o = _stacked_o(model, adapter, geo).double()                       # [L, H, d, D_out]
    gram = torch.zeros(L * H, L * H, dtype=torch.float64)
    x = as_sequences(ids, "Head redundancy")                           # [n, T]
    for s in range(x.shape[0]):
        check_stop(should_stop, "Head redundancy")
        z = [None] * L

        def hook_for(layer):
            def hook(module, args):
                z[layer] = args[0].detach()                            # [1, T, H*d]
            return hook

        with attached() as hooks:
            for l in range(L):
                hooks.before(adapter.o_proj(model, l), hook_for(l))
            model(input_ids=x[s:s + 1].to(input_device(model)), use_cache=False)
        zs = torch.stack(z).cpu().double().reshape(L, -1, H, d)        # [L, T, H, d]
        contrib = torch.einsum("lthd,lhde->lhte", zs, o).reshape(L * H, -1)  # [L*H, T*D_out]
        gram += contrib @ contrib.T                                    # [L*H, L*H]
        report(progress, (s + 1) / x.shape[0], "head redundancy: head outputs")
    return gram


def head_pattern_gram(model, ids: torch.Tensor, *, progress: Progress | None = None,
                      should_stop: ShouldStop | None = None) -> torch.Tensor:
    """Gram matrix [L*H, L*H] (float64) of the heads' attention maps over ids [n, T]."""
    from analysis.measure.roles import attention_probabilities
    x = as_sequences(ids, "Head redundancy")                           # [n, T]
    gram = None
    for s in range(x.shape[0]):
        check_stop(should_stop, "Head redundancy")
        a = attention_probabilities(model, x[s:s + 1])[0].double()     # [L, H, T, T]
        T = a.shape[-1]
        causal = bool(a.triu(1).abs().max() < 1e-6)
        context = torch.ones(T, T, dtype=torch.float64).tril() if causal else torch.ones(T, T, dtype=torch.float64)
        uniform = context / context.sum(1, keepdim=True)               # [T, T]
        flat = (a - uniform).reshape(a.shape[0] * a.shape[1], -1)      # [L*H, T*T]
        gram = flat @ flat.T if gram is None else gram + flat @ flat.T
        report(progress, (s + 1) / x.shape[0], "head redundancy: attention patterns")
    return gram


def cosine_from_gram(gram: torch.Tensor) -> np.ndarray:
    """Cosine similarity [N, N] from a Gram matrix [N, N]; heads with zero output give 0."""
    norm = gram.diagonal().clamp_min(0).sqrt()                         # [N]
    denom = norm[:, None] * norm[None, :]
    sim = torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros((), dtype=gram.dtype))
    return sim.clamp(-1.0, 1.0).numpy()


def near_duplicate_groups(sim: np.ndarray, n_heads: int, threshold: float) -> list[list[tuple[int, int]]]:
    """Connected components of sim >= threshold (off-diagonal), as (layer, head) lists, largest first."""
    n = sim.shape[0]
    parent = list(range(n))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    rows, cols = np.nonzero(np.triu(sim >= threshold, 1))
    for a, b in zip(rows, cols):
        parent[find(a)] = find(b)
    comps: dict[int, list[int]] = {}
    for a in range(n):
        comps.setdefault(find(a), []).append(a)
    groups = [[(a // n_heads, a % n_heads) for a in members] for members in comps.values() if len(members) > 1]
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def redundancy_from_similarity(sim: np.ndarray, n_layers: int, n_heads: int, *,
                               ablation_delta: np.ndarray | None = None,
                               threshold: float = DEFAULT_THRESHOLD,
                               effect_threshold: float = DEFAULT_EFFECT_THRESHOLD, kind: str = "output") -> Redundancy:
    """Nearest neighbours, groups and the redundant flag from a similarity matrix [L*H, L*H]."""
    n = n_layers * n_heads
    if sim.shape != (n, n):
        raise InputError(f"Similarity must be [{n}, {n}] for {n_layers} x {n_heads} heads; got {list(sim.shape)}.")
    off = sim.copy()
    np.fill_diagonal(off, -np.inf)
    best = off.argmax(1)                                               # [L*H]
    nearest = off[np.arange(n), best].reshape(n_layers, n_heads)       # [L, H]
    partner = np.stack([best // n_heads, best % n_heads], -1).reshape(n_layers, n_heads, 2)
    redundant = None
    if ablation_delta is not None:
        delta = np.asarray(ablation_delta, dtype=float)
        if delta.shape != (n_layers, n_heads):
            raise InputError(f"Ablation effects must be [{n_layers}, {n_heads}]; got {list(delta.shape)}.")
        redundant = (nearest >= threshold) & (np.abs(delta) <= effect_threshold)
    return Redundancy(sim, nearest, partner, near_duplicate_groups(sim, n_heads, threshold), redundant,
                      kind, threshold, effect_threshold)


GRAMS = {"output": head_output_gram, "pattern": head_pattern_gram}


class RedundancyFinder:
    """Pairwise head similarity on real text plus the redundancy rule; one verb: find."""

    def __init__(self, kind: str = "output", threshold: float = DEFAULT_THRESHOLD,
                 effect_threshold: float = DEFAULT_EFFECT_THRESHOLD):
        if kind not in GRAMS:
            raise InputError(f"Unknown similarity {kind!r}; use one of {', '.join(GRAMS)}.")
        if not -1.0 <= threshold <= 1.0:
            raise InputError(f"Similarity threshold {threshold} must be between -1 and 1.")
        self.kind, self.threshold, self.effect_threshold = kind, threshold, effect_threshold

    def find(self, model, ids: torch.Tensor, ablation_delta: np.ndarray | None = None, *,
             progress: Progress | None = None, should_stop: ShouldStop | None = None) -> Redundancy:
        x = as_sequences(ids, "Head redundancy")                       # [n, T]
        geo = adapter_for(model).geometry(model)
        gram = GRAMS[self.kind](model, x, progress=progress, should_stop=should_stop)
        return redundancy_from_similarity(cosine_from_gram(gram), geo.n_layers, geo.n_heads,
                                          ablation_delta=ablation_delta, threshold=self.threshold,
                                          effect_threshold=self.effect_threshold, kind=self.kind)


def head_redundancy(loaded, text: str | bytes | None = None, *, ablation_delta: np.ndarray | None = None,
                    kind: str = "output", threshold: float = DEFAULT_THRESHOLD,
                    effect_threshold: float = DEFAULT_EFFECT_THRESHOLD, max_tokens: int = 256,
                    seq_len: int = 128, progress: Progress | None = None, should_stop: ShouldStop | None = None) -> Redundancy:
    """Redundancy of `loaded`'s heads on `text` (None = built-in evaluation text).

    ablation_delta: [L, H] single-head effects (AblationResult.head_delta) for the redundant flag."""
    ids = text_sequences(loaded.tokenizer, text, max_tokens=max_tokens, seq_len=seq_len)  # [n, T]
    return RedundancyFinder(kind, threshold, effect_threshold).find(
        loaded.model, ids, ablation_delta, progress=progress, should_stop=should_stop)
