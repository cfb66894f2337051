"""Model loading: the real built-ins offline, local folders round-trip exactly, the memory
estimate, the atomic built-in cache, and a clear HeadscopeError for every bad input."""
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, MambaConfig, PreTrainedTokenizerFast, ResNetConfig,
                          RwkvConfig, T5Config)

from analysis.arch import models as M
from analysis.core.errors import ModelLoadError, UnsupportedModelError
from analysis.core.text import evaluation_text, tokenize
from tests._tiny import VOCAB, tiny_config, tiny_input_ids, tiny_model


# -- helpers ---------------------------------------------------------------------------------

def _save_tiny_tokenizer(folder):
    """A word-level tokenizer over VOCAB ids ("[UNK]", "[PAD]", "w2", ...), saved into `folder`."""
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)


def _tiny_folder(tmp_path, model_type="llama"):
    """A saved tiny random-weight model of `model_type` with a tokenizer; returns (folder, model)."""
    folder = tmp_path / f"tiny-{model_type}"
    model = tiny_model(model_type)
    model.save_pretrained(folder)
    _save_tiny_tokenizer(folder)
    return folder, model


def _config_folder(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _assert_fix_in(message: str):
    """A user-facing message says what to do, not only what went wrong."""
    verbs = ("use ", "pass ", "copy", "check", "pick", "add ", "replace", "delete", "load it", "close",
             "install", "run ")
    assert any(v in message.lower() for v in verbs), message


# -- the real built-ins ----------------------------------------------------------------------

def test_smollm2_loads_as_a_gqa_causal_lm(smollm2):
    g = smollm2.geometry
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, g.hidden) == (30, 9, 3, 64, 576)
    assert smollm2.kind == "causal-lm" and smollm2.adapter.model_type == "llama"
    assert not smollm2.model.training
    assert smollm2.model.dtype == torch.float32
    assert 130e6 < M.count_parameters(smollm2.model.config) < 140e6  # "135M"


def test_smollm2_dense_perplexity_is_sane(smollm2):
    # Wrong Q/K permutation or a broken dequantization gives perplexities in the thousands.
    ids = tokenize(smollm2.tokenizer, evaluation_text(), max_tokens=256)  # [1, 256]
    assert ids.shape == (1, 256)
    with torch.no_grad():
        loss = smollm2.model(input_ids=ids, labels=ids).loss
    ppl = math.exp(loss.item())
    assert math.isfinite(ppl) and 2 < ppl < 30, ppl


def test_smollm2_outputs_are_deterministic(smollm2):
    ids = tokenize(smollm2.tokenizer, evaluation_text(2000), max_tokens=64)  # [1, 64]
    with torch.no_grad():
        a = smollm2.model(input_ids=ids).logits  # [1, 64, V]
        b = smollm2.model(input_ids=ids).logits  # [1, 64, V]
    assert torch.equal(a, b)


def test_smollm2_cache_is_a_plain_checkpoint(smollm2):
    cache = Path(smollm2.source)
    assert (cache / M._MARKER).is_file() and (cache / "model.safetensors").is_file()
    plain = AutoModelForCausalLM.from_pretrained(cache).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345]])  # [1, 6]
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, smollm2.model(input_ids=ids).logits)


