"""What a cut breaks: every probe's accuracy and logit difference, dense vs cut, with CIs; a lost
capability flagged.

A cut is a mask pruned [L, H] applied to the dense model (the Prune page's view, a mask.json, a
pipeline round's mask: gates through the one masking mechanism, which equals surgery), or a model
of its own measured on the same items (a pipeline round's recovered weights, an export folder the
caller loaded). Both sides read the same items with the same seed, so their bootstrap resamples are
the same (paired). A capability is **lost** when the cut's accuracy CI lies entirely below the dense
model's accuracy (its upper bound < dense accuracy), and **at chance** when that CI also reaches the
probe's chance level (0.5). Probes that do not apply to the model, or that cannot build enough items
with its tokenizer, are listed under `skipped` with the reason (asked for by name, they are an error).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from analysis.arch.cut import Cut, checked
from analysis.core.errors import InputError, check_seed
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.measure.evaluation import context_length
from analysis.measure.probes.measure import ProbeScore, build_items, measure_probes
from analysis.measure.probes.registry import chosen

# docs/results.md section written by scripts/probes_results.py (scripts/results.py keeps it)
PROBES_MARKERS = ("<!-- probes:begin -->", "<!-- probes:end -->")


@dataclass(frozen=True)
class ProbeChange:
    """One probe, dense vs cut."""
    name: str
    label: str
    dense: dict                       # ProbeScore.row of the dense model
    cut: dict                         # ProbeScore.row of the cut
    lost: bool
    at_chance: bool
    rejected: dict = field(default_factory=dict)

    def row(self) -> dict:
        d, c = self.dense, self.cut
        return dict(probe=self.name, label=self.label, n_items=d["n_items"],
                    dense_accuracy=d["accuracy"], dense_low=d["accuracy_low"], dense_high=d["accuracy_high"],
                    cut_accuracy=c["accuracy"], cut_low=c["accuracy_low"], cut_high=c["accuracy_high"],
                    dense_logit_diff=d["logit_diff"], cut_logit_diff=c["logit_diff"],
                    cut_logit_diff_low=c["logit_diff_low"], cut_logit_diff_high=c["logit_diff_high"],
                    lost=self.lost, at_chance=self.at_chance)


@dataclass(frozen=True)
class CutReport:
    """Every applicable probe, dense vs cut (`changes`), and the probes left out with why (`skipped`)."""
    changes: list
    skipped: dict = field(default_factory=dict)     # probe -> reason

    @property
    def lost(self) -> list[ProbeChange]:
        return [c for c in self.changes if c.lost]

    def warnings(self) -> list[str]:
        """One sentence per lost capability (shown the way a growing model is)."""
        return [f"the cut loses {c.label.lower()}: accuracy {c.cut['accuracy']:.2f} "
                f"[{c.cut['accuracy_low']:.2f}, {c.cut['accuracy_high']:.2f}] against dense "
                f"{c.dense['accuracy']:.2f}" + (" (at chance)" if c.at_chance else "") for c in self.lost]

    def rows(self) -> list[dict]:
        return [c.row() for c in self.changes]

    def as_dict(self) -> dict:
        return dict(probes=self.rows(), lost=[c.name for c in self.lost], skipped=self.skipped,
                    warnings=self.warnings(), rejected={c.name: c.rejected for c in self.changes if c.rejected})

    def markdown(self, title: str = "What the cut breaks (capability probes)") -> str:
        head = (f"## {title}\n\nAccuracy = share of items whose correct token out-scores its contrast (chance 0.5); "
                "[95 % bootstrap CI over items' sequences]; logit difference = mean correct - contrast. "
                "LOST = the cut's CI lies below the dense accuracy.\n\n"
                "| probe | items | dense accuracy | cut accuracy | dense logit diff | cut logit diff | |\n"
                "|---|---:|---:|---:|---:|---:|---|\n")
        rows = [f"| {c.label} | {c.dense['n_items']} | {_acc(c.dense)} | {_acc(c.cut)} | {c.dense['logit_diff']:.2f} | "
                f"{c.cut['logit_diff']:.2f} | {'**LOST**' + (' (at chance)' if c.at_chance else '') if c.lost else ''} |"
                for c in self.changes]
        skipped = "".join(f"\n- {name}: {why}" for name, why in self.skipped.items())
        return head + "\n".join(rows) + ("\n\nNot measured:" + skipped if skipped else "") + "\n"


def _acc(r: dict) -> str:
    return f"{r['accuracy']:.3f} [{r['accuracy_low']:.3f}, {r['accuracy_high']:.3f}]"


def is_lost(dense_mean: float, cut_high: float) -> bool:
    """The rule of a lost capability, for any metric (higher = better) with a CI on the cut's side: the cut's
    upper bound lies below the dense model's mean."""
    return float(cut_high) < float(dense_mean)


