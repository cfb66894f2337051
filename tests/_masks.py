"""Test helpers shared by the surgery and export tests: a forward's first output (`forward`), the same
under `head_mask` (`masked_forward`), and named masks that cover every structural case surgery handles
(`surgery_masks`)."""
import numpy as np
import torch

from analysis.arch.head_gates import gates_from_mask, head_mask


def forward(model, ids, **kwargs):
    """The first output (logits or hidden states) of a no-grad forward of ids [B, T]."""
    with torch.no_grad():
        return model(input_ids=ids, **kwargs)[0]


def masked_forward(model, pruned, ids):
    """`forward` with the heads of pruned [L, H] gated off (the oracle surgery and exports must match)."""
    with head_mask(model, gates_from_mask(pruned)):
        return forward(model, ids)


def surgery_masks(geometry, seed):
    """Named masks covering every structural case (for G = 1 some coincide, that is fine)."""
    L, H, G = geometry.n_layers, geometry.n_heads, geometry.group_size
    rng = np.random.default_rng(seed)
    masks = {}
    uneven = np.zeros((L, H), bool)
    uneven[0, 0] = True                          # group 0 keeps G-1 heads, the others G
    masks["uneven-groups"] = uneven
    group = np.zeros((L, H), bool)
    group[1, :G] = True                          # KV group 0 of layer 1 emptied
    group[0, [0, H - 1]] = True
    masks["emptied-group"] = group
    layer = np.zeros((L, H), bool)
    layer[0] = True                              # every head of layer 0: only O's bias is left
    layer[1, 1] = True
    masks["emptied-layer"] = layer
    one_per_group = np.zeros((L, H), bool)
    one_per_group[:, ::G] = G > 1                # every group keeps G-1 heads: group structure kept
    one_per_group[1, 0] = True
    masks["even-groups"] = one_per_group
    for i in range(2):
        random = rng.random((L, H)) < 0.5
        random[rng.integers(L), rng.integers(H)] = True
        masks[f"random{i}"] = random
    return masks
