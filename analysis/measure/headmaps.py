"""What every head detector shares: the result type, where each of a model's heads sits in the
L x H map, and how a mask turns heads off.

- `Detection`: one detector's scores [L, H] (float64; a pruned head scores 0), the threshold
  above which a head "has" the role, and extras (whole-model numbers, per-token views).
- Slots: a dense model's layer l holds heads 0..H-1. A physically pruned model
  (analysis.compress.surgery.prune_heads / export.load_pruned) holds fewer heads in some layers;
  its `HeadLayout` says which original head each one is, and the detectors put every kept
  head's score into that head's original slot, so maps of a dense, a masked and a pruned model
  line up head for head.
- `layer_geometry`: one layer's own head counts, read off its projections' shapes (so
  `Adapter.read_heads` splits a pruned layer right).
- Masks: `gates` [L, H] (1 keep, 0 prune) run through analysis.arch.head_gates.head_mask, the
  one masking mechanism; a head whose gate is 0 writes nothing, and its score is set to 0.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from analysis.arch.adapters import GPT2Conv1D, Stacked, adapter_for
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import as_gates, head_mask
from analysis.core.errors import InputError


@dataclass
class Detection:
    """One detector's result. scores [L, H]: the role strength of every head (original slots)."""
    name: str
    scores: np.ndarray                 # [L, H] float64
    threshold: float
    unit: str = ""
    extras: dict = field(default_factory=dict)

    @property
    def has_role(self) -> np.ndarray:
        """[L, H] bool: the heads whose score is at or above the threshold."""
        return np.nan_to_num(self.scores, nan=-np.inf) >= self.threshold

    def tagged(self) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the heads with the role, strongest first."""
        rows = [(int(l), int(h), float(self.scores[l, h])) for l, h in zip(*np.nonzero(self.has_role))]
        return sorted(rows, key=lambda r: -r[2])


def layer_geometry(model, layer: int, geometry: HeadGeometry | None = None, adapter=None) -> HeadGeometry:
    """The geometry of one layer as it is now: its own head and KV-head counts (a physically pruned
    layer has fewer; 0 heads = a layer with no attention left)."""
    adapter = adapter or adapter_for(model)
    geo = geometry or adapter.geometry(model)
    d = geo.head_dim
    modules = adapter.projection_modules(model, layer)
    layout = adapter.family.layout
    o = modules["o"]
    width = o.weight.shape[0] if isinstance(layout, GPT2Conv1D) else o.weight.shape[1]
    n_heads = int(width) // d
    if adapter.family.mha_only:
        n_kv = n_heads
    elif isinstance(layout, Stacked):
        n_kv = (int(modules["qkv"].weight.shape[0]) // d - n_heads) // 2
    else:
        n_kv = int(modules["k"].weight.shape[0]) // d
    if (n_heads, n_kv) == (geo.n_heads, geo.n_kv_heads):
        return geo
    return _LayerGeometry(geo.n_layers, n_heads, n_kv, d, geo.hidden)


@dataclass(frozen=True)
class _LayerGeometry:
    """A pruned layer's counts (HeadGeometry insists on H >= 1 and H % H_kv == 0 model-wide)."""
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads if self.n_kv_heads else 1


def head_slots(model, layout=None, adapter=None) -> list[list[int]]:
    """For every layer, the original head index of each head the model holds now.

    layout: the `HeadLayout` of a physically pruned model (prune_heads returns it; an export
    folder holds it as head_layout.json). Without one the model must be whole."""
    adapter = adapter or adapter_for(model)
    geo = adapter.geometry(model)
    counts = [layer_geometry(model, l, geo, adapter).n_heads for l in range(geo.n_layers)]
    if layout is not None:
        kept = [list(map(int, heads)) for heads in layout.heads]
        if [len(k) for k in kept] != counts:
            raise InputError("The head layout does not match the model's per-layer head counts; use the "
                             "head_layout.json saved with this pruned model.")
        return kept
    if any(c != geo.n_heads for c in counts):
        raise InputError("This model has fewer heads in some layers (physically pruned) but no head layout was "
                         "given; pass the HeadLayout from prune_heads, or load the export folder that holds "
                         "head_layout.json.")
    return [list(range(geo.n_heads)) for _ in range(geo.n_layers)]


def place(per_layer: list, slots: list[list[int]], n_heads: int) -> np.ndarray:
    """Per-layer score vectors [H_l] (None = no heads) -> [L, H] float64, 0 where a head is gone."""
    out = np.zeros((len(slots), n_heads))
    for l, (values, kept) in enumerate(zip(per_layer, slots)):
        if values is not None and kept:
            out[l, kept] = np.asarray(values, dtype=np.float64)
    return out


def gates_array(model, gates) -> torch.Tensor | None:
    """gates [L, H] (or None) validated against the model's geometry; None when every gate is 1."""
    if gates is None:
        return None
    g = as_gates(gates, adapter_for(model).geometry(model))
    if g.dim() != 2:
        raise InputError("Detectors take one mask: gates of shape [layers, heads].")
    return None if bool((g == 1).all()) else g


def masked(model, gates):
    """head_mask(model, gates) when there is a mask, else a no-op context."""
    return nullcontext(model) if gates is None else head_mask(model, gates)


def zero_pruned(scores: np.ndarray, gates) -> np.ndarray:
    """Scores [L, H] with the heads whose gate is 0 set to 0 (a pruned head does nothing)."""
    if gates is None:
        return scores
    off = (torch.as_tensor(gates).detach().cpu().numpy() == 0)
    return np.where(off, 0.0, scores)


__all__ = ["Detection", "layer_geometry", "head_slots", "place", "gates_array", "masked", "zero_pruned"]
