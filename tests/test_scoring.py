"""Head scorers: hand-computed MP / MP-G, MP-G == MP on MHA, the a_kv * E_kv / G split on GQA,
every calibration scorer against an independent oracle on tiny models (raw Hugging Face
weights, .backward(), finite differences, IG completeness), the SmolLM2 MHA expansion, and
the scorer registry."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from analysis.core.errors import InputError, UnsupportedModelError
from analysis.arch.head_gates import head_mask
from analysis.measure.profiles import profile_model
from analysis.score.scoring import (
    SCORERS,
    AblationOracle,
    GradientHeadScorer,
    HeadGateScorer,
    HeadScores,
    HybridScorer,
    IntegratedGateScorer,
    MagnitudeScorer,
    MPGScorer,
    MPScorer,
    RandomScorer,
    SparseGPTHeadScorer,
    Subject,
    WandaHeadScorer,
    calibration_ids,
    get_scorer,
    min_max,
    mp_aggregate,
)
from tests._scoring_fixtures import HAND_MAGNITUDE, HAND_MP_Z05, HAND_MPG_Z05, hand_profile, random_profile
from tests._tiny import tiny_config, tiny_input_ids, tiny_model
from tests._tolerance import EXACT, forward_tolerance

# calibration scorers vs their hand-written reference, float32 (Llama's RMSNorm computes in float32
# whatever the model dtype, so float64 would not remove the rounding): the derived relative bound
# of a 2-layer forward whose longest dot product is the MLP's 64 (tests/_tolerance.py): 1.5e-5
F32_SCORES = forward_tolerance(torch.float32, width=64, depth=2, scale=1.0)

# ---------------------------------------------------------------------------------------------
# Weight-only scorers, by hand
# ---------------------------------------------------------------------------------------------


def test_mp_by_hand():
    s = MPScorer(z=0.5).score(hand_profile())
    np.testing.assert_array_equal(s.scores, HAND_MP_Z05)
    assert s.zero_count == 4
    assert s.name == "mp" and s.params == dict(z=0.5, scope="layer", ord=2, std="population")
    assert s.cost.forward_passes == 0 and s.cost.backward_passes == 0
    np.testing.assert_allclose(s.tiebreak, HAND_MAGNITUDE)


def test_mp_at_z_zero_by_hand():
    # z = 0: tau = mean. Layer 0: q h1 4*1, o 2 per head, k 2 -> [4, 8]; layer 1: q only.
    s = MPScorer(z=0.0).score(hand_profile())
    np.testing.assert_allclose(s.scores, [[4, 8], [1.5, 2.0], [0, 0]])


def test_mpg_by_hand():
    np.testing.assert_array_equal(MPGScorer(z=0.5).score(hand_profile()).scores, HAND_MPG_Z05)
    # a_q = 2, a_kv = 3: [2*1 + 3*1/2, 2*3 + 3*1/2]
    s = MPGScorer(z=0.5, a_q=2.0, a_kv=3.0).score(hand_profile())
    np.testing.assert_allclose(s.scores[0], [3.5, 7.5])
    assert s.params["a_q"] == 2.0 and s.params["a_kv"] == 3.0


def test_magnitude_by_hand_l2_and_l1():
    np.testing.assert_allclose(MagnitudeScorer().score(hand_profile()).scores, HAND_MAGNITUDE)
    np.testing.assert_allclose(MagnitudeScorer(ord=1).score(hand_profile(l1_scale=2.0)).scores,
                               2 * HAND_MAGNITUDE)


def test_mpg_equals_mp_exactly_on_mha():
    profile = random_profile(H=6, Hkv=6)
    for z in (0.0, 1.0, 2.0, 3.0):
        for scope in ("layer", "model"):
            mp = MPScorer(z=z, scope=scope).score(profile).scores
            mpg = MPGScorer(z=z, scope=scope).score(profile).scores
            assert np.array_equal(mp, mpg), (z, scope)
    model = tiny_model("gpt2")  # MHA
    assert np.array_equal(MPScorer().score(model).scores, MPGScorer().score(model).scores)


def test_mpg_splits_the_group_excess_on_gqa():
    profile = random_profile(L=3, H=6, Hkv=2, d=5)  # G = 3
    a_q, a_kv, z = 0.7, 1.3, 1.0
    e = profile.excess(z)
    scores = MPGScorer(z=z, a_q=a_q, a_kv=a_kv).score(profile).scores
    mp = MPScorer(z=z).score(profile).scores
    for layer in range(3):
        for h in range(6):
            g = h // 3
            own = e["q"][layer, h].sum() + e["o"][layer, h].sum()
            group = e["k"][layer, g].sum() + e["v"][layer, g].sum()
            assert scores[layer, h] == pytest.approx(a_q * own + a_kv * group / 3, rel=1e-12)
            assert mp[layer, h] == pytest.approx(own + group, rel=1e-12)


def test_mp_of_a_model_equals_mp_of_its_profile():
    model = tiny_model("llama")
    assert np.array_equal(MPGScorer().score(model).scores, MPGScorer().score(profile_model(model)).scores)


def test_random_is_a_seeded_permutation():
    a = RandomScorer(seed=3).score(hand_profile()).scores
    b = RandomScorer(seed=3).score(hand_profile()).scores
    c = RandomScorer(seed=4).score(random_profile(L=8, H=8, Hkv=8)).scores
    d = RandomScorer(seed=5).score(random_profile(L=8, H=8, Hkv=8)).scores
    assert np.array_equal(a, b)
    assert sorted(a.ravel()) == list(range(6))
    assert not np.array_equal(c, d)


def test_ablation_oracle_passes_the_sweep_through():
    increase = np.array([[0.1, -0.2], [0.0, 3.0], [1.0, 1.0]])
    s = AblationOracle(increase).score(hand_profile())
    np.testing.assert_array_equal(s.scores, increase)
    with pytest.raises(InputError):
        AblationOracle(np.ones((2, 2))).score(hand_profile())
    with pytest.raises(InputError):
        AblationOracle(np.array([[np.nan, 1.0]]))


def test_ablation_oracle_runs_the_sweep_on_calibration():
    model, ids = tiny_model("llama", dtype=torch.float64), tiny_input_ids(3, 10)   # float64: EXACT
    s = AblationOracle().score(model, calibration=ids)
    dense = _loss(model, ids)
    for layer in range(2):
        for h in range(4):
            gates = torch.ones(2, 4)
            gates[layer, h] = 0.0
            assert s.scores[layer, h] == pytest.approx(_loss(model, ids, gates) - dense, rel=0, abs=EXACT)
    assert s.params == dict(n_sequences=8, seq_len=128) and s.cost.forward_passes == 3 * 9


def test_head_scores_validation():
    with pytest.raises(InputError):
        HeadScores("x", np.ones(3))
    with pytest.raises(InputError):
        HeadScores("x", np.ones((2, 2)), tiebreak=np.ones((2, 3)))


def test_registry_and_get_scorer():
    assert set(SCORERS) == {"mp", "mp-g", "magnitude", "random", "wanda", "sparsegpt", "gradient", "gate",
                            "gate-ig", "hybrid", "ablation"}
    for name, cls in SCORERS.items():
        assert cls.name == name
    assert isinstance(get_scorer("mp-g", z=1.5), MPGScorer)
    with pytest.raises(InputError, match="choose one of"):
        get_scorer("nope")
    with pytest.raises(InputError):
        MPGScorer(z=-1)
    with pytest.raises(InputError):
        MPGScorer(a_kv=float("nan"))


# ---------------------------------------------------------------------------------------------
# Calibration scorers against independent oracles (tiny Llama, GQA: H = 4, Hkv = 2, d = 8)
# ---------------------------------------------------------------------------------------------


def _llama_views(model, layer):
    attn = model.model.layers[layer].self_attn
    return attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight


def _per_head(q_rows, k_rows, v_rows, o_cols, H=4, Hkv=2):
    """Row/column values [H*d] / [Hkv*d] -> per-head totals with the group's K/V repeated."""
    q = q_rows.reshape(H, -1).sum(1)
    o = o_cols.reshape(H, -1).sum(1)
    kv = (k_rows + v_rows).reshape(Hkv, -1).sum(1).repeat_interleave(H // Hkv)
    return (q + o + kv).numpy()


def _captured_inputs(model, ids):
    """Attention inputs (input_layernorm of each layer's input) and O's inputs, via the model's own parts."""
    outs, handles = {}, []
    for layer in range(2):
        o = model.model.layers[layer].self_attn.o_proj
        handles.append(o.register_forward_hook(lambda m, a, r, layer=layer: outs.__setitem__(layer, a[0].detach())))
    try:
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    att = {layer: model.model.layers[layer].input_layernorm(hidden[layer]).detach() for layer in range(2)}
    return ({k: v.reshape(-1, v.shape[-1]).double() for k, v in att.items()},
            {k: v.reshape(-1, v.shape[-1]).double() for k, v in outs.items()})


def test_wanda_against_raw_weights_and_captured_inputs():
    model, ids = tiny_model("llama"), tiny_input_ids(4, 12)
    s = WandaHeadScorer(batch_size=3).score(model, calibration=ids)
    att, out = _captured_inputs(model, ids)
    for layer in range(2):
        q, k, v, o = (w.detach().double().abs() for w in _llama_views(model, layer))
        xa, xo = att[layer].norm(dim=0), out[layer].norm(dim=0)  # [D], [H*d]
        expected = _per_head((q * xa).sum(1), (k * xa).sum(1), (v * xa).sum(1), (o * xo).sum(0))
        np.testing.assert_allclose(s.scores[layer], expected, rtol=F32_SCORES, atol=0)
    assert s.cost.forward_passes == 4 and s.cost.backward_passes == 0
    assert s.cost.calibration_tokens == 48


def test_sparsegpt_against_explicit_inverse():
    model, ids = tiny_model("llama"), tiny_input_ids(4, 12)
    s = SparseGPTHeadScorer(batch_size=2, damping=0.01).score(model, calibration=ids)
    att, out = _captured_inputs(model, ids)

    def hinv_diag(x):
        h = x.T @ x / x.shape[0]
        h = h + 0.01 * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
        return torch.linalg.inv(h).diagonal()

    for layer in range(2):
        q, k, v, o = (w.detach().double() ** 2 for w in _llama_views(model, layer))
        ha, ho = hinv_diag(att[layer]), hinv_diag(out[layer])
        expected = _per_head((q / ha**2).sum(1), (k / ha**2).sum(1), (v / ha**2).sum(1), (o / ho**2).sum(0))
        np.testing.assert_allclose(s.scores[layer], expected, rtol=F32_SCORES, atol=0)


def test_gradient_head_against_backward():
    model, ids = tiny_model("llama"), tiny_input_ids(4, 12)
    s = GradientHeadScorer(batch_size=3).score(model, calibration=ids)  # batches of 3 + 1
    ref = copy.deepcopy(model)
    ref.model.zero_grad()
    ref(input_ids=ids, labels=ids).loss.backward()  # mean over all 4 x 11 predicted tokens
    for layer in range(2):
        q, k, v, o = ((w.detach() * w.grad).double().abs() for w in _llama_views(ref, layer))
        np.testing.assert_allclose(s.scores[layer], _per_head(q.sum(1), k.sum(1), v.sum(1), o.sum(0)), rtol=F32_SCORES, atol=0)
    assert s.cost.backward_passes == 4
    assert all(p.grad is None for p in model.parameters())  # the scored model is left untouched


def _loss(model, ids, gates=None):
    """Mean next-token NLL in the model's dtype (HF's own loss upcasts only to float32)."""
    ctx = head_mask(model, gates) if gates is not None else torch.no_grad()
    with torch.no_grad(), ctx:
        logits = model(input_ids=ids).logits  # [B, T, V]
        return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                       ids[:, 1:].reshape(-1)))


