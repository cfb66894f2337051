"""A probe's numbers under any mask: logit difference and accuracy per item, bootstrap CIs over units.

For item i read at position p with correct token c and contrast k:
    diff_i = logit_p[c] - logit_p[k]        (the logit difference)
    correct_i = diff_i > 0                   (accuracy = their share; 0.5 = chance)
    nll_i = -log softmax(logit_p)[c]         (what a probe's extras read, e.g. the ICL score)
Logits are computed at the read positions only (a forward hook on the base model keeps just those
hidden states before the LM head), and B masks (gates [B, L, H] through
analysis.arch.head_gates.head_mask) share the passes, mask-major as the masking contract says.

Passes (`layout`): the rows of every probe measured together are pooled (`pooled_values`; a row is
one prompt, and rows of different probes share passes), sorted by length and cut into passes, each
trimmed to its longest row, so that the padded tokens plus `pass_tokens` per pass (what one more
forward pass costs, in tokens) are the fewest (dynamic programming over the distinct lengths); no
pass holds more than `batch_tokens` tokens (rows x length x masks). A row's numbers do not depend on
the other rows of its pass (causal rows are right-padded and read before the padding; masked-LM rows
carry an attention mask), so pooled, batched and one-row-at-a-time give the same values (tests in
float64).

CIs: a percentile bootstrap (`N_BOOT` resamples, seeded) over units (the sequences items come from;
analysis.measure.probes.items), the same resamples for every mask, so two calls with the same items
and seed (a dense run cached earlier and a cut) are paired.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from analysis.arch.adapters import input_device
from analysis.core.distributed import SOLO, Team
from analysis.core.errors import InputError, check_seed
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.evaluation import context_length, gate_batch
from analysis.measure.loss import token_nll
from analysis.measure.probes.items import ProbeItems
from analysis.measure.probes.registry import chosen

N_BOOT = 1000
LEVEL = 0.95
BATCH_TOKENS = 4096          # tokens per forward pass at most (rows x length x masks)
PASS_TOKENS = 48             # what one more forward pass costs, in padded tokens (bench/bench_probes.py)
LAYOUT_WINDOW = 64           # distinct lengths one pass may span (bounds the layout's search)


def keep_positions(rows: torch.Tensor, positions: torch.Tensor):
    """Forward hook for the base model: keep the hidden states at (rows [m], positions [m]) only, as one
    sequence [1, m, D] (the LM head then runs on the m read positions and nothing else)."""
    def hook(module, args, output):
        hidden = output[0]                                              # [R, T, D]
        picked = hidden[rows.to(hidden.device), positions.to(hidden.device)][None]   # [1, m, D]
        if isinstance(output, tuple):
            return (picked, *output[1:])
        output[next(iter(output.keys()))] = picked
        return output
    return hook


def layout(lengths, n_masks: int = 1, batch_tokens: int = BATCH_TOKENS,
           pass_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """Rows (indices of lengths [S]) cut into passes, longest first (module docstring): each pass a run
    of rows of similar length within batch_tokens for n_masks masks, the runs chosen to minimise the
    padded tokens + pass_tokens per pass."""
    lengths = [int(v) for v in lengths]
    distinct = sorted(set(lengths))                                     # [G] ascending
    rank = {v: g for g, v in enumerate(distinct)}
    count = np.bincount([rank[v] for v in lengths], minlength=len(distinct))   # [G] rows of each length

    def passes(rows: int, width: int) -> int:                          # passes a run of rows x width needs
        return -(-rows // max(1, batch_tokens // max(1, width * n_masks)))

    best, cut = [0.0] + [np.inf] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):                               # best[j]: lengths 0..j-1 laid out
        rows = 0
        for i in range(j - 1, max(-1, j - 1 - LAYOUT_WINDOW), -1):        # lengths i..j-1 in one run
            rows += int(count[i])
            cost = best[i] + passes(rows, distinct[j - 1]) * pass_tokens + rows * distinct[j - 1] * n_masks
            if cost < best[j]:
                best[j], cut[j] = cost, i
    order = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s))   # longest first
    out, start, j = [], 0, len(distinct)
    while j > 0:                                                        # the runs, longest first
        rows = order[start:start + int(count[cut[j]:j].sum())]
        per = max(1, batch_tokens // max(1, distinct[j - 1] * n_masks))
        out += [rows[k:k + per] for k in range(0, len(rows), per)]
        start, j = start + len(rows), cut[j]
    return out


def pool(items_list: list[ProbeItems]) -> tuple[ProbeItems, list[int]]:
    """Several probes' items as one ProbeItems (rows and items concatenated, in order) and the offset of
    each probe's first item (its items are pool items offset .. offset + n - 1)."""
    if len(items_list) == 1:
        return items_list[0], [0]
    kinds = {it.kind for it in items_list}
    if len(kinds) != 1:
        raise InputError(f"Probes of one measurement read one kind of model; got {sorted(kinds)}.")
    T = max(it.ids.shape[1] for it in items_list)
    ids = torch.cat([torch.nn.functional.pad(it.ids, (0, T - it.ids.shape[1]), value=0)
                     for it in items_list])                             # [S, T] (padding is never read)
    row_offsets = np.cumsum([0] + [it.ids.shape[0] for it in items_list])[:-1]
    offsets = np.cumsum([0] + [it.correct.numel() for it in items_list])[:-1].tolist()
    cat = lambda name: torch.cat([getattr(it, name) for it in items_list])      # noqa: E731
    return replace(items_list[0], name="the probes", ids=ids, lengths=cat("lengths"),
                   row=torch.cat([it.row + int(o) for it, o in zip(items_list, row_offsets)]),
                   position=cat("position"), correct=cat("correct"), contrast=cat("contrast"),
                   unit=torch.cat([it.unit + int(o) for it, o in zip(items_list, row_offsets)]),
                   reference=cat("reference"), conditions=sum((it.conditions for it in items_list), ()),
                   rejected={}, notes=()), offsets


