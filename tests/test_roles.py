"""Head roles from attention patterns: planted heads in a hand-built GPT-2 must be found, hand-built
attention tensors must give hand-computed statistics, and the shared model must be left as it was."""
import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from analysis.arch.adapters import adapter_for
from analysis.core.errors import CancelledError, InputError
from analysis.measure.roles import (RoleTagger, attention_probabilities, eager_attention, head_roles, pattern_stats,
                            roles_from_stats, token_frequencies)

P = 16          # positions = sequence length of the planted model
HEADS = 4       # 0 previous-token, 1 first-token, 2 offset +2, 3 uniform (broad)


def planted_gpt2(c: float = 3.0) -> GPT2LMHeadModel:
    """1-layer GPT-2 whose heads are built to attend by position.

    Token embeddings are zero and position p embeds as the one-hot e_p, so after ln_1 (weight 1,
    bias 0) the residual is u_p = (e_p - 1/D) / std. Head weights (through the adapter):
    head 0: q_i = c e_i, k_j = c e_{j+1}  -> query i scores key i-1 highest (previous token);
    head 1: q = c e_0 from the bias, k_j = c u_j[0] e_0 -> every query scores key 0 (first token);
    head 2: like head 0 with k_j = c e_{j+2}  -> key i-2 (fixed offset 2);
    head 3: q = k = 0 -> uniform over the causal context (broad)."""
    cfg = GPT2Config(vocab_size=64, n_positions=P, n_embd=HEADS * P, n_layer=1, n_head=HEADS)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    adapter = adapter_for(model)
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.wpe.weight[:, :P] = torch.eye(P)
        model.transformer.h[0].ln_1.weight.fill_(1.0)
        model.transformer.h[0].ln_1.bias.zero_()
    hw = adapter.read_heads(model, 0)                                   # q, k: [H, d=P, D]
    for t in (hw.q, hw.k, hw.q_bias, hw.k_bias):
        t.zero_()

    def shift(k):                                                       # e_j -> e_{j+k}
        s = torch.zeros(P, P)
        s[torch.arange(k, P), torch.arange(P - k)] = 1.0
        return s

    hw.q[0, :, :P] = c * torch.eye(P)
    hw.k[0, :, :P] = c * shift(1)
    hw.q_bias[1, 0] = c
    hw.k[1, 0, 0] = c
    hw.q[2, :, :P] = c * torch.eye(P)
    hw.k[2, :, :P] = c * shift(2)
    adapter.write_heads(model, 0, hw)
    return model


def test_planted_heads_are_found():
    model = planted_gpt2()
    x = torch.randint(0, 64, (3, P), generator=torch.Generator().manual_seed(0))
    roles = RoleTagger().tag(model, x)
    role, strength = roles.primary()
    assert role[0].tolist() == ["previous-token", "first-token", "positional", "broad"]
    assert strength[0, 0] > 0.95 and strength[0, 1] > 0.95 and strength[0, 3] > 0.95
    assert roles.best_offset[0, 2] == 2 and roles.strengths["positional"][0, 2] > 0.95
    # heads are not tagged with roles they do not have
    assert roles.strengths["first-token"][0, 0] < 0.2 and roles.strengths["previous-token"][0, 1] < 0.2
    tagged = {(t.head, t.role) for t in roles.tags()}
    assert (0, "first-token") not in tagged and (1, "previous-token") not in tagged
    assert (3, "previous-token") not in tagged and (3, "first-token") not in tagged


def test_a_weaker_plant_gives_a_weaker_strength():
    x = torch.randint(0, 64, (2, P), generator=torch.Generator().manual_seed(1))
    strong = RoleTagger().tag(planted_gpt2(3.0), x).strengths["previous-token"][0, 0]
    weak = RoleTagger().tag(planted_gpt2(0.25), x).strengths["previous-token"][0, 0]
    assert weak < strong - 0.3


def _hand_attention():
    """n=1, L=1, H=3, T=5 causal patterns: previous-token, first-token, uniform."""
    T = 5
    a = torch.zeros(1, 1, 3, T, T)
    for i in range(T):
        a[0, 0, 0, i, max(i - 1, 0)] = 1.0
        a[0, 0, 1, i, 0] = 1.0
        a[0, 0, 2, i, : i + 1] = 1.0 / (i + 1)
    return a