def test_head_gate_importance_against_finite_differences():
    # GPT-2 computes fully in float64 once converted (Llama's RMSNorm would upcast to float32 only)
    model, ids = tiny_model("gpt2").double(), tiny_input_ids(3, 10)
    s = HeadGateScorer(batch_size=2).score(model, calibration=ids)
    eps = 1e-6
    expected = np.zeros((2, 4))
    for layer in range(2):
        for h in range(4):
            for b in range(3):
                up, down = torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
                up[layer, h], down[layer, h] = 1 + eps, 1 - eps
                expected[layer, h] += abs(_loss(model, ids[b:b + 1], up) - _loss(model, ids[b:b + 1], down)) / (2 * eps)
    np.testing.assert_allclose(s.scores, expected / 3, rtol=1e-5)


def test_integrated_gate_attribution_is_complete():
    model, ids = tiny_model("gpt2").double(), tiny_input_ids(2, 10)
    s = IntegratedGateScorer(batch_size=2, n_steps=48).score(model, calibration=ids)
    loss_on = _loss(model, ids)
    loss_off = _loss(model, ids, torch.zeros(2, 4, dtype=torch.float64))
    # attributions sum to L(on) - L(off); scores are minus the attributions
    assert s.scores.sum() == pytest.approx(loss_off - loss_on, rel=1e-3)
    assert s.cost.forward_passes == 2 * 48