def test_minilm_embeddings_rank_a_paraphrase_above_an_unrelated_sentence(minilm):
    assert minilm.kind == "encoder"
    assert (minilm.geometry.n_layers, minilm.geometry.n_heads) == (6, 12)
    sentences = ["A man is playing a guitar on stage.",
                 "Someone performs music with a guitar in front of an audience.",
                 "The stock market fell sharply after the interest rate decision."]
    batch = minilm.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = minilm.model(**batch).last_hidden_state  # [3, T, 384]
    emb = torch.nn.functional.normalize(M.mean_pool(hidden, batch["attention_mask"]), dim=-1)  # [3, 384]
    paraphrase, unrelated = (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()
    assert paraphrase > 0.5 and paraphrase > unrelated + 0.3, (paraphrase, unrelated)


def test_builtin_registry():
    assert M.DEFAULT_MODEL in M.BUILTIN_MODELS
    assert set(M.BUILTIN_MODELS) == {"smollm2-135m", "minilm-l6"}
    for name, builtin in M.BUILTIN_MODELS.items():
        assert builtin.name == name and builtin.license and builtin.package


# -- helpers with hand-computed answers --------------------------------------------------------

def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],
                           [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]])  # [2, 3, 2]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # [2, 3]
    assert torch.equal(M.mean_pool(hidden, mask), torch.tensor([[2.0, 3.0], [7.0, 8.0]]))
    assert torch.equal(M.mean_pool(hidden[1:]), torch.tensor([[7.0, 8.0]]))


@pytest.mark.parametrize("architectures, model_type, kind", [
    (["LlamaForCausalLM"], "llama", "causal-lm"),
    (["GPT2LMHeadModel"], "gpt2", "causal-lm"),
    (["RobertaForMaskedLM"], "roberta", "masked-lm"),
    (["BertModel"], "bert", "encoder"),
    (["BertForSequenceClassification"], "bert", "encoder"),
    (None, "llama", "causal-lm"),
    (None, "bert", "encoder"),
])
def test_model_kind_from_architectures(architectures, model_type, kind):
    assert M.model_kind(SimpleNamespace(architectures=architectures, model_type=model_type)) == kind


def test_parameter_count_matches_a_hand_count():
    cfg = tiny_config("llama")
    V, D, I, L = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, D // cfg.num_attention_heads
    per_layer = D * H * d + 2 * D * Hkv * d + H * d * D + 3 * D * I + 2 * D
    params = V * D + L * per_layer + D + (0 if cfg.tie_word_embeddings else V * D)
    counted = M.count_parameters(cfg)
    assert params <= counted <= params + d  # + the rotary inv_freq buffer (d/2 values)
    tied = tiny_config("llama", tie_word_embeddings=True)
    assert M.count_parameters(cfg) - M.count_parameters(tied) == (0 if cfg.tie_word_embeddings else V * D)


def test_estimate_model_bytes_scales_with_dtype():
    cfg = tiny_config("llama")
    n = M.count_parameters(cfg)
    margin = lambda nbytes: int(nbytes * (1 + M.MEMORY_MARGIN_FRACTION)) + M.MEMORY_MARGIN_BYTES
    assert M.estimate_model_bytes(cfg) == margin(4 * n)
    assert M.estimate_model_bytes(cfg, torch.bfloat16) == margin(2 * n)


# -- local folders -----------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, kind", [("llama", "causal-lm"), ("bert", "masked-lm")])
def test_local_folder_round_trip(tmp_path, model_type, kind):
    folder, original = _tiny_folder(tmp_path, model_type)
    messages = []
    loaded = M.load_model(str(folder), progress=lambda f, m: messages.append(f))
    assert loaded.kind == kind and loaded.source == str(folder) and not loaded.model.training
    assert loaded.geometry == loaded.adapter.geometry(original)
    ids = tiny_input_ids()  # [2, 10]
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, original(input_ids=ids).logits)
    assert messages == sorted(messages) and messages[-1] == 1.0
    assert loaded.tokenizer("w5 w7")["input_ids"][-2:] == [5, 7]


