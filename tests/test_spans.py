"""Per-KV-head attention spans (analysis/arch/spans.py): the exactness oracles of issue 41 item 3.

- a window that covers the whole sequence == full attention (EXACT, float64, both kernels);
- the windowed kernel == a naive float64 reference written here with loops over heads and queries;
- taps see the post-RoPE tensors the kernel reads (their softmax == the eager kernel's probabilities);
- a cached decode under a window == the full forward under the same window (the band is positional);
- spans compose with the head mask (the one masking mechanism);
- bad input is one line, and the model is restored whatever happens.
"""
import numpy as np
import pytest
import torch

from analysis.arch.head_gates import head_mask
from analysis.arch.hooks import attached
from analysis.arch.spans import SPANS, band, spans, tapped, windowed
from analysis.arch.window import Window
from analysis.core.errors import InputError
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT, float32_inside_tolerance

SPAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")


def _model(family: str, impl: str):
    m = tiny_model(family, dtype=torch.float64)
    m.set_attn_implementation(impl)
    return m


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", SPAN_FAMILIES)
def test_window_covering_the_sequence_is_full_attention(family, impl):
    m = _model(family, impl)
    x = tiny_input_ids(2, 12)
    every = np.ones((2, 2), dtype=bool)
    with torch.no_grad():
        dense = m(x).logits
        with windowed(m, every, Window(0, 12)):
            full = m(x).logits
        with windowed(m, every, Window(3, 40)):
            wider = m(x).logits
        with windowed(m, every, Window(2, 4)):                    # a real window changes the output
            narrow = m(x).logits
    assert m.config._attn_implementation == impl
    assert (dense - full).abs().max().item() <= EXACT
    assert (dense - wider).abs().max().item() <= EXACT
    assert (dense - narrow).abs().max().item() > 1e-4


