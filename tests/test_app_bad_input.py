"""Bad input to the app (tests/test_bad_input_*.py have the CLI and the library
API): a config.json that is JSON but not a config or has an impossible geometry, a 5,000-character
model name, and NaN / Inf weights in memory and opened weights only. Each shows one error box
naming the problem and the fix, never a traceback or the bug note."""
import json

import pytest

from tests._apptools import fresh_caches, new_app, no_exception, tiny_model_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


@pytest.fixture
def model(tmp_path):
    return tiny_model_dir(tmp_path / "model")


def _error_text(at) -> str:
    no_exception(at)
    assert at.error, "expected an error box"
    return " ".join(e.value for e in at.error)


@pytest.mark.parametrize("name,change,problem", [
    ("list", lambda cfg: [1, 2], "JSON list, not a config"),
    ("null", lambda cfg: None, "JSON null, not a config"),
    ("deep", "[" * 50_000 + "]" * 50_000, "nested too deeply"),
    ("heads-0", lambda cfg: {**cfg, "num_attention_heads": 0}, "num_attention_heads"),
    ("layers-two", lambda cfg: {**cfg, "num_hidden_layers": "two"}, "num_hidden_layers"),
])
@pytest.mark.parametrize("page", ["model", "prune"])
def test_config_that_is_not_a_config(model, name, change, problem, page):
    cfg = model / "config.json"
    cfg.write_text(change if isinstance(change, str) else json.dumps(change(json.loads(cfg.read_text()))))
    text = _error_text(new_app(model, page=page))
    assert problem in text and "original config.json" in text, text


def test_model_name_too_long_for_the_file_system():
    at = new_app(page="model", run=False)
    at.run()
    at.sidebar.selectbox(key="hs.w.model_choice").set_value("other").run()
    at.sidebar.text_input(key="hs.w.model_text").set_value("a" * 5000).run()
    text = _error_text(at)
    assert "name is too long" in text and "shorter" in text, text


def test_model_name_too_long_in_the_link_falls_back_and_says_so():
    at = new_app("a" * 5000, page="model")                     # the link field caps its length first
    no_exception(at)
    notes = [w.value for w in at.warning]
    assert any("longer than 1000 characters" in n and "Fix the `model=` part" in n for n in notes), notes
    assert all(len(n) < 600 for n in notes), [len(n) for n in notes]   # the value is cut, not echoed whole


def _poison(folder, value):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if k.endswith("layers.0.self_attn.q_proj.weight"))
    state[name] = state[name].clone()
    state[name][3, 5] = value
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_weights_in_memory(model, value):
    _poison(model, value)
    text = _error_text(new_app(model, page="prune", scorer="mp-g"))
    assert "NaN or infinite values in layer 0" in text and "intact copy" in text, text


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_weights_opened_weights_only(model, value):
    _poison(model, value)
    at = new_app(model, page="model")
    at.toggle(key=f"hs.w.weights_only.{model}").set_value(True).run()
    no_exception(at)
    at.switch_page("pages/prune.py").run()
    text = _error_text(at)
    assert "NaN or infinite values in layer 0" in text and "q_proj" in text and "intact copy" in text, text
