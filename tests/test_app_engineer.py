"""The engineer's view before an export (issue 33): the whole-model change (parameters, the file's bytes in
the chosen format, the KV cache) in percent of the model, equal to what the export then writes; and a few
prompts continued by the dense model and by the cut, the cut's text equal to the physically pruned
model's."""
import json
import struct

import numpy as np
import pytest

from tests._apptools import fresh_caches, new_app, no_exception, out_root, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def _mask():
    pruned = np.zeros((4, 4), bool)
    pruned[0, :2] = True                    # one whole KV group of layer 0 (G = 2)
    pruned[2, 2:] = True
    return pruned


def test_whole_model_change_equals_the_written_pruned_file(tiny_dir, out_root):
    from analysis.arch.models import count_parameters
    from analysis.compress import export as export_mod
    from components import cache, state
    key = state.ModelKey(str(tiny_dir))
    lm = cache.load(key)
    rows = {r["whole model"].split(" ")[0]: r for r in cache.whole_model_change(key, _mask(), "auto", "pruned", ())}
    result = export_mod.export("pruned", lm.model, _mask(), out_root, "cut", tokenizer=lm.tokenizer)
    weights = result.path / export_mod.WEIGHTS_FILE
    raw = weights.read_bytes()
    header = struct.unpack("<Q", raw[:8])[0]
    assert rows["pruned"]["cut"] == len(raw) - 8 - header             # the tensor bytes of the file written
    params = rows["parameters"]
    assert params["dense"] == count_parameters(lm.model) and params["cut"] < params["dense"]
    assert params["change, % of the model"] == pytest.approx(100 * (params["cut"] - params["dense"]) / params["dense"])
    kv = rows["KV"]
    assert kv["cut"] == kv["dense"] * 6 // 8                           # 2 of 8 KV heads gone
    layout = json.loads((result.path / export_mod.LAYOUT_FILE).read_text())
    assert sum(len(h) for h in layout["heads"]) == 16 - 4


def test_whole_model_change_in_gguf_bytes(tiny_dir):
    from components import cache, state
    key = state.ModelKey(str(tiny_dir))
    rows = cache.whole_model_change(key, _mask(), "auto", "gguf", (("gguf_type", "f16"),))
    gguf = next(r for r in rows if r["whole model"].startswith("GGUF"))
    assert gguf["exact"] and 0 < gguf["cut"] < gguf["dense"]
    q4 = next(r for r in cache.whole_model_change(key, _mask(), "auto", "gguf", (("gguf_type", "q4_k_m"),))
              if r["whole model"].startswith("GGUF"))
    assert not q4["exact"] and "about" in q4["whole model"] and q4["dense"] < gguf["dense"]
    zeroed = next(r for r in cache.whole_model_change(key, _mask(), "auto", "zeroed", ()) if "file" in r["whole model"])
    assert zeroed["change"] == 0                                       # full shapes: no bytes saved


def test_generation_side_by_side_is_the_physical_cuts(tiny_dir):
    import torch

    from analysis.compress.surgery import prune_heads
    from components import cache, state
    key = state.ModelKey(str(tiny_dir))
    lm = cache.load(key)
    rows = cache.generate_side_by_side(key, _mask(), ("The cat", "A dog"), 6)
    smaller, _ = prune_heads(lm.model, _mask())
    for row in rows:
        ids = lm.tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            dense = lm.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
            cut = smaller.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
        assert row["dense"] == lm.tokenizer.decode(dense[0, ids.shape[1]:], skip_special_tokens=True)
        assert row["cut"] == lm.tokenizer.decode(cut[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_export_page_shows_the_whole_model_and_generates(tiny_dir, out_root):
    at = new_app(tiny_dir, page="export", policy="global", sparsity="0.25")
    no_exception(at)
    whole = next(t.value for t in at.table if "whole model" in t.value.columns)
    assert list(whole["whole model"])[0] == "parameters" and whole["change, % of the model"].iloc[0].endswith("%")
    at.text_area(key="hs.w.export.prompts").set_value("The cat\nA dog").run()
    at.number_input(key="hs.w.export.gen_tokens").set_value(4).run()
    at.button(key="export.generate").click().run()
    no_exception(at)
    shown = next(t.value for t in at.table if "prompt" in t.value.columns)
    assert list(shown["prompt"]) == ["The cat", "A dog"] and {"dense", "cut"} <= set(shown.columns)


def test_whole_model_change_counts_the_bytes_of_the_dtype_the_export_writes(tmp_path, out_root):
    """A bfloat16 checkpoint loaded in float32: the export writes bfloat16 (issue 35), and the table counts
    the bytes of that file, not of the float32 copy in memory."""
    import torch

    from analysis.compress import export as export_mod
    from components import cache, state
    from tests._apptools import trivial_tokenizer
    from tests._tiny import tiny_model
    folder = tmp_path / "bf16"
    tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16).save_pretrained(folder)
    trivial_tokenizer().save_pretrained(folder)
    key = state.ModelKey(str(folder))
    lm = cache.load(key)
    assert lm.source_dtype == torch.bfloat16 and next(lm.model.parameters()).dtype == torch.float32
    rows = {r["whole model"].split(" ")[0]: r for r in cache.whole_model_change(key, _mask(), "auto", "pruned", ())}
    result = export_mod.export("pruned", lm.model, _mask(), out_root, "cut16", tokenizer=lm.tokenizer,
                               dtype=lm.source_dtype)
    raw = (result.path / export_mod.WEIGHTS_FILE).read_bytes()
    assert rows["pruned"]["cut"] == len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
