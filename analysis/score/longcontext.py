"""What a cut does at long context: the long-context probes, dense vs a cut, per probe x length x depth.

The cut is an analysis.arch.cut.Cut: a head mask (gates through analysis.arch.head_gates, batched), a KV plan
(per KV head full / window / prune: the passes run inside `cut.running`, the masked path), or a model of its
own (an export folder read back with its plan, a recovered model, a stock checkpoint).
Both sides read the same items (analysis.measure.probes.longcontext: rows of exactly `length` tokens, the
same keys and text at every depth) with the same bootstrap seed, so their resamples are paired; a cell
(probe, length, depth, and "all" depths) is **lost** when the cut's accuracy CI lies below the dense
accuracy, **at chance** when that CI also reaches 0.5 (analysis.measure.probes.breaks.compare, one rule).

The digit-answer probes (passkey, passkey-once, needle) are also judged as the field judges them, by the
**generated answer**: each row's prompt (the row up to the answer) decoded greedily under the cut with the
cut's own cache; a row is right when the continuation's first number is the key. Its exact match per cell
has a CI from the same resamples, is **lost generated** by the same rule (the cut's CI below dense's mean:
analysis.measure.probes.breaks.is_lost), and the paired rows give a McNemar count: rows dense answers and the
cut does not (lost), the reverse (gained), and the exact two-sided McNemar p of those counts.

The dense scores are the costly half and do not depend on the cut: `LongContextReport.dense` is keyed by
(probe, length, the items' digest) and can be passed back as `dense=` for the next cut (the app caches it
per model), so a second cut runs one pass per row. The model's own context limit
(analysis.measure.evaluation.context_length: 8,192 for the built-in SmolLM2) is checked before any pass.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field

from analysis.arch.cut import Cut, checked
from analysis.core.errors import check_seed
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.measure.evaluation import context_length
from analysis.measure.probes.breaks import compare, is_lost
from analysis.measure.longheads import check_lengths
from analysis.measure.probes.longcontext import (ALL, DEFAULT_DEPTHS, DEFAULT_LENGTH, DEFAULT_SEQUENCES, LongScores,
                                                 LongWork, build_long, item_work, long_scores, measure_long)

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


def mcnemar_p(lost: int, gained: int) -> float:
    """The exact two-sided McNemar p of paired right / wrong outcomes: `lost` rows right on dense only, `gained`
    rows right on the cut only; under "the cut changes nothing" each of the n = lost + gained discordant rows goes
    either way with probability 1/2, so p = min(1, 2 * P(Binomial(n, 1/2) <= min(lost, gained))) (1 when n = 0)."""
    n, k = int(lost) + int(gained), min(int(lost), int(gained))
    return 1.0 if n == 0 else min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n)


def generated_change(dense: LongScores, cut: LongScores, label: str, dense_row: dict, cut_row: dict) -> dict:
    """The generated answers of one cell, dense vs cut (LongChange's fields): lost by `is_lost`, the rows lost and
    gained (paired: the same rows), their McNemar p. Empty when either side has no generated answers."""
    if dense.generated is None or cut.generated is None or "generated" not in cut_row:
        return {}
    rows = dense.rows[label]
    d, c = dense.generated[rows] > 0.5, cut.generated[rows] > 0.5           # [R] each row right
    lost, gained = int((d & ~c).sum()), int((~d & c).sum())
    return dict(generated_lost=is_lost(dense_row["generated"], cut_row["generated_high"]), rows_lost=lost,
                rows_gained=gained, mcnemar_p=mcnemar_p(lost, gained))


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
    generated_lost: bool = False          # the cut's generated exact-match CI lies below dense's
    rows_lost: int | None = None          # rows (a key at a depth) dense answers and the cut does not
    rows_gained: int | None = None        # the reverse
    mcnemar_p: float | None = None

    def row(self) -> dict:
        d, c = self.dense, self.cut
        out = dict(probe=self.probe, label=self.label, length=self.length, depth=self.depth,
                   n_units=d["n_units"], n_items=d["n_items"], dense_accuracy=d["accuracy"],
                   dense_low=d["accuracy_low"], dense_high=d["accuracy_high"], dense_logit_diff=d["logit_diff"])
        for side, r in (("dense", d), ("cut", c)):
            if r is None:
                continue
            if side == "cut":
                out.update(cut_accuracy=r["accuracy"], cut_low=r["accuracy_low"], cut_high=r["accuracy_high"],
                           cut_logit_diff=r["logit_diff"], lost=self.lost, at_chance=self.at_chance)
            for name, key in (("exact", "exact_match"), ("generated", "generated")):
                if key in r:
                    out.update({f"{side}_{name}": r[key], f"{side}_{name}_low": r[f"{key}_low"],
                                f"{side}_{name}_high": r[f"{key}_high"]})
        if self.rows_lost is not None:
            out.update(generated_lost=self.generated_lost, rows_lost=self.rows_lost, rows_gained=self.rows_gained,
                       mcnemar_p=self.mcnemar_p)
        return out


@dataclass(frozen=True)
class LongContextReport:
    """Every cell dense (and cut), the dense scores to reuse, what was read and how long it took."""
    changes: list
    dense: dict                          # items_key -> LongScores of the dense model (pass back as dense=)
    lengths: tuple
    depths: tuple
    limit: int                           # the model's context length
    cut: dict | None = None              # what the cut is (mask / plan / model), None: dense only
    work: object = None                  # LongWork of this run (rows per length, passes)
    cut_values: dict | None = None       # (name, length) -> (diff, nll, seconds, written) of the cut: pass back as cut_values=
    seconds: float = 0.0
    notes: tuple = field(default_factory=tuple)

    @property
    def lost(self) -> list[LongChange]:
        """The cells the cut loses by teacher-forced accuracy."""
        return [c for c in self.changes if c.lost]

    @property
    def lost_generated(self) -> list[LongChange]:
        """The cells the cut loses by generated answers."""
        return [c for c in self.changes if c.generated_lost]

    def warnings(self) -> list[str]:
        """One sentence per lost cell, teacher-forced first, then generated (the 'all depths' cell first)."""
        where = lambda c: f"{c.label.lower()} at {c.length} tokens" + ("" if c.depth == ALL else f", {c.depth}")  # noqa: E731
        forced = [f"the cut loses {where(c)}: accuracy {c.cut['accuracy']:.2f} [{c.cut['accuracy_low']:.2f}, "
                  f"{c.cut['accuracy_high']:.2f}] against dense {c.dense['accuracy']:.2f}"
                  + (" (at chance)" if c.at_chance else "") for c in self.lost]
        generated = [f"the cut loses {where(c)} in generated answers: exact match {c.cut['generated']:.2f} "
                     f"[{c.cut['generated_low']:.2f}, {c.cut['generated_high']:.2f}] against dense "
                     f"{c.dense['generated']:.2f} ({c.rows_lost} rows lost, {c.rows_gained} gained, McNemar p "
                     f"{c.mcnemar_p:.2g})" for c in self.lost_generated]
        return forced + generated

    def rows(self) -> list[dict]:
        return [c.row() for c in self.changes]

    def as_dict(self) -> dict:
        work = None if self.work is None else dict(rows=self.work.rows, passes=self.work.passes,
                                                   decode_calls=self.work.steps, tokens=self.work.total_tokens)
        return dict(lengths=list(self.lengths), depths=list(self.depths), context_limit=self.limit, cut=self.cut,
                    cells=self.rows(), lost=[(c.probe, c.length, c.depth) for c in self.lost],
                    lost_generated=[(c.probe, c.length, c.depth) for c in self.lost_generated],
                    generated_rule=GENERATED_RULE, warnings=self.warnings(), work=work, seconds=self.seconds,
                    notes=list(self.notes))

    def markdown(self, title: str = "Long-context probes") -> str:
        cut = self.cut is not None
        head = (f"## {title}\n\nAccuracy = share of items (a key's digits, a copied token) whose correct token "
                "out-scores its contrast, the earlier digits given (teacher forcing; chance 0.5) [95 % bootstrap CI "
                "over sequences]; exact = share of keys with every digit right; generated = " + GENERATED_RULE + "."
                + (" LOST = the cut's CI lies below the dense accuracy (LOST generated: below the dense generated "
                   "exact match); rows lost / gained: rows only dense / only the cut answers (generated), with the "
                   "exact McNemar p." if cut else "") + "\n\n"
                "| probe | tokens | depth | sequences | dense accuracy | dense exact | dense generated |"
                + (" cut accuracy | cut exact | cut generated | rows lost / gained (p) | |" if cut else "")
                + "\n|---|---:|---|---:|---:|---:|---:|" + ("---:|---:|---:|---:|---|" if cut else "") + "\n")
        lines = []
        for c in self.changes:
            r = c.row()
            line = (f"| {c.label} | {c.length} | {c.depth} | {r['n_units']} | "
                    f"{_ci(r, 'dense_accuracy', 'dense_low', 'dense_high')} | "
                    f"{_ci(r, 'dense_exact', 'dense_exact_low', 'dense_exact_high')} | "
                    f"{_ci(r, 'dense_generated', 'dense_generated_low', 'dense_generated_high')} |")
            if cut:
                counts = "-" if c.rows_lost is None else f"{c.rows_lost} / {c.rows_gained} ({c.mcnemar_p:.2g})"
                line += (f" {_ci(r, 'cut_accuracy', 'cut_low', 'cut_high')} | "
                         f"{_ci(r, 'cut_exact', 'cut_exact_low', 'cut_exact_high')} | "
                         f"{_ci(r, 'cut_generated', 'cut_generated_low', 'cut_generated_high')} | {counts} | "
                         f"{' '.join(f'**{f}**' for f in flags(c))} |")
            lines.append(line)
        return head + "\n".join(lines) + "\n"


# what "generated" means, in the reports' own words (docs/DEFINITIONS.md says the same)
GENERATED_RULE = ("share of rows (a key at one depth) whose greedy continuation of the prompt, written by the model "
                  "itself up to 2 tokens past the answer's length, has the key as its first number")


def flags(change: LongChange) -> list[str]:
    """The LOST words of a cell: 'LOST' (teacher-forced; '(at chance)' added) and 'LOST generated'."""
    out = ["LOST" + (" (at chance)" if change.at_chance else "")] if change.lost else []
    return out + (["LOST generated"] if change.generated_lost else [])


def _ci(row: dict, mean: str, low: str, high: str) -> str:
    if mean not in row:
        return "-"
    return f"{row[mean]:.3f} [{row[low]:.3f}, {row[high]:.3f}]"


def long_context_report(loaded, probes=None, lengths=(DEFAULT_LENGTH,), depths=DEFAULT_DEPTHS, *,
                        n_items: int = DEFAULT_SEQUENCES, cut: Cut | None = None, dense: dict | None = None,
                        built: dict | None = None, seed: int = 0, bos: str = "auto", progress: Progress | None = None,
                        should_stop: ShouldStop | None = None, per_row: dict | None = None,
                        cut_values: dict | None = None) -> LongContextReport:
    """The long-context probes `probes` (None: all) at `lengths` x `depths` on the dense `loaded.model`, and
    (given one) on a `cut` (analysis.arch.cut.Cut: a mask, a KV plan, or a model of its own). dense: scores
    from an earlier report (`LongContextReport.dense`), reused where the items are the same. built: items from
    analysis.measure.probes.longcontext.build_long (else built here). per_row: length -> seconds of one row
    (`row_seconds`), so progress fractions follow the time. InputError before any pass for a length above the
    model's limit (or the cut model's), a bad depth, a cut of another model. cut_values: the cut's item values
    from an earlier report of the same cut and items (`LongContextReport.cut_values`): its passes are skipped."""
    seed = check_seed(seed, "The long-context probes' seed")
    cut = checked(cut, loaded.geometry)
    limit = context_length(loaded, default=2**31)          # a deferred load: its config
    if cut is not None and cut.kind == "model":
        limit = min(limit, context_length(cut.model, default=2**31))
    if built is None:
        built = build_long(probes, loaded.tokenizer, loaded.kind, lengths, depths=depths, n_items=n_items, seed=seed,
                           bos=bos, limit=limit)
    else:
        check_lengths([length for _, length in built], limit)
    keys = {k: items_key(k[0], k[1], items) for k, (_, _, items) in built.items()}
    dense = dict(dense or {})
    work = report_work(built, dense, cut=cut is not None and cut_values is None)
    todo = {k: built[k] for k in built if keys[k] not in dense}
    weight = {k: (per_row or {}).get(k[1], float(k[1])) * built[k][2].ids.shape[0] for k in built}
    dense_w, cut_w = sum(weight[k] for k in todo), (sum(weight.values()) if cut is not None else 0.0)
    dense_share = dense_w / (dense_w + cut_w) if dense_w + cut_w else 1.0
    t0 = time.perf_counter()
    if todo:
        scores = measure_long(loaded.model, todo, tokenizer=loaded.tokenizer, seed=seed, should_stop=should_stop,
                              weights=weight, progress=scaled(progress, 0.0, dense_share))
        dense.update({keys[k]: s for k, s in scores.items()})
    measured, values = None, None
    if cut is not None and cut_values is not None:                        # the cut's values of an earlier run
        values = dict(cut_values)
        measured = {k: long_scores(spec, probe, items, values[k][0], values[k][1], seed=seed, seconds=values[k][2],
                                   written=values[k][3]) for k, (spec, probe, items) in built.items()}
    elif cut is not None:
        values = {}
        with cut.running(loaded.model, adapter=loaded.adapter) as model:
            measured = measure_long(model, built, tokenizer=loaded.tokenizer, new_cache=cut.new_cache, seed=seed,
                                    progress=scaled(progress, dense_share, 1.0), should_stop=should_stop,
                                    weights=weight, values=values)
    changes = []
    for k in built:
        d = dense[keys[k]]
        for label in [ALL] + [lab for lab in d.depths if lab != ALL]:
            if measured is None:
                s = d.depths[label]
                changes.append(LongChange(s.name, s.label, k[1], label, s.row()))
            else:
                ch = compare(d.depths[label], measured[k].depths[label])
                changes.append(LongChange(ch.name, ch.label, k[1], label, ch.dense, ch.cut, ch.lost, ch.at_chance,
                                          **generated_change(d, measured[k], label, ch.dense, ch.cut)))
    used_depths = tuple(dict.fromkeys(d for (_, p, _) in built.values() for d in p.depths))
    used_lengths = tuple(dict.fromkeys(length for _, length in built))
    notes = tuple(n for (_, _, items) in built.values() for n in items.notes)
    return LongContextReport(changes, {keys[k]: dense[keys[k]] for k in built}, used_lengths, used_depths, limit,
                             None if cut is None else cut.as_dict(), work, values, time.perf_counter() - t0, notes)


def report_work(built: dict, dense: dict | None = None, *, cut: bool = False) -> LongWork:
    """The rows a report reads per length and the decode calls of their generated answers: each row whose dense
    scores are not in `dense` once, and every row again for the cut (what its time estimate multiplies by
    `row_seconds` and `step_seconds`)."""
    cached = set(dense or {})
    rows: dict[int, int] = {}
    steps: dict[int, int] = {}
    for (name, length), (_, probe, items) in built.items():
        n, calls = item_work(probe, items)
        sides = (items_key(name, length, items) not in cached) + cut
        rows[length] = rows.get(length, 0) + n * sides
        steps[length] = steps.get(length, 0) + calls * sides
    return LongWork({k: v for k, v in sorted(rows.items()) if v}, 1, {k: v for k, v in sorted(steps.items()) if v})
