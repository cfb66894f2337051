"""The "zeroed" format: the original shapes with the pruned heads' weights zeroed
(`analysis.arch.head_gates.zero_heads` on a copy), safetensors + config.json: loads anywhere with
plain `from_pretrained`, no smaller, no faster."""
from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from analysis.arch.head_gates import zero_heads
from analysis.arch.models import quiet_progress_bars
from analysis.compress.export.formats import ExportFormat


def save_hf(model: nn.Module, folder: Path, config=None) -> None:
    """Hugging Face checkpoint (save_pretrained: its key conventions), optionally with another config."""
    with quiet_progress_bars():
        model.save_pretrained(folder, safe_serialization=True)
    if config is not None:
        config.architectures = [type(model).__name__]
        config.save_pretrained(folder)


class ZeroedFormat(ExportFormat):
    name = "zeroed"   # label, help, rank, options: its declaration (export/format_registry.py)
    physical = False
    keeps_dtype = True

    def write(self, model, pruned, folder, *, kv_policy="auto", rounds=None, dtype=None, **options):
        copied = zero_heads(copy.deepcopy(model), pruned)
        save_hf(copied if dtype is None else copied.to(dtype), folder)
        return None
