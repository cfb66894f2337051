"""The "stock" format: a uniform-per-layer pruned checkpoint whose config.json holds the pruned counts
(num_attention_heads / num_key_value_heads / head_dim), so stock `AutoModel*.from_pretrained` loads it
with no custom code; refused where the family's config cannot express the cut. `stock_check` says
beforehand whether a mask can be written this way and which sparsities can."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analysis.arch import resize
from analysis.arch.adapters import adapter_for
from analysis.compress.export.formats import PhysicalFormat, StreamSpec
from analysis.compress.export.zeroed import save_hf
from analysis.compress.surgery import HeadLayout
from analysis.core.errors import HeadscopeError, InputError


def stock_config_for(model_or_config, layout: HeadLayout):
    """The config stock Hugging Face code needs to build `layout`'s shapes (uniform layouts only);
    for a model or its config (the streamed export has no model)."""
    counts = layout.uniform_counts()
    if counts is None:
        per_layer = [layout.layer_counts(layer) for layer in range(layout.n_layers)]
        raise InputError(
            f"A stock checkpoint needs the same head counts in every layer, but this mask keeps (query, KV) "
            f"heads {per_layer} per layer. Use the 'balanced-uniform' mask policy (or 'uniform' with "
            f"kv_policy='expand', which copies K/V for uneven GQA groups), or export the head-layout checkpoint "
            f"instead.")
    config = getattr(model_or_config, "config", model_or_config)
    return resize.stock_config(adapter_for(config), config, counts[0], counts[1], layout.head_dim)


@dataclass(frozen=True)
class StockCheck:
    """Whether a stock config (plain `from_pretrained`) can describe what surgery makes of a mask,
    and the nearest sparsities at which one can: [(sparsity, policy, kv_policy, (H', Hkv'))]."""
    ok: bool
    reason: str
    counts: tuple[int, int] | None
    nearest: list

    def message(self) -> str:
        if self.ok:
            return (f"A stock config describes this mask ({self.counts[0]} query / {self.counts[1]} KV heads in "
                    f"every layer): the 'stock' export loads with plain from_pretrained.")
        options = "; ".join(f"sparsity {s:.4g} ({policy} policy, kv_policy {kv}: {h} query / {kv_h} KV heads per "
                            f"layer)" for s, policy, kv, (h, kv_h) in self.nearest[:3])
        return f"No stock config can describe this mask: {self.reason} " + (
            f"Nearest sparsities that can: {options}." if options else "No sparsity can (this family's config "
                                                                      "cannot describe pruned heads).")


def _stock_accepts(adapter, config, n_heads: int, n_kv_heads: int, head_dim: int) -> str:
    """'' when stock code can build n_heads / n_kv_heads per layer, else why not."""
    try:
        resize.stock_config(adapter, config, n_heads, n_kv_heads, head_dim)
    except HeadscopeError as err:
        return str(err)
    return ""


def stock_sparsities(model_or_config) -> list[tuple[float, str, str, tuple[int, int]]]:
    """Every sparsity below 1 whose mask a stock config can describe, with the policy that makes it:
    balanced-uniform (c heads from every group, K/V kept) or, where that is not the only way,
    uniform + kv_policy 'expand' (K/V copied per query head: bigger KV cache)."""
    adapter = adapter_for(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    g = adapter.geometry(config)
    out = []
    for kept in range(g.n_heads - 1, 0, -1):                     # H' query heads kept per layer
        sparsity = (g.n_heads - kept) / g.n_heads
        if g.group_size == 1:
            candidates = [("uniform", "auto", kept)]
        else:
            candidates = ([("balanced-uniform", "auto", g.n_kv_heads)] if kept % g.n_kv_heads == 0 else []) + [
                ("uniform", "expand", kept)]
        for policy, kv_policy, n_kv in candidates:
            if not _stock_accepts(adapter, config, kept, n_kv, g.head_dim):
                out.append((sparsity, policy, kv_policy, (kept, n_kv)))
                break
    return out


def stock_check(model_or_config, pruned, *, kv_policy: str = "auto", sparsity: float | None = None,
                stock: list | None = None) -> StockCheck:
    """Can a stock config describe what surgery makes of pruned [L, H] under kv_policy? `nearest`
    lists the stock-describable sparsities closest to `sparsity` (default: the mask's). `stock`: the
    model's `stock_sparsities` when the caller keeps them (they depend on the config only)."""
    from analysis.score.masks import plan_layout
    adapter = adapter_for(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    g = adapter.geometry(config)
    p = np.asarray(pruned, dtype=bool)
    target = float(p.mean() if sparsity is None else sparsity)
    nearest = sorted(stock_sparsities(config) if stock is None else stock, key=lambda c: (abs(c[0] - target), c[0]))
    heads, kv_heads = plan_layout(p, g.group_size, kv_policy)
    counts = sorted({(len(h), len(kv)) for h, kv in zip(heads, kv_heads)})
    if len(counts) != 1 or counts[0][0] == 0:
        reason = (f"the layers keep different (query, KV) head counts {counts[:4]}{' ...' if len(counts) > 4 else ''}"
                  if len(counts) != 1 else "every head is pruned") + "; a stock config has one count for all layers."
        return StockCheck(False, reason, None, nearest)
    (h, kv), = counts
    if (h, kv) == (g.n_heads, g.n_kv_heads):
        return StockCheck(True, "", (h, kv), nearest)
    why = _stock_accepts(adapter, config, h, kv, g.head_dim)
    return StockCheck(not why, why, (h, kv), nearest)


class StockFormat(PhysicalFormat):
    name = "stock"   # label, help, rank, options: its declaration (export/format_registry.py)
    keeps_dtype = True
    # streamed (analysis.compress.export.streamed): the checkpoint's names, config.json with the pruned counts
    streamed = StreamSpec(names="checkpoint", producer=False, config="stock")

    def write_cut(self, smaller, layout, folder, *, original, **options):
        save_hf(smaller, folder, stock_config_for(original, layout))
