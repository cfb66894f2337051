"""Long-context heads (analysis/measure/longheads.py): retrieval and streaming scores, on planted circuits.

Planted models are tiny Llamas whose attention weights are written by hand, so what each head does is
known before anything is measured:
- every token's embedding is e_const + e_(1 + id): all tokens have the same norm, so after the input
  RMSNorm a token is exactly c * (e_const + e_(1 + id));
- rope_theta = 1e32: the first rotary pair turns by 1 radian per position, every other pair by <= 1e-8
  (no rotation at these lengths), so q.k on those dims reads token identity only, and on the first pair
  cos(i - j), largest at i = j.

Retrieval: a head whose Q/K map each answer step's current token to the next needle token copies at
every step (score 1 exactly: hits are counts); a head on the first rotary pair attends to itself and
copies nothing (0). Streaming: eight heads attend to one far token with graded strength; the cheap score
and the end-to-end oracle (windowing each head alone) must both put the strongest first and rank them
alike (Spearman above the 1 % critical value of the exact null distribution over 8! rankings).
Exactness: the rows the score computes from the tapped q/k/v equal the model's own attention output,
full and windowed (float64).
"""
import itertools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from analysis.arch.hooks import attached
from analysis.arch.spans import attention_layers, tapped, windowed
from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.measure.attribution import rank_correlation
from analysis.measure.longheads import (NeedleItem, RetrievalDetector, StreamingDetector, attention_rows,
                                        needle_items, query_rows, retrieval_scores, streaming_scores, streaming_text,
                                        windowing_effect)
from tests._tiny import tiny_model

ROPE = {"rope_type": "default", "rope_theta": 1e32}


def _planted(vocab, hidden, heads, kv_heads, head_dim, layers=1, positions=256):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=positions, rope_parameters=ROPE, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double().eval()
    with torch.no_grad():
        e = torch.zeros(vocab, hidden, dtype=torch.float64)
        e[:, 0] = 1.0
        e[torch.arange(vocab), 1 + torch.arange(vocab)] = 1.0
        m.model.embed_tokens.weight.copy_(e)
        for layer in m.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.mlp.down_proj.weight.zero_()
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.zero_()
    return m


# -- retrieval ----------------------------------------------------------------------------------------

COPY, LOCAL = 0, 2                                      # query heads 0 (KV head 0) and 2 (KV head 1)
NEEDLE = [100, 101, 110, 111, 112, 113, 114, 102]      # lead, five content tokens, end
QUESTION = [103, 104]


def _needle_item(depth_at: int, T: int = 96, seed: int = 0) -> NeedleItem:
    g = torch.Generator().manual_seed(seed)
    answer = NEEDLE[2:7]
    n_text = T - len(NEEDLE) - len(QUESTION) - len(answer)
    text = torch.randint(4, 100, (n_text,), generator=g)                   # never a needle id
    ids = torch.cat([text[:depth_at], torch.tensor(NEEDLE), text[depth_at:], torch.tensor(QUESTION + answer)])
    return NeedleItem(ids, depth_at, depth_at + len(NEEDLE), T - len(answer), T, depth_at / n_text, "planted")


def _retrieval_model():
    """Head COPY: at the row holding prev_t it attends to the key holding next_t (the needle's next token);
    head LOCAL: cos(i - j) on the first rotary pair, so its top-1 is its own row."""
    m = _planted(vocab=128, hidden=160, heads=4, kv_heads=2, head_dim=16)
    attn = m.model.layers[0].self_attn
    d = 16
    prev = [QUESTION[-1]] + NEEDLE[2:6]                 # the token at each answer row
    nxt = NEEDLE[2:7]                                   # the token that row must copy
    with torch.no_grad():
        for t, (a, b) in enumerate(zip(prev, nxt)):
            attn.q_proj.weight[COPY * d + 1 + t, 1 + a] = 3.0      # dims 1..5: unrotated pairs
            attn.k_proj.weight[0 * d + 1 + t, 1 + b] = 3.0
        attn.q_proj.weight[LOCAL * d + 0, 0] = 3.0                 # first rotary pair, from e_const
        attn.k_proj.weight[1 * d + 0, 0] = 3.0
    return m


