"""The iterative schedule (analysis/compress/recover/pipeline.py): exact target counts, rounds recorded in the head
layout, every round's model reloads from every export format equal to itself, the budget rule."""
import copy
import json

import numpy as np
import pytest
import torch

from analysis.compress.recover.distill import DistillConfig
from analysis.core.errors import InputError
from analysis.compress.export import LAYOUT_FILE, ONNX_FILE, load_pruned
from analysis.compress.recover.pipeline import PipelineConfig, export_round, round_counts, run_pipeline
from analysis.compress.surgery import prune_heads
from tests._evalkit import tiny_loaded
from tests._tolerance import EXACT, forward_tolerance, max_diff
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

SMALL_DISTILL = DistillConfig(lr=1e-3, batch_size=2, seq_len=16, max_sequences=8)
IDS = torch.randint(10, 1000, (4, 16), generator=torch.Generator().manual_seed(0))   # [4, 16]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def _loaded(tokenizer, **overrides):
    return tiny_loaded("llama", tokenizer, "causal-lm", **overrides)


def test_round_counts():
    assert round_counts(0.5, 0.2, 16) == [3, 6, 8]
    assert round_counts(0.25, 0.25, 270) == [67]
    assert round_counts(0.25, 0.1, 270) == [27, 54, 67]
    assert round_counts(0.25, 0.1, 270, unit=3) == [27, 54, 67]       # SmolLM2, groups of G = 3
    assert round_counts(0.25, 0.1, 8, unit=2) == [2]                  # 1 head per round is not a group
    assert round_counts(0.5, 0.2, 16, unit=4) == [4, 8]               # 3 -> 4 (a multiple of the unit)
    assert round_counts(0.5, 0.2, 17, unit=4) == [4, 8]               # final 8: no round within a unit of it


def test_prunes_exactly_the_target_and_layout_records_rounds(tokenizer):
    loaded = _loaded(tokenizer, num_hidden_layers=4)                    # 16 heads
    dense_state = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    cfg = PipelineConfig(target_sparsity=0.5, step=0.2, recovery_steps=2, distill=SMALL_DISTILL, eval_tokens=64,
                         policy="global")
    steps = []
    result = run_pipeline(loaded, cfg, train_data=IDS, on_step=steps.append)
    assert [r.n_pruned for r in result.rounds] == [3, 6, 8]
    assert int(result.pruned.sum()) == 8 == int(np.floor(0.5 * 16))
    assert [int((result.head_rounds == r).sum()) for r in (1, 2, 3)] == [3, 3, 2]
    assert np.array_equal(result.head_rounds > 0, result.pruned)
    for r in result.rounds:                                             # new heads match the table
        assert all(result.head_rounds[l, h] == r.index for l, h in r.new_heads)
    assert [s["round"] for s in steps] == [1, 1, 2, 2, 3, 3]
    _, layout = result.smaller()
    assert layout.rounds == result.head_rounds.tolist()
    assert all(torch.equal(v, loaded.model.state_dict()[k]) for k, v in dense_state.items())  # cached model untouched


def test_one_shot_is_one_round_without_recovery(tokenizer):
    loaded = _loaded(tokenizer, num_hidden_layers=4)
    cfg = PipelineConfig(target_sparsity=0.5, step=0.2, recovery_steps=3, distill=SMALL_DISTILL, eval_tokens=64,
                         policy="global")
    result = run_pipeline(loaded, cfg.one_shot(), train_data=IDS)
    assert len(result.rounds) == 1 and result.rounds[0].history == []
    assert result.rounds[0].metric == result.rounds[0].metric_cut and int(result.pruned.sum()) == 8
    assert set(np.unique(result.head_rounds)) == {0, 1}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def test_every_round_reloads_from_every_format(tokenizer, tmp_path):
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM
    loaded = _loaded(tokenizer)
    # 4 -> 2 -> 1 heads kept per layer: every round has a stock config (hidden 32 divides)
    cfg = PipelineConfig(target_sparsity=0.75, step=0.5, recovery_steps=2, policy="uniform",
                         distill=SMALL_DISTILL, eval_tokens=64)
    seen = []
    result = run_pipeline(loaded, cfg, train_data=IDS, keep_round_models=True,
                          on_round=lambda r, m, p: seen.append(p))
    assert len(result.round_models) == 2 == len(seen)
    ids = IDS[:2, :12]
    for index, (model, mask) in enumerate(zip(result.round_models, seen), start=1):
        small, _ = prune_heads(model, mask, kv_policy="expand")
        for fmt in ("zeroed", "pruned", "stock", "onnx"):   # gguf reloads in llama.cpp: tests/test_gguf.py
            out = export_round(fmt, model, mask, result.head_rounds * (result.head_rounds <= index), tmp_path,
                               f"round{index}-{fmt}", kv_policy="expand")
            if fmt == "zeroed":
                back = _logits(AutoModelForCausalLM.from_pretrained(out.path).eval(), ids)
                reference = _logits(model, ids)
            elif fmt == "onnx":
                session = ort.InferenceSession(str(out.path / ONNX_FILE), providers=["CPUExecutionProvider"])
                back = torch.from_numpy(session.run(None, {"input_ids": ids.numpy(),
                                                           "attention_mask": np.ones_like(ids.numpy())})[0])
                reference = _logits(small, ids)
            else:
                back = _logits(load_pruned(out.path), ids)
                reference = _logits(small, ids)
            # float32 through another runtime (ONNX Runtime) or attention kernel (a reload picks
            # its own): the derived worst case for this depth and width (tests/_tolerance.py)
            cfg_ = model.config
            tol = forward_tolerance(torch.float32, width=cfg_.intermediate_size, depth=cfg_.num_hidden_layers,
                                    scale=reference.abs().max().item())
            assert max_diff(back, reference) <= tol, f"round {index} {fmt}"
            if fmt != "zeroed":
                rounds = np.array(json.loads((out.path / LAYOUT_FILE).read_text())["rounds"])
                assert np.array_equal(rounds > 0, mask) and rounds.max() == index
    # the claim "the final model equals its cut" in float64, where it holds on every CPU
    final64 = copy.deepcopy(result.model).double()
    assert max_diff(_logits(prune_heads(final64, result.pruned)[0], ids), _logits(final64, ids)) <= EXACT


