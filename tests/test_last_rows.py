"""The last rows of attention from tapped q/k/v (analysis.measure.longheads.last_rows) against a naive float64
reference (explicit exp over the keys, from the model's own weights and rotary embedding) and the window's
output change against the model's own windowed kernel (analysis.arch.spans) read at W_O's input."""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.spans import windowed
from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.measure.longheads import last_rows
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT

T, Q, SINKS, RECENT = 14, 3, 2, 4
BAND = Window(SINKS, RECENT)


@pytest.fixture(scope="module")
def llama():
    m = tiny_model("llama", dtype=torch.float64)
    m.set_attn_implementation("sdpa")
    return m


def _o_inputs(model, ids, window=None) -> list[torch.Tensor]:
    """W_O's input [T, H*d] of every layer (the heads' outputs side by side), under an optional window plan."""
    adapter = adapter_for(model)
    seen, handles = [], []
    for layer in range(len(adapter.layers(model))):
        handles.append(adapter.o_proj(model, layer).register_forward_pre_hook(
            lambda _m, args: seen.append(args[0][0].detach().clone())))
    try:
        with torch.no_grad():
            if window is None:
                model(input_ids=ids[None])
            else:
                with windowed(model, window, BAND):
                    model(input_ids=ids[None])
    finally:
        for h in handles:
            h.remove()
    return seen


def _naive_probs(model, ids) -> np.ndarray:
    """[L, H, T, T] attention probabilities by explicit exp in float64 from eager attention's own
    probabilities' definition: the eager kernel with float64 scores, one row at a time."""
    out = []

    def tap(layer, query, key, value):
        G = query.shape[1] // key.shape[1]
        scale = model.model.layers[layer].self_attn.scaling
        rows = np.zeros((query.shape[1], T, T))
        for h in range(query.shape[1]):
            for i in range(T):
                s = [float(query[0, h, i] @ key[0, h // G, j]) * scale for j in range(i + 1)]
                e = np.exp(np.array(s) - max(s))
                rows[h, i, :i + 1] = e / e.sum()
        out.append(rows)

    from analysis.arch.spans import tapped
    with torch.no_grad(), tapped(model, tap):
        model(input_ids=ids[None])
    return np.stack(out)


def test_rows_are_the_naive_softmax(llama):
    ids = tiny_input_ids(1, T)[0]
    rows = last_rows(llama, ids, queries=Q, window=BAND)
    assert rows.window == BAND
    probs = _naive_probs(llama, ids)                                     # [L, H, T, T]
    np.testing.assert_allclose(rows.mass, probs[:, :, -Q:].mean(2), rtol=0, atol=EXACT)
    np.testing.assert_array_equal(rows.top1, probs[:, :, -Q:].argmax(-1))
    np.testing.assert_allclose(rows.mass.sum(-1), 1.0, atol=EXACT)
    parts = rows.regions()
    assert parts["sinks"] == pytest.approx(rows.mass[..., :SINKS].sum(-1), abs=EXACT)
    assert parts["recent"] == pytest.approx(rows.mass[..., T - RECENT:].sum(-1), abs=EXACT)


def test_window_change_is_the_windowed_kernel(llama):
    ids = tiny_input_ids(1, T, seed=3)[0]
    rows = last_rows(llama, ids, queries=Q, window=BAND)
    g = adapter_for(llama).geometry(llama)
    dense = _o_inputs(llama, ids)
    for layer in range(g.n_layers):
        window = np.zeros((g.n_layers, g.n_kv_heads), bool)
        window[layer] = True                                             # this layer only: its input is dense's
        cut = _o_inputs(llama, ids, window)[layer]
        full = dense[layer]
        for h in range(g.n_heads):
            sl = slice(h * g.head_dim, (h + 1) * g.head_dim)
            a, b = full[-Q:, sl], cut[-Q:, sl]                           # [Q, d]
            want = ((a - b).norm(dim=-1) / a.norm(dim=-1)).mean().item()
            assert rows.window_change[layer, h] == pytest.approx(want, abs=1e-10)
    assert rows.window_change.max() > 1e-3                              # the window does change something


def test_a_window_as_long_as_the_text_changes_nothing(llama):
    ids = tiny_input_ids(1, T)[0]
    rows = last_rows(llama, ids, queries=Q, window=Window(0, T))
    assert np.abs(rows.window_change).max() <= EXACT


def test_refusals(llama):
    ids = tiny_input_ids(1, T)[0]
    with pytest.raises(InputError, match="fewer than"):
        last_rows(llama, ids[:2], queries=Q)
    with pytest.raises(InputError, match="reads nothing"):
        last_rows(llama, ids, window=(4, 0))