def test_hybrid_is_the_sum_of_min_max_normalized_parts():
    model, ids = tiny_model("llama"), tiny_input_ids(4, 12)
    s = HybridScorer(z=1.0).score(model, calibration=ids)
    profile = profile_model(model)
    wanda = WandaHeadScorer().score(model, calibration=ids).scores
    expected = min_max(mp_aggregate(profile.l2)) + min_max(MPScorer(z=1.0).score(profile).scores) + min_max(wanda)
    np.testing.assert_allclose(s.scores, expected, rtol=1e-9)
    assert min_max(np.full((2, 2), 3.0)).tolist() == [[0, 0], [0, 0]]


@pytest.mark.parametrize("family", ["gpt2", "phi3", "gpt_neox"])
def test_gradient_scorers_run_on_fused_layouts(family):
    model, ids = tiny_model(family), tiny_input_ids(2, 8)
    for cls in (GradientHeadScorer, HeadGateScorer, WandaHeadScorer, SparseGPTHeadScorer):
        s = cls().score(model, calibration=ids)
        assert s.scores.shape == (2, 4) and np.isfinite(s.scores).all() and (s.scores >= 0).all(), cls.name


def test_masked_lm_gradient_uses_the_mask_token():
    model, ids = tiny_model("bert"), tiny_input_ids(2, 8)
    subject = Subject(model, *_adapter_geometry(model), "masked-lm", SimpleNamespace(mask_token_id=3))
    s = GradientHeadScorer().score(subject, calibration=ids)
    assert np.isfinite(s.scores).all() and (s.scores > 0).any()
    with pytest.raises(InputError, match="mask token"):
        GradientHeadScorer().score(model, calibration=ids)  # a bare module brings no tokenizer


