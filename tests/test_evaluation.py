"""Evaluation under head masks: perplexity, pseudo-perplexity, embedding fidelity, curves.

Oracles: the dense model (all-ones gates must be bit-identical), a copy with the heads zeroed
in its weights (gate 0 must match it), the plain HF perplexity loop, and a pseudo-perplexity
computed straight from its definition with one full forward per masked copy.
"""
import copy

import numpy as np
import pytest
import torch

from analysis.core.errors import CancelledError, InputError
from analysis.measure.evaluation import (CausalPerplexity, EmbeddingFidelity, MaskedChunk, PseudoPerplexity,
                                         causal_windows, evaluate, perplexity)
from analysis.score.curves import lowest_scores_mask, sparsity_curve, sparsity_levels
from analysis.arch.head_gates import zero_heads
from analysis.core.text import evaluation_text

from ._evalkit import hf_loop_perplexity, reference_pseudo_perplexity, tiny_loaded
from ._tiny import VOCAB, tiny_input_ids, tiny_model
from ._tolerance import EXACT, forward_tolerance

TEXT = evaluation_text(max_chars=3000)


@pytest.fixture(scope="module")
def tiny_llama(smollm2):
    return tiny_loaded("llama", smollm2.tokenizer, "causal-lm")


@pytest.fixture(scope="module")
def tiny_bert(minilm):
    return tiny_loaded("bert", minilm.tokenizer, "masked-lm")


@pytest.fixture(scope="module")
def tiny_encoder(minilm):
    from transformers import AutoModel
    from analysis.arch.adapters import adapter_for
    from analysis.arch.models import LoadedModel
    from ._tiny import tiny_config
    torch.manual_seed(0)
    model = AutoModel.from_config(tiny_config("bert", vocab_size=len(minilm.tokenizer),
                                                initializer_range=0.3)).eval()
    a = adapter_for(model)
    return LoadedModel(model, minilm.tokenizer, "tiny-bert-encoder", "encoder", a, a.geometry(model), "in-process")


def _pruned(L, H, heads):
    p = np.zeros((L, H), dtype=bool)
    for l, h in heads:
        p[l, h] = True
    return p


# -- windows ----------------------------------------------------------------------------------

