"""The compact KV cache (analysis/arch/kvcache.py) and the spans kernel on compact layers (issue 41).

Oracles, float64 tiny llama / qwen2 / mistral:
- a cached decode with the compact cache == the full forward under the same window (float32_inside_tolerance:
  the rotary cos/sin and, for eager, the softmax see other shapes in a decode step);
- == a decode with transformers' DynamicCache under `windowed` (the masked path), step by step;
- the banded prefill in query blocks (its cost grows with sinks + recent) == the masked path (EXACT on sdpa,
  which computes float64 throughout), also when the prompt comes in chunks;
- the real bytes of the K / V tensors it holds == KVPlan.kv_bytes after every step (integer equality), a plan's
  pruned KV heads (mode rows, run on the dense model under `applied`, eager here; sdpa in tests/test_cut.py)
  holding nothing.
"""
import numpy as np
import pytest
import torch

from analysis.arch.kvcache import CompactCache, compact, kv_cache_bytes, mode_rows_of
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, applied
from analysis.arch.spans import ring_positions, tapped, windowed
from analysis.arch.window import Window
from analysis.core.errors import InputError
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT, float32_inside_tolerance

FAMILIES = ("llama", "qwen2", "mistral")
WINDOW_PLAN = np.array([[True, False], [True, True]])        # one full head, three windowed
ROWS = mode_rows_of(WINDOW_PLAN)                              # the same as mode codes per layer
BAND = Window(2, 5)


def _model(family: str, impl: str = "sdpa"):
    m = tiny_model(family, dtype=torch.float64)
    m.set_attn_implementation(impl)
    return m


def _plan(window) -> KVPlan:
    return KVPlan(np.where(window, WINDOW, FULL), BAND, n_heads=4)


def _decode(m, x, prompt: int, cache):
    """Logits of the prompt's last token and of each fed token after it [B, T - prompt + 1, V], the bytes."""
    out = m(x[:, :prompt], past_key_values=cache, use_cache=True)
    cache, steps, sizes = out.past_key_values, [out.logits[:, -1]], [kv_cache_bytes(out.past_key_values)]
    for t in range(prompt, x.shape[1]):
        out = m(x[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1])
        sizes.append(kv_cache_bytes(cache))
    return torch.stack(steps, 1), sizes


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compact_decode_matches_the_full_forward_and_the_masked_decode(family, impl):
    m = _model(family, impl)
    x = tiny_input_ids(2, 30)
    plan = _plan(WINDOW_PLAN)
    d = m.config.head_dim if getattr(m.config, "head_dim", None) else m.config.hidden_size // 4
    with torch.no_grad():
        with windowed(m, WINDOW_PLAN, BAND):
            full = m(x).logits                                          # [2, 30, V]
            masked, _ = _decode(m, x, 12, None)                         # transformers' DynamicCache
        with compact(m, ROWS, BAND) as cache:
            small, sizes = _decode(m, x, 12, cache)
    tol = float32_inside_tolerance(m, full.abs().max().item())
    assert (small - full[:, 11:]).abs().max().item() <= tol
    assert (small - masked).abs().max().item() <= (EXACT if impl == "sdpa" else tol)
    assert sizes == [plan.kv_bytes(t, head_dim=d, dtype_bytes=8, batch=2) for t in range(12, 31)]
    assert sizes[-1] < kv_cache_bytes_of_dense(m, x)                  # it really is smaller


def test_pruned_kv_heads_keep_nothing_and_the_plan_decodes_as_its_masked_path_on_eager():
    """A plan with pruned KV heads on the dense model (its groups gated off by `applied`) on the eager kernel
    (tests/test_cut.py checks sdpa through the Cut): the compact cache keeps nothing of them, holds exactly
    plan.kv_bytes, and decodes what the masked path computes."""
    m = _model("llama", "eager")
    x = tiny_input_ids(2, 24)
    plan = KVPlan(np.array([[WINDOW, PRUNE], [FULL, WINDOW]]), BAND, n_heads=4)
    d = m.config.head_dim if getattr(m.config, "head_dim", None) else m.config.hidden_size // 4
    with torch.no_grad():
        with applied(m, plan):
            full = m(x).logits                                          # [2, 24, V] masked path
            masked, _ = _decode(m, x, 10, None)                         # transformers' DynamicCache
        with applied(m, plan, compact=True):
            small, sizes = _decode(m, x, 10, CompactCache(list(plan.modes), plan.window))
    tol = float32_inside_tolerance(m, full.abs().max().item())
    assert (small - full[:, 9:]).abs().max().item() <= tol
    assert (small - masked).abs().max().item() <= tol
    assert sizes == [plan.kv_bytes(t, head_dim=d, dtype_bytes=8, batch=2) for t in range(10, 25)]