def _adapter_geometry(model):
    from analysis.arch.adapters import adapter_for
    adapter = adapter_for(model)
    return adapter, adapter.geometry(model)


def test_loss_scorers_refuse_an_encoder_without_lm_head():
    torch.manual_seed(0)
    encoder = AutoModel.from_config(tiny_config("bert")).eval()
    for cls in (GradientHeadScorer, HeadGateScorer, IntegratedGateScorer):
        with pytest.raises(UnsupportedModelError, match="LM head"):
            cls().score(encoder, calibration=tiny_input_ids(2, 8))
    assert WandaHeadScorer().score(encoder, calibration=tiny_input_ids(2, 8)).scores.shape == (2, 4)


def test_calibration_input_errors():
    model = tiny_model("llama")
    with pytest.raises(InputError):
        WandaHeadScorer().score(model, calibration=torch.ones(8, dtype=torch.long))  # not [n, T]
    with pytest.raises(InputError):
        WandaHeadScorer().score(model, calibration=torch.ones(2, 4))  # floats
    with pytest.raises(InputError, match="tokenizer"):
        WandaHeadScorer().score(model)  # no calibration and no tokenizer
    with pytest.raises(InputError):
        WandaHeadScorer(n_sequences=0)
    with pytest.raises(InputError, match="model itself"):
        WandaHeadScorer().score(hand_profile())


