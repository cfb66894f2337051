"""Head geometry: how many layers, query heads, KV heads, and how wide each head is.

The contract's symbols (docs/DEFINITIONS.md): L layers, H query heads, H_kv key/value heads,
G = H / H_kv query heads per KV group, d = head_dim, D = hidden size. Query head h belongs to
KV group h // G. `kv_groups_emptied` says which KV groups a mask [L, H] empties (numpy; the mask planner
in analysis.score.masks and the head gates both read it).
"""
from dataclasses import dataclass

import numpy as np

from analysis.core.errors import UnsupportedModelError


@dataclass(frozen=True)
class HeadGeometry:
    n_layers: int    # L
    n_heads: int     # H, query heads per layer
    n_kv_heads: int  # H_kv, key/value heads per layer (H for MHA, 1 for MQA)
    head_dim: int    # d
    hidden: int      # D, the residual width

    def __post_init__(self):
        for name in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"Head geometry has {name} = {getattr(self, name)}; "
                                            "a model with attention heads needs every count > 0.")
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} query heads do not split evenly into {self.n_kv_heads} KV heads.")

    @property
    def group_size(self) -> int:
        """G: query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def n_total_heads(self) -> int:
        """L * H, the population the global ranking runs over."""
        return self.n_layers * self.n_heads

    @property
    def is_gqa(self) -> bool:
        return self.n_kv_heads < self.n_heads

    def kv_group(self, head: int) -> int:
        """KV group of query head `head` (h // G)."""
        return head // self.group_size

    def as_dict(self) -> dict:
        return dict(n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                    head_dim=self.head_dim, hidden=self.hidden, group_size=self.group_size)


def kv_groups_emptied(pruned: np.ndarray, group_size: int) -> np.ndarray:
    """[L, H] pruned query heads -> [L, H_kv] True where every query head of the group is pruned."""
    p = np.asarray(pruned, dtype=bool)
    return p.reshape(p.shape[0], -1, group_size).all(axis=-1)
