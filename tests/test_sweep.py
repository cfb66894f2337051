"""z sweeps with injected evaluators: each distinct mask evaluated once and in one batch, the
suggested z (best on calibration, ties to the z nearest 2.0), the evaluation split only where
asked, and bad inputs."""

import numpy as np
import pytest

from analysis.core.errors import CancelledError, InputError
from analysis.score.masks import plan_mask
from analysis.score.scoring import MPGScorer, MPScorer
from analysis.score.sweep import suggest, sweep_z, z_grid
from tests._scoring_fixtures import random_profile


class Recorder:
    """Fake evaluator: metric = a fixed value per mask (from `table`, keyed by mask bytes)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, masks):
        self.calls.append(masks.copy())
        return np.array([self.fn(m) for m in masks])


def test_distinct_masks_evaluated_once_in_one_batch():
    profile = random_profile(L=6, H=8, Hkv=2)
    zs = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    calib = Recorder(lambda m: float(np.flatnonzero(m.ravel()).sum()))
    result = sweep_z(profile, 0.25, calib, zs=zs)
    expected = [plan_mask(MPGScorer(z=z).score(profile), 0.25, group_size=4).pruned for z in zs]
    assert len(calib.calls) == 1
    distinct = {m.tobytes() for m in expected}
    assert len(calib.calls[0]) == len(distinct)
    for z, mask, value, zero in zip(zs, expected, result.calibration, result.zero_score_heads):
        assert value == float(np.flatnonzero(mask.ravel()).sum())
        assert zero == MPGScorer(z=z).score(profile).zero_count
    assert (result.n_pruned == 12).all()
    assert np.isnan(result.evaluation).all()  # no evaluation split given


def test_suggested_z_is_best_on_calibration_with_evaluation_beside_it():
    profile = random_profile(L=6, H=8, Hkv=2, seed=3)
    zs = z_grid(0.5, 3.0, 0.5)
    masks = {z: plan_mask(MPScorer(z=z).score(profile), 0.5, group_size=4).pruned.tobytes() for z in zs}
    rank = {m: i for i, m in enumerate(dict.fromkeys(masks.values()))}
    calib = Recorder(lambda m: 10.0 + rank[m.tobytes()])  # the first distinct mask is best
    held_out = Recorder(lambda m: 100.0 + rank[m.tobytes()])
    result = sweep_z(profile, 0.5, calib, held_out, zs=zs, scorer="mp")
    best_mask = next(m for m, i in rank.items() if i == 0)
    ties = [z for z in zs if masks[z] == best_mask]
    assert result.suggested_z == min(ties, key=lambda z: (abs(z - 2.0), z))
    assert result.suggested_evaluation == 100.0
    assert len(held_out.calls) == 1 and len(held_out.calls[0]) == 1  # only the suggested mask
    rows = result.rows()
    assert sum(r["suggested"] for r in rows) == 1 and rows[0]["z"] == 0.5


def test_evaluate_all_and_higher_is_better():
    profile = random_profile(seed=5)
    calib = Recorder(lambda m: float(m[0].sum()))
    held_out = Recorder(lambda m: 0.5)
    result = sweep_z(profile, 0.3, calib, held_out, zs=[0.5, 1.5, 2.5], higher_is_better=True,
                     evaluate_all=True, metric="embedding-fidelity")
    assert not np.isnan(result.evaluation).any()
    assert result.calibration[list(result.zs).index(result.suggested_z)] == result.calibration.max()
    assert result.as_dict()["metric"] == "embedding-fidelity"


def test_suggest_ties_and_non_finite():
    zs = np.array([1.0, 1.5, 2.5, 3.0])
    assert suggest(zs, [5.0, 4.0, 4.0, 9.0]) == 1  # 1.5 and 2.5 tie; both 0.5 from 2.0 -> the smaller
    assert suggest(zs, [np.nan, 7.0, np.inf, 8.0]) == 1
    with pytest.raises(InputError, match="diverges"):
        suggest(zs, [np.nan] * 4)


def test_bad_sweep_inputs():
    profile = random_profile()
    with pytest.raises(InputError, match="threshold scorer"):
        sweep_z(profile, 0.25, Recorder(lambda m: 1.0), scorer="wanda")
    with pytest.raises(InputError):
        sweep_z(profile, 0.25, Recorder(lambda m: 1.0), zs=[])
    with pytest.raises(InputError):
        sweep_z(profile, 0.25, Recorder(lambda m: 1.0), zs=[1.0, -1.0])
    with pytest.raises(InputError):
        sweep_z(profile, 1.0, Recorder(lambda m: 1.0), zs=[1.0])
    with pytest.raises(InputError):
        z_grid(2.0, 1.0, 0.5)
    with pytest.raises(CancelledError):
        sweep_z(profile, 0.25, Recorder(lambda m: 1.0), zs=[1.0], should_stop=lambda: True)
    assert z_grid().tolist() == [0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0]
