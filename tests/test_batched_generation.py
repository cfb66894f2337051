"""Batched generation (analysis/measure/decode_rows.py and the harness's generate_until over it) on tiny random
Llama / Qwen2 models whose greedy choices are far apart (their unembedding scaled up).

Oracles: each prompt alone through the one-row loop (analysis.measure.decode.greedy). Prompts of different lengths
in one left-padded batch give each row the one-row tokens and logits within `float32_inside_tolerance` (the
float32 parts of a float64 model see padded rows: another summation order; tests/_tolerance.py), on the eager
kernel (headscope's own 4-D padding mask) and on sdpa; the pad id changes nothing at all (no pad is read); a row
stopped early (its EOS, a stop rule, its budget) leaves the batch and the other rows' tokens are unchanged; the
cache's bytes shared out per row are each row's one-row bytes. Through the harness: the texts and every
generation record but the seconds are the same batched and one at a time, for the dense model, a head-mask cut
and a KV plan without windows (its compact cache batched); a windowed plan generates one row at a time, and its
compact cache refuses left-padded rows; a model with sliding layers gets its own masks; the generation batch is
capped by an estimate of a row's memory.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.arch.kvcache import CompactCache, kv_cache_bytes
from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.measure.decode import Stop, greedy
from analysis.measure.decode_rows import greedy_rows, left_padded
from tests._tiny import tiny_model
from tests._tolerance import float32_inside_tolerance

LENGTHS = (9, 3, 14, 1, 6)
STEPS = 10


def _model(family: str, implementation: str, dtype=torch.float64):
    model = tiny_model(family, dtype=dtype, max_position_embeddings=128)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)          # a random model's logits are otherwise nearly flat
    return model


def _prompts(lengths=LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 128, (n,), generator=g).tolist() for n in lengths]


def _alone(model, prompts, steps=STEPS, stops=None):
    """Each prompt through the one-row loop: its GreedyRun."""
    stops = stops or [None] * len(prompts)
    return [greedy(model, torch.tensor([p]), steps, stop=s, kv_bytes=kv_cache_bytes) for p, s in zip(prompts, stops)]


def _margin(logits: torch.Tensor) -> float:
    """The smallest top-1 minus top-2 logit gap over the steps of one row's logits [n, V]."""
    top = logits.topk(2, dim=-1).values                                             # [n, 2]
    return float((top[:, 0] - top[:, 1]).min())


def test_left_padding_puts_each_row_at_position_zero():
    ids, mask, positions = left_padded([[5, 6, 7], [8]], pad_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 1, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("one_by_one", [True, False], ids=["prefilled one by one", "one padded prefill"])
@pytest.mark.parametrize("family,implementation", [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "eager")])
def test_a_batch_of_prompts_of_different_lengths_is_each_prompt_alone(family, implementation, one_by_one):
    model = _model(family, implementation)
    prompts = _prompts()
    alone = _alone(model, prompts)
    run = greedy_rows(model, prompts, STEPS, kv_bytes=kv_cache_bytes, prefill_one_by_one=one_by_one)
    for i, one in enumerate(alone):
        if one_by_one:                                   # the first token's logits are the row's own prefill
            assert torch.equal(run.logits[i][0], one.logits[0, 0])
        tol = float32_inside_tolerance(model, float(one.logits.abs().max()))
        assert _margin(one.logits[0]) > 2 * tol          # a rounding difference inside tol cannot flip a choice
        assert run.tokens[i] == one.tokens[0].tolist() and run.stopped[i] == "length"
        assert (run.logits[i] - one.logits[0]).abs().max() <= tol
        assert run.kv_bytes[i] == (one.kv_bytes[0], one.kv_bytes[-1])       # its share is its one-row bytes
    assert all(len(rows) == len(prompts) for rows in run.step_rows)          # nobody stopped: all fed every step


def test_a_model_with_sliding_layers_gets_its_own_masks():
    """Mistral reading a 5-token sliding window (shorter than most prompts): the 2-D mask, transformers' own
    sliding masks built from it, one padded prefill (its cache keeps a window only)."""
    model = tiny_model("mistral", dtype=torch.float64, max_position_embeddings=128, sliding_window=5)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    prompts = _prompts()
    run = greedy_rows(model, prompts, STEPS)
    assert run.row_prefill is None
    for i, one in enumerate(_alone(model, prompts)):
        tol = float32_inside_tolerance(model, float(one.logits.abs().max()))
        assert run.tokens[i] == one.tokens[0].tolist()
        assert (run.logits[i] - one.logits[0]).abs().max() <= tol