def kv_cache_bytes_of_dense(m, x) -> int:
    with torch.no_grad():
        return kv_cache_bytes(m(x, use_cache=True).past_key_values)


@pytest.mark.parametrize("family", FAMILIES)
def test_banded_prefill_in_blocks_is_the_masked_path(family):
    m = _model(family)
    x = tiny_input_ids(2, 40)
    with torch.no_grad():
        with windowed(m, WINDOW_PLAN, BAND):
            full = m(x).logits
        with compact(m, ROWS, BAND, block=4) as cache:
            one = m(x, past_key_values=cache, use_cache=True).logits    # 10 blocks of 4 queries
        with compact(m, ROWS, BAND, block=3) as cache:
            parts = [m(x[:, a:b], past_key_values=cache, use_cache=True).logits
                     for a, b in ((0, 9), (9, 10), (10, 27), (27, 40))]  # a prompt in chunks, one a single token
    assert (one - full).abs().max().item() <= EXACT
    assert (torch.cat(parts, 1) - full).abs().max().item() <= EXACT


def test_heads_that_are_not_consecutive_are_gathered_and_put_back_in_place():
    m = tiny_model("llama", dtype=torch.float64, num_attention_heads=8, num_key_value_heads=4)
    m.set_attn_implementation("sdpa")
    window = np.array([[True, False, True, False], [False, True, True, False]])
    x = tiny_input_ids(1, 24)
    with torch.no_grad():
        with windowed(m, window, Window(1, 3)):
            full = m(x).logits
        with compact(m, mode_rows_of(window), Window(1, 3), block=4) as cache:
            small, _ = _decode(m, x, 10, cache)
    assert (small - full[:, 9:]).abs().max().item() <= float32_inside_tolerance(m, full.abs().max().item())


def test_a_window_covering_the_sequence_keeps_everything_and_is_full_attention():
    m = _model("llama")
    x = tiny_input_ids(1, 16)
    every = np.ones((2, 2), dtype=bool)
    with torch.no_grad():
        dense = m(x).logits
        with compact(m, mode_rows_of(every), Window(0, 16), block=4) as cache:
            got = m(x, past_key_values=cache, use_cache=True).logits
            assert cache.kept_tokens() == [[16, 16], [16, 16]]
    assert (got - dense).abs().max().item() <= EXACT


def test_the_ring_holds_the_sinks_and_the_latest_tokens():
    m = _model("llama")
    x = tiny_input_ids(1, 20)
    with torch.no_grad(), compact(m, mode_rows_of(np.ones((2, 2), bool)), Window(2, 3)) as cache:
        m(x[:, :7], past_key_values=cache, use_cache=True)
        assert cache.kept_tokens() == [[5, 5], [5, 5]]
        held = ring_positions(7, Window(2, 3))
        assert sorted(held.tolist()) == [0, 1, 4, 5, 6]
        assert torch.equal(Window(2, 3).slot(held), torch.arange(5))     # each position in its own slot
        for t in range(7, 20):
            m(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            assert sorted(ring_positions(t + 1, Window(2, 3)).tolist()) == [0, 1, t - 2, t - 1, t]
        assert cache.kept_tokens() == [[5, 5], [5, 5]]


def test_bad_input_is_one_line():
    m = _model("llama")
    x = tiny_input_ids(1, 6)
    with pytest.raises(InputError, match="window of 0"):
        CompactCache(ROWS, Window(1, 0))
    with pytest.raises(InputError, match="needs the plan's window"):
        CompactCache(ROWS, (1, 2))
    with pytest.raises(InputError, match="made for 3 KV heads"):
        with torch.no_grad(), compact(m, ROWS, Window(1, 2)):
            m(x, past_key_values=CompactCache(mode_rows_of(np.ones((2, 3), bool)), Window(1, 2)), use_cache=True)
    with pytest.raises(InputError, match="tap"):
        with torch.no_grad(), tapped(m, lambda *a: None):
            m(x, past_key_values=CompactCache(ROWS, Window(1, 2)), use_cache=True)
    with pytest.raises(InputError, match="rolled back"):
        CompactCache(ROWS, Window(1, 2)).crop(-1)
    assert m.config._attn_implementation == "sdpa"
