"""Write the "Does MP find the specialized heads?" section of docs/results.md.

For each built-in model (SmolLM2-135M, MiniLM-L6) and each role — the taxonomy detectors of
analysis.measure.detectors and the Voita-style pattern tags of analysis.measure.roles — a head has the
role when its strength is at or above the role's threshold; the MP-G score (z = 2) is read as a
classifier of the role: ROC AUC, a two-sided permutation p-value (10,000 seeded permutations),
Spearman's rho between the score and the strength, and which of the role's heads the MP-G global mask
prunes at 30 % sparsity (analysis.score.specialization). Every number is written as it comes out.

    .venv/bin/python scripts/roles_results.py [--cache-dir DIR] [--out docs/results.md]

The section lives between ROLES_MARKERS (analysis.score.specialization); scripts/results.py keeps it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

from analysis.arch.models import load_model  # noqa: E402
from analysis.core.atomic import write_section  # noqa: E402
from analysis.measure.attribution import rank_correlation  # noqa: E402
from analysis.measure.detectors import default_detectors, detect_heads  # noqa: E402
from analysis.measure.roles import ROLES, head_roles  # noqa: E402
from analysis.score.masks import plan_mask  # noqa: E402
from analysis.score.specialization import (ROLES_MARKERS, mpg_scores, pruned_roles, role_tests,  # noqa: E402
                                           strengths_of)

COMMAND = ".venv/bin/python scripts/roles_results.py"
MODELS = ("smollm2-135m", "minilm-l6")
SPARSITY = 0.3


def model_section(name: str, cache_dir, *, max_tokens: int, permutations: int, seed: int) -> list[str]:
    start = time.perf_counter()
    loaded = load_model(name, cache_dir=cache_dir)
    decoder = loaded.kind == "causal-lm"
    names = default_detectors(loaded.kind)            # the long-context ones: scripts/kv_heads_results.py
    det = detect_heads(loaded, names, max_tokens=max_tokens, options=dict(seed=seed))
    strengths = strengths_of(det)
    pattern = head_roles(loaded, max_tokens=max_tokens)
    for role in ROLES:
        if role != "previous-token":                                   # one definition: the detector's
            strengths[f"{role} (pattern tag)"] = (pattern.strengths[role], pattern.thresholds[role])
    scores = mpg_scores(loaded, 2.0)
    tests = role_tests(scores.scores, strengths, n_permutations=permutations, seed=seed)
    plan = plan_mask(scores, SPARSITY, group_size=loaded.geometry.group_size)
    pruned = {r["role"]: r for r in pruned_roles(plan.pruned, strengths)}
    g = loaded.geometry
    lines = [f"### {name} ({g.n_layers} layers x {g.n_heads} heads, {loaded.kind})", "",
             f"MP-G (z = 2) scores {scores.zero_count} of {scores.scores.size} heads exactly 0. Text roles on the first "
             f"{max_tokens} tokens of the built-in evaluation split; induction / duplicate-token on 8 sequences of "
             f"[BOS] + 50 random tokens repeated twice (seed {seed}).", "",
             "| role | threshold | heads with role | ROC AUC | p (two-sided) | Spearman rho (score vs strength) "
             f"| mean MP-G with / without | role heads pruned at {SPARSITY:.0%} |",
             "|---|---|---|---|---|---|---|---|"]
    for t in tests:
        s, _ = strengths[t.role]
        rho = rank_correlation(scores.scores, s) if np.isfinite(s).sum() >= 3 else float("nan")
        p = pruned[t.role]
        auc = "n/a (no head has it)" if not np.isfinite(t.auc) else f"{t.auc:.3f}"
        pv = "n/a" if not np.isfinite(t.p_value) else f"{t.p_value:.4f}"
        lines.append(f"| {t.role} | {t.threshold:g} | {t.n_with_role} | {auc} | {pv} | {rho:.3f} | "
                     f"{t.mean_score_with:.3g} / {t.mean_score_without:.3g} | {p['pruned_with_role']} of "
                     f"{p['with_role']} |")
    ind = det["induction"]
    lines.append("")
    sig = [t for t in tests if np.isfinite(t.p_value) and t.p_value < 0.05]
    rest = [t.role for t in tests if t not in sig and np.isfinite(t.auc)]
    lines.append("As it comes out: " + ("; ".join(
        f"{t.role} heads score {'higher' if t.auc > 0.5 else 'lower'} under MP-G (AUC {t.auc:.2f}, p {t.p_value:.4f}, "
        f"{t.n_with_role} heads)" for t in sig) or "no role is predicted by MP-G at p < 0.05")
        + (f"; no significant relation for {', '.join(rest)}" if rest else "") + ".")
    lines.append("Strongest heads: " + "; ".join(
        f"{n}: " + ", ".join(f"L{l}H{h} ({s:.2f})" for l, h, s in det[n].tagged()[:4]) for n in names
        if det[n].tagged()) + ".")
    if "icl_score" in ind.extras:
        e = ind.extras
        lines.append(f"In-context-learning score: loss {e['loss_first_copy']:.3f} nats on the first copy, "
                     f"{e['loss_second_copy']:.3f} on the second (drop {e['icl_score']:.3f}).")
    if not decoder:
        lines.append("Copying, successor and DLA do not apply (no unembedding: MiniLM has no LM head).")
    lines += ["", f"({time.perf_counter() - start:.0f} s)", ""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--permutations", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    begin, end = ROLES_MARKERS
    lines = [begin, "## Does MP find the specialized heads? (scripts/roles_results.py)", "",
             f"Generated by `{COMMAND}`" + (f" --max-tokens {args.max_tokens}" if args.max_tokens != 256 else "")
             + ". A head has a role when its strength is at or above the threshold (docs/DEFINITIONS.md, "
             "'What heads do'). ROC AUC of the MP-G score (z = 2) for predicting the role: > 0.5 = role heads "
             "score higher (MP keeps them), < 0.5 = MP prunes them first; p from "
             f"{args.permutations:,} seeded label permutations. The last column: how many of the role's heads the "
             f"MP-G global mask at {SPARSITY:.0%} sparsity prunes (30 % of all heads are pruned).", ""]
    for name in MODELS:
        lines += model_section(name, args.cache_dir, max_tokens=args.max_tokens, permutations=args.permutations,
                               seed=args.seed)
    lines.append(end)
    section = "\n".join(lines)
    write_section(args.out, section, begin, end, what="The results file")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
