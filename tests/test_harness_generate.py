"""Generative tasks through the harness bridge (analysis.measure.harness: HeadscopeLM.generate_until and
generate_greedy) on a float64 tiny Llama with a one-token-per-character tokenizer.

Oracles: the generated texts equal a hand-rolled greedy loop (a full forward of the whole sequence per token,
no cache) with the same stop rule (the model's EOS id, the task's stop strings and the tokenizer's EOS text,
max_gen_toks), and equal the harness's own HFLM.generate_until (transformers' generate); every stop reason
occurs; the KV bytes recorded per row are the cache's K / V tensors, counted from the geometry; Stop ends a
generation.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from analysis.core.errors import CancelledError
from analysis.measure import harness as H
from tests._apptools import trivial_tokenizer
from tests._tiny import tiny_model

QUESTIONS = ["what is 3 plus 4?", "hello there, who are you?", "name a colour:", "count to five:", "say yes or no:",
             "spell cat backwards:"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny():
    """A float64 tiny Llama over the trivial tokenizer's 97 ids, its unembedding scaled so greedy decoding
    wanders (a random model's logits are otherwise nearly flat)."""
    tok = trivial_tokenizer()
    model = tiny_model("llama", dtype=torch.float64, max_position_embeddings=128, vocab_size=len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model, tok


def _prepared(until, max_gen: int = MAX_NEW):
    import datasets
    data = datasets.Dataset.from_list([dict(q=q, a="x") for q in QUESTIONS])
    cfg = dict(task="tiny_gen", dataset_path="", output_type="generate_until", test_split="test",
               custom_dataset=lambda **_: {"test": data}, doc_to_text="Q: {{q}}\nA:", doc_to_target="{{a}}",
               generation_kwargs=dict(until=list(until), max_gen_toks=max_gen, do_sample=False),
               metric_list=[dict(metric="exact_match", aggregation="mean", higher_is_better=True)])
    return H.prepare_configs({"tiny_gen": cfg}, {"tiny_gen": H.TaskSource("tiny_gen", "(in memory)", "(in memory)")})


@torch.no_grad()
def _hand_rolled(model, tok, context: str, until: list[str], max_new: int) -> str:
    """Greedy decoding by hand: the whole sequence through the model for every token (no cache), stopping on
    the model's EOS id, on a stop string in the text so far, or after max_new tokens; the text cut at the first
    stop string (the harness's post-processing)."""
    eos = model.generation_config.eos_token_id
    seq, new = list(tok(context).input_ids), []
    stops = until + [tok.eos_token]
    for _ in range(max_new):
        token = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(token)
        new.append(token)
        if token == eos or any(s in tok.decode(new) for s in stops):
            break
    text = tok.decode(new, skip_special_tokens=True)
    for s in stops:
        text = text.split(s)[0]
    return text


def _harness_own(model, tok, prepared) -> list[str]:
    """HFLM.generate_until as the harness runs it (transformers' generate, batch of one)."""
    from lm_eval.models.huggingface import HFLM
    model.tie_weights = lambda *args, **kwargs: None
    try:
        lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(tok), backend="causal", batch_size=1)
    finally:
        del model.tie_weights
    task = prepared.tasks["tiny_gen"]
    task.build_all_requests(limit=None, rank=0, world_size=1)
    return lm.generate_until(task.instances, disable_tqdm=True)


def _stop_rules(texts: list[str]) -> tuple[list[str], str]:
    """A stop string inside one free generation (chars 4-5 of text a) and an EOS character inside another (text
    b, after its third char), each absent from where the other rule must act: both rules fire, on different rows."""
    for a in texts:
        for b in texts:
            if a is b or len(a) < 8 or len(b) < 6:
                continue
            stop = a[4:6]
            for c in b[3:6]:
                if c not in a[:6] and stop not in b[:b.index(c) + 2]:
                    return [stop], c
    raise AssertionError(f"the tiny model's free generations give no pair of stop rules: {texts}")


def test_generation_is_greedy_decoding_with_the_harness_stop_rules(tiny):
    model, tok = tiny
    free = H.run_harness(model, tok, _prepared([]), keep_samples=True)             # EOS and length only
    texts = [s["generation"] for s in free.samples["tiny_gen"]]
    until, eos_char = _stop_rules(texts)
    original_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(eos_char)
    try:
        prepared = _prepared(until)
        run = H.run_harness(model, tok, prepared, keep_samples=True)
        got = [s["generation"] for s in sorted(run.samples["tiny_gen"], key=lambda s: s["doc_id"])]
        contexts = [f"Q: {q}\nA:" for q in QUESTIONS]
        assert got == [_hand_rolled(model, tok, c, until, MAX_NEW) for c in contexts]
        assert got == _harness_own(model, tok, prepared)
        stopped = {g["stopped"] for g in run.generations["tiny_gen"]}
    finally:
        model.generation_config.eos_token_id = original_eos
    assert stopped == {"until", "eos", "length"}, stopped


def test_each_row_records_its_kv_bytes_and_speed(tiny):
    model, tok = tiny
    run = H.run_harness(model, tok, _prepared([]))
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8
    rows = run.generations["tiny_gen"]
    assert [r["doc_id"] for r in rows] == list(range(len(QUESTIONS)))
    for r, q in zip(rows, QUESTIONS):
        assert r["prompt_tokens"] == len(f"Q: {q}\nA:") and not r["truncated"]
        assert r["kv_bytes_prompt"] == per_token * r["prompt_tokens"]
        assert r["kv_bytes_end"] == per_token * (r["prompt_tokens"] + r["new_tokens"] - 1)   # the last token is not fed
        assert (r["tokens_per_s"] is None) == (r["new_tokens"] == 1)
        assert r["tokens_per_s"] is None or r["tokens_per_s"] > 0


def test_stop_ends_a_generation(tiny):
    model, tok = tiny
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 5
    with pytest.raises(CancelledError):
        H.run_harness(model, tok, _prepared([]), should_stop=should_stop)
    assert not any(m._forward_pre_hooks for m in model.modules())                # the layer checks are gone


def test_a_cut_gives_each_prompt_a_cache_of_its_own(tiny):
    """What a Cut's generation reads (analysis.arch.cut.Cut's interface): the module from `running`, and for each
    prompt a fresh `new_cache()` passed as past_key_values: the KV bytes recorded are that cache's."""
    from transformers import DynamicCache

    from analysis.arch.kvcache import kv_cache_bytes
    model, tok = tiny
    made = []

    class Recording:
        windowed = False                  # rows may be left padded (analysis.measure.harness.generation_batch_for)

        @contextlib.contextmanager
        def running(self, dense, *, adapter=None):
            yield dense

        def new_cache(self):
            made.append(DynamicCache())
            return made[-1]
    run = H.run_harness(model, tok, _prepared([]), cut=Recording(), generation_batch=1)
    rows = run.generations["tiny_gen"]
    assert len(made) == len(rows) == len(QUESTIONS) and len({id(c) for c in made}) == len(made)
    assert sorted(kv_cache_bytes(c) for c in made) == sorted(r["kv_bytes_end"] for r in rows)