def test_a_planted_copy_head_scores_one_and_a_local_head_zero():
    m = _retrieval_model()
    items = [_needle_item(at, seed=s) for s, at in enumerate((5, 40, 70))]
    scores, accuracy = retrieval_scores(m, items)
    assert scores.shape == (1, 4) and accuracy.shape == (3,)
    assert scores[0, COPY] == 1.0 and scores[0, LOCAL] == 0.0
    tops = {}

    def tap(layer, q, k, v):
        tops["local"] = (q[0, LOCAL] @ k[0, 1].T).masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1),
                                                              -np.inf).argmax(-1)
    with torch.no_grad(), tapped(m, tap):
        m(items[0].ids[None])
    assert torch.equal(tops["local"], torch.arange(96))                   # it really attends to itself
    gates = torch.ones(1, 4)
    gates[0, COPY] = 0.0
    masked, _ = retrieval_scores(m, items, gates=gates)
    assert masked[0, COPY] == 0.0                                          # a pruned head copies nothing


def test_needle_items_are_exact_length_and_end_with_the_needle_content():
    from tests._apptools import trivial_tokenizer
    tok = trivial_tokenizer()
    items = needle_items(tok, (200, 300), (0.0, 0.5, 1.0), needles=2, seed=3)
    assert len(items) == 2 * 2 * 3
    for it in items:
        assert it.ids.numel() == it.length
        needle = it.ids[it.needle_start:it.needle_end].tolist()
        answer = it.targets.tolist()
        assert any(needle[i:i + len(answer)] == answer for i in range(len(needle)))   # copied from the needle
    assert items[0].kind == "words" and items[3].kind == "number"
    again = needle_items(tok, (200, 300), (0.0, 0.5, 1.0), needles=2, seed=3)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(items, again))   # seeded
    with pytest.raises(InputError, match="too short"):
        needle_items(tok, (60,), needles=1)


def test_the_detector_respects_the_models_context_and_reads_its_defaults():
    m = tiny_model("llama")                                                # max_position_embeddings 64
    from tests._apptools import trivial_tokenizer
    det = RetrievalDetector(tokenizer=trivial_tokenizer(), depths=(0.5,), needles=1)
    assert det.resolved_lengths(m) == (64,) and det.passes(m) == [64]
    with pytest.raises(InputError, match="longer than this model reads"):
        RetrievalDetector(lengths=(128,), tokenizer=trivial_tokenizer()).detect(m)
    with pytest.raises(InputError, match="tokenizer"):
        RetrievalDetector().detect(m)
    with pytest.raises(InputError, match="depth"):
        RetrievalDetector(depths=(1.5,))


# -- streaming ----------------------------------------------------------------------------------------

FAR = 5                                                 # the far token, at position 1 only
BAND = Window(1, 4)