def test_loading_in_bfloat16(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    assert M.load_model(str(folder), dtype=torch.bfloat16).model.dtype == torch.bfloat16


# -- the atomic built-in cache -----------------------------------------------------------------

def test_interrupted_conversion_leaves_no_cache(tmp_path):
    builtin = M.BUILTIN_MODELS["smollm2-135m"]

    def killed(dest, report):
        (dest / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt  # Ctrl-C in the middle of writing

    with pytest.raises(KeyboardInterrupt):
        M._cached_builtin(builtin, tmp_path, {"source": "x"}, M.no_progress, killed)
    assert list((tmp_path / "models").iterdir()) == []


def test_conversion_reports_per_tensor_and_stop_mid_conversion_leaves_nothing(tmp_path):
    """Issue 20 item 7: the real GGUF conversion moves the bar inside its longest step (one report
    per dequantized tensor, fractions rising), a stop request raised at the 10th tensor ends it
    (CancelledError, not a finished load), and neither a cache nor a temporary folder is left.
    Stopping there costs the file's parse and the model build, not the whole conversion."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from analysis.core.errors import CancelledError
    patched = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm)
    calls = []

    def tensors_seen() -> int:
        return sum("dequantizing GGUF tensor" in message for _, message in calls)

    with pytest.raises(CancelledError, match="cancelled"):
        M.load_model("smollm2-135m", cache_dir=tmp_path, progress=lambda f, m: calls.append((f, m)),
                     should_stop=lambda: tensors_seen() >= 10)
    fractions = [f for f, _ in calls]
    assert tensors_seen() == 10 and len(calls) > 12, calls          # start, the steps, 10 tensors
    assert fractions == sorted(fractions) and 0.0 == fractions[0] < fractions[-1] < 0.9, fractions
    tensor_fractions = [f for f, m in calls if "dequantizing" in m]
    assert all(a < b for a, b in zip(tensor_fractions, tensor_fractions[1:])), tensor_fractions
    assert list((tmp_path / "models").iterdir()) == []
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm) == patched  # hooks undone


def test_conversion_pending_only_for_a_converting_builtin_without_its_cache(tmp_path, builtin_cache_dir, smollm2):
    """The app's cold-load Stop button shows exactly when the load would convert first."""
    assert M.conversion_pending("smollm2-135m", cache_dir=tmp_path)
    assert not M.conversion_pending("smollm2-135m", cache_dir=builtin_cache_dir)   # converted by the fixture
    assert not M.conversion_pending("minilm-l6", cache_dir=tmp_path)               # loads from its package
    assert not M.conversion_pending(str(tmp_path), cache_dir=tmp_path)             # a folder: no conversion
    (tmp_path / "models" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "models" / "smollm2-135m" / M._MARKER).write_text("[1]")            # not a marker
    assert M.conversion_pending("smollm2-135m", cache_dir=tmp_path)


def test_conversion_runs_once_and_reruns_when_the_source_changes(tmp_path):
    builtin = M.BUILTIN_MODELS["smollm2-135m"]
    calls = []

    def convert(dest, report):
        calls.append(dest)
        (dest / "weights").write_text(f"conversion {len(calls)}")

    first = M._cached_builtin(builtin, tmp_path, {"source": "a"}, M.no_progress, convert)
    again = M._cached_builtin(builtin, tmp_path, {"source": "a"}, M.no_progress, convert)
    assert first == again == tmp_path / "models" / "smollm2-135m" and len(calls) == 1
    assert (first / "weights").read_text() == "conversion 1"
    M._cached_builtin(builtin, tmp_path, {"source": "b"}, M.no_progress, convert)
    assert len(calls) == 2 and (first / "weights").read_text() == "conversion 2"
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m"]


def test_damaged_builtin_cache_says_to_delete_it(tmp_path, smollm2):
    cache = tmp_path / "models" / "smollm2-135m"
    cache.mkdir(parents=True)
    for name in (M._MARKER, "config.json"):
        shutil.copy(Path(smollm2.source) / name, cache / name)
    (cache / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ModelLoadError, match="damaged or truncated") as info:
        M.load_model("smollm2-135m", cache_dir=tmp_path)
    assert str(cache) in str(info.value) and "delete" in str(info.value)


# -- bad inputs: every one is a HeadscopeError that says how to fix it -----------------------

def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        M.load_model(str(tmp_path / "no" / "such" / "model"))
    _assert_fix_in(str(info.value))


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file") as info:
        M.load_model(str(path))
    _assert_fix_in(str(info.value))


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_name(name):
    with pytest.raises(ModelLoadError, match="built-in"):
        M.load_model(name)


def test_hub_id_offline_and_not_cached():
    with pytest.raises(ModelLoadError) as info:
        M.load_model("headscope-tests/no-such-model-anywhere")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message and "no internet" in message
    _assert_fix_in(message)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json") as info:
        M.load_model(str(tmp_path))
    _assert_fix_in(str(info.value))


@pytest.mark.parametrize("config", [
    ResNetConfig(),
    MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=32),
    RwkvConfig(hidden_size=16, num_hidden_layers=1, vocab_size=32),
], ids=["resnet", "mamba", "rwkv"])
def test_models_without_attention_heads(tmp_path, config):
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="no attention heads") as info:
        M.load_model(str(tmp_path))
    _assert_fix_in(str(info.value))


