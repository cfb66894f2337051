"""Regenerate docs/results.md: head scorers compared on the built-in SmolLM2, with error bars.

What one run measures (every number is written as measured, whatever it says):
- one evaluation token stream: the first --eval-tokens (default 16,384) tokens of the built-in
  evaluation split, the SAME ids for every row, cut into non-overlapping windows of --window
  tokens (stride = window; each window's first token is context only);
- for every scorer, perplexity after pruning 12.5 / 25 / 50 % of all heads (global policy), with a
  95 % bootstrap confidence interval over windows (the same resampled windows for every row);
- Wanda-Head and SparseGPT-Head as defined and layer-normalized (each layer's scores divided by
  that layer's mean score: `normalize="layer"`, the option users have);
- MP-G at z = 1.5 / 2 / 2.5 and at the z the z sweep suggests on the calibration split
  (--sweep-tokens of it), evaluated on the evaluation split;
- Random over --seeds (>= 5): mean, spread over seeds, and a bootstrap CI of the seed mean;
- MP-G (z = 2) under the global / balanced / groups policies, with the parameters surgery really
  removes (analysis.score.masks.summarize_mask: the layout prune_heads builds);
- Spearman correlation of every scorer with the single-head ablation oracle;
- how long each scorer, the sweep, the evaluation and the whole script took.

    .venv/bin/python scripts/results.py [--cache-dir DIR] [--out docs/results.md] [options]

`run(loaded, options)` does the work on any causal-LM LoadedModel (the tests run it on a tiny
model); the file is written atomically (analysis.core.atomic.atomic_write).

Multi-process: `accelerate launch --multi_gpu --num_processes N scripts/results.py ...` (docs/DISTRIBUTED.md)
splits the calibration scorers' batches, the ablation oracle's layers, the z sweeps' and the big
batched evaluation's forward passes over the processes (analysis.core.distributed); the numbers are
the single-process ones; rank 0 alone writes the file and prints.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import time
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from analysis.core import distributed  # noqa: E402
from analysis.core.atomic import atomic_write, marked_section  # noqa: E402
from analysis.measure.attribution import rank_correlation  # noqa: E402
from analysis.core.errors import InputError  # noqa: E402
from analysis.measure.evaluation import bootstrap_perplexity, evaluator_for, gate_batch, token_ids  # noqa: E402
from analysis.score.masks import plan_mask, summarize_mask  # noqa: E402
from analysis.measure.profiles import profile_model  # noqa: E402
from analysis.compress.recover.report import (EDGE_MARKERS, FRONTIER_MARKERS, KV_POLICIES_MARKERS,  # noqa: E402
                                              LONG_CONTEXT_MARKERS, RECOVERY_MARKERS)
from analysis.score.kvscores import KV_HEADS_MARKERS  # noqa: E402
from analysis.score.specialization import ROLES_MARKERS  # noqa: E402
from analysis.measure.probes.breaks import PROBES_MARKERS  # noqa: E402
from analysis.score.longcontext import KV_QUALITY_MARKERS, LONG_PROBES_MARKERS  # noqa: E402
from analysis.score.scoring import SCORERS, calibration_ids, get_scorer, scorer_parameters  # noqa: E402
from analysis.score.sweep import split_evaluators, sweep_z  # noqa: E402
from analysis.core.text import WIKI_ATTRIBUTION, evaluation_text  # noqa: E402

POLICY_ROWS = ("global", "balanced", "groups")
ORACLE = "ablation"


@dataclass
class Options:
    """Every knob of a run (the command line's options; the defaults are the documented run)."""
    eval_tokens: int = 16384
    window: int = 512
    sparsities: tuple = (0.125, 0.25, 0.5)
    seeds: tuple = (0, 1, 2, 3, 4)
    n_sequences: int = 8
    seq_len: int = 128
    batch_size: int = 4
    eval_batch: int = 8
    ig_steps: int = 4
    ablation_sequences: int = 2
    ablation_seq_len: int = 64
    sweep_tokens: int = 2048
    bootstrap: int = 1000
    quiet: bool = False
    extra: dict = field(default_factory=dict)   # not options: notes for the header


def scorer_rows(o: Options) -> list[tuple[str, object]]:
    """(row label, scorer) in table order: the configured rows below, then every other registered
    scorer (analysis.score.scoring.SCORERS) at its defaults, so a new scorer gets a row without editing
    this script. Random has its own rows (several seeds); the ablation oracle is the reference."""
    cal = dict(n_sequences=o.n_sequences, seq_len=o.seq_len, batch_size=o.batch_size)
    rows = [
        ("MP-G (z = 1.5)", "mp-g", dict(z=1.5)),
        ("MP-G (z = 2.0)", "mp-g", dict(z=2.0)),
        ("MP-G (z = 2.5)", "mp-g", dict(z=2.5)),
        ("MP (z = 2.0)", "mp", dict(z=2.0)),
        ("Magnitude (L2)", "magnitude", dict(ord=2)),
        ("Wanda-Head", "wanda", cal),
        ("Wanda-Head, layer-normalized", "wanda", dict(cal, normalize="layer")),
        ("SparseGPT-Head", "sparsegpt", cal),
        ("SparseGPT-Head, layer-normalized", "sparsegpt", dict(cal, normalize="layer")),
        ("Gradient-Head", "gradient", cal),
        ("Head gate, abs. gradient (Michel)", "gate", cal),
        (f"Head gate, integrated ({o.ig_steps} steps)", "gate-ig", dict(cal, n_steps=o.ig_steps)),
        ("Hybrid (Magnitude + MP + Wanda)", "hybrid", cal),
        (f"Ablation oracle ({o.ablation_sequences} x {o.ablation_seq_len} tokens)", ORACLE,
         dict(n_sequences=o.ablation_sequences, seq_len=o.ablation_seq_len)),
    ]
    listed = {name for _, name, _ in rows} | {"random"}
    for name, cls in SCORERS.items():
        if name not in listed:
            accepted = scorer_parameters(name)
            rows.append((cls.label, name, {k: v for k, v in cal.items() if k in accepted}))
    return [(label, get_scorer(name, **params)) for label, name, params in rows]


def say(o: Options, message: str) -> None:
    if not o.quiet:
        print(message, file=sys.stderr, flush=True)


class MaskTable:
    """Masks to evaluate, deduplicated: identical masks share one evaluation."""

    def __init__(self):
        self.masks: list[np.ndarray] = []
        self.index: dict[bytes, int] = {}

    def add(self, pruned: np.ndarray) -> int:
        key = np.asarray(pruned, bool).tobytes()
        if key not in self.index:
            self.index[key] = len(self.masks)
            self.masks.append(np.asarray(pruned, bool))
        return self.index[key]


bootstrap_ppl = bootstrap_perplexity     # one home: analysis.measure.evaluation


def cell(value: float, lo: float, hi: float) -> str:
    return f"{value:.2f} [{lo:.2f}, {hi:.2f}]"


def cost_text(scores) -> str:
    c = scores.cost
    if c.forward_passes == 0 and c.backward_passes == 0:
        return f"weights only, {c.seconds:.2f} s"
    passes = f"{c.forward_passes} fwd" + (f" + {c.backward_passes} bwd" if c.backward_passes else "")
    return f"{passes} x {c.calibration_tokens // max(1, c.calibration_sequences)} tok, {c.seconds:.1f} s"


@dataclass
class Measured:
    """Everything `run` measured, for the markdown and the data it returns (indices point into `table`)."""
    ids: torch.Tensor                                  # [N] the evaluation token ids
    windows: list
    window: int
    table: MaskTable = field(default_factory=MaskTable)
    cells: dict = field(default_factory=dict)          # (row, sparsity) -> mask index
    scores_of: dict = field(default_factory=dict)      # row label (or random-<seed>) -> [L, H]
    costs: dict = field(default_factory=dict)          # row label -> scoring cost text
    timings: dict = field(default_factory=dict)        # step -> seconds
    swept: dict = field(default_factory=dict)          # sparsity -> the z the sweep picked
    policy_plans: dict = field(default_factory=dict)   # (policy, sparsity) -> MaskPlan, or why it is infeasible
    random_cells: dict = field(default_factory=dict)   # (seed, sparsity) -> mask index
    n_masks: int = 0                                   # masks evaluated, the dense model counted
    dense: int = -1
    ppl: np.ndarray | None = None                      # [B] perplexity of every mask
    lo: np.ndarray | None = None                       # [B] 95 % CI
    hi: np.ndarray | None = None
    boot: np.ndarray | None = None                     # [R, B] bootstrap resamples
    counts: np.ndarray | None = None                   # [W] scored tokens per window

    def fmt(self, i: int) -> str:
        return cell(self.ppl[i], self.lo[i], self.hi[i])


SWEEP_LABEL = "MP-G (z from the sweep)"


def run(loaded, o: Options, team: distributed.Team = distributed.SOLO) -> tuple[str, dict]:
    """Measure everything for `loaded` (a causal-LM LoadedModel); returns (markdown, data).

    team: the processes of a launch that split the work (every process returns the same result)."""
    if loaded.kind != "causal-lm":
        raise InputError(f"scripts/results.py measures causal-LM perplexity; {loaded.name} is a {loaded.kind}.")
    if len(o.seeds) < 5:
        raise InputError(f"Random needs at least 5 seeds for a spread; got {len(o.seeds)}.")
    started = time.perf_counter()
    m, evaluator = _evaluation_ids(loaded, o)
    profile_start = time.perf_counter()
    profile = profile_model(loaded.model, adapter=loaded.adapter)
    m.timings["row-norm profile"] = time.perf_counter() - profile_start
    _score_rows(loaded, o, profile, m, team)
    _sweep_rows(loaded, o, profile, m, team)
    _policy_and_random_rows(loaded, o, profile, m)
    _evaluate_masks(loaded, o, evaluator, m, team)
    lines = (_summary_lines(loaded, o, m) + _policy_lines(loaded, o, m) + _oracle_lines(loaded, o, m)
             + _timing_lines(o, m, time.perf_counter() - started))
    data = dict(ids=m.ids.numpy(), windows=len(m.windows), window=m.window, ppl=m.ppl, lo=m.lo, hi=m.hi,
                cells=m.cells, random_cells=m.random_cells, dense=m.dense, policy_plans=m.policy_plans,
                swept=m.swept, masks=m.table.masks, timings=m.timings, scores=m.scores_of)
    return "\n".join(lines), data


def _evaluation_ids(loaded, o: Options):
    """(Measured with the evaluation ids and their windows, the evaluator)."""
    ids = token_ids(loaded.tokenizer, evaluation_text(max_chars=16 * o.eval_tokens + 4096),
                    max_tokens=o.eval_tokens)                                        # [N]
    if ids.numel() < o.eval_tokens:
        raise InputError(f"The evaluation split has only {ids.numel()} tokens; asked for {o.eval_tokens}.")
    evaluator = evaluator_for(loaded.kind, window=o.window, stride=o.window, batch_size=o.eval_batch)
    windows = evaluator.plan(loaded.model, ids.numel())
    return Measured(ids, windows, windows[0].end - windows[0].begin), evaluator


def _score_rows(loaded, o: Options, profile, m: Measured, team) -> None:
    """Every scorer row's scores, cost and masks at every sparsity."""
    G = loaded.geometry.group_size
    calibration = calibration_ids(loaded.tokenizer, o.n_sequences, o.seq_len)       # [n, T]
    ablation_ids = calibration_ids(loaded.tokenizer, o.ablation_sequences, o.ablation_seq_len)
    for label, scorer in scorer_rows(o):
        say(o, f"scoring: {label}")
        ids_for = ablation_ids if scorer.name == ORACLE else calibration
        scores = (scorer.score(loaded, calibration=ids_for, team=team) if scorer.needs_calibration
                  else scorer.score(profile))
        m.scores_of[label], m.costs[label] = scores.scores, cost_text(scores)
        m.timings[label] = scores.cost.seconds
        for s in o.sparsities:
            m.cells[(label, s)] = m.table.add(plan_mask(scores, s, group_size=G).pruned)


def _sweep_rows(loaded, o: Options, profile, m: Measured, team) -> None:
    """MP-G at the z the calibration-split sweep picks, per sparsity."""
    say(o, "z sweep on the calibration split")
    G = loaded.geometry.group_size
    sweep_start = time.perf_counter()
    calib_eval, _, _, _ = split_evaluators(loaded, max_tokens=o.sweep_tokens, window=o.window,
                                           batch_size=o.eval_batch, team=team)
    for s in o.sparsities:
        result = sweep_z(profile, s, calib_eval, None, scorer="mp-g")
        m.swept[s] = result.suggested_z
        m.cells[(SWEEP_LABEL, s)] = m.table.add(plan_mask(get_scorer("mp-g", z=result.suggested_z).score(profile), s,
                                                          group_size=G).pruned)
    m.timings["z sweep (calibration split)"] = time.perf_counter() - sweep_start


def _policy_and_random_rows(loaded, o: Options, profile, m: Measured) -> None:
    """MP-G (z = 2) under every policy row, and the random scorer at every seed."""
    G = loaded.geometry.group_size
    mpg2 = get_scorer("mp-g", z=2.0).score(profile)
    for policy in POLICY_ROWS:
        for s in o.sparsities:
            try:
                plan = plan_mask(mpg2, s, group_size=G, policy=policy)
            except InputError as err:                   # no feasible count near s: say so in the table
                m.policy_plans[(policy, s)] = str(err)
                continue
            m.policy_plans[(policy, s)] = plan
            m.cells[(f"policy {policy}", s)] = m.table.add(plan.pruned)
    for seed in o.seeds:
        scores = get_scorer("random", seed=seed).score(profile)
        m.scores_of[f"random-{seed}"] = scores.scores
        for s in o.sparsities:
            m.random_cells[(seed, s)] = m.table.add(plan_mask(scores, s, group_size=G).pruned)


def _evaluate_masks(loaded, o: Options, evaluator, m: Measured, team) -> None:
    """Every distinct mask (and the dense model) in one batched evaluation, with bootstrap CIs."""
    g = loaded.geometry
    m.n_masks = len(m.table.masks) + 1
    say(o, f"evaluating {m.n_masks} distinct masks (dense included) on {m.ids.numel()} tokens, {len(m.windows)} windows")
    eval_start = time.perf_counter()
    m.dense = m.table.add(np.zeros((g.n_layers, g.n_heads), bool))
    gates = gate_batch(loaded.model, pruned=np.stack(m.table.masks))                   # [B, L, H]
    sums, m.counts = evaluator.window_nll(loaded.model, m.ids, gates, team=team)     # [B, W], [W]
    m.timings["evaluation (all masks)"] = time.perf_counter() - eval_start
    m.ppl = np.exp(sums.sum(axis=1) / m.counts.sum())                                 # [B]
    m.boot = bootstrap_ppl(sums, m.counts, o.bootstrap)                               # [R, B]
    m.lo, m.hi = np.percentile(m.boot, [2.5, 97.5], axis=0)                           # [B] each


def _summary_lines(loaded, o: Options, m: Measured) -> list[str]:
    """The header and the main table: every scorer row, the swept MP-G row, the random row."""
    g = loaded.geometry
    L, H, G = g.n_layers, g.n_heads, g.group_size
    head = " | ".join(f"{100 * s:g} %" for s in o.sparsities)
    align = " | ".join("---:" for _ in o.sparsities)
    lines = [
        f"# Head-scoring results on {loaded.name}",
        "",
        "Regenerated by:",
        "",
        "```",
        o.extra.get("command", "(run() called directly)"),
        "```",
        "",
        f"Model: `{loaded.name}`: {L} layers x {H} query heads ({g.n_kv_heads} KV heads, G = {G}), {L * H} heads.",
        f"Evaluation: causal-LM perplexity on the first {m.ids.numel():,} tokens of the built-in evaluation split "
        f"(token ids sha256 `{hashlib.sha256(m.ids.numpy().tobytes()).hexdigest()[:16]}`, the same ids for every "
        f"row), {len(m.windows)} non-overlapping windows of {m.window} tokens (stride {m.window}; each window's first "
        f"token is context only, so {int(m.counts.sum()):,} tokens are scored). Cells: perplexity "
        f"[95 % bootstrap CI over windows, {o.bootstrap} resamples, the same resamples for every cell]. "
        f"**Dense perplexity: {m.fmt(m.dense)}.**",
        f"Masks: global ranking, k = floor(s * {L * H}) heads, unless a policy says otherwise. Calibration "
        f"(data-driven scorers): {o.n_sequences} sequences x {o.seq_len} tokens of the calibration split "
        f"(disjoint from the evaluation split); the ablation oracle uses {o.ablation_sequences} x "
        f"{o.ablation_seq_len}.",
        "",
        f"| Scorer | {head} | Scoring cost |",
        f"| --- | {align} | --- |",
    ]
    for label, _ in scorer_rows(o):
        lines.append(f"| {label} | {' | '.join(m.fmt(m.cells[(label, s)]) for s in o.sparsities)} | {m.costs[label]} |")
    lines.append(f"| {SWEEP_LABEL} | " + " | ".join(f"z = {m.swept[s]:g}: {m.fmt(m.cells[(SWEEP_LABEL, s)])}"
                                                   for s in o.sparsities) + " | the sweep, below |")
    random_parts = []
    for s in o.sparsities:
        rows = [m.random_cells[(seed, s)] for seed in o.seeds]
        seed_mean = m.boot[:, rows].mean(axis=1)                                      # [R]
        m_lo, m_hi = np.percentile(seed_mean, [2.5, 97.5])
        random_parts.append(f"{m.ppl[rows].mean():.2f} [{m_lo:.2f}, {m_hi:.2f}] (seeds: {m.ppl[rows].min():.2f} to "
                            f"{m.ppl[rows].max():.2f}, std {m.ppl[rows].std(ddof=1):.2f})")
    lines.append(f"| Random (mean over seeds {', '.join(map(str, o.seeds))}) | {' | '.join(random_parts)} | none |")
    return lines


def _policy_lines(loaded, o: Options, m: Measured) -> list[str]:
    """MP-G (z = 2) under the mask policies, with what surgery removes."""
    g = loaded.geometry
    bias = loaded.adapter.has_qkv_bias(loaded.model)
    dtype_bytes = next(loaded.model.parameters()).element_size()
    lines = ["", "## MP-G (z = 2) under the mask policies", "",
             "Parameters removed = what surgery (analysis.compress.surgery.prune_heads, kv_policy auto) really removes from "
             "the attention; negative = the model grows (uneven GQA groups: K/V copied per query head).", "",
             "| Policy | Sparsity | Heads pruned | Perplexity [95 % CI] | Attention params removed | KV cache |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for policy in POLICY_ROWS:
        for s in o.sparsities:
            plan = m.policy_plans[(policy, s)]
            if isinstance(plan, str):
                lines.append(f"| {policy} | {s:g} | infeasible | {plan} | | |")
                continue
            summary = summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, bias=bias, dtype_bytes=dtype_bytes)
            lines.append(f"| {policy} | {s:g} | {plan.n_pruned} (asked {plan.requested}) | "
                         f"{m.fmt(m.cells[(f'policy {policy}', s)])} | {summary.params_removed:,} "
                         f"({100 * summary.params_removed_fraction:.1f} %) | {summary.kv_cache_ratio:.3g}x |")
    return lines


def _oracle_lines(loaded, o: Options, m: Measured) -> list[str]:
    """Spearman's rho of every scorer (and the random seeds) with the ablation oracle."""
    g = loaded.geometry
    rows = scorer_rows(o)
    oracle_label = next(label for label, scorer in rows if scorer.name == ORACLE)
    oracle = m.scores_of[oracle_label]
    lines = ["", "## Agreement with the single-head ablation oracle", "",
             f"Spearman's rho between each scorer's head scores and the oracle's ({oracle_label}) over all "
             f"{g.n_layers * g.n_heads} heads (higher = ranks heads more like their real loss increase).", "",
             "| Scorer | Spearman rho |", "| --- | ---: |"]
    for label, scorer in rows:
        if scorer.name != ORACLE:
            lines.append(f"| {label} | {rank_correlation(m.scores_of[label], oracle):+.3f} |")
    rhos = np.array([rank_correlation(m.scores_of[f"random-{seed}"], oracle) for seed in o.seeds])
    lines.append(f"| Random (mean ± std over {len(o.seeds)} seeds) | {rhos.mean():+.3f} ± {rhos.std(ddof=1):.3f} |")
    return lines


def _timing_lines(o: Options, m: Measured, total: float) -> list[str]:
    """The timings table and the notes."""
    lines = ["", "## Timings", "", "| Step | Seconds |", "| --- | ---: |"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in m.timings.items()]
    lines += [f"| whole run | {total:.1f} |", "",
              "Notes:",
              f"- One run, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} CPU, "
              f"{torch.get_num_threads()} torch threads; seconds depend on machine load. {m.n_masks} distinct masks "
              "were evaluated (identical masks share one evaluation).",
              "- The z sweep picks, per sparsity, the z with the lowest calibration-split perplexity over z = 0.5 "
              f".. 3.0 (first {o.sweep_tokens} calibration tokens); that z is then evaluated on the evaluation split.",
              "- Layer-normalized Wanda-Head / SparseGPT-Head: each layer's head scores divided by that layer's "
              "mean head score, so every layer's mean is 1 and the global ranking compares heads within their "
              "layer's scale.",
              f"- Text: {WIKI_ATTRIBUTION}", ""]
    return lines


def _floats(text: str) -> tuple:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> None:
    from analysis.arch.models import load_model

    defaults = Options()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    for f in fields(Options):
        if f.name in ("extra", "quiet"):
            continue
        value = getattr(defaults, f.name)
        kind = _floats if isinstance(value, tuple) else type(value)
        shown = ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else value
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=value, help=f"default {shown}")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    options = Options(**{f.name: getattr(args, f.name) for f in fields(Options) if f.name != "extra"})
    options.seeds = tuple(int(s) for s in options.seeds)
    command = " ".join([".venv/bin/python scripts/results.py"] + [
        f"--{k.replace('_', '-')} {','.join(f'{x:g}' for x in v) if isinstance(v, tuple) else v}"
        for k, v in vars(args).items() if k not in ("cache_dir", "out", "quiet")])
    options.extra["command"] = command
    team = distributed.team()
    try:
        options.quiet = options.quiet or not team.is_main
        loaded = load_model(args.model, cache_dir=args.cache_dir)
        text, _ = run(loaded, options, team=team)
        if team.is_main:
            # the recovery section belongs to bench/bench_recovery.py --write-docs, the roles section to
            # scripts/roles_results.py, the probes section to scripts/probes_results.py, the edge section to
            # bench/bench_gguf.py --write-docs, the frontier and long-context sections to bench_frontier.py and
            # bench_long_context.py --write-docs, the kv-heads section to scripts/kv_heads_results.py, the
            # kv-policies section to bench_kv_policies.py, the long-probes section to bench_long_probes.py, the
            # kv-quality section to bench_kv_quality.py: keep them as they are
            kept = "\n\n".join(part for markers in (RECOVERY_MARKERS, ROLES_MARKERS, PROBES_MARKERS, EDGE_MARKERS,
                                                      FRONTIER_MARKERS, LONG_CONTEXT_MARKERS, KV_HEADS_MARKERS,
                                                      KV_POLICIES_MARKERS, LONG_PROBES_MARKERS, KV_QUALITY_MARKERS)
                                if (part := marked_section(args.out, *markers)))
            atomic_write(Path(args.out), text.rstrip("\n") + "\n" + ("\n" + kept + "\n" if kept else ""),
                         what="The results file")
            print(text)
    finally:
        distributed.leave(team)


if __name__ == "__main__":
    main()