def _naive(q, k, v, window, sinks, recent, scale):
    """float64 loops: q [B, H, T, d], k / v [B, Hkv, T, d] -> [B, T, H, d], window [Hkv] bool."""
    B, H, T, d = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(T):
                keys = [j for j in range(i + 1) if not window[g] or j < sinks or i - j < recent]
                s = torch.stack([(q[b, h, i] * k[b, g, j]).sum() * scale for j in keys])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[b, i, h] = sum(p[n] * v[b, g, j] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_windowed_kernel_matches_a_naive_float64_reference(family):
    m = _model(family, "sdpa")                                         # sdpa computes float64 throughout
    x = tiny_input_ids(2, 10)
    window = np.array([[True, False], [False, True]])
    sinks, recent = 2, 3
    seen, outputs = {}, {}
    attn = [layer.self_attn for layer in m.model.layers]
    with torch.no_grad(), attached() as hooks:
        for l, a in enumerate(attn):
            hooks.before(a.o_proj, lambda mod, args, l=l: outputs.__setitem__(l, args[0].clone()))
        with spans(m, windowed=window, window=Window(sinks, recent),
                   tap=lambda l, q, k, v: seen.__setitem__(l, (q.clone(), k.clone(), v.clone()))):
            m(x)
    for l, a in enumerate(attn):
        q, k, v = seen[l]
        ref = _naive(q, k, v, window[l], sinks, recent, a.scaling).reshape(outputs[l].shape)
        assert (outputs[l] - ref).abs().max().item() <= EXACT


def test_tap_sees_what_the_eager_kernel_reads():
    m = _model("llama", "eager")
    x = tiny_input_ids(1, 9)
    seen = {}
    with torch.no_grad():
        probs = m(x, output_attentions=True).attentions                 # [1, H, T, T] per layer
        with tapped(m, lambda l, q, k, v: seen.__setitem__(l, (q, k))):
            m(x)
    for l, (q, k) in seen.items():
        a = m.model.layers[l].self_attn
        G = q.shape[1] // k.shape[1]
        s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * a.scaling   # [1, H, T, T]
        s = s.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
        p = torch.softmax(s.float(), -1).double()                      # the eager kernel's float32 softmax
        assert (p - probs[l]).abs().max().item() < 1e-6


def test_band_rule():
    pos = torch.arange(8)
    allowed = band(pos, pos, Window(2, 3))
    for i in range(8):
        for j in range(8):
            assert bool(allowed[i, j]) == (j <= i and (j < 2 or i - j < 3))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_cached_decode_under_a_window_matches_the_full_forward(family):
    m = _model(family, "sdpa")
    x = tiny_input_ids(1, 14)
    window = np.array([[True, False], [True, True]])
    with torch.no_grad(), windowed(m, window, Window(1, 4)):
        full = m(x).logits                                              # [1, 14, V]
        out = m(x[:, :8], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(8, 14):
            out = m(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    decoded = torch.stack(steps[:-1], 1)                               # predictions for tokens 8..13
    tol = float32_inside_tolerance(m, full.abs().max().item())
    assert (decoded - full[:, 7:13]).abs().max().item() <= tol


def test_spans_compose_with_the_head_mask():
    m = _model("llama", "sdpa")
    x = tiny_input_ids(2, 10)
    window = np.array([[False, True], [True, False]])
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = pruned[1, 3] = True
    gates = torch.from_numpy(1.0 - pruned.astype(np.float64))
    with torch.no_grad():
        with head_mask(m, gates), windowed(m, window, Window(1, 3)):
            both = m(x).logits
        with windowed(m, window, Window(1, 3)), head_mask(m, gates):
            other_order = m(x).logits
        with windowed(m, window, Window(1, 3)):
            only_window = m(x).logits
    assert (both - other_order).abs().max().item() <= EXACT
    assert (both - only_window).abs().max().item() > 1e-4


def test_right_padding_keeps_the_window_of_the_real_tokens():
    m = _model("llama", "sdpa")
    x = tiny_input_ids(1, 9)
    padded = torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 9), torch.zeros(1, 3)], 1).long()
    window = np.array([[True, True], [False, True]])
    with torch.no_grad(), windowed(m, window, Window(1, 3)):
        alone = m(x).logits
        batch = m(padded, attention_mask=mask).logits[:, :9]
    assert (alone - batch).abs().max().item() <= EXACT


def test_bad_input_is_one_line_and_the_model_is_restored():
    m = _model("llama", "sdpa")
    x = tiny_input_ids(1, 6)
    with pytest.raises(InputError, match="window of 0"):
        with windowed(m, np.ones((2, 2), bool), Window(1, 0)):
            pass
    with pytest.raises(InputError, match="needs its window"):
        with spans(m, windowed=np.ones((2, 2), bool), window=None):
            pass
    with pytest.raises(InputError, match="one row per layer"):
        with windowed(m, np.ones((3, 2), bool), Window(1, 2)):
            pass
    with pytest.raises(InputError, match="key/value heads"):
        with windowed(m, np.ones((2, 3), bool), Window(1, 2)):
            pass
    with pytest.raises(InputError, match="sink"):
        with windowed(m, np.ones((2, 2), bool), Window(-1, 2)):
            pass
    with pytest.raises(RuntimeError):
        with windowed(m, np.ones((2, 2), bool), Window(1, 2)):
            with pytest.raises(InputError, match="already active"):
                with tapped(m, lambda *a: None):
                    pass
            raise RuntimeError("boom")
    assert m.config._attn_implementation == "sdpa"
    with torch.no_grad():                                               # nothing left behind: the dense model
        dense = m(x).logits
        m.set_attn_implementation(SPANS)                               # no block open: the plain kernel
        try:
            stray = m(x).logits
        finally:
            m.set_attn_implementation("sdpa")
    assert (dense - stray).abs().max().item() <= EXACT


def test_other_kernels_and_families_are_refused():
    bloom = tiny_model("bloom", dtype=torch.float64)
    with pytest.raises(InputError):
        with windowed(bloom, np.ones((2, 4), bool), Window(1, 2)):
            pass
