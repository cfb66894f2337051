"""What a cut does at long context: the long-context probes, dense vs a cut, per probe x length x depth.

The cut is one of: a head mask pruned [L, H] (gates through analysis.arch.head_gates), a KV plan (per KV
head full / window / prune, analysis.score.kvplan: the passes run inside `applied`), or a model of its own
(an export folder loaded with analysis.compress.export.load_pruned, a recovered model, a stock checkpoint).
Both sides read the same items (analysis.measure.probes.longcontext: rows of exactly `length` tokens, the
same keys and text at every depth) with the same bootstrap seed, so their resamples are paired; a cell
(probe, length, depth, and "all" depths) is **lost** when the cut's accuracy CI lies below the dense
accuracy, **at chance** when that CI also reaches 0.5 (analysis.measure.probes.breaks.compare, one rule).

The dense scores are the costly half and do not depend on the cut: `LongContextReport.dense` is keyed by
(probe, length, the items' digest) and can be passed back as `dense=` for the next cut (the app caches it
per model), so a second cut runs one pass per row. The model's own context limit
(analysis.measure.evaluation.context_length: 8,192 for the built-in SmolLM2) is checked before any pass.
"""
from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from analysis.core.errors import InputError, check_seed
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.measure.evaluation import context_length, gate_batch
from analysis.measure.probes.breaks import compare
from analysis.measure.longheads import check_lengths
from analysis.measure.probes.longcontext import (ALL, DEFAULT_DEPTHS, DEFAULT_LENGTH, DEFAULT_SEQUENCES, LongWork,
                                                 build_long, measure_long)

# docs/results.md section written by bench/bench_long_probes.py --write-docs
LONG_PROBES_MARKERS = ("<!-- long-probes:begin -->", "<!-- long-probes:end -->")
# docs/results.md section written by bench/bench_kv_quality.py --write-docs (what KV plans keep at long context)
KV_QUALITY_MARKERS = ("<!-- kv-quality:begin -->", "<!-- kv-quality:end -->")


def items_key(name: str, length: int, items) -> tuple[str, int, str]:
    """(probe, length, digest of the items' tokens, answers and contrasts): the key of a cached dense score."""
    h = hashlib.sha1()
    for t in (items.ids, items.position, items.correct, items.contrast, items.unit):
        h.update(t.numpy().tobytes())
    return name, int(length), h.hexdigest()[:16]


@dataclass(frozen=True)
class LongChange:
    """One cell: a probe at one length and depth ("all": every depth), dense (and cut) numbers."""
    probe: str
    label: str
    length: int
    depth: str                   # "depth 0.5" | "all"
    dense: dict                  # ProbeScore.row of the dense model
    cut: dict | None = None
    lost: bool = False
    at_chance: bool = False

    def row(self) -> dict:
        d, c = self.dense, self.cut
        out = dict(probe=self.probe, label=self.label, length=self.length, depth=self.depth,
                   n_units=d["n_units"], n_items=d["n_items"], dense_accuracy=d["accuracy"],
                   dense_low=d["accuracy_low"], dense_high=d["accuracy_high"], dense_logit_diff=d["logit_diff"])
        if "exact_match" in d:
            out.update(dense_exact=d["exact_match"], dense_exact_low=d["exact_match_low"],
                       dense_exact_high=d["exact_match_high"])
        if c is not None:
            out.update(cut_accuracy=c["accuracy"], cut_low=c["accuracy_low"], cut_high=c["accuracy_high"],
                       cut_logit_diff=c["logit_diff"], lost=self.lost, at_chance=self.at_chance)
            if "exact_match" in c:
                out.update(cut_exact=c["exact_match"], cut_exact_low=c["exact_match_low"],
                           cut_exact_high=c["exact_match_high"])
        return out