def test_float32_rows_stay_within_the_float32_bound():
    model = _model("llama", "eager", dtype=torch.float32)
    prompts = _prompts()
    run = greedy_rows(model, prompts, 1, prefill_one_by_one=False)   # the first token: one padded prefill
    for i, p in enumerate(prompts):
        one = greedy(model, torch.tensor([p]), 1)
        assert (run.logits[i] - one.logits[0]).abs().max() <= float32_inside_tolerance(model, float(
            one.logits.abs().max()))


def test_the_pad_id_changes_nothing():
    """No real query reads a pad: another pad token gives the same logits, bit for bit."""
    model = _model("llama", "eager")
    prompts = _prompts()
    a = greedy_rows(model, prompts, 4, pad_id=0, prefill_one_by_one=False)
    b = greedy_rows(model, prompts, 4, pad_id=77, prefill_one_by_one=False)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_a_row_that_stops_early_leaves_the_others_unchanged():
    model = _model("llama", "eager")
    prompts = _prompts()
    free = _alone(model, prompts)
    first = free[0].tokens[0].tolist()
    second = free[2].tokens[0].tolist()
    eos = first[3]                                       # row 0 stops on its 4th token (an EOS id of its own)
    assert eos not in first[:3]
    pair = second[4:6]                                   # row 2 stops when its sequence ends with two tokens
    assert all(second[k:k + 2] != pair for k in range(4))

    def ends_with_pair(seq, _):
        return seq[0, -2:].tolist() == pair
    stops = [Stop(eos=(eos,)), None, Stop(until=(ends_with_pair,)), None, None]
    budgets = [STEPS, STEPS, STEPS, 2, STEPS]           # row 3: a budget of its own
    run = greedy_rows(model, prompts, budgets, stops=stops)
    assert run.tokens[0] == first[:4] and run.stopped[0] == "eos"
    assert run.tokens[2] == second[:6] and run.stopped[2] == "until"
    assert run.tokens[3] == free[3].tokens[0].tolist()[:2] and run.stopped[3] == "length"
    for i in (1, 4):
        assert run.tokens[i] == free[i].tokens[0].tolist() and run.stopped[i] == "length"
    assert [0 in rows for rows in run.step_rows] == [True] * 3 + [False] * (STEPS - 4)   # fed 3 times, then gone
    assert [3 in rows for rows in run.step_rows] == [True] + [False] * (STEPS - 2)
    alone = _alone(model, prompts, stops=stops)          # the stop rules give the one-row loop the same ends
    assert run.tokens[0] == alone[0].tokens[0].tolist() and run.tokens[2] == alone[2].tokens[0].tolist()


@pytest.mark.parametrize("one_by_one", [True, False])
def test_the_seconds_of_a_batch_are_shared_out_per_row(one_by_one):
    from analysis.core.clock import Clock
    model = _model("llama", "eager")
    run = greedy_rows(model, _prompts(), [STEPS, 2, STEPS, STEPS, STEPS], clock=Clock(torch.device("cpu")),
                      prefill_one_by_one=one_by_one)
    shares = [run.seconds(i) for i in range(len(LENGTHS))]
    assert (run.row_prefill is not None) == one_by_one
    if one_by_one:                                       # each row's own; the stacking is the rest
        assert sum(p for p, _ in shares) <= run.prefill_seconds[0]
    else:
        assert sum(p for p, _ in shares) == pytest.approx(run.prefill_seconds[0])
    assert sum(d for _, d in shares) == pytest.approx(sum(w for w, _ in run.step_seconds))
    assert len(run.step_seconds) == STEPS - 1


def _plan(modes, window=Window(2, 6)):
    from analysis.arch.kvplan import KVPlan
    return KVPlan(np.asarray(modes, np.int8), window, 4)


def test_a_compact_cache_with_windows_refuses_left_padded_rows_but_not_rows_of_one_length():
    from analysis.arch.cut import Cut
    model = _model("llama", "eager")
    cut = Cut.of_plan(_plan([[0, 1], [1, 0]]))
    with cut.running(model) as running:
        with pytest.raises(InputError, match="one prompt at a time"):
            greedy_rows(running, _prompts(), 3, cache=cut.new_cache())
        same = _prompts((7, 7))
        run = greedy_rows(running, same, 3, cache=cut.new_cache())
        assert run.tokens == [greedy(running, torch.tensor([p]), 3, cache=cut.new_cache()).tokens[0].tolist()
                              for p in same]