def test_budget_keeps_the_last_model_inside_it(tokenizer):
    loaded = _loaded(tokenizer, num_hidden_layers=4)
    cfg = PipelineConfig(target_sparsity=0.5, step=0.2, eval_tokens=64)
    free = run_pipeline(loaded, cfg)
    metrics = [r.metric for r in free.rounds]
    budget = metrics[0] + 1e-6 if metrics[0] > free.dense_metric else free.dense_metric * 1.5
    inside = next((i for i, m in enumerate(metrics) if m > budget), len(metrics))
    held = run_pipeline(loaded, PipelineConfig(target_sparsity=0.5, step=0.2, eval_tokens=64, ppl_budget=budget))
    assert [r.metric for r in held.accepted] == metrics[:inside]
    assert held.stopped_by_budget == (inside < len(metrics))
    if held.stopped_by_budget:
        assert not held.rounds[-1].accepted and held.rounds[-1].metric > budget
    expected = free.rounds[inside - 1].n_pruned if inside else 0
    assert int(held.pruned.sum()) == expected
    assert held.final_metric <= budget


def test_stop_ends_the_run_as_cancelled(tokenizer):
    from analysis.core.errors import CancelledError
    loaded = _loaded(tokenizer, num_hidden_layers=4)
    rounds = []
    with pytest.raises(CancelledError):
        run_pipeline(loaded, PipelineConfig(target_sparsity=0.5, step=0.2, eval_tokens=64),
                     on_round=lambda r, m, p: rounds.append(r.index), should_stop=lambda: len(rounds) >= 1)
    assert rounds == [1]


def test_bad_input(tokenizer):
    loaded = _loaded(tokenizer)
    with pytest.raises(InputError, match="not above the dense"):
        run_pipeline(loaded, PipelineConfig(ppl_budget=1.0, eval_tokens=64))
    with pytest.raises(InputError, match="Recovery steps"):
        run_pipeline(loaded, PipelineConfig(recovery_steps=-1))
    with pytest.raises(InputError, match="batch_size"):       # checked before any work
        run_pipeline(loaded, PipelineConfig(recovery_steps=2, distill=DistillConfig(batch_size=0)))
    zero = run_pipeline(loaded, PipelineConfig(recovery_steps=0, eval_tokens=64))   # 0 = no recovery
    assert all(r.history == [] for r in zero.rounds)
    with pytest.raises(InputError, match="target sparsity"):
        run_pipeline(loaded, PipelineConfig(target_sparsity=0.0))
    with pytest.raises(InputError, match="Unknown scorer"):
        run_pipeline(loaded, PipelineConfig(scorer="nope"))
    with pytest.raises(InputError, match="fewer than one batch"):
        run_pipeline(loaded, PipelineConfig(recovery_steps=1, distill=SMALL_DISTILL, eval_tokens=64),
                     train_data="Too short.")


@pytest.mark.parametrize("scorer", sorted(__import__("analysis.score.scoring", fromlist=["SCORERS"]).SCORERS))
def test_every_registered_scorer_drives_the_cut(tokenizer, scorer):
    """Each scorer of the registry (calibration ones on the current weights) plans every round of a
    two-round schedule with recovery, under the default (groups) policy: whole KV groups go, the
    rounds only grow, and the final model is smaller than dense."""
    from analysis.score.scoring import calibration_ids
    loaded = _loaded(tokenizer, num_hidden_layers=4)                    # 16 heads, G = 2
    cfg = PipelineConfig(target_sparsity=0.5, step=0.25, recovery_steps=1, distill=SMALL_DISTILL, eval_tokens=64,
                         scorer=scorer)
    result = run_pipeline(loaded, cfg, train_data=IDS, calibration=calibration_ids(tokenizer, 2, 16))
    assert result.config.policy == "groups" and [r.n_pruned for r in result.rounds] == [4, 8]
    groups = result.pruned.reshape(4, 2, 2)                             # [L, Hkv, G]
    assert np.array_equal(groups.all(-1), groups.any(-1))               # whole groups only
    assert np.isfinite(result.final_metric) and result.final_accuracy is not None
    small, _ = result.smaller()
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in loaded.model.parameters())


def test_the_recorded_config_says_the_steps_each_round_ran():
    """report.json / the pipeline result record the distillation steps a round really runs: the recovery
    steps (or the token budget's steps), not DistillConfig's default."""
    from analysis.compress.recover.distill import DistillConfig
    from analysis.compress.recover.pipeline import PipelineConfig
    cfg = PipelineConfig(recovery_steps=10, distill=DistillConfig(steps=80, batch_size=2, seq_len=16))
    assert cfg.as_dict()["distill"]["steps"] == 10 == cfg.steps_per_round()
    budget = PipelineConfig(recovery_steps=10, recovery_tokens=100, distill=DistillConfig(batch_size=2, seq_len=16))
    assert budget.as_dict()["distill"]["steps"] == 4 == budget.steps_per_round()       # ceil(100 / 32)
    assert PipelineConfig(recovery_steps=0).as_dict()["distill"]["steps"] == 0
