"""Model page: geometry of what was loaded, and every bad model choice shown as a fixable error
(never a traceback)."""
import json

import pytest
from transformers import AutoConfig

from tests._apptools import fresh_caches, metric, new_app, no_exception, tiny_dir, smollm2_app  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_tiny_model_geometry_is_shown(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    at = new_app(tiny_dir, page="model")
    no_exception(at)
    assert metric(at, "Family") == cfg["model_type"] == "llama"
    assert metric(at, "Kind") == "causal-lm"
    assert int(metric(at, "Layers (L)")) == cfg["num_hidden_layers"]
    assert int(metric(at, "Query heads (H)")) == cfg["num_attention_heads"]
    assert int(metric(at, "KV heads (H_kv)")) == cfg["num_key_value_heads"]
    assert int(metric(at, "head_dim (d)")) == cfg["hidden_size"] // cfg["num_attention_heads"]
    from safetensors.torch import load_file
    n_params = sum(t.numel() for t in load_file(tiny_dir / "model.safetensors").values())
    assert int(metric(at, "Parameters").replace(",", "")) == n_params


def test_sidebar_picker_accepts_a_typed_folder(tiny_dir):
    at = new_app(page="model", run=False)
    at.run()
    at.sidebar.selectbox(key="hs.w.model_choice").set_value("other").run()
    at.sidebar.text_input(key="hs.w.model_text").set_value(str(tiny_dir)).run()
    no_exception(at)
    assert at.query_params["model"] == str(tiny_dir)
    assert int(metric(at, "Layers (L)")) == 4


def _error_text(at) -> str:
    no_exception(at)
    assert at.error, "expected an error box"
    return " ".join(e.value for e in at.error)


def test_unknown_model_id_says_how_to_fix(tmp_path):
    at = new_app(str(tmp_path / "no-such-folder"), page="model")
    text = _error_text(at)
    assert "does not exist" in text and "built-in" in text


def test_unknown_hub_id_says_how_to_fix():
    at = new_app("no-such-org/no-such-model-xyz", page="model")
    text = _error_text(at)
    assert "Copy the model folder" in text or "built-in" in text


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    AutoConfig.for_model("mamba", hidden_size=16, num_hidden_layers=1, vocab_size=32).save_pretrained(tmp_path)
    at = new_app(tmp_path, page="prune")
    text = _error_text(at)
    assert "mamba" in text and "llama" in text  # what it is, and what would work


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    at = new_app(tmp_path, page="profiles")
    assert "config.json" in _error_text(at)


def test_empty_model_name_asks_for_one():
    at = new_app(page="model", run=False)
    at.run()
    at.sidebar.selectbox(key="hs.w.model_choice").set_value("other").run()
    no_exception(at)
    assert any("Pick a model" in i.value for i in at.info)


@pytest.mark.slow
def test_builtin_smollm2_geometry(smollm2_app):
    at = new_app(smollm2_app, page="model")
    no_exception(at)
    assert (metric(at, "Layers (L)"), metric(at, "Query heads (H)"), metric(at, "KV heads (H_kv)")) == ("30", "9", "3")
    assert metric(at, "Query heads per KV head (G)") == "3"


def test_builtin_minilm_encoder_on_every_page():
    """The built-in encoder (no LM head): every page renders; its check metric is embedding fidelity."""
    for page in ("model", "profiles", "prune", "compare", "heads", "export"):
        at = new_app("minilm-l6", page=page)
        no_exception(at)
        assert not at.error, (page, [e.value for e in at.error])
    assert int(metric(new_app("minilm-l6", page="model"), "All heads (L x H)")) == 72
    at = new_app("minilm-l6", page="prune")
    at.number_input(key="hs.w.prune.max_tokens").set_value(32).run()
    at.button(key="prune.check").click().run()
    no_exception(at)
    assert float(metric(at, "Dense embedding-fidelity")) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < float(metric(at, "Masked embedding-fidelity")) < 1.0


def test_the_pruning_note_names_the_models_default_policy(tiny_dir):
    """Issue 33: the Model page explained "one global list" while the default on GQA models is groups."""
    from tests._apptools import new_app, texts
    at = new_app(tiny_dir, page="model")
    shown = texts(at)
    assert "one global list" not in shown
    assert "The current mask policy is **groups (GQA): whole KV groups**" in shown
