"""The heads behind a probe: the drop of its mean logit difference when each head alone (and each KV
group) is removed, an L x H "circuit" map, through the fast ablation sweep.

Causal LMs use analysis.measure.ablation.FastAblation with `ProbeReadout`: one dense pass captures
every layer's input, then each layer's ablations replay only the layers from there on, all of a
layer's ablations batched in one pass (gates [R, L, H]), and only the read positions go through the
LM head. The sweep splits its layers over the processes of a launch as the loss sweep does. The
rows are first cut into buckets of similar length (each bucket one sweep), laid out as the probes'
passes are (`measure.layout`: the padded tokens x ablations plus `MAP_PASS_TOKENS` per bucket, what a
bucket's own dense pass and layer calls cost, are the fewest); the buckets' per-unit changes add up to
the whole probe's. `method="naive"` is the reference: one
full masked forward per ablation over all the probe's rows at once (right-padded: padding after the
last read position changes nothing in a causal model; analysis.measure.ablation.naive_sweep, same
readout); the two agree to rounding (tests in float64). Masked LMs evaluate every ablation's gates in batched
passes of `measure.item_values` (no prefix to reuse: attention looks both ways).

drop[l, h] = mean diff (dense) - mean diff (head l, h removed): positive = the head helps the answer.
CIs per head: a bootstrap over the probe's units of the same per-unit changes (fast sweep).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.distributed import Team
from analysis.core.errors import InputError, check_seed
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.measure.ablation import FastAblation, ablation_gates, apply_chain, naive_sweep
from analysis.measure.probes.items import ProbeItems
from analysis.measure.probes.measure import LEVEL, N_BOOT, item_values, layout

MAP_BATCH_TOKENS = 8192      # tokens per replayed pass (ablation rows x sequences x length)
MAP_PASS_TOKENS = 48         # what one more bucket costs, in padded tokens x ablations (bench/bench_probes.py)


class ProbeReadout:
    """FastAblation readout of a probe's scored items on rows x [S, T]: unit = row, unit sum = the
    summed logit differences of its items, total = the number of items (metric: mean logit difference)."""
    metric = "logit difference"

    def __init__(self, items: ProbeItems, rows: list[int]):
        keep = items.scored & torch.isin(items.row, torch.tensor(rows))
        local = {s: i for i, s in enumerate(rows)}
        self.row = torch.tensor([local[int(s)] for s in items.row[keep]], dtype=torch.long)   # [m] row in x
        self.position = items.position[keep]                             # [m]
        self.correct, self.contrast = items.correct[keep], items.contrast[keep]
        self.n_rows = len(rows)

    def total(self, x: torch.Tensor) -> int:
        return int(self.row.numel())

    def weights(self, x: torch.Tensor) -> np.ndarray:
        return np.bincount(self.row.numpy(), minlength=self.n_rows).astype(np.float64)   # [S] items per row

    def _unit_sums(self, logits: torch.Tensor, r: int) -> torch.Tensor:
        """logits [r, m, V] at the items -> summed differences per row [r, S] (float64)."""
        c, k = self.correct.to(logits.device), self.contrast.to(logits.device)
        diff = (logits.gather(-1, c.expand(r, -1)[..., None]) - logits.gather(-1, k.expand(r, -1)[..., None]))[..., 0]
        out = torch.zeros(r, self.n_rows, dtype=torch.float64)
        return out.index_add_(1, self.row, diff.double().cpu())          # [r, S]

    def dense(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._unit_sums(logits[self.row, self.position][None], 1)[0]   # [S]

    def replay(self, chain, hidden: torch.Tensor, x: torch.Tensor, r: int) -> torch.Tensor:
        S = x.shape[0]
        rows = (torch.arange(r)[:, None] * S + self.row[None]).to(hidden.device)   # [r, m] mask-major
        picked = hidden[rows, self.position.to(hidden.device)[None]]       # [r, m, D]
        return self._unit_sums(apply_chain(chain, picked), r)             # [r, S]


def length_buckets(items: ProbeItems, n_ablations: int = 1, pass_tokens: int = MAP_PASS_TOKENS) -> list[list[int]]:
    """The rows that hold scored items, cut into buckets of similar length (`measure.layout` for
    n_ablations masks, no limit on a bucket's size: the sweep splits its passes itself), shortest first."""
    rows = sorted(set(items.row[items.scored].tolist()))
    buckets = layout(items.lengths[rows].tolist(), n_ablations, 2**62, pass_tokens)
    return [sorted((rows[i] for i in b), key=lambda s: (int(items.lengths[s]), s)) for b in reversed(buckets)]


@dataclass(frozen=True)
class ProbeMap:
    """A probe's per-head map: drop [L, H] of the mean logit difference when that head alone is removed."""
    name: str
    label: str
    base: float                       # dense mean logit difference over the scored items
    drop: np.ndarray                  # [L, H]
    group_drop: np.ndarray | None     # [L, Hkv] whole KV group removed (GQA)
    drop_ci: np.ndarray | None        # [L, H, 2] bootstrap over units (None for the naive reference)
    n_items: int
    method: str
    seconds: float

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """(layer, head, drop) of the k heads whose removal hurts the probe most."""
        flat = np.argsort(-np.nan_to_num(self.drop, nan=-np.inf), axis=None)[:k]
        H = self.drop.shape[1]
        return [(int(i // H), int(i % H), float(self.drop.flat[i])) for i in flat]

    def margin(self) -> float:
        """drop of the top head / drop of the second (how clearly one head carries the probe)."""
        (_, _, a), (_, _, b) = self.top(2)
        return a / b if b > 0 else float("inf")

    def as_dict(self) -> dict:
        return dict(name=self.name, label=self.label, base=self.base, drop=self.drop, group_drop=self.group_drop,
                    drop_ci=self.drop_ci, n_items=self.n_items, method=self.method, seconds=self.seconds,
                    top=[dict(layer=l, head=h, drop=d) for l, h, d in self.top(10)])


def _unit_ci(unit_delta: np.ndarray, weight: np.ndarray, *, seed: int, n_boot: int = N_BOOT) -> np.ndarray:
    """CI [L, R, 2] of -sum(unit_delta) / sum(weight) over resampled units (unit_delta [L, R, U])."""
    picks = np.random.default_rng(seed).integers(0, weight.size, size=(n_boot, weight.size))   # [n_boot, U]
    sums = np.nan_to_num(unit_delta)[..., picks].sum(-1)                # [L, R, n_boot]
    drops = -sums / weight[picks].sum(-1)                               # [L, R, n_boot]
    tail = 100 * (1 - LEVEL) / 2
    return np.moveaxis(np.percentile(drops, [tail, 100 - tail], axis=-1), 0, -1)   # [L, R, 2]


def probe_map(model, spec, items: ProbeItems, *, method: str = "fast", groups: bool = True, layers=None,
              seed: int = 0, batch_tokens: int = MAP_BATCH_TOKENS, pass_tokens: int = MAP_PASS_TOKENS,
              progress: Progress | None = None, should_stop: ShouldStop | None = None,
              team: Team | None = None) -> ProbeMap:
    """The per-head map of one probe's items on `model` (method "fast" or "naive"; masked LMs: batched);
    pass_tokens: the fast sweep's cost of one more length bucket (`length_buckets`)."""
    if method not in ("fast", "naive"):
        raise InputError(f"Unknown map method {method!r}; use 'fast' or 'naive'.")
    seed = check_seed(seed, "The probe map's seed")                     # before the sweep, not after it
    t0 = time.perf_counter()
    geo = adapter_for(model).geometry(model)
    if items.kind == "masked-lm":
        drop, group = _batched_map(model, items, geo, groups, progress, should_stop, team)
        base = float(item_values(model, items)[0][0, items.scored.numpy()].mean())
        return ProbeMap(spec.name, spec.label, base, drop, group, None, items.n_items, "batched masks",
                        time.perf_counter() - t0)
    R = ablation_gates(geo, 0, groups=groups).shape[0]
    buckets = length_buckets(items, R, pass_tokens) if method == "fast" else [sorted(set(items.row[items.scored].tolist()))]
    n = items.n_items
    delta, base, units, weights = np.zeros((geo.n_layers, R)), 0.0, [], []
    for i, rows in enumerate(buckets):
        T = int(items.lengths[rows].max())
        x = items.ids[rows, :T]                                          # [S_b, T_b]
        readout = ProbeReadout(items, rows)
        sub = scaled(progress, i / len(buckets), (i + 1) / len(buckets))
        if method == "fast":
            res = FastAblation(max(1, batch_tokens // T), groups, readout).sweep(
                model, x, layers=layers, progress=sub, should_stop=should_stop, team=team)
        else:
            res = naive_sweep(model, x, groups=groups, layers=layers, progress=sub, should_stop=should_stop,
                              team=team, readout=readout)
        share = res.n_tokens / n                                         # this bucket's items / all items
        full = res.head_delta if res.group_delta is None else np.concatenate([res.head_delta, res.group_delta], 1)
        delta += full * share
        base += res.base_loss * share
        if res.unit_delta is not None:
            units.append(res.unit_delta)
            weights.append(res.unit_weight)
    H = geo.n_heads
    ci = None
    if units and len(units) == len(buckets):
        ci = _unit_ci(np.concatenate(units, 2), np.concatenate(weights), seed=seed)[:, :H]
    return ProbeMap(spec.name, spec.label, base, -delta[:, :H], -delta[:, H:] if R > H else None, ci, n, method,
                    time.perf_counter() - t0)


def _batched_map(model, items, geo, groups, progress, should_stop, team):
    """Masked LMs: dense + every ablation's gates [1 + L*R, L, H] through measure.item_values."""
    gates = torch.cat([torch.ones(1, geo.n_layers, geo.n_heads)] +
                      [ablation_gates(geo, l, groups=groups) for l in range(geo.n_layers)])   # [1+L*R, L, H]
    diff, _ = item_values(model, items, gates, progress=progress, should_stop=should_stop, team=team)
    mean = diff[:, items.scored.numpy()].mean(1)                         # [1+L*R]
    drop = (mean[0] - mean[1:]).reshape(geo.n_layers, -1)                # [L, R]
    H = geo.n_heads
    return drop[:, :H], (drop[:, H:] if drop.shape[1] > H else None)


def role_overlap(pmap: ProbeMap, detections: dict, k: int = 10) -> list[dict]:
    """Per detector role (analysis.measure.detectors results): how many of the probe's top-k heads have it,
    which ones, and the share of all heads that have it (what k heads picked at random would show)."""
    top = [(l, h) for l, h, _ in pmap.top(k)]
    rows = []
    for name, det in detections.items():
        has = det.has_role
        hits = [f"L{l}H{h}" for l, h in top if has[l, h]]
        rows.append(dict(role=name, top_k=len(top), with_role=len(hits), heads=hits,
                         base_rate=float(has.mean()), expected=float(has.mean() * len(top))))
    return rows