def test_a_compact_cache_without_windows_batches_as_each_row_alone():
    """A KV plan that only prunes: its compact cache holds every token of the full heads, left padded rows
    included; finished rows leave it (CompactLayer.batch_select_indices)."""
    from analysis.arch.cut import Cut
    model = _model("llama", "eager")
    cut = Cut.of_plan(_plan([[0, 2], [2, 0]]))
    prompts = _prompts()
    with cut.running(model) as running:
        cache = cut.new_cache()
        assert isinstance(cache, CompactCache)
        run = greedy_rows(running, prompts, [STEPS, 3, STEPS, 5, STEPS], cache=cache, kv_bytes=kv_cache_bytes)
        for i, p in enumerate(prompts):
            one = greedy(running, torch.tensor([p]), STEPS, cache=cut.new_cache(), kv_bytes=kv_cache_bytes)
            n = len(run.tokens[i])
            assert run.tokens[i] == one.tokens[0].tolist()[:n]
            assert run.kv_bytes[i] == (one.kv_bytes[0], one.kv_bytes[n - 1])


# -- through the harness -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from tests._apptools import trivial_tokenizer
    tok = trivial_tokenizer()
    model = tiny_model("llama", dtype=torch.float64, max_position_embeddings=128, vocab_size=len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model, tok


def _run(model, tok, prepared, batch, cut=None):
    from analysis.measure import harness as H
    run = H.run_harness(model, tok, prepared, keep_samples=True, generation_batch=batch, cut=cut)
    texts = [s["generation"] for s in sorted(run.samples["tiny_gen"], key=lambda s: s["doc_id"])]
    records = [{k: v for k, v in r.items() if k not in ("prefill_s", "decode_s", "tokens_per_s", "batch")}
               for r in run.generations["tiny_gen"]]
    return run, texts, records


def _cuts():
    from analysis.arch.cut import Cut
    mask = np.zeros((2, 4), bool)
    mask[0, 1] = mask[1, 3] = True
    return {"dense": None, "mask": Cut.of_mask(mask), "plan without windows": Cut.of_plan(_plan([[0, 2], [2, 0]]))}


@pytest.mark.parametrize("which", ["dense", "mask", "plan without windows"])
def test_the_harness_generates_the_same_texts_batched_and_one_at_a_time(tiny, which):
    from tests.test_harness_generate import QUESTIONS, _prepared, _stop_rules
    model, tok = tiny
    cut = _cuts()[which]
    _, free, _ = _run(model, tok, _prepared([]), 1, cut)
    until, eos_char = _stop_rules(free)                  # a stop string and an EOS id, each ending some rows
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(eos_char)
    try:
        prepared = _prepared(until)
        one, texts, records = _run(model, tok, prepared, 1, cut)
        for batch in (4, 8):                             # two batches of 4 and 2; one of all 6
            run, got, got_records = _run(model, tok, prepared, batch, cut)
            assert got == texts and got_records == records
            assert run.generation_batch == batch and {r["batch"] for r in run.generations["tiny_gen"]} == (
                {4, 2} if batch == 4 else {len(QUESTIONS)})
    finally:
        model.generation_config.eos_token_id = original
    assert {"until", "eos"} <= {r["stopped"] for r in records}      # both rules ended rows, in one batch or not
    assert one.generation_batch == 1


def test_a_windowed_plan_generates_one_row_at_a_time(tiny):
    from analysis.arch.cut import Cut
    from tests.test_harness_generate import _prepared
    model, tok = tiny
    run, _, _ = _run(model, tok, _prepared([]), 8, Cut.of_plan(_plan([[0, 1], [1, 0]])))
    assert run.generation_batch == 1 and {r["batch"] for r in run.generations["tiny_gen"]} == {1}


def test_the_generation_batch_is_capped_by_memory(monkeypatch):
    """rows_that_fit: the requested rows, fewer where row_bytes of them would pass MEMORY_SHARE of the free
    memory, never fewer than one; row_bytes is the KV cache (2 x L x Hkv x d a token) and the prefill's widths."""
    from analysis.measure.harness import lm
    model = _model("llama", "sdpa")
    tokens = 100
    one = lm.row_bytes(model, tokens)
    assert one == tokens * (2 * 2 * 2 * 8 + lm.TRANSIENT_WIDTHS * 32) * 8          # L 2, Hkv 2, d 8, D 32, float64
    monkeypatch.setattr(lm, "_free_bytes", lambda device: int(3.5 * one / lm.MEMORY_SHARE))
    assert lm.rows_that_fit(model, 8, tokens) == 3 and lm.rows_that_fit(model, 2, tokens) == 2
    monkeypatch.setattr(lm, "_free_bytes", lambda device: 0)
    assert lm.rows_that_fit(model, 8, tokens) == 1