def test_attention_model_without_an_adapter(tmp_path):
    T5Config(d_model=16, d_kv=4, num_heads=4, num_layers=1, vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not supported") as info:
        M.load_model(str(tmp_path))
    assert "llama" in str(info.value)  # names what is supported


@pytest.mark.parametrize("config, error, hint", [
    ({"model_type": "headscope_no_such_arch", "hidden_size": 8}, UnsupportedModelError, "does not know"),
    ({"model_type": "headscope_custom", "auto_map": {"AutoConfig": "m.C"}}, UnsupportedModelError,
     "trust_remote_code=True"),
    ({"hidden_size": 8}, ModelLoadError, "no model_type"),
], ids=["unknown-model-type", "custom-code", "no-model-type"])
def test_bad_configs(tmp_path, config, error, hint):
    with pytest.raises(error, match=hint) as info:
        M.load_model(str(_config_folder(tmp_path, config)))
    _assert_fix_in(str(info.value))


def test_config_that_is_not_json(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_truncated_weights(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="damaged or truncated") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_missing_weights_file(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_weights_lacking_tensors_the_config_needs(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    _edit_config(folder, num_hidden_layers=3)  # layer 2 has no weights: it would be random
    with pytest.raises(ModelLoadError, match="lack") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_weights_with_other_shapes_than_the_config(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    _edit_config(folder, intermediate_size=48)
    with pytest.raises(ModelLoadError, match="could not be loaded") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_missing_tokenizer(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    for path in folder.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            path.unlink()
    with pytest.raises(ModelLoadError, match="tokenizer") as info:
        M.load_model(str(folder))
    _assert_fix_in(str(info.value))


def test_model_too_large_for_free_ram(tmp_path):
    folder, _ = _tiny_folder(tmp_path)
    need = M.estimate_model_bytes(tiny_config("llama"))
    with pytest.raises(ModelLoadError, match="RAM") as info:
        M.load_model(str(folder), available_bytes=need - 1)
    _assert_fix_in(str(info.value))
    assert M.load_model(str(folder), available_bytes=need).kind == "causal-lm"


@pytest.mark.parametrize("listening", [False, True])
def test_an_unreachable_hub_means_local_cache_only(monkeypatch, listening):
    """Unreachable (a refused connect), an uncached id fails at once from the local cache instead of
    ~25 s of network retries; a reachable endpoint is asked normally."""
    import socket
    from analysis.arch import models
    from analysis.core.errors import ModelLoadError
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if listening:
        server.listen(1)
    else:
        server.close()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    seen = {}

    def from_pretrained(source, **kwargs):
        seen.update(kwargs)
        raise OSError("not in the cache")

    monkeypatch.setattr(models.AutoConfig, "from_pretrained", from_pretrained)
    try:
        with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
            models.load_model("someorg/not-cached-anywhere")
    finally:
        server.close()
    assert seen["local_files_only"] is (not listening)