@dataclass(frozen=True)
class LongContextReport:
    """Every cell dense (and cut), the dense scores to reuse, what was read and how long it took."""
    changes: list
    dense: dict                          # items_key -> {depth label: ProbeScore} (pass back as dense=)
    lengths: tuple
    depths: tuple
    limit: int                           # the model's context length
    cut: dict | None = None              # what the cut is (mask / plan / model), None: dense only
    work: object = None                  # LongWork of this run (rows per length, passes)
    seconds: float = 0.0
    notes: tuple = field(default_factory=tuple)

    @property
    def lost(self) -> list[LongChange]:
        return [c for c in self.changes if c.lost]

    def warnings(self) -> list[str]:
        """One sentence per lost cell (the 'all depths' cell first when it is lost)."""
        return [f"the cut loses {c.label.lower()} at {c.length} tokens" + ("" if c.depth == ALL else f", {c.depth}")
                + f": accuracy {c.cut['accuracy']:.2f} [{c.cut['accuracy_low']:.2f}, {c.cut['accuracy_high']:.2f}] "
                f"against dense {c.dense['accuracy']:.2f}" + (" (at chance)" if c.at_chance else "")
                for c in self.lost]

    def rows(self) -> list[dict]:
        return [c.row() for c in self.changes]

    def as_dict(self) -> dict:
        work = None if self.work is None else dict(rows=self.work.rows, passes=self.work.passes,
                                                   tokens=self.work.total_tokens)
        return dict(lengths=list(self.lengths), depths=list(self.depths), context_limit=self.limit, cut=self.cut,
                    cells=self.rows(), lost=[(c.probe, c.length, c.depth) for c in self.lost],
                    warnings=self.warnings(), work=work, seconds=self.seconds, notes=list(self.notes))

    def markdown(self, title: str = "Long-context probes") -> str:
        cut = self.cut is not None
        head = (f"## {title}\n\nAccuracy = share of items (a key's digits, a copied token) whose correct token "
                "out-scores its contrast (chance 0.5) [95 % bootstrap CI over sequences]; exact = share of keys with "
                "every digit right." + (" LOST = the cut's CI lies below the dense accuracy." if cut else "") + "\n\n"
                "| probe | tokens | depth | sequences | dense accuracy | dense exact |"
                + (" cut accuracy | cut exact | |" if cut else "") + "\n|---|---:|---|---:|---:|---:|"
                + ("---:|---:|---|" if cut else "") + "\n")
        lines = []
        for c in self.changes:
            r = c.row()
            line = (f"| {c.label} | {c.length} | {c.depth} | {r['n_units']} | "
                    f"{_ci(r, 'dense_accuracy', 'dense_low', 'dense_high')} | "
                    f"{_ci(r, 'dense_exact', 'dense_exact_low', 'dense_exact_high')} |")
            if cut:
                flag = ("**LOST**" + (" (at chance)" if c.at_chance else "")) if c.lost else ""
                line += (f" {_ci(r, 'cut_accuracy', 'cut_low', 'cut_high')} | "
                         f"{_ci(r, 'cut_exact', 'cut_exact_low', 'cut_exact_high')} | {flag} |")
            lines.append(line)
        return head + "\n".join(lines) + "\n"


def _ci(row: dict, mean: str, low: str, high: str) -> str:
    if mean not in row:
        return "-"
    return f"{row[mean]:.3f} [{row[low]:.3f}, {row[high]:.3f}]"


def _cut_of(loaded, pruned, plan, model) -> tuple[str | None, dict | None]:
    given = [name for name, v in (("mask", pruned), ("plan", plan), ("model", model)) if v is not None]
    if len(given) > 1:
        raise InputError(f"Give one cut: a mask, a KV plan or a model (not {' and '.join(given)}).")
    if not given:
        return None, None
    if given[0] == "mask":
        p = np.asarray(pruned, dtype=bool)
        return "mask", dict(kind="mask", n_pruned=int(p.sum()))
    if given[0] == "plan":
        plan.check_geometry(loaded.geometry)
        return "plan", dict(kind="kv-plan", describe=plan.describe(), sinks=plan.sinks, recent=plan.recent,
                            counts=plan.counts())
    return "model", dict(kind="model")


