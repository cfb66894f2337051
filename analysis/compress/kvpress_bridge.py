"""A KV plan as a kvpress press (NVIDIA's kvpress, the field's KV-compression library on HF models).

kvpress is not one of headscope's dependencies (it pins transformers < 5.3): it lives in the peers environment
(bench/peers/setup_kvpress.sh) and is imported only inside `duo_press`, so this module imports with numpy and
headscope's core alone, in either environment.

`duo_press(source)` returns a kvpress `DuoAttentionPress` whose streaming heads, sink_size and recent_size are
the plan's: `source` is a KVPlan, a DuoPattern (analysis.compress.export.duo) or a DuoAttention pattern folder
(thresholded like DuoAttention: `threshold` / `sparsity`). The press is a subclass that takes its pattern from
the plan instead of downloading one of DuoAttention's published patterns by the model's hub name (what
`DuoAttentionPress.post_init_from_model` does), and checks the model's layers and KV heads first.

What kvpress can express of a plan, and what it cannot (docs/PEERS.md):
- full / window per KV head: yes, DuoAttentionPress's `streaming_mask` is [L, Hkv], one gate per KV head, as a
  plan's modes are;
- when the window applies: kvpress compresses once, after the prefill of the context (a forward hook). The
  prefill itself runs every head on full attention, and the decoded tokens are never evicted, so a streaming
  head reads sink_size + the last recent_size tokens of the prefill + everything after it. headscope's plan
  windows every query, prefill included (the band of analysis.arch.spans), and its compact cache evicts as it
  decodes. The two agree on what the first query after the prefill reads (sinks + the recent_size - 1 tokens
  before it + itself, against kvpress's sinks + recent_size tokens before it: one token more);
- memory: DuoAttentionPress does not free anything; it records which cached keys to hide
  (`module.masked_key_indices`) and, while decoding, overwrites them with a key whose attention weight
  underflows to zero (kvpress/attention_patch.py). The cache holds every head's every token; the runner
  (bench/peers/kvpress_ruler.py) measures what it holds;
- prune: no press removes a KV head or a query head's output. A plan with pruned KV heads is refused unless
  `pruned="full"` / `"window"` writes them as gates, which is right only for a model whose pruned heads are
  zeroed (the zeroed export: their output is 0 whatever they read); kvpress still caches their K/V.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.core.errors import InputError

SETUP = "bash bench/peers/setup_kvpress.sh, then run with .venv-kvpress/bin/python"


def plan_pattern(source, *, threshold: float | None = None, sparsity: float | None = None,
                 pruned: str = "refuse") -> tuple[np.ndarray, int, int]:
    """(streaming [L, Hkv] bool, sink_size, recent_size) of a KVPlan, a DuoPattern or a pattern folder."""
    from analysis.compress.export.duo import DuoPattern, pattern_from_plan, read_pattern
    if isinstance(source, (str, Path)):
        source = read_pattern(source)
    if not isinstance(source, DuoPattern):
        if threshold is not None or sparsity is not None:
            raise InputError("A KV plan says which heads are full; a threshold or sparsity applies to a DuoAttention "
                             "pattern's gates only.")
        source = pattern_from_plan(source, pruned=pruned)
    return ~source.full(threshold=threshold, sparsity=sparsity), source.sink_size, source.recent_size


def duo_press(source, *, threshold: float | None = None, sparsity: float | None = None, pruned: str = "refuse"):
    """A kvpress DuoAttentionPress running `source`'s pattern (see the module docstring). InputError when
    kvpress is not installed, or (when the press meets the model) for a model of other layers / KV heads."""
    streaming, sinks, recent = plan_pattern(source, threshold=threshold, sparsity=sparsity, pruned=pruned)
    return _press_class()(head_compression_ratio=float(streaming.mean()), plan_streaming=streaming,
                          plan_sinks=sinks, plan_recent=recent)


def press_pattern(press) -> tuple[np.ndarray, int, int]:
    """(streaming [L, Hkv] bool, sink_size, recent_size) a DuoAttentionPress runs (after it met a model)."""
    return np.asarray(press.streaming_mask.cpu().numpy(), dtype=bool), int(press.sink_size), int(press.recent_size)


@functools.cache
def _press_class():
    """PlanDuoAttentionPress, defined on first use (kvpress is imported here only)."""
    try:
        import torch
        from kvpress import DuoAttentionPress
    except ImportError as err:
        raise InputError(f"kvpress is not installed here ({err}); it lives in its own environment: {SETUP}.") from None

    @dataclass
    class PlanDuoAttentionPress(DuoAttentionPress):
        """DuoAttentionPress with its streaming heads from a headscope plan (no download, no on-the-fly scores)."""
        plan_streaming: np.ndarray = field(default=None, repr=False)   # [L, Hkv] bool
        plan_sinks: int = 0
        plan_recent: int = 1

        def post_init_from_model(self, model):
            config = model.config
            theirs = (config.num_hidden_layers, getattr(config, "num_key_value_heads", None)
                      or config.num_attention_heads)
            if tuple(self.plan_streaming.shape) != theirs:
                raise InputError(f"The plan is for {self.plan_streaming.shape[0]} layers x "
                                 f"{self.plan_streaming.shape[1]} KV heads, but the model has {theirs[0]} x "
                                 f"{theirs[1]}; make the plan for this model.")
            self.sink_size, self.recent_size = self.plan_sinks, self.plan_recent
            self.streaming_mask = torch.as_tensor(self.plan_streaming, dtype=torch.bool, device=model.device)

    return PlanDuoAttentionPress
