"""Compensation after recovery: do the kept heads take over the pruned heads' work?

The head-pruning literature reports that after fine-tuning or distillation the remaining heads
pick up roles of the removed ones. For one mask, this compares every detector's scores of the
KEPT heads in two models that share the mask:
- before: the dense model under the mask (the cut with no recovery);
- after: the recovered (distilled) model under the same mask.
Per role: how many kept heads have it before and after, their mean score, and the kept heads whose
score rose the most. For DLA also the direct logit the pruned heads gave in the dense model (what
the cut removed) next to the kept heads' total DLA before and after (what the kept heads add back
directly). For an iterative run, "before" is the dense model under the final mask, not the state
before each round's recovery.
"""
from __future__ import annotations

import numpy as np
import torch

from analysis.measure.detectors import DETECTORS, detect_heads

DEFAULT_DETECTORS = ("previous-token", "induction", "duplicate-token", "copying", "dla")
COMPENSATION_TOKENS = 128     # tokens of text each detector reads, before and after recovery


def compensation(loaded, recovered_model, pruned, text=None, *, names=DEFAULT_DETECTORS,
                 max_tokens: int = COMPENSATION_TOKENS, options: dict | None = None, progress=None,
                 should_stop=None) -> list[dict]:
    """One row per detector comparing the kept heads before (loaded.model under `pruned`) and after
    recovery (`recovered_model`, full shape, under `pruned`). Decoder-only detectors are skipped for
    encoders."""
    from types import SimpleNamespace

    from analysis.core.progress import scaled
    p = np.asarray(pruned, dtype=bool)
    gates = torch.as_tensor(~p, dtype=torch.float32)
    names = [n for n in names if DETECTORS[n].applies_to(loaded.kind)]
    opts = {**dict(length=30, n_sequences=4), **(options or {})}
    common = dict(max_tokens=max_tokens, seq_len=max_tokens, options=opts, should_stop=should_stop)
    before = detect_heads(loaded, names, text, gates=gates, progress=scaled(progress, 0.0, 0.5), **common)
    after_lm = SimpleNamespace(model=recovered_model, tokenizer=loaded.tokenizer)
    after = detect_heads(after_lm, names, text, gates=gates, progress=scaled(progress, 0.5, 0.9), **common)
    dense_dla = None
    if "dla" in names:
        dense_dla = detect_heads(loaded, ["dla"], text, progress=scaled(progress, 0.9, 1.0), **common)["dla"]
    kept = ~p
    rows = []
    for name in names:
        b, a = before[name], after[name]
        rise = np.where(kept, a.scores - b.scores, -np.inf)
        top = [f"L{l}H{h} ({b.scores[l, h]:.2f}->{a.scores[l, h]:.2f})"
               for l, h in zip(*np.unravel_index(np.argsort(-rise, axis=None)[:3], rise.shape)) if kept[l, h]]
        row = dict(role=name, threshold=b.threshold, kept_with_role_before=int((b.has_role & kept).sum()),
                   kept_with_role_after=int((a.has_role & kept).sum()),
                   mean_kept_before=float(b.scores[kept].mean()) if kept.any() else float("nan"),
                   mean_kept_after=float(a.scores[kept].mean()) if kept.any() else float("nan"),
                   largest_rises=top)
        if name == "dla" and dense_dla is not None:
            row.update(pruned_heads_dla_dense=float(dense_dla.scores[p].sum()),
                       kept_heads_dla_before=float(b.scores[kept].sum()),
                       kept_heads_dla_after=float(a.scores[kept].sum()))
        rows.append(row)
    return rows


def compensation_markdown(rows: list[dict]) -> str:
    """The compensation table as markdown (for the pipeline report)."""
    if not rows:
        return ""
    lines = ["## Compensation after recovery (kept heads, before -> after distillation)", "",
             "| role | threshold | kept heads with role | mean score of kept heads | largest rises |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['role']} | {r['threshold']:g} | {r['kept_with_role_before']} -> {r['kept_with_role_after']} "
                     f"| {r['mean_kept_before']:.4f} -> {r['mean_kept_after']:.4f} | {', '.join(r['largest_rises'])} |")
    dla = next((r for r in rows if "pruned_heads_dla_dense" in r), None)
    if dla is not None:
        lines += ["", f"Direct logit attribution: the pruned heads gave {dla['pruned_heads_dla_dense']:+.4f} logits to "
                      f"the correct token in the dense model; the kept heads give {dla['kept_heads_dla_before']:+.4f} "
                      f"before recovery and {dla['kept_heads_dla_after']:+.4f} after."]
    return "\n".join(lines) + "\n"
