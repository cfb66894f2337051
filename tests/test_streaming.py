"""Streaming profiler: the same norms as the in-memory path (single file, sharded, bf16, the
built-in SmolLM2 and MiniLM checkpoints), no model instantiated, and clear errors for broken
checkpoint folders."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from analysis.core.errors import ModelLoadError, UnsupportedModelError
from analysis.measure.profiles import profile_model
from analysis.arch.checkpoint import INDEX_FILE
from analysis.measure.streaming import profile_checkpoint
from tests._tiny import tiny_model


def _max_diff(a, b):
    return max(float(np.abs(a.norms(o)[p] - b.norms(o)[p]).max()) for p in "qkvo" for o in (1, 2))


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "gpt_neox", "bert", "opt"])
def test_streaming_equals_in_memory_single_file(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    # the same head_norms on the same float32 kernels (the streamed one on one thread, reading ahead): equal
    assert _max_diff(profile_checkpoint(tmp_path), profile_model(model)) == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streaming_equals_in_memory_sharded(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = list(tmp_path.glob("*.safetensors"))
    assert (tmp_path / INDEX_FILE).is_file() and len(shards) > 2
    assert _max_diff(profile_checkpoint(tmp_path), profile_model(model)) == 0.0
    # the index file itself is also accepted as the path
    assert _max_diff(profile_checkpoint(tmp_path / INDEX_FILE), profile_model(model)) == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streaming_half_checkpoint(tmp_path, dtype):
    model = tiny_model("llama").to(dtype)
    model.save_pretrained(tmp_path)
    streamed = profile_checkpoint(tmp_path)
    # the in-memory profile of the same half-precision model: the same float32 upcast, chunk by chunk
    assert _max_diff(streamed, profile_model(model)) == 0.0
    # and of its float32 copy: float32 sums of the same values, in another order (rows of 64 here):
    # a few float32 ulps of the norm, well below 1e-5 at these weights' norms (< 10)
    assert _max_diff(streamed, profile_model(model.float())) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workers_reuse_their_buffers_and_every_layer_keeps_its_own_norms(tmp_path, monkeypatch, dtype):
    # 7 layers over STREAM_WORKERS threads: every thread reads several layers into the same buffers,
    # and each layer's norms must still be its own (the in-memory profile's, bit for bit)
    from analysis.measure import streaming
    assert streaming.STREAM_WORKERS >= 2
    model = tiny_model("llama", num_hidden_layers=7).to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    import analysis.arch.checkpoint as checkpoint
    real, buffers = checkpoint.read_tensor, set()
    monkeypatch.setattr(checkpoint, "read_tensor",
                        lambda entry, buffer=None: buffers.add(None if buffer is None else buffer.data_ptr())
                        or real(entry, buffer))
    streamed = profile_checkpoint(tmp_path, ords=(2,))
    assert None not in buffers and len(buffers) <= streaming.STREAM_WORKERS * 4   # 4 tensors a layer, reused
    memory = profile_model(model)
    assert streamed.n_layers == 7
    for p in "qkvo":
        assert np.array_equal(streamed.l2[p], memory.l2[p]), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_only_read_streams_l1_on_first_use_with_the_same_bits(tmp_path, monkeypatch, dtype):
    # the CLI reads L2 alone (ords=(2,)): fewer passes; L1, when asked for, streams the files again
    model = tiny_model("llama").to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    both = profile_checkpoint(tmp_path)
    import analysis.arch.checkpoint as checkpoint
    reads = []
    real = checkpoint.read_tensor
    monkeypatch.setattr(checkpoint, "read_tensor",
                        lambda entry, buffer=None: reads.append(entry.name) or real(entry, buffer))
    lean = profile_checkpoint(tmp_path, ords=(2,))
    first = len(reads)
    assert first > 0 and lean.l1 is None
    for p in "qkvo":
        assert np.array_equal(lean.l2[p], both.l2[p])
    l1 = lean.norms(1)                                   # the second read, now
    assert len(reads) == 2 * first
    for p in "qkvo":
        assert np.array_equal(l1[p], both.l1[p])
    with pytest.raises(ValueError):
        profile_checkpoint(tmp_path, ords=(1,))


def test_streaming_never_builds_the_model(tmp_path, monkeypatch):
    tiny_model("llama").save_pretrained(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the streaming profiler instantiated a model")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    seen = []
    profile = profile_checkpoint(tmp_path, progress=lambda f, m: seen.append(f))
    assert profile.n_layers == 2 and seen[-1] == 1.0


def test_missing_shard_is_a_clear_error(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim):
        profile_checkpoint(tmp_path)


def test_broken_folders_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not a checkpoint folder"):
        profile_checkpoint(tmp_path / "nowhere")
    tiny_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        profile_checkpoint(tmp_path)
    (tmp_path / "weights.bin").rename(tmp_path / "model.safetensors")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        profile_checkpoint(tmp_path)


def test_config_from_another_model_is_a_clear_error(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    other = tmp_path / "other"
    tiny_model("gpt2").save_pretrained(other)
    shutil.copy(tmp_path / "config.json", other / "config.json")  # llama config, gpt2 weights
    with pytest.raises(ModelLoadError, match="llama"):
        profile_checkpoint(other)


def test_unsupported_architecture(tmp_path):
    from transformers import AutoConfig
    AutoConfig.for_model("mamba", hidden_size=8, num_hidden_layers=1, vocab_size=16).save_pretrained(tmp_path)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError):
        profile_checkpoint(tmp_path)


def test_streaming_smollm2_checkpoint_matches_memory(smollm2):
    streamed = profile_checkpoint(smollm2.source)
    assert (streamed.n_layers, streamed.n_heads, streamed.n_kv_heads) == (30, 9, 3)
    assert _max_diff(streamed, profile_model(smollm2.model)) <= 1e-5


def test_streaming_minilm_package_matches_memory(minilm):
    assert Path(minilm.source, "model.safetensors").is_file()  # the package's own checkpoint
    assert _max_diff(profile_checkpoint(minilm.source), profile_model(minilm.model)) <= 1e-5