def long_context_report(loaded, probes=None, lengths=(DEFAULT_LENGTH,), depths=DEFAULT_DEPTHS, *,
                        n_items: int = DEFAULT_SEQUENCES, pruned=None, plan=None, model=None, dense: dict | None = None,
                        built: dict | None = None, seed: int = 0, bos: str = "auto", cut_info: dict | None = None,
                        progress: Progress | None = None, should_stop: ShouldStop | None = None,
                        per_row: dict | None = None, running=None) -> LongContextReport:
    """The long-context probes `probes` (None: all) at `lengths` x `depths` on the dense `loaded.model`, and
    (given one) on a cut: `pruned` [L, H] mask, a KVPlan `plan`, or a `model` of its own. dense: scores from an
    earlier report (`LongContextReport.dense`), reused where the items are the same. built: items from
    analysis.measure.probes.longcontext.build_long (else built here). per_row: length -> seconds of one row
    (`row_seconds`), so progress fractions follow the time. running: with `model`, a context the model's passes
    run inside (an export read back with its KV plan: analysis.compress.kvruntime.KVPlanModel.running). InputError
    before any pass for a length above the model's limit (or the cut model's), a bad depth, a plan of another model."""
    seed = check_seed(seed, "The long-context probes' seed")
    what, info = _cut_of(loaded, pruned, plan, model)
    limit = context_length(loaded.model, default=2**31)
    if what == "model":
        limit = min(limit, context_length(model, default=2**31))
    if built is None:
        built = build_long(probes, loaded.tokenizer, loaded.kind, lengths, depths=depths, n_items=n_items, seed=seed,
                           bos=bos, limit=limit)
    else:
        check_lengths([length for _, length in built], limit)
    keys = {k: items_key(k[0], k[1], items) for k, (_, _, items) in built.items()}
    dense = dict(dense or {})
    work = report_work(built, dense, cut=what is not None)
    todo = {k: built[k] for k in built if keys[k] not in dense}
    weight = {k: (per_row or {}).get(k[1], float(k[1])) * built[k][2].ids.shape[0] for k in built}
    dense_w, cut_w = sum(weight[k] for k in todo), (sum(weight.values()) if what is not None else 0.0)
    dense_share = dense_w / (dense_w + cut_w) if dense_w + cut_w else 1.0
    t0 = time.perf_counter()
    if todo:
        scores = measure_long(loaded.model, todo, seed=seed, should_stop=should_stop, weights=weight,
                              progress=scaled(progress, 0.0, dense_share))
        dense.update({keys[k]: s for k, s in scores.items()})
    cut = None
    if what is not None:
        part = scaled(progress, dense_share, 1.0)
        if what == "mask":
            cut = measure_long(loaded.model, built, gates=gate_batch(loaded.model, None, pruned), seed=seed,
                               progress=part, should_stop=should_stop, weights=weight)
        elif what == "plan":
            from analysis.score.kvplan import applied
            with applied(loaded.model, plan, adapter=loaded.adapter):
                cut = measure_long(loaded.model, built, seed=seed, progress=part, should_stop=should_stop,
                                   weights=weight)
        else:
            with running() if running is not None else nullcontext():
                cut = measure_long(model, built, seed=seed, progress=part, should_stop=should_stop, weights=weight)
    changes = []
    for k in built:
        d = dense[keys[k]]
        for label in [ALL] + [lab for lab in d if lab != ALL]:
            if cut is None:
                s = d[label]
                changes.append(LongChange(s.name, s.label, k[1], label, s.row()))
            else:
                ch = compare(d[label], cut[k][label])
                changes.append(LongChange(ch.name, ch.label, k[1], label, ch.dense, ch.cut, ch.lost, ch.at_chance))
    used_depths = tuple(dict.fromkeys(d for (_, p, _) in built.values() for d in p.depths))
    used_lengths = tuple(dict.fromkeys(length for _, length in built))
    notes = tuple(n for (_, _, items) in built.values() for n in items.notes)
    return LongContextReport(changes, {keys[k]: dense[keys[k]] for k in built}, used_lengths, used_depths, limit,
                             None if what is None else {**info, **(cut_info or {})},
                             work, time.perf_counter() - t0, notes)


def report_work(built: dict, dense: dict | None = None, *, cut: bool = False) -> LongWork:
    """The rows a report reads per length: each row whose dense scores are not in `dense` once, and every row
    again for the cut (what its time estimate multiplies by `row_seconds`)."""
    cached = set(dense or {})
    rows: dict[int, int] = {}
    for (name, length), (_, _, items) in built.items():
        n = int(items.ids.shape[0])
        rows[length] = rows.get(length, 0) + n * ((items_key(name, length, items) not in cached) + cut)
    return LongWork({k: v for k, v in sorted(rows.items()) if v})