def read_values(logits: torch.Tensor, correct: torch.Tensor, contrast: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(diff [b, m], nll [b, m]) float64 of m items from their logits [b, m, V] (b masks), correct / contrast [m]
    (the module docstring's formulas; half logits are read in float32)."""
    b = logits.shape[0]
    logits = logits.float() if logits.dtype not in (torch.float32, torch.float64) else logits
    c, k = correct.to(logits.device).expand(b, -1), contrast.to(logits.device).expand(b, -1)   # [b, m]
    diff = (logits.gather(-1, c[..., None]) - logits.gather(-1, k[..., None]))[..., 0]
    nll = token_nll(logits, c)                                           # [b, m]
    return diff.double().cpu().numpy(), nll.double().cpu().numpy()


@torch.no_grad()
def item_values(model, items: ProbeItems, gates: torch.Tensor | None = None, *, batch_tokens: int = BATCH_TOKENS,
                pass_tokens: int = PASS_TOKENS, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, team: Team | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(diff [B, n], nll [B, n]) float64 of every item under every gate row (gates [B, L, H]; None = dense,
    B = 1); passes laid out by `layout`. `team`: the processes of a launch that split the passes
    (single-process numbers)."""
    from analysis.arch.head_gates import head_mask
    B = 1 if gates is None else gates.shape[0]
    n = items.correct.numel()
    base = model.base_model
    if base is model:
        raise InputError("This model has no language-model head, so it predicts no tokens to probe.")
    longest, context = int(items.lengths.max()), context_length(model, default=2**31)
    if longest > context:
        raise InputError(f"The {items.name} probe's prompts take up to {longest} tokens; this model reads at most "
                         f"{context}. Use fewer or shorter items (e.g. the code probe's max_chars).")
    mask_chunk = max(1, min(B, batch_tokens // max(1, int(items.lengths.max()))))
    jobs = [(rows, m) for rows in layout(items.lengths.tolist(), min(B, mask_chunk), batch_tokens, pass_tokens)
            for m in range(0, B, mask_chunk)]
    by_row: dict[int, list[int]] = {}
    for i, s in enumerate(items.row.tolist()):
        by_row.setdefault(s, []).append(i)
    device = input_device(model)
    attention = items.attention_mask() if items.kind == "masked-lm" else None

    def run(j: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        rows, m0 = jobs[j]
        check_stop(should_stop, "Probes")
        g = None if gates is None else gates[m0:m0 + mask_chunk]        # [b, L, H]
        b = 1 if g is None else g.shape[0]
        T = int(items.lengths[rows].max())
        x = items.ids[rows, :T]                                         # [r, T]
        ri, ii = (torch.tensor(v) for v in zip(*[(r, i) for r, s in enumerate(rows) for i in by_row[s]]))   # [m]
        keep = (torch.arange(b)[:, None] * len(rows) + ri[None]).reshape(-1)   # [b*m] rows of x.repeat(b, 1)
        handle = base.register_forward_hook(keep_positions(keep, items.position[ii].repeat(b)))
        try:
            kwargs = {} if attention is None else {"attention_mask": attention[rows, :T].repeat(b, 1).to(device)}
            with head_mask(model, g) if g is not None else nullcontext():
                logits = model(input_ids=x.repeat(b, 1).to(device), use_cache=False, **kwargs).logits  # [1, b*m, V]
        finally:
            handle.remove()
        diff, nll = read_values(logits.reshape(b, ii.numel(), -1), items.correct[ii], items.contrast[ii])  # [b, m]
        report(progress, (j + 1) / len(jobs), f"{items.name}: pass {j + 1}/{len(jobs)}")
        return diff, nll, ii.tolist()

    diff, nll = np.zeros((B, n)), np.zeros((B, n))
    for (rows, m0), (d, l, ii) in zip(jobs, (team or SOLO).map(run, len(jobs), what="the probes")):
        diff[m0:m0 + d.shape[0], ii] = d
        nll[m0:m0 + l.shape[0], ii] = l
    return diff, nll


def bootstrap(values: np.ndarray, units: np.ndarray, *, n_boot: int = N_BOOT, seed: int = 0,
              level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """(mean [B], CI [B, 2]) of values [B, n] with a percentile bootstrap over units [n] (ids): units
    are resampled with replacement, a resample's mean is its items' mean. Same resamples for any B."""
    seed = check_seed(seed, "The bootstrap's seed")
    uniq, inverse = np.unique(units, return_inverse=True)
    U = uniq.size
    sums = np.zeros((values.shape[0], U))
    np.add.at(sums.T, inverse, values.T)                                # [B, U] per-unit sums
    counts = np.bincount(inverse, minlength=U).astype(np.float64)       # [U]
    picks = np.random.default_rng(seed).integers(0, U, size=(n_boot, U))    # [n_boot, U]
    means = sums[:, picks].sum(-1) / counts[picks].sum(-1)              # [B, n_boot]
    tail = 100 * (1 - level) / 2
    return values.mean(1), np.percentile(means, [tail, 100 - tail], axis=1).T   # [B], [B, 2]


@dataclass(frozen=True)
class ProbeScore:
    """One probe's numbers for B masks (row 0 is whatever the caller put first, e.g. the dense model)."""
    name: str
    label: str
    kind: str
    n_items: int
    n_units: int
    n_tokens: int
    accuracy: np.ndarray                 # [B] share of items with diff > 0
    accuracy_ci: np.ndarray              # [B, 2]
    logit_diff: np.ndarray               # [B] mean logit difference
    logit_diff_ci: np.ndarray            # [B, 2]
    conditions: dict                     # condition -> accuracy [B]
    extras: dict = field(default_factory=dict)     # name -> [B] (e.g. icl_score)
    rejected: dict = field(default_factory=dict)   # filler list -> how many the tokenizer split
    notes: tuple = ()
    chance: float = 0.5
    seconds: float = 0.0

    def row(self, b: int = 0) -> dict:
        """Mask b's numbers as a flat JSON-able dict."""
        return dict(probe=self.name, label=self.label, n_items=self.n_items, n_units=self.n_units,
                    accuracy=float(self.accuracy[b]), accuracy_low=float(self.accuracy_ci[b, 0]),
                    accuracy_high=float(self.accuracy_ci[b, 1]), logit_diff=float(self.logit_diff[b]),
                    logit_diff_low=float(self.logit_diff_ci[b, 0]), logit_diff_high=float(self.logit_diff_ci[b, 1]),
                    **{k: float(v[b]) for k, v in self.extras.items()})

    def as_dict(self) -> dict:
        return dict(name=self.name, label=self.label, kind=self.kind, n_items=self.n_items, n_units=self.n_units,
                    n_tokens=self.n_tokens, accuracy=self.accuracy, accuracy_ci=self.accuracy_ci,
                    logit_diff=self.logit_diff, logit_diff_ci=self.logit_diff_ci, conditions=self.conditions,
                    extras=self.extras, rejected=self.rejected, notes=list(self.notes), chance=self.chance)


def score_items(spec, probe, items: ProbeItems, diff: np.ndarray, nll: np.ndarray, *, seed: int = 0,
          n_boot: int = N_BOOT, seconds: float = 0.0) -> ProbeScore:
    """ProbeScore from the item values diff / nll [B, n] (the scored items; reference items go to extras)."""
    s = items.scored.numpy()
    d, units = diff[:, s], items.unit.numpy()[s]
    acc, acc_ci = bootstrap((d > 0).astype(np.float64), units, n_boot=n_boot, seed=seed)
    mean, mean_ci = bootstrap(d, units, n_boot=n_boot, seed=seed)
    conds = np.array(items.conditions)[s]
    by = {str(c): (d[:, conds == c] > 0).mean(1) for c in dict.fromkeys(conds)}
    return ProbeScore(spec.name, spec.label, items.kind, items.n_items, items.n_units, items.n_tokens, acc, acc_ci,
                      mean, mean_ci, by, probe.extras(items, diff, nll), items.rejected_counts(), items.notes,
                      spec.chance, seconds)


def build_items(names, tokenizer, kind: str, *, options: dict | None = None) -> dict[str, tuple]:
    """name -> (spec, probe, items) for the probes `names` (None = all that apply to `kind`)."""
    from analysis.measure.probes.registry import probe_spec
    out = {}
    for name in chosen(names, kind):
        spec = probe_spec(name)
        probe = spec.make(**(options or {}))
        out[name] = (spec, probe, probe.build(tokenizer, kind))
    return out


def pooled_values(model, items_list: list[ProbeItems], gates: torch.Tensor | None = None, *,
                  batch_tokens: int = BATCH_TOKENS, pass_tokens: int = PASS_TOKENS, progress: Progress | None = None,
                  should_stop: ShouldStop | None = None, team: Team | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """item_values of several probes' items in shared passes (`pool`, `layout`): [(diff [B, n_k], nll [B, n_k])]."""
    context = context_length(model, default=2**31)
    for items in items_list:                                            # each probe's own message first
        if int(items.lengths.max()) > context:
            raise InputError(f"The {items.name} probe's prompts take up to {int(items.lengths.max())} tokens; this "
                             f"model reads at most {context}. Use fewer or shorter items (e.g. the code probe's "
                             f"max_chars).")
    pooled, offsets = pool(items_list)
    diff, nll = item_values(model, pooled, gates, batch_tokens=batch_tokens, pass_tokens=pass_tokens,
                            progress=progress, should_stop=should_stop, team=team)
    ends = offsets[1:] + [diff.shape[1]]
    return [(diff[:, a:b], nll[:, a:b]) for a, b in zip(offsets, ends)]


def measure_probes(model, built: dict, *, gates=None, pruned=None, seed: int = 0, n_boot: int = N_BOOT,
                   batch_tokens: int = BATCH_TOKENS, pass_tokens: int = PASS_TOKENS, progress: Progress | None = None,
                   should_stop: ShouldStop | None = None, team: Team | None = None) -> dict[str, ProbeScore]:
    """Every probe of `built` (build_items) on `model` under the masks gates [B, L, H] / pruned (None: dense),
    all probes' rows in shared passes (`pooled_values`); a probe's `seconds` is its share of the passes'
    time by its tokens."""
    seed = check_seed(seed, "The probes' seed")                        # before the passes, not after them
    g = gate_batch(model, gates, pruned)                                # [B, L, H] | None
    t0 = time.perf_counter()
    values = pooled_values(model, [items for _, _, items in built.values()], g, batch_tokens=batch_tokens,
                           pass_tokens=pass_tokens, progress=progress, should_stop=should_stop, team=team)
    seconds = time.perf_counter() - t0
    total = sum(items.n_tokens for _, _, items in built.values())
    return {name: score_items(spec, probe, items, diff, nll, seed=seed, n_boot=n_boot,
                              seconds=seconds * items.n_tokens / total)
            for (name, (spec, probe, items)), (diff, nll) in zip(built.items(), values)}


def run_probes(loaded, names=None, *, gates=None, pruned=None, options: dict | None = None, seed: int = 0,
               progress: Progress | None = None, should_stop: ShouldStop | None = None,
               team: Team | None = None) -> dict[str, ProbeScore]:
    """Build and measure the probes `names` (None = all that apply) on a LoadedModel under a mask."""
    seed = check_seed(seed, "The probes' seed")
    built = build_items(names, loaded.tokenizer, loaded.kind, options={"seed": seed, **(options or {})})
    return measure_probes(loaded.model, built, gates=gates, pruned=pruned, seed=seed, progress=progress,
                          should_stop=should_stop, team=team)