def test_windows_hand_computed():
    ws = [(w.begin, w.end, w.n_target) for w in causal_windows(10, 4, 2)]
    assert ws == [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    # non-overlapping windows: the first token of each window has no context, so it is not scored
    assert [(w.begin, w.end, w.n_target) for w in causal_windows(10, 4, 4)] == [(0, 4, 3), (4, 8, 3), (8, 10, 1)]


@pytest.mark.parametrize("n,window,stride", [(50, 16, 8), (37, 10, 3), (5, 64, 64), (64, 8, 1)])
def test_overlapping_windows_score_every_token_after_the_first_once(n, window, stride):
    scored = []
    for w in causal_windows(n, window, stride):
        assert w.end - w.begin <= window and w.n_target <= w.end - w.begin - 1
        scored += list(range(w.end - w.n_target, w.end))
    assert scored == list(range(1, n))


# -- causal perplexity ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_all_ones_gates_give_exactly_the_dense_perplexity(family):
    model = tiny_model(family)
    ids = tiny_input_ids(1, 40).reshape(-1)
    ev = CausalPerplexity(window=16, stride=8, batch_size=3)
    L, H = 2, 4
    dense = ev.measure(model, ids)
    ones = ev.measure(model, ids, torch.ones(1, L, H))
    assert ones.values[0] == dense.values[0]
    assert ones.mean_nll[0] == dense.mean_nll[0]


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom", "phi3"])
def test_gate_zero_equals_heads_zeroed_in_the_weights(family):
    model = tiny_model(family, dtype=torch.float64)
    ids = tiny_input_ids(1, 40).reshape(-1)
    ev = CausalPerplexity(window=16, stride=8, batch_size=4)
    pruned = _pruned(2, 4, [(0, 1), (1, 0), (1, 1)])          # (1,0)+(1,1) empties a KV group under GQA
    gates = torch.from_numpy(1.0 - pruned.astype(np.float32)).unsqueeze(0)
    masked = ev.measure(model, ids, gates).values[0]
    zeroed = ev.measure(zero_heads(copy.deepcopy(model), pruned), ids).values[0]
    dense = ev.measure(model, ids).values[0]
    assert masked == pytest.approx(zeroed, rel=EXACT)
    assert masked != dense                                    # the mask really changed something,
    assert abs(masked - zeroed) <= 1e-9 * abs(masked - dense)  # by far more than the match's error


def test_batched_masks_equal_one_mask_at_a_time():
    model = tiny_model("llama", dtype=torch.float64)
    ids = tiny_input_ids(1, 45).reshape(-1)
    ev = CausalPerplexity(window=16, stride=6, batch_size=5)
    rng = np.random.default_rng(0)
    gates = torch.from_numpy((rng.random((4, 2, 4)) > 0.4).astype(np.float32))   # [B, L, H]
    gates[1] = 0.5                                              # fractional gates are allowed too
    batched = ev.measure(model, ids, gates).values
    single = [ev.measure(model, ids, gates[b:b + 1]).values[0] for b in range(4)]
    np.testing.assert_allclose(batched, single, rtol=EXACT, atol=0)


@pytest.mark.parametrize("window,stride", [(16, 8), (16, 16), (20, 3)])
def test_sliding_window_matches_the_plain_hf_loop(window, stride):
    model = tiny_model("gpt2", dtype=torch.float64)
    ids = tiny_input_ids(1, 50).reshape(-1)
    ref, n_ref = hf_loop_perplexity(model, ids, window, stride)
    ev = CausalPerplexity(window=window, stride=stride, batch_size=4).measure(model, ids)
    assert ev.n_tokens == n_ref
    # the model runs in float64, but Hugging Face's own loss casts the logits to float32: the bound
    # on log-perplexity is one float32 log-sum-exp over the vocabulary (tests/_tolerance.py)
    tol = forward_tolerance(torch.float32, width=VOCAB, depth=1, scale=np.log(ref))
    assert abs(np.log(ev.value) - np.log(ref)) <= tol


def test_text_longer_than_the_context_is_windowed(tiny_llama):
    ctx = tiny_llama.model.config.max_position_embeddings    # 64 for the tiny model
    ids = tiny_llama.tokenizer(TEXT)["input_ids"]
    assert len(ids) > 3 * ctx
    ev = evaluate(tiny_llama, TEXT, max_tokens=None, stride=ctx // 2)
    assert ev.n_tokens == len(ids) - 1                        # every token after the first, once
    ref, n_ref = hf_loop_perplexity(tiny_llama.model, torch.tensor(ids), ctx, ctx // 2)
    assert ev.value == pytest.approx(ref, rel=1e-5)


def test_perplexity_function_accepts_pruned_masks_and_gates(tiny_llama):
    L, H = tiny_llama.geometry.n_layers, tiny_llama.geometry.n_heads
    p = _pruned(L, H, [(0, 0), (1, 3)])
    a = perplexity(tiny_llama, TEXT, pruned=p, max_tokens=64)
    b = perplexity(tiny_llama, TEXT, gates=1.0 - p.astype(np.float32), max_tokens=64)
    both = perplexity(tiny_llama, TEXT, pruned=np.stack([np.zeros_like(p), p]), max_tokens=64)
    dense = perplexity(tiny_llama, TEXT, max_tokens=64)
    assert isinstance(a, float) and a == b
    assert both.shape == (2,) and both[0] == pytest.approx(dense, rel=1e-6) and both[1] == pytest.approx(a, rel=1e-6)


def test_smollm2_dense_perplexity_is_sane(smollm2):
    ppl = perplexity(smollm2, max_tokens=128)
    assert 5.0 < ppl < 40.0                                   # a random model would be ~ vocab size


# -- masked LM pseudo-perplexity --------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_pseudo_perplexity_equals_the_straightforward_reference(family):
    model = tiny_model(family, dtype=torch.float64)
    ids = torch.cat([torch.tensor([2]), tiny_input_ids(1, 14).reshape(-1), torch.tensor([3])])  # [16]
    positions = list(range(1, 15))
    chunk = MaskedChunk(ids, torch.tensor(positions))
    got = PseudoPerplexity(batch_size=5).measure(model, [chunk], mask_token_id=4).value
    assert got == pytest.approx(reference_pseudo_perplexity(model, ids, positions, 4), rel=1e-6)


def test_pseudo_perplexity_under_a_mask_equals_zeroed_reference():
    model = tiny_model("bert", dtype=torch.float64)
    ids = torch.cat([torch.tensor([2]), tiny_input_ids(1, 10).reshape(-1), torch.tensor([3])])
    positions = list(range(1, 11))
    pruned = _pruned(2, 4, [(0, 2), (1, 1)])
    gates = torch.from_numpy(1.0 - pruned.astype(np.float32)).unsqueeze(0)
    got = PseudoPerplexity(batch_size=4).measure(model, [MaskedChunk(ids, torch.tensor(positions))], gates,
                                                 mask_token_id=4).value
    ref = reference_pseudo_perplexity(zero_heads(copy.deepcopy(model), pruned), ids, positions, 4)
    assert got == pytest.approx(ref, rel=EXACT)


def test_pseudo_perplexity_from_text_skips_special_tokens(tiny_bert):
    ev = evaluate(tiny_bert, "The cat sat on the mat near the door.", window=8)
    tok = tiny_bert.tokenizer
    n_words = len(tok("The cat sat on the mat near the door.", add_special_tokens=False)["input_ids"])
    assert ev.metric == "pseudo-perplexity" and ev.n_tokens == n_words
    ids = tok("The cat sat on the mat near the door.")["input_ids"][:7]   # [CLS] + 6 tokens (window 8 - 2 specials)
    ids = torch.tensor(ids + [tok.sep_token_id])
    ref_first_chunk = reference_pseudo_perplexity(tiny_bert.model, ids, range(1, 7), tok.mask_token_id)
    first = PseudoPerplexity(window=8).measure(
        tiny_bert.model, [MaskedChunk(ids, torch.arange(1, 7))], mask_token_id=tok.mask_token_id).value
    assert first == pytest.approx(ref_first_chunk, rel=1e-6)


# -- encoders: embedding fidelity -------------------------------------------------------------

def test_embedding_fidelity_is_one_dense_and_matches_zeroed_weights(tiny_encoder):
    ev = EmbeddingFidelity(window=16)
    chunks = ev.prepare(tiny_encoder.tokenizer, TEXT, 60)
    model = tiny_encoder.model
    assert ev.measure(model, chunks).value == pytest.approx(1.0, abs=1e-12)
    pruned = _pruned(2, 4, [(0, 0), (0, 3), (1, 2)])
    gates = torch.from_numpy(1.0 - pruned.astype(np.float32)).unsqueeze(0)
    got = ev.measure(model, chunks, gates).value
    zeroed = zero_heads(copy.deepcopy(model), pruned)
    with torch.no_grad():
        cos = [torch.nn.functional.cosine_similarity(
            model(input_ids=c[None]).last_hidden_state.mean(1).double(),
            zeroed(input_ids=c[None]).last_hidden_state.mean(1).double()).item() for c in chunks]
    assert got < 0.999
    assert abs(got - np.mean(cos)) <= 1e-3 * (1.0 - got)


def test_minilm_fidelity_drops_when_heads_are_pruned(minilm):
    p = np.zeros((6, 12), dtype=bool)
    p[:, :6] = True
    ev = evaluate(minilm, TEXT, pruned=np.stack([np.zeros_like(p), p]), max_tokens=128)
    assert ev.metric == "embedding-fidelity" and ev.higher_is_better
    assert ev.values[0] == pytest.approx(1.0, abs=1e-9) and ev.values[1] < 0.99
    with pytest.raises(InputError, match="no LM head"):
        perplexity(minilm, TEXT)


# -- bad input, progress, cancel ----------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "   \n\t ", b"", b"\xff\xfe\xfa not utf-8"])
def test_empty_or_undecodable_text_is_an_input_error(tiny_llama, text):
    with pytest.raises(InputError):
        perplexity(tiny_llama, text)


def test_text_shorter_than_two_tokens_is_an_input_error(tiny_llama):
    assert len(tiny_llama.tokenizer("Hi")["input_ids"]) < 2
    with pytest.raises(InputError, match="at least 2"):
        perplexity(tiny_llama, "Hi")


def test_utf8_bytes_are_accepted(tiny_llama):
    text = "Zürich is a city in Switzerland."
    assert perplexity(tiny_llama, text.encode("utf-8")) == perplexity(tiny_llama, text)


@pytest.mark.parametrize("shape", [(2, 3), (3, 4), (4,), (2, 2, 3)])
def test_mask_of_the_wrong_shape_is_an_input_error(tiny_llama, shape):
    with pytest.raises(InputError, match="shape"):
        perplexity(tiny_llama, TEXT, gates=np.ones(shape), max_tokens=32)
    with pytest.raises(InputError, match="shape"):
        perplexity(tiny_llama, TEXT, pruned=np.zeros(shape, dtype=bool), max_tokens=32)


def test_gates_and_pruned_together_is_an_input_error(tiny_llama):
    with pytest.raises(InputError, match="not both"):
        perplexity(tiny_llama, TEXT, gates=np.ones((2, 4)), pruned=np.zeros((2, 4), bool))


def test_progress_reaches_one_and_cancel_raises(tiny_llama):
    seen = []
    evaluate(tiny_llama, TEXT, max_tokens=200, window=32, batch_size=2, progress=lambda f, m: seen.append(f))
    assert seen and seen[-1] == 1.0 and all(a <= b for a, b in zip(seen, seen[1:]))
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 1

    with pytest.raises(CancelledError):
        evaluate(tiny_llama, TEXT, max_tokens=200, window=32, batch_size=2, should_stop=stop)


# -- sparsity curves ----------------------------------------------------------------------------

def test_sparsity_levels():
    np.testing.assert_allclose(sparsity_levels(0.6, 0.1), [0, .1, .2, .3, .4, .5, .6])
    np.testing.assert_allclose(sparsity_levels(0.5, 0.25), [0, .25, .5])
    with pytest.raises(InputError):
        sparsity_levels(0.6, 0.0)


def test_lowest_scores_mask_hand_computed():
    scores = np.array([[3.0, 1.0], [0.5, 2.0]])
    assert lowest_scores_mask(scores, 0.5).tolist() == [[False, True], [True, False]]
    assert not lowest_scores_mask(scores, 0.0).any()


def test_sparsity_curve_points_equal_single_evaluations(tiny_llama):
    L, H = tiny_llama.geometry.n_layers, tiny_llama.geometry.n_heads
    scores = np.arange(L * H, dtype=float).reshape(L, H)[:, ::-1].copy()
    used = []

    def mask_fn(s, sparsity):
        used.append(sparsity)
        return lowest_scores_mask(s, sparsity)

    curve = sparsity_curve(tiny_llama, scores, TEXT, max_sparsity=0.5, step=0.25, mask_fn=mask_fn, max_tokens=64)
    assert used == [0.0, 0.25, 0.5]
    assert curve.n_pruned.tolist() == [0, 2, 4]
    dense = perplexity(tiny_llama, TEXT, max_tokens=64)
    assert curve.values[0] == pytest.approx(dense, rel=1e-6)
    for s, v in zip(curve.sparsities, curve.values):
        assert v == pytest.approx(perplexity(tiny_llama, TEXT, pruned=lowest_scores_mask(scores, s), max_tokens=64),
                                  rel=1e-6)
    with pytest.raises(InputError, match="shape"):
        sparsity_curve(tiny_llama, scores[:1], TEXT)


def test_sparsity_curve_leaves_out_levels_the_policy_cannot_build(tiny_llama):
    """balanced-uniform prunes in steps of one head per KV group in every layer: the levels in
    between are left out (and listed), the rest equal their single evaluations."""
    from analysis.score.masks import plan_mask
    g = tiny_llama.geometry
    scores = np.arange(g.n_layers * g.n_heads, dtype=float).reshape(g.n_layers, g.n_heads)

    def mask_fn(s, sparsity):
        return plan_mask(s, sparsity, group_size=g.group_size, policy="balanced-uniform").pruned

    curve = sparsity_curve(tiny_llama, scores, TEXT, sparsities=[0.0, 0.25, 0.5], mask_fn=mask_fn, max_tokens=64)
    assert curve.sparsities.tolist() == [0.0, 0.5] and curve.n_pruned.tolist() == [0, 4]
    assert [x for x, _ in curve.skipped] == [0.25] and "Feasible sparsities" in curve.skipped[0][1]
    assert curve.values[1] == pytest.approx(perplexity(tiny_llama, TEXT, pruned=mask_fn(scores, 0.5), max_tokens=64),
                                            rel=1e-6)
    with pytest.raises(InputError, match="cannot build any"):
        sparsity_curve(tiny_llama, scores, TEXT, sparsities=[0.25], mask_fn=mask_fn, max_tokens=64)


# -- next-token top-1 accuracy ----------------------------------------------------------------

@torch.no_grad()
def _reference_top1(model, ids: torch.Tensor, window: int) -> tuple[int, int]:
    """Correct argmax predictions and scored tokens over non-overlapping windows, one plain forward
    per window (the first token of each window is context only)."""
    hits = total = 0
    for begin in range(0, ids.numel(), window):
        x = ids[begin:begin + window].unsqueeze(0)                    # [1, T]
        if x.shape[1] < 2:
            break
        pred = model(input_ids=x).logits[0, :-1].argmax(-1)          # [T-1]
        hits += int((pred == x[0, 1:]).sum())
        total += x.shape[1] - 1
    return hits, total


def test_top1_accuracy_matches_a_plain_loop_and_batched_masks(smollm2):
    """SmolLM2 (a real LM, so the accuracy is far from 0 and 1): the accuracy from the perplexity passes
    equals a plain argmax loop; two masks in one batch equal their separate runs; ratio to dense."""
    from analysis.measure.evaluation import accuracy_ratio, token_ids
    ids = token_ids(smollm2.tokenizer, TEXT, max_tokens=192)           # [192]
    hits, total = _reference_top1(smollm2.model, ids, 64)
    dense = evaluate(smollm2, TEXT, max_tokens=192, window=64, stride=64)
    assert dense.n_tokens == total and 0.1 < hits / total < 0.9
    assert dense.accuracy == hits / total
    pruned = np.zeros((2, 30, 9), dtype=bool)
    pruned[0, :, :3] = True                                            # a third of every layer
    pruned[1, 5] = True                                                # all of layer 5
    both = evaluate(smollm2, TEXT, max_tokens=192, window=64, stride=64, pruned=pruned)
    for b in range(2):   # batched float32 logits may differ in the last bits: at most one argmax near a tie flips
        one = evaluate(smollm2, TEXT, max_tokens=192, window=64, stride=64, pruned=pruned[b])
        assert abs(both.top1[b] - one.accuracy) * total <= 1
    cut = evaluate(smollm2, TEXT, max_tokens=192, window=64, stride=64, pruned=pruned[0])
    assert cut.accuracy < dense.accuracy                               # a third of all heads: worse
    assert accuracy_ratio(cut, dense) == cut.accuracy / dense.accuracy


def test_no_accuracy_for_masked_lms(tiny_bert):
    ev = evaluate(tiny_bert, TEXT, max_tokens=40)
    assert ev.top1 is None and ev.accuracy is None
