"""Work a multi-process test runs under `accelerate launch` and again in one process (tests/test_distributed.py).

`compute(loaded, team)` runs the library's split work on a tiny causal LM: a z sweep, every
calibration scorer, a sparsity curve, the results script's batched window sums and a naive
ablation sweep. `python tests/_distributed_driver.py MODEL_DIR OUT.pkl` (under a launcher) joins
the run, computes, and rank 0 pickles the results to OUT.pkl.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

CALIBRATION = dict(n_sequences=4, seq_len=16, batch_size=1)       # 4 batches: 2 per process
SCORERS = {"wanda": {}, "sparsegpt": {}, "gradient": {}, "gate": {}, "gate-ig": dict(n_steps=2),
           "hybrid": {}, "ablation": {}}
EVAL_TOKENS = 640                                                 # 10 windows of 64 tokens


def compute(loaded, team) -> dict:
    """Every split computation's numbers, as plain arrays / dicts."""
    from analysis.measure.ablation import head_ablation
    from analysis.measure.evaluation import evaluator_for, gate_batch, token_ids
    from analysis.score.curves import sparsity_curve
    from analysis.measure.profiles import profile_model
    from analysis.score.scoring import calibration_ids, get_scorer
    from analysis.score.sweep import split_evaluators, sweep_z
    from analysis.core.text import evaluation_text

    out = {}
    profile = profile_model(loaded.model, adapter=loaded.adapter)
    cal, ev, metric, higher = split_evaluators(loaded, max_tokens=EVAL_TOKENS, team=team)
    out["sweep"] = sweep_z(profile, 0.25, cal, ev, zs=[0.5, 1.0, 1.5, 2.0, 2.5, 3.0], metric=metric,
                           higher_is_better=higher, evaluate_all=True).as_dict()
    ids = calibration_ids(loaded.tokenizer, CALIBRATION["n_sequences"], CALIBRATION["seq_len"])
    for name, params in SCORERS.items():
        scorer = get_scorer(name, **{**CALIBRATION, **params})
        out[f"score-{name}"] = scorer.score(loaded, calibration=ids, team=team).scores
    out["curve"] = sparsity_curve(loaded, out["score-wanda"], max_tokens=EVAL_TOKENS, team=team).values
    stream = token_ids(loaded.tokenizer, evaluation_text(max_chars=4 * EVAL_TOKENS), max_tokens=EVAL_TOKENS)
    L, H = loaded.geometry.n_layers, loaded.geometry.n_heads
    masks = np.random.default_rng(0).random((11, L, H)) < 0.3                         # [11, L, H]
    sums, counts = evaluator_for(loaded.kind, batch_size=4).window_nll(
        loaded.model, stream, gate_batch(loaded.model, pruned=masks), team=team)      # [11, W], [W]
    out["window-sums"], out["window-counts"] = sums, counts
    naive = head_ablation(loaded, method="naive", max_tokens=48, seq_len=16, team=team)
    out["naive-head"], out["naive-group"], out["naive-base"] = naive.head_delta, naive.group_delta, naive.base_loss
    return out


def main(model_dir: str, out_path: str) -> int:
    from analysis.core import distributed
    from analysis.arch.models import load_model

    team = distributed.team()
    try:
        result = compute(load_model(model_dir), team)
        if team.is_main:
            Path(out_path).write_bytes(pickle.dumps(dict(result, world=team.world)))
    finally:
        distributed.leave(team)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
