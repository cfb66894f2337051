"""The app with a checkpoint folder opened weights only (issue 22): the Model page's switch builds no
model (meta device), Profiles / Prune / Walkthrough / Export work from the streamed profile, the
export is the streamed one (its tensors equal the in-memory export's), and the pages that run the
model say so in one line and offer loading it with offload."""
import json

import numpy as np
import pytest
import torch

from tests._apptools import fresh_caches, new_app, no_exception, out_root, texts  # noqa: F401
from tests._tiny import tiny_model

pytestmark = pytest.mark.usefixtures("fresh_caches")


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Llama checkpoint folder in bfloat16, sharded, with no tokenizer (weights only needs none)."""
    folder = tmp_path / "ckpt"
    tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    return folder


def _metric(at, label: str) -> str:
    return next(m.value for m in at.get("metric") if m.label == label)


def _weights_only(at, folder):
    at.toggle(key=f"hs.w.weights_only.{folder}").set_value(True).run()
    no_exception(at)
    return at


def _open(folder, page="model", **params):
    at = new_app(folder, page="model", **params)
    _weights_only(at, folder)
    if page != "model":
        at.switch_page(f"pages/{page}.py").run()
        no_exception(at)
    return at


def test_model_page_opens_weights_only_without_building_it(checkpoint):
    from analysis.arch.models import is_weights_only
    from components import cache, state
    at = _open(checkpoint)
    shown = texts(at)
    assert "Open weights only" in shown and "Layers (L): 4" in shown and "KV heads (H_kv): 2" in shown
    lm = cache.load(state.ModelKey(str(checkpoint), weights_only=True))
    assert is_weights_only(lm) and next(lm.model.parameters()).dtype == torch.bfloat16


def test_prune_page_live_z_and_sparsity_counted_from_the_layout(checkpoint):
    at = _open(checkpoint, "prune", sparsity="0.25")
    assert _metric(at, "Query heads after / before") == "12 / 16"                # 25% of 16 heads pruned
    at.slider(key="hs.w.prune.sparsity").set_value(0.5).run()
    no_exception(at)
    assert _metric(at, "Query heads after / before") == "8 / 16"
    at.slider(key="hs.w.prune.z").set_value(1.0).run()
    no_exception(at)
    assert "Heads with score 0 at z = 1" in texts(at)
    info = [i.value for i in at.info]
    assert any("runs the model" in line and "weights only" in line for line in info), info
    assert any(b.label == "Load the model with disk offload" for b in at.button)


@pytest.mark.parametrize("page", ["profiles", "walkthrough"])
def test_profile_pages_work_weights_only(checkpoint, page):
    at = _open(checkpoint, page)
    assert not at.error, [e.value for e in at.error]
    assert at.get("plotly_chart")


@pytest.mark.parametrize("page", ["heads", "pipeline", "compare"])
def test_pages_that_run_the_model_say_so_in_one_line(checkpoint, page):
    at = _open(checkpoint, page)
    lines = [i.value for i in at.info if "runs the model" in i.value]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert any(b.label == "Load the model with disk offload" for b in at.button)


def test_offload_button_loads_the_model(checkpoint):
    from tests._apptools import trivial_tokenizer
    trivial_tokenizer().save_pretrained(checkpoint)            # a loaded model needs its tokenizer
    at = _open(checkpoint, "heads")
    next(b for b in at.button if b.label == "Load the model with disk offload").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    assert not [i.value for i in at.info if "runs the model" in i.value]
    assert any(b.label.startswith("Run the ablation sweep") for b in at.button)
    placement = at.session_state["hs.placement"]
    assert placement.device_map == "auto" and placement.offload_folder


def test_export_page_streams_and_equals_the_in_memory_export(checkpoint, out_root, tmp_path):
    from analysis.compress.export import FORMATS, export_to, load_pruned
    from safetensors.torch import load_file
    at = _open(checkpoint, "export", sparsity="0.5", scorer="mp-g")
    fmt = at.selectbox(key="hs.w.export.format.streamed")
    from analysis.compress.export.streamed import streamed_formats
    assert "pruned" in streamed_formats() and "zeroed" not in streamed_formats()
    assert list(fmt.options) == [FORMATS[f].label for f in streamed_formats()]         # the streamed formats
    at.text_input(key="hs.w.export.folder").set_value("cut").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    folder = out_root / "cut"
    record = json.loads((folder / "mask.json").read_text())
    pruned = np.ones((record["n_layers"], record["n_heads"]), bool)
    for layer, kept in enumerate(record["kept"]):
        pruned[layer, kept] = False
    assert pruned.sum() == 8
    export_to("pruned", tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16), pruned, tmp_path / "mem")
    mine = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    theirs = load_file(str(tmp_path / "mem" / "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    assert all(mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]) for k in mine)
    assert load_pruned(folder) is not None


def test_streamed_profile_reports_each_layer_and_stops(checkpoint):
    from analysis.core.errors import CancelledError
    from components import cache, state
    key = state.ModelKey(str(checkpoint), weights_only=True)
    with pytest.raises(CancelledError):
        cache.profile(key, _should_stop=lambda: True)
    seen = []
    prof = cache.profile(key, _progress=lambda f, m: seen.append(m))
    assert [m for m in seen if m.startswith("streamed layer")] == [f"streamed layer {i}/4" for i in range(1, 5)]
    assert prof.n_layers == 4
