"""Does MP find the specialized heads? The paper's hypothesis (§VI.A) tested head by head.

For each role (a detector of analysis.measure.detectors, or any [L, H] strength with a
threshold), a head "has" the role when its strength is at or above the threshold. The MP-G
score (analysis.score.scoring.MPGScorer, z = 2 by default) is then read as a classifier of the
role:
- ROC AUC: the probability that a head with the role has a higher MP-G score than a head
  without it (ties count one half; computed from mid-ranks, the Mann-Whitney U statistic).
  0.5 = MP-G says nothing about the role; > 0.5 = role heads score higher (MP keeps them);
  < 0.5 = role heads score lower (MP prunes them first).
- Permutation p-value (two-sided): the role labels are shuffled n times (seeded) over the heads,
  p = (1 + #{|AUC_perm - 0.5| >= |AUC - 0.5|}) / (n + 1).
- For a mask: which roles the pruned heads had (how many of each role's heads it removes).
MP-G scores many heads exactly 0 (in the bulk); those ties are handled by the mid-ranks, so the
AUC does not depend on the ranking's tie-break.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from analysis.core.errors import InputError, check_seed, check_whole_number

DEFAULT_PERMUTATIONS = 10_000
MAX_PERMUTATIONS = 1_000_000         # p-values to 1e-6; more only costs time


def _ranks(score: np.ndarray) -> np.ndarray:
    return rankdata(np.asarray(score, dtype=np.float64).reshape(-1), method="average")  # [N] mid-ranks


def roc_auc(score: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC of `score` for the boolean `label` (same shape); NaN without both classes."""
    y = np.asarray(label, dtype=bool).reshape(-1)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = _ranks(score)
    return float((r[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def permutation_p(score: np.ndarray, label: np.ndarray, *, n_permutations: int = DEFAULT_PERMUTATIONS,
                  seed: int = 0) -> float:
    """Two-sided permutation p-value of the AUC (seeded; NaN without both classes)."""
    n_permutations = check_whole_number(n_permutations, "The number of permutations", low=1, high=MAX_PERMUTATIONS)
    seed = check_seed(seed)
    y = np.asarray(label, dtype=bool).reshape(-1)
    n1, N = int(y.sum()), y.size
    if n1 == 0 or n1 == N:
        return float("nan")
    r = _ranks(score)
    observed = abs(roc_auc(score, label) - 0.5)
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_permutations, 2000):
        m = min(2000, n_permutations - start)
        picks = rng.random((m, N)).argsort(1)[:, :n1]                  # [m, n1] shuffled role heads
        auc = (r[picks].sum(1) - n1 * (n1 + 1) / 2) / (n1 * (N - n1))  # [m]
        hits += int((np.abs(auc - 0.5) >= observed - 1e-12).sum())
    return (1 + hits) / (n_permutations + 1)


@dataclass
class RoleTest:
    role: str
    threshold: float
    n_with_role: int
    n_heads: int
    auc: float
    p_value: float
    mean_score_with: float       # mean MP-G of the heads with the role
    mean_score_without: float

    def as_dict(self) -> dict:
        return dict(role=self.role, threshold=self.threshold, n_with_role=self.n_with_role, n_heads=self.n_heads,
                    auc=self.auc, p_value=self.p_value, mean_mpg_with=self.mean_score_with,
                    mean_mpg_without=self.mean_score_without)


def role_tests(mpg: np.ndarray, strengths: dict[str, tuple[np.ndarray, float]], *,
               n_permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> list[RoleTest]:
    """One RoleTest per role. strengths: role -> (strength [L, H], threshold)."""
    s = np.asarray(mpg, dtype=np.float64)
    out = []
    for role, (strength, threshold) in strengths.items():
        st = np.asarray(strength, dtype=np.float64)
        if st.shape != s.shape:
            raise InputError(f"Role {role!r} has strengths of shape {list(st.shape)}; the scores are {list(s.shape)}.")
        label = np.nan_to_num(st, nan=-np.inf) >= threshold
        with_, without = s[label], s[~label]
        out.append(RoleTest(role, float(threshold), int(label.sum()), int(label.size), roc_auc(s, label),
                            permutation_p(s, label, n_permutations=n_permutations, seed=seed),
                            float(with_.mean()) if with_.size else float("nan"),
                            float(without.mean()) if without.size else float("nan")))
    return out


def strengths_of(detections: dict) -> dict[str, tuple[np.ndarray, float]]:
    """role -> (scores, threshold) from analysis.measure.detectors results."""
    return {name: (d.scores, d.threshold) for name, d in detections.items()}


def pruned_roles(pruned: np.ndarray, strengths: dict[str, tuple[np.ndarray, float]]) -> list[dict]:
    """For a mask pruned [L, H]: per role, how many heads have it and how many of those are pruned."""
    p = np.asarray(pruned, dtype=bool)
    rows = []
    for role, (strength, threshold) in strengths.items():
        label = np.nan_to_num(np.asarray(strength, dtype=np.float64), nan=-np.inf) >= threshold
        hit = label & p
        rows.append(dict(role=role, with_role=int(label.sum()), pruned_with_role=int(hit.sum()),
                         share_pruned=(float(hit.sum() / label.sum()) if label.any() else float("nan")),
                         mask_share=float(p.mean()),
                         heads=[f"L{l}H{h}" for l, h in zip(*np.nonzero(hit))]))
    return rows


def mpg_scores(target, z: float = 2.0):
    """The MP-G HeadScores (z) of a model / LoadedModel (weights only)."""
    from analysis.score.scoring import MPGScorer
    return MPGScorer(z=z).score(target)


# docs/results.md section written by scripts/roles_results.py (scripts/results.py keeps it)
ROLES_MARKERS = ("<!-- roles:begin -->", "<!-- roles:end -->")


def probe_strengths(maps: dict, top: int = 10) -> dict[str, tuple[np.ndarray, float]]:
    """The probes' top heads as roles: probe -> (drop [L, H], threshold = its top-th largest drop), so
    `role_tests` asks whether MP-G keeps the heads each probe depends on most (maps: name -> ProbeMap)."""
    out = {}
    for name, m in maps.items():
        drop = np.nan_to_num(np.asarray(m.drop, dtype=np.float64), nan=-np.inf)
        k = min(int(top), drop.size)
        out[f"{name} probe (top {k} heads)"] = (drop, float(np.sort(drop, axis=None)[-k]))
    return out
