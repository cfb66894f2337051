"""SmolLM2 placed by accelerate with a max_memory that sends some blocks to disk offload computes
what the in-memory model computes (float32, as offloading needs; measured difference: 0; the
bound is the derived float32 worst case of tests/_tolerance.py, which holds on any CPU), and
surgery and export work from it.

One offloaded load for the module (cpu=420MiB: the last few blocks and the final norm on the disk); small token
counts keep the file short. The in-memory twin is the session's `smollm2` fixture.
"""
import numpy as np
import pytest
import torch

from analysis.arch.adapters import input_device, is_dispatched, is_offloaded
from analysis.core.errors import UnsupportedModelError

from tests._tolerance import forward_tolerance, max_diff

# SmolLM2: 30 layers, longest dot product the MLP's 1536; relative (scale 1): eps32 * 1536 * 30 = 5.5e-3,
# while the mask below moves perplexity by > 1% and logits by whole units
REL = forward_tolerance(torch.float32, width=1536, depth=30, scale=1.0)
TOKENS = 64


@pytest.fixture(scope="module")
def offloaded(builtin_cache_dir, tmp_path_factory):
    from analysis.arch.models import load_model
    folder = tmp_path_factory.mktemp("offload")
    return load_model("smollm2-135m", cache_dir=builtin_cache_dir, max_memory="cpu=420MiB", offload_folder=folder)


@pytest.fixture(scope="module")
def mask(smollm2):
    g = smollm2.geometry
    pruned = np.random.default_rng(0).random((g.n_layers, g.n_heads)) < 0.3   # [L, H]
    pruned[29, :3] = True                                                     # an emptied KV group, on disk
    return pruned


def _disk_layers(loaded) -> list[int]:
    return sorted(int(name.split(".")[2]) for name, where in loaded.model.hf_device_map.items()
                  if where == "disk" and name.startswith("model.layers."))


def test_some_blocks_are_on_the_disk(offloaded):
    disk = _disk_layers(offloaded)
    assert disk and len(disk) < offloaded.geometry.n_layers
    assert is_offloaded(offloaded.model) and is_dispatched(offloaded.model)
    attn = offloaded.adapter.attention(offloaded.model, disk[0])
    assert attn.q_proj.weight.device.type == "meta"       # the real weights live in accelerate's hook
    assert input_device(offloaded.model) == torch.device("cpu")
    assert "offload" in offloaded.placement.describe()


def test_real_weights_of_an_offloaded_layer(smollm2, offloaded):
    layer = _disk_layers(offloaded)[-1]
    a = offloaded.adapter.read_heads(offloaded.model, layer)
    b = smollm2.adapter.read_heads(smollm2.model, layer)
    assert all(torch.equal(getattr(a, p), getattr(b, p)) for p in ("q", "k", "v", "o"))
    assert offloaded.adapter.attention(offloaded.model, layer).q_proj.weight.device.type == "meta"  # dropped again
    with pytest.raises(UnsupportedModelError, match="offloaded"):
        offloaded.adapter.write_heads(offloaded.model, layer, a)


def test_dense_and_masked_perplexity(smollm2, offloaded, mask):
    from analysis.measure.evaluation import perplexity
    pruned = np.stack([np.zeros_like(mask), mask])                         # [2, L, H]: dense and masked
    want = perplexity(smollm2, pruned=pruned, max_tokens=TOKENS)
    got = perplexity(offloaded, pruned=pruned, max_tokens=TOKENS)
    assert want[1] > want[0] * 1.01                                      # the mask matters
    np.testing.assert_allclose(got, want, rtol=REL)


def test_mp_g_scores(smollm2, offloaded):
    from analysis.score.scoring import get_scorer
    want = get_scorer("mp-g").score(smollm2)
    got = get_scorer("mp-g").score(offloaded)
    assert (want.scores > 0).any()
    np.testing.assert_allclose(got.scores, want.scores, rtol=REL)
    np.testing.assert_allclose(got.tiebreak, want.tiebreak, rtol=REL)


def test_ablation_deltas(smollm2, offloaded):
    from analysis.measure.ablation import FastAblation
    from analysis.measure.tokens import split_sequences
    from analysis.measure.evaluation import token_ids
    from analysis.core.text import evaluation_text
    ids = split_sequences(token_ids(smollm2.tokenizer, evaluation_text(4000), max_tokens=48), 24)  # [2, 24]
    layers = [_disk_layers(offloaded)[-2]]                                # a block on the disk, and the one after
    want = FastAblation(batch_size=8).sweep(smollm2.model, ids, layers=layers)
    got = FastAblation(batch_size=8).sweep(offloaded.model, ids, layers=layers)
    assert got.method == want.method == "fast"
    atol = REL * abs(want.base_loss)
    assert abs(got.base_loss - want.base_loss) <= atol
    np.testing.assert_allclose(got.head_delta[layers], want.head_delta[layers], rtol=REL, atol=atol)
    np.testing.assert_allclose(got.group_delta[layers], want.group_delta[layers], rtol=REL, atol=atol)


def test_surgery_and_export_from_the_offloaded_model(smollm2, offloaded, mask, tmp_path):
    """prune_heads works on the dispatched model (offloaded layers read through their hooks) and
    computes the masked in-memory model; the pruned export writes exactly its real tensors."""
    from safetensors import safe_open
    from analysis.arch.adapters import real_state_dict
    from analysis.compress.export import WEIGHTS_FILE, export
    from analysis.arch.head_gates import gates_from_mask, head_mask
    from analysis.compress.surgery import prune_heads
    x = torch.randint(4, 1000, (1, 16), generator=torch.Generator().manual_seed(0))  # [1, 16]
    with torch.no_grad(), head_mask(smollm2.model, gates_from_mask(mask)):
        masked = smollm2.model(input_ids=x).logits                        # [1, 16, V]
    with torch.no_grad():
        dense = smollm2.model(input_ids=x).logits                         # [1, 16, V]
    smaller, layout = prune_heads(offloaded.model, mask)
    # different matmul shapes (cut vs masked) in float32: the derived worst case at the logit scale,
    # far below what the mask itself changes (asserted, so the comparison can fail)
    tol = REL * masked.abs().max().item()
    assert max_diff(dense, masked) > 10 * tol
    with torch.no_grad():
        assert max_diff(smaller(input_ids=x).logits, masked) <= tol
    assert is_offloaded(offloaded.model)                                  # the original is untouched
    result = export("pruned", offloaded.model, mask, tmp_path, "from-offload", tokenizer=offloaded.tokenizer)
    assert result.layout.heads == layout.heads
    want = real_state_dict(smaller)
    disk = _disk_layers(offloaded)[-1]
    with safe_open(result.path / WEIGHTS_FILE, "pt") as saved:
        assert set(saved.keys()) <= want.keys()
        for key in (f"model.layers.{disk}.self_attn.q_proj.weight", f"model.layers.{disk}.mlp.up_proj.weight",
                    "model.norm.weight"):
            assert torch.equal(saved.get_tensor(key), want[key]), key


def test_gradient_scorer_refuses_offloaded_weights(offloaded):
    from analysis.score.scoring import get_scorer
    with pytest.raises(UnsupportedModelError, match="offload"):
        get_scorer("gradient", n_sequences=1, seq_len=8).score(offloaded)