def test_pattern_stats_hand_computed():
    s = pattern_stats(_hand_attention())
    assert s.causal
    np.testing.assert_allclose(s.previous[0], [1.0, 0.25, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4])
    np.testing.assert_allclose(s.first[0], [0.25, 1.0, (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4])
    np.testing.assert_allclose(s.entropy[0], [0.0, 0.0, 1.0], atol=1e-12)
    # locality of the previous-token head: 1 - 1 / mean(0..i) for queries 1..4 -> 1 - 1/(i/2)
    np.testing.assert_allclose(s.locality[0, 0], np.mean([1 - 1 / (i / 2) for i in range(1, 5)]))
    np.testing.assert_allclose(s.locality[0, 2], 0.0, atol=1e-6)  # float32 1/3 etc.
    assert list(s.offsets) == [0, 1, 2, 3, 4]
    # offset masses, mean over the diagonal A[i, i-k]: offset 1 of the previous-token head = 1
    assert s.offset_mass[0, 0, 1] == pytest.approx(1.0)


def test_rare_word_strength_hand_computed():
    T = 6
    ids = torch.tensor([[0, 5, 7, 5, 9, 5]])                            # token 7 is rare, 9 rarer
    freq = np.zeros(16)
    freq[[0, 5, 7, 9]] = [1000, 500, 20, 3]
    a = torch.zeros(1, 1, 2, T, T)
    for i in range(T):
        a[0, 0, 0, i, 0] = 1.0                                          # a sink head
    # head 1 attends to the rarest earlier token (excluding position 0 and itself)
    for i in range(T):
        keys = [j for j in range(1, i)]
        a[0, 0, 1, i, min(keys, key=lambda j: freq[ids[0, j]]) if keys else 0] = 1.0
    s = pattern_stats(a, ids, freq)
    # queries with >= 4 candidate keys (1..i-1 plus none) are i = 5 only: candidates 1..4
    assert s.rare[0, 1] == pytest.approx(1.0) and s.rare[0, 0] == pytest.approx(0.0)
    roles = roles_from_stats(s)
    assert ("rare-word" in {t.role for t in roles.tags() if t.head == 1})


def test_bidirectional_patterns_measure_negative_offsets():
    T = 6
    a = torch.zeros(1, 1, 1, T, T)
    for i in range(T):
        a[0, 0, 0, i, min(i + 1, T - 1)] = 1.0                          # next token (encoder)
    s = pattern_stats(a)
    assert not s.causal
    roles = roles_from_stats(s)
    assert roles.best_offset[0, 0] == -1 and roles.strengths["positional"][0, 0] > 0.8


def test_eager_switch_is_restored_and_sdpa_model_gives_probabilities():
    model = planted_gpt2()
    model.set_attn_implementation("sdpa")
    x = torch.randint(0, 64, (1, P))
    attn = attention_probabilities(model, x)
    assert attn.shape == (1, 1, HEADS, P, P)
    assert torch.allclose(attn.sum(-1), torch.ones(1, 1, HEADS, P))
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        with eager_attention(model):
            assert model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_bad_input_and_cancel():
    model = planted_gpt2()
    with pytest.raises(InputError):
        RoleTagger().tag(model, torch.tensor([[3]]))
    with pytest.raises(CancelledError):
        RoleTagger().tag(model, torch.randint(0, 64, (2, P)), should_stop=lambda: True)


def test_token_frequencies_count_tokens(minilm):
    tok = minilm.tokenizer
    freq = token_frequencies(tok, ["the cat", "the dog the"])
    the = tok("the", add_special_tokens=False)["input_ids"][0]
    cat = tok("cat", add_special_tokens=False)["input_ids"][0]
    assert freq.shape == (len(tok),) and freq[the] == 3 and freq[cat] == 1 and freq.sum() == 5


@pytest.mark.slow
def test_smollm2_has_sink_and_previous_token_heads(smollm2):
    """Real model: attention sinks on the first token and previous-token heads are ubiquitous in
    trained LMs; the tagger must find both kinds, and the shared model must be left on its
    attention implementation."""
    before = smollm2.model.config._attn_implementation
    roles = head_roles(smollm2, max_tokens=128, seq_len=64, frequencies=np.ones(len(smollm2.tokenizer)))
    assert smollm2.model.config._attn_implementation == before
    found = {t.role for t in roles.tags()}
    assert {"first-token", "previous-token"} <= found
    rows = roles.table(np.zeros((30, 9)))
    assert rows and set(rows[0]) == {"layer", "head", "role", "strength", "detail", "ablation_delta"}