def compare(dense: ProbeScore, cut: ProbeScore, b: int = 0, d: int = 0) -> ProbeChange:
    """Mask b of `cut` against mask d of `dense` (the same probe and items)."""
    high, low = float(cut.accuracy_ci[b, 1]), float(cut.accuracy_ci[b, 0])
    lost = is_lost(dense.accuracy[d], high)
    return ProbeChange(dense.name, dense.label, dense.row(d), cut.row(b), lost, lost and low <= cut.chance,
                       dense.rejected)


def build_applicable(loaded, names=None, *, options: dict | None = None) -> tuple[dict, dict]:
    """(built items by probe, skipped probe -> reason): with names=None every applicable probe that can be
    built (the others skipped with the reason); named probes must apply and build (InputError otherwise)."""
    picked = chosen(names, loaded.kind)
    context = context_length(loaded.model, default=2**31)
    built, skipped = {}, {}
    for name in picked:
        try:
            one = build_items([name], loaded.tokenizer, loaded.kind, options=options)
            longest = int(one[name][2].lengths.max())
            if longest > context:
                raise InputError(f"The {one[name][0].label} probe's prompts take up to {longest} tokens; this model "
                                 f"reads at most {context}.")
            built.update(one)
        except InputError as err:
            if names is not None and "all" not in names:
                raise
            skipped[name] = str(err)
    if not built:
        raise InputError("No probe could be built for this model: " + " ".join(skipped.values()))
    return built, skipped


def prompt_tokens(built: dict) -> int:
    """The prompt tokens of `built` (build_applicable's items): what one measurement of them reads."""
    return int(sum(items.n_tokens for _, _, items in built.values()))


def dense_scores(loaded, built: dict, *, seed: int = 0, progress: Progress | None = None,
                 should_stop: ShouldStop | None = None, team=None) -> dict[str, ProbeScore]:
    """The dense model's scores of `built` (what an app caches once per model)."""
    return measure_probes(loaded.model, built, seed=seed, progress=progress, should_stop=should_stop, team=team)


