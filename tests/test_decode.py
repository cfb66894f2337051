"""The one decode loop (analysis/measure/decode.py) on a float64 tiny Llama whose greedy choices are far apart.

Oracles: a hand-written greedy loop (a full forward of the whole sequence per token, no cache); every caller of the
loop gets its tokens exactly: `greedy`, `prefill` + `decode` (the long-context probes' split), the harness's
`generate_greedy` with its stop rules (an EOS id and a stop sequence end it where the hand loop's rule does, the
token that stopped it kept), and the speed report's decode timing (the same steps, fed the same tokens). The clock
reads every time after a device sync (a counting fake of the CPU entry, and of torch.cuda.synchronize for a CUDA
device: the table routes each device type to its own wait).
"""
import copy

import pytest
import torch

from analysis.arch.kvcache import kv_cache_bytes
from analysis.core import clock
from analysis.core.clock import Clock
from analysis.measure.decode import STOPPED, Stop, decode, greedy, prefill
from analysis.measure.harness import generate_greedy
from tests._tiny import tiny_model
from tests._tolerance import float32_inside_tolerance

STEPS = 12


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", dtype=torch.float64, max_position_embeddings=128)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)          # a random model's logits are otherwise nearly flat
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))     # [1, 9]
    return model, prompt


@torch.no_grad()
def _hand(model, prompt, steps):
    """Greedy by hand: the whole sequence through the model for every token, no cache. (tokens, the smallest top-1
    minus top-2 logit margin along the way, the largest |logit|)."""
    seq, new, margin, scale = prompt[0].tolist(), [], float("inf"), 0.0
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]                    # [V]
        top = logits.topk(2).values
        margin, scale = min(margin, float(top[0] - top[1])), max(scale, float(logits.abs().max()))
        new.append(int(logits.argmax()))
        seq.append(new[-1])
    return new, margin, scale


def test_every_caller_gets_the_hand_loop_tokens(tiny):
    model, prompt = tiny
    want, margin, scale = _hand(model, prompt, STEPS)
    assert margin > 2 * float32_inside_tolerance(model, scale)   # a cached step vs the full forward cannot flip it
    run = greedy(model, prompt, STEPS, kv_bytes=kv_cache_bytes)
    assert run.tokens[0].tolist() == want and run.stopped == "length" and run.logits.shape == (1, STEPS, 128)
    per_token = 2 * 2 * 2 * 8 * 8                     # K and V, L 2, Hkv 2, d 8, float64
    assert run.kv_bytes == [per_token * (9 + k) for k in range(STEPS)]      # after the prompt, then each fed token
    last, cache = prefill(model, prompt)
    branch = copy.deepcopy(cache)                     # the probes branch the cache before decoding
    assert decode(model, last, cache, STEPS, keep_logits=False).tokens[0].tolist() == want
    assert decode(model, last, branch, 3).tokens[0].tolist() == want[:3]
    timed = greedy(model, prompt, STEPS, clock=Clock(), keep_logits=False)  # what the speed report's steps feed
    assert timed.tokens[0].tolist() == want and timed.logits is None and len(timed.step_seconds) == STEPS - 1
    gen = generate_greedy(model, prompt, max_new_tokens=STEPS)
    assert gen.tokens == want and gen.stopped == "length" and gen.decode_steps == STEPS - 1


def test_stop_rules_end_where_the_hand_loop_says(tiny):
    model, prompt = tiny
    want, _, _ = _hand(model, prompt, STEPS)
    eos = want[4]
    first = want.index(eos)                           # the first time the EOS id comes (at or before index 4)
    gen = generate_greedy(model, prompt, max_new_tokens=STEPS, eos=(eos,))
    assert gen.tokens == want[:first + 1] and gen.stopped == "eos"
    seen = []

    def until(seq, _scores):                          # a stop sequence: the prompt + 3 new tokens so far
        seen.append(seq.shape[1])
        return seq.shape[1] == prompt.shape[1] + 3
    gen = generate_greedy(model, prompt, max_new_tokens=STEPS, stop=(until,))
    assert gen.tokens == want[:3] and gen.stopped == "until" and seen == [10, 11, 12]
    run = greedy(model, prompt, STEPS, stop=Stop(eos=(eos,)))
    assert run.tokens[0].tolist() == want[:first + 1] and run.stopped in STOPPED
    with pytest.raises(ValueError, match="one row"):
        greedy(model, prompt.repeat(2, 1), 2, stop=Stop(eos=(eos,)))


def test_the_clock_syncs_before_every_read(tiny, monkeypatch):
    model, prompt = tiny
    seen = []
    monkeypatch.setitem(clock.SYNCHRONIZE, "cpu", lambda device: seen.append("cpu"))
    run = greedy(model, prompt, 5, clock=Clock(torch.device("cpu")))
    assert len(seen) == 2 + 2 * 4                     # the prefill's two reads, then two per decode call (4 fed)
    assert run.prefill_seconds[0] > 0 and len(run.step_seconds) == 4 and all(w > 0 for w, _ in run.step_seconds)
    seen.clear()
    generate_greedy(model, prompt, max_new_tokens=3)  # the harness's generations time through the same clock
    assert len(seen) == 2 + 2 * 2
    cuda = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: cuda.append(str(device)))
    Clock("cuda:1").since(Clock("cuda:1").now())
    assert cuda == ["cuda:1", "cuda:1"] and clock.device_type(torch.device("mps")) == "mps"
