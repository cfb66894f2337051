"""MP-G versus roles: the ROC AUC equals a pair count by hand (ties one half), the permutation p-value
behaves (seeded, small for a perfect split, large for no signal), and pruned_roles counts by hand."""
import itertools

import numpy as np
import pytest

from analysis.core.errors import InputError
from analysis.score.specialization import permutation_p, pruned_roles, role_tests, roc_auc


def _auc_by_pairs(score, label):
    pos, neg = score[label], score[~label]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_is_the_pair_count_with_ties_as_halves():
    rng = np.random.default_rng(0)
    score = rng.integers(0, 4, size=(5, 6)).astype(float)              # many ties, like MP-G's zeros
    label = rng.random((5, 6)) < 0.3
    assert roc_auc(score, label) == pytest.approx(_auc_by_pairs(score.ravel(), label.ravel()), abs=1e-12)
    assert roc_auc(np.arange(6.0), np.array([0, 0, 0, 1, 1, 1], bool)) == 1.0
    assert roc_auc(np.arange(6.0), np.array([1, 1, 1, 0, 0, 0], bool)) == 0.0
    assert np.isnan(roc_auc(np.arange(3.0), np.zeros(3, bool)))


def test_permutation_p_value():
    score = np.arange(40.0)
    perfect = score >= 35
    p = permutation_p(score, perfect, n_permutations=2000, seed=1)
    assert p == permutation_p(score, perfect, n_permutations=2000, seed=1)   # seeded
    # 5 of 40 at the top: C(40, 5) = 658,008 labelings, 2 as extreme (top and bottom) -> almost never
    assert p <= 3 / 2001
    mixed = np.zeros(40, bool)
    mixed[[0, 39, 10, 29]] = True                                      # symmetric: AUC = 0.5
    assert roc_auc(score, mixed) == pytest.approx(0.5)
    assert permutation_p(score, mixed, n_permutations=2000, seed=1) == 1.0
    with pytest.raises(InputError):
        permutation_p(score, perfect, n_permutations=0)


def test_role_tests_and_pruned_roles_by_hand():
    mpg = np.array([[0.0, 0.0, 3.0], [1.0, 0.0, 5.0]])
    strength = np.array([[0.1, 0.2, 0.9], [0.0, 0.3, 0.8]])
    (t,) = role_tests(mpg, {"x": (strength, 0.5)}, n_permutations=500)
    assert (t.n_with_role, t.n_heads) == (2, 6) and t.auc == 1.0
    assert t.mean_score_with == 4.0 and t.mean_score_without == pytest.approx(0.25)
    pruned = np.array([[True, True, False], [False, True, True]])
    (row,) = pruned_roles(pruned, {"x": (strength, 0.5)})
    assert row["with_role"] == 2 and row["pruned_with_role"] == 1 and row["heads"] == ["L1H2"]
    with pytest.raises(InputError, match="shape"):
        role_tests(mpg, {"x": (strength[:1], 0.5)})