def cut_report(loaded, cut: Cut, *, built: dict | None = None, skipped: dict | None = None,
               dense: dict | None = None, names=None, options: dict | None = None, seed: int = 0,
               progress: Progress | None = None, should_stop: ShouldStop | None = None, team=None) -> CutReport:
    """Dense vs a `cut` (analysis.arch.cut.Cut: a mask on `loaded.model`, a KV plan, or a model of its own, e.g.
    recovered); `built` / `dense`: items and dense scores computed before (e.g. cached), else computed here."""
    seed = check_seed(seed, "The probes' seed")
    cut = checked(cut, loaded.geometry, required=True)
    if built is None:
        built, skipped = build_applicable(loaded, names, options={"seed": seed, **(options or {})})
    if cut.kind == "mask" and dense is None:                           # dense and cut in the same passes
        p = cut.mask
        both = measure_probes(loaded.model, built, pruned=np.stack([np.zeros_like(p), p]), seed=seed,
                              progress=progress, should_stop=should_stop, team=team)
        return CutReport([compare(s, s, 1, 0) for s in both.values()], dict(skipped or {}))
    if dense is None:
        dense = dense_scores(loaded, built, seed=seed, progress=scaled(progress, 0.0, 0.5), should_stop=should_stop,
                             team=team)
        progress = scaled(progress, 0.5, 1.0)
    if cut.kind == "mask":
        measured = measure_probes(loaded.model, built, pruned=cut.mask, seed=seed, progress=progress,
                                  should_stop=should_stop, team=team)
    else:
        with cut.running(loaded.model, adapter=loaded.adapter) as model:
            measured = measure_probes(model, built, seed=seed, progress=progress, should_stop=should_stop, team=team)
    return CutReport([compare(dense[n], measured[n]) for n in measured if n in dense], dict(skipped or {}))


class CapabilityCheck:
    """The probes measured once on the dense model, then on any number of cuts (a pipeline's rounds):
    `stage(name, sparsity, model=... | pruned=...)` -> that stage's dense-vs-cut rows as a dict. A model
    no probe applies to (or builds for) gives empty stages with the reason in `skipped`."""

    def __init__(self, loaded, names=None, *, options: dict | None = None, seed: int = 0,
                 should_stop: ShouldStop | None = None):
        self.loaded, self.seed, self.should_stop = loaded, check_seed(seed, "The probes' seed"), should_stop
        try:
            self.built, self.skipped = build_applicable(loaded, names, options={"seed": seed, **(options or {})})
        except InputError as err:
            self.built, self.skipped = {}, {"all": str(err)}
        self.dense = dense_scores(loaded, self.built, seed=seed, should_stop=should_stop) if self.built else {}

    def stage(self, name: str, sparsity: float, cut: Cut) -> dict:
        out = dict(stage=name, sparsity=float(sparsity))
        if not self.built:
            return dict(out, probes=[], lost=[], warnings=[], skipped=self.skipped)
        rep = cut_report(self.loaded, cut, built=self.built, skipped=self.skipped,
                         dense=self.dense, seed=self.seed, should_stop=self.should_stop)
        return dict(out, **rep.as_dict())


def capabilities_markdown(stages: list[dict]) -> str:
    """A report section: per stage, each probe's accuracy [CI] (dense first), LOST where its CI is below dense."""
    rows = [s for s in stages if s["probes"]]
    if not rows:
        why = "; ".join(f"{k}: {v}" for s in stages for k, v in s.get("skipped", {}).items())
        return f"## Capability probes\n\nNot measured ({why or 'no probe applies'}).\n"
    names = [p["label"] for p in rows[0]["probes"]]
    dense = rows[0]["probes"]
    out = ["## What each stage breaks (capability probes)", "",
           "Accuracy [95 % bootstrap CI]: the share of probe items whose correct token out-scores its contrast "
           "(chance 0.5), on the same items for every stage; LOST = the stage's CI lies below the dense accuracy.", "",
           "| stage | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
           "| dense | " + " | ".join(f"{p['dense_accuracy']:.3f} [{p['dense_low']:.3f}, {p['dense_high']:.3f}]"
                                     for p in dense) + " |"]
    for s in rows:
        out.append(f"| {s['stage']} | " + " | ".join(
            f"{p['cut_accuracy']:.3f} [{p['cut_low']:.3f}, {p['cut_high']:.3f}]" + (" **LOST**" if p["lost"] else "")
            for p in s["probes"]) + " |")
    out += [""] + [f"**Warning:** {s['stage']}: {w}." for s in rows for w in s["warnings"]]
    skipped = rows[0].get("skipped") or {}
    out += [f"- Not measured: {k}: {v}" for k, v in skipped.items()]
    return "\n".join(out) + "\n"