def test_cancel_stops_a_calibration_scorer():
    from analysis.core.errors import CancelledError
    with pytest.raises(CancelledError):
        WandaHeadScorer().score(tiny_model("llama"), calibration=tiny_input_ids(2, 8), should_stop=lambda: True)


# ---------------------------------------------------------------------------------------------
# The built-in SmolLM2
# ---------------------------------------------------------------------------------------------


def test_calibration_text_too_short(smollm2):
    with pytest.raises(InputError, match="calibration text has"):
        calibration_ids(smollm2.tokenizer, n_sequences=4, seq_len=64, text="Far too short a text.")
    ids = calibration_ids(smollm2.tokenizer, n_sequences=2, seq_len=16)
    assert ids.shape == (2, 16) and ids.dtype == torch.long


def test_wanda_on_smollm2_with_builtin_calibration(smollm2):
    seen = []
    s = WandaHeadScorer(n_sequences=2, seq_len=32).score(smollm2, progress=lambda f, m: seen.append(f))
    assert s.scores.shape == (30, 9) and np.isfinite(s.scores).all() and (s.scores > 0).all()
    assert s.cost.calibration_tokens == 64 and seen[-1] == 1.0


def _expanded_to_mha(loaded):
    """SmolLM2 with every KV head repeated G times: an MHA model computing the same function."""
    config = copy.deepcopy(loaded.model.config)
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim if getattr(config, "head_dim", None) else config.hidden_size // H
    config.num_key_value_heads = H
    state = {}
    for name, tensor in loaded.model.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensor = tensor.reshape(Hkv, d, -1).repeat_interleave(H // Hkv, dim=0).reshape(H * d, -1)
        state[name] = tensor
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    for name, buffer in list(model.named_buffers()):  # non-persistent buffers (rotary) stay on meta
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = loaded.model.get_buffer(name).clone()
    return model.eval()


@pytest.mark.slow
def test_smollm2_expanded_to_mha_keeps_perplexity_and_mp(smollm2):
    from analysis.arch.adapters import adapter_for
    from analysis.measure.evaluation import perplexity
    from analysis.arch.models import LoadedModel

    expanded = _expanded_to_mha(smollm2)
    adapter = adapter_for(expanded)
    assert adapter.geometry(expanded).n_kv_heads == 9
    loaded = LoadedModel(expanded, smollm2.tokenizer, "smollm2-mha", "causal-lm", adapter,
                         adapter.geometry(expanded), "test")
    dense = perplexity(smollm2, max_tokens=256)
    assert perplexity(loaded, max_tokens=256) == pytest.approx(dense, rel=1e-5)
    # repeating each KV row G times keeps every population's mean and (population) std, so MP
    # is unchanged, and on the MHA copy MP-G == MP, while MP-G on the GQA original differs.
    original, mha = profile_model(smollm2.model), profile_model(expanded)
    np.testing.assert_allclose(MPScorer().score(mha).scores, MPScorer().score(original).scores, rtol=1e-9)
    assert np.array_equal(MPGScorer().score(mha).scores, MPScorer().score(mha).scores)


@pytest.mark.parametrize("cls", [WandaHeadScorer, SparseGPTHeadScorer])
def test_layer_normalized_variant_divides_by_each_layers_mean(cls):
    model, ids = tiny_model("llama"), tiny_input_ids(4, 12)
    raw = cls(batch_size=4).score(model, calibration=ids)
    normalized = cls(batch_size=4, normalize="layer").score(model, calibration=ids)
    by_hand = raw.scores / raw.scores.mean(axis=1, keepdims=True)              # [L, H]
    np.testing.assert_allclose(normalized.scores, by_hand, rtol=1e-12)
    np.testing.assert_allclose(normalized.scores.mean(axis=1), 1.0, rtol=1e-12)
    # within a layer the order is unchanged; across layers the activation scale is gone
    for layer in range(raw.scores.shape[0]):
        assert np.array_equal(np.argsort(raw.scores[layer]), np.argsort(normalized.scores[layer]))
    assert raw.params["normalize"] == "none" and normalized.params["normalize"] == "layer"
    np.testing.assert_array_equal(raw.tiebreak, normalized.tiebreak)
    with pytest.raises(InputError, match="normalize"):
        cls(normalize="global")