def _streaming_model():
    """Eight MHA heads; head h scores key FAR at h (others 0), so its attention on the far token is
    e^h / (e^h + i) at row i. Values: every token gives c on dim 1, FAR also c on dim 0; W_O is the
    same block for every head, so windowing head h moves the residual along one direction, by an amount
    that grows with h."""
    H, d, hidden = 8, 8, 64
    m = _planted(vocab=32, hidden=hidden, heads=H, kv_heads=H, head_dim=d)
    attn = m.model.layers[0].self_attn
    c2 = hidden / 2.0                                   # (RMSNorm's scale)^2: tokens have two unit entries
    block = torch.randn(hidden, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.3
    with torch.no_grad():
        for h in range(H):
            attn.q_proj.weight[h * d + 1, 0] = 1.0
            attn.k_proj.weight[h * d + 1, 1 + FAR] = h / (c2 * d ** -0.5)     # score h on the far token
            attn.v_proj.weight[h * d + 0, 1 + FAR] = 1.0
            attn.v_proj.weight[h * d + 1, 0] = 1.0
            attn.o_proj.weight[:, h * d:(h + 1) * d] = block
    return m


def _streaming_ids(T=40, n=2):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(6, 32, (n, T), generator=g)
    ids[:, 0] = 4
    ids[:, 1] = FAR
    return ids


def _spearman_null_quantile(n: int, q: float) -> float:
    """The q-quantile of Spearman's rho between a fixed ranking and a uniformly random one of n items
    (exact: every one of the n! rankings)."""
    base = np.arange(n)
    rhos = np.array([1 - 6 * ((base - np.array(p)) ** 2).sum() / (n * (n * n - 1))
                     for p in itertools.permutations(range(n))])
    return float(np.quantile(rhos, q))


def test_the_streaming_score_ranks_heads_like_windowing_them_end_to_end():
    m = _streaming_model()
    ids = _streaming_ids()
    kv, head = streaming_scores(m, list(ids), window=BAND, queries=64)
    assert kv.shape == (1, 8) and np.allclose(kv, head)                    # MHA: a KV head is a head
    effect = windowing_effect(m, ids, window=BAND)
    assert effect.kl.shape == (1, 8) and (effect.kl >= 0).all()
    assert int(kv.argmax()) == 7 and int(effect.kl.argmax()) == 7         # the planted far reader first
    assert np.all(np.diff(kv[0]) > 0)                                      # graded as planted
    bound = _spearman_null_quantile(8, 0.99)                               # 1 % of random rankings beat it
    rho = rank_correlation(kv, effect.kl)
    assert rho > bound, (rho, bound, kv, effect.kl)
    rho_loss = rank_correlation(kv, np.abs(effect.loss_delta))
    assert np.isfinite(rho_loss)                                           # reported, not bounded: random labels


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_rows_from_the_tap_are_the_models_own_attention_output(family):
    """float64: the full rows == the model's o_proj input; the windowed rows == it under `windowed` with
    that layer's KV heads windowed (the same band, one definition)."""
    m = tiny_model(family, dtype=torch.float64)
    m.set_attn_implementation("sdpa")
    x = torch.randint(4, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    rows = query_rows(30, Window(2, 5), 12)
    modules = attention_layers(m)
    ours, seen = {}, {}

    def tap(layer, q, k, v):
        ours[layer] = attention_rows(modules[layer], q, k, v, rows, Window(2, 5))

    def grab(store):
        return lambda l: (lambda mod, args: store.__setitem__(l, args[0][0].clone()))

    full_out, win_out = {}, {}
    with torch.no_grad():
        with attached() as hooks:
            for l, a in enumerate(modules):
                hooks.before(a.o_proj, grab(full_out)(l))
            with tapped(m, tap):
                m(x)
        for l, a in enumerate(modules):                 # layer l alone windowed: its input is the dense one
            plan = np.zeros((2, 2), dtype=bool)
            plan[l] = True
            with attached() as hooks, windowed(m, plan, Window(2, 5)):
                hooks.before(a.o_proj, grab(win_out)(l))
                m(x)
    H, d = 4, modules[0].head_dim
    for l in range(2):
        o_full, o_win = ours[l]                                            # [H, n, d]
        want_full = full_out[l][rows].reshape(len(rows), H, d).transpose(0, 1)
        want_win = win_out[l][rows].reshape(len(rows), H, d).transpose(0, 1)
        assert (o_full - want_full).abs().max().item() <= 1e-12
        assert (o_win - want_win).abs().max().item() <= 1e-12


def test_streaming_refusals_and_masks():
    m = tiny_model("llama")
    from tests._apptools import trivial_tokenizer
    with pytest.raises(InputError, match="fits inside the window"):
        streaming_scores(m, [torch.arange(4, 40)], window=Window(4, 40))
    with pytest.raises(InputError, match="reads nothing"):
        StreamingDetector(window=(4, 0))
    with pytest.raises(InputError, match="reads nothing"):
        StreamingDetector.for_options(trivial_tokenizer(), {"recent": 0})     # the registry's builder
    with pytest.raises(InputError, match="longer than this model reads"):
        StreamingDetector(lengths=(65,), tokenizer=trivial_tokenizer()).detect(m)
    det = StreamingDetector(window=Window(2, 8), tokenizer=trivial_tokenizer())
    res = det.detect(m)
    assert res.scores.shape == (2, 4) and res.extras["kv_scores"].shape == (2, 2)
    assert np.array_equal(res.scores, np.repeat(res.extras["kv_scores"], 2, axis=1))
    gates = torch.ones(2, 4)
    gates[1, 2:] = 0.0                                                     # KV head 1 of layer 1 emptied
    masked = det.detect(m, gates=gates)
    assert masked.extras["kv_scores"][1, 1] == 0.0 and (masked.scores[1, 2:] == 0).all()


@pytest.mark.slow
def test_smollm2_has_retrieval_heads(smollm2):
    """Wu et al. 2024 find retrieval heads in every model they test, and a model that finds the needle must
    copy it from somewhere: at 384 tokens SmolLM2 writes most of the needle right, and some head copies at
    least 10 % of it."""
    det = RetrievalDetector((384,), (0.5,), needles=2, tokenizer=smollm2.tokenizer).detect(smollm2.model)
    assert det.scores.shape == (30, 9) and det.extras["kv_scores"].shape == (30, 3)
    assert det.extras["answer_accuracy"] > 0.5
    assert det.scores.max() >= det.threshold and det.tagged()


def test_a_stop_lands_inside_a_pass_and_leaves_the_model_as_it_was():
    from analysis.arch.attention import current_implementation
    from analysis.core.errors import CancelledError
    m = _streaming_model()
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 1                                              # after the first layer's tap
    with pytest.raises(CancelledError):
        streaming_scores(m, list(_streaming_ids()), window=BAND, should_stop=should_stop)
    assert current_implementation(m) == "sdpa"
    kv, _ = streaming_scores(m, list(_streaming_ids()), window=BAND)
    assert int(kv.argmax()) == 7


def test_every_head_score_reads_the_calibration_rows_not_a_verdicts(monkeypatch):
    """Retrieval, streaming, retrieval-aware and the KV groups' importance read the calibration split (the other
    half of the built-in text, other needles), so no verdict's rows (RULER's test rows, the probes) chose the plan
    it judges. Each is compared with the rows of both splits built by hand: equal to one, not to the other."""
    from analysis.core.text import calibration_text
    from analysis.measure import ablation
    from analysis.measure.retrieval_aware import RetrievalAwareDetector
    from analysis.measure.splits import CALIBRATION, TEST
    from analysis.score.kvscores import group_importance
    from tests._apptools import trivial_tokenizer
    tok, m = trivial_tokenizer(), tiny_model("llama", max_position_embeddings=512)
    got = RetrievalDetector((200,), (0.5,), needles=2, tokenizer=tok).items(m)
    for split, same in ((CALIBRATION, True), (TEST, False)):
        want = needle_items(tok, (200,), (0.5,), needles=2, split=split)
        assert all(torch.equal(a.ids, b.ids) for a, b in zip(got, want)) is same, split
    streamed = StreamingDetector([200], tokenizer=tok, n_sequences=1).sequences(m)
    assert torch.equal(streamed[0], streaming_text(tok, 200, split=CALIBRATION))
    assert not torch.equal(streamed[0], streaming_text(tok, 200, split=TEST))
    aware, _ = RetrievalAwareDetector((256,), (0.5, 1.0), needles=1, window=Window(2, 100), tokenizer=tok).built(m)
    calibration = needle_items(tok, (256,), (0.5, 1.0), needles=1, split=CALIBRATION)
    assert all(any(torch.equal(a.ids, c.ids) for c in calibration) for a in aware)
    seen = []
    monkeypatch.setattr(ablation, "head_ablation", lambda loaded, text, **kw: seen.append(text) or _Delta())
    group_importance(_Loaded(), 64)
    assert seen and calibration_text().startswith(seen[0])


class _Delta:
    group_delta, head_delta = np.zeros((2, 1)), np.zeros((2, 2))


class _Loaded:
    class geometry:
        group_size = 2
