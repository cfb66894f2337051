"""Export page: mask.json describes exactly the shown mask and view; exports land inside the output
folder, refuse unsafe or occupied targets with a fix, and never change the shared cached model."""
import json

import numpy as np
import pytest
import torch

from tests._apptools import (downloads, figure_titled, fresh_caches, new_app, no_exception, out_root,  # noqa: F401
                             tiny_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")


def _shown_mask(at):
    return np.asarray(figure_titled(at, "heads pruned")["data"][0]["z"]).astype(bool)


def test_mask_json_is_the_shown_mask(tiny_dir, out_root, downloads):
    at = new_app(tiny_dir, page="export", policy="global", scorer="mp-g", z="1.5", sparsity="0.5")
    no_exception(at)
    record = json.loads(downloads["mask.json"])
    pruned = _shown_mask(at)
    kept = [np.flatnonzero(~row).tolist() for row in pruned]
    assert record["kept"] == kept and int(pruned.sum()) == 8
    assert (record["scorer"], record["z"], record["sparsity"]) == ("mp-g", 1.5, 0.5)


def test_export_pruned_keeps_cached_model_intact(tiny_dir, out_root):
    from analysis.compress.export import load_pruned, mask_from_json
    from components import cache, state
    at = new_app(tiny_dir, page="export", policy="global", sparsity="0.5")
    model = cache.load(state.ModelKey(str(tiny_dir))).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    at.selectbox(key="hs.w.export.format").set_value("pruned").run()
    at.text_input(key="hs.w.export.folder").set_value("my-export").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert not at.error and any("my-export" in s.value for s in at.success)
    folder = out_root / "my-export"
    np.testing.assert_array_equal(mask_from_json(folder), _shown_mask(at))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    smaller = load_pruned(folder)
    assert sum(p.numel() for p in smaller.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("folder,needle", [("../outside", "outside the output folder"), ("", "Give a folder name")])
def test_unsafe_targets_are_refused(tiny_dir, out_root, folder, needle):
    at = new_app(tiny_dir, page="export", policy="global")
    at.text_input(key="hs.w.export.folder").set_value(folder).run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert any(needle in e.value for e in at.error), [e.value for e in at.error]
    assert not at.success


def test_occupied_target_needs_overwrite(tiny_dir, out_root):
    (out_root / "taken").mkdir(parents=True)
    (out_root / "taken" / "keep.txt").write_text("mine")
    at = new_app(tiny_dir, page="export", policy="global")
    at.text_input(key="hs.w.export.folder").set_value("taken").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert any("already exists" in e.value for e in at.error)
    assert (out_root / "taken" / "keep.txt").read_text() == "mine"
    at.checkbox(key="hs.w.export.overwrite").check().run()
    at.button(key="export.run").click().run()
    # a folder headscope did not write is never replaced, even with overwrite (issue 11, class 4)
    assert any("not a headscope export" in e.value for e in at.error)
    assert (out_root / "taken" / "keep.txt").read_text() == "mine"
    (out_root / "taken" / "keep.txt").unlink()
    at.checkbox(key="hs.w.export.overwrite").uncheck().run()
    at.button(key="export.run").click().run()          # an empty folder is filled
    first = (out_root / "taken" / "mask.json").read_text()
    at.checkbox(key="hs.w.export.overwrite").check().run()
    at.button(key="export.run").click().run()          # and a headscope export is replaced
    assert not at.error and (out_root / "taken" / "mask.json").read_text() == first


def test_measured_report_shows_the_pruned_size(tiny_dir, out_root):
    at = new_app(tiny_dir, page="export", policy="global", sparsity="0.5")
    at.number_input(key="hs.w.export.speed.repeats").set_value(1).run()
    at.multiselect(key="hs.w.export.speed.lengths").set_value([128]).run()
    at.button(key="export.measure").click().run()
    no_exception(at)
    from components import cache, state
    model = cache.load(state.ModelKey(str(tiny_dir))).model
    dense = sum(p.numel() for p in model.parameters())
    shown = int([m for m in at.metric if m.label == "Parameters"][0].value.replace(",", ""))
    assert 0 < shown < dense
    assert any(m.label == "Heads pruned" and m.value == "8 / 16" for m in at.metric)
    assert at.table, "no timing table"
    from analysis.compress.cost import FLOP_NOTE
    assert FLOP_NOTE in [c.value for c in at.caption]          # the one FLOP convention, said under the table


def test_default_folder_name_follows_the_settings_until_edited(tiny_dir, out_root):
    at = new_app(tiny_dir, page="export", policy="global", scorer="mp-g", sparsity="0.5")
    no_exception(at)
    folder = at.text_input(key="hs.w.export.folder")
    assert folder.value.endswith("-mp-g-s0.5-global-zeroed")
    assert at.text_input(key="hs.w.export.root").value == str(out_root)     # the env variable's root is shown
    at.selectbox(key="hs.w.export.format").set_value("pruned").run()
    assert at.text_input(key="hs.w.export.folder").value.endswith("-mp-g-s0.5-global-pruned")
    at.text_input(key="hs.w.export.folder").set_value("mine").run()
    at.selectbox(key="hs.w.export.format").set_value("zeroed").run()
    assert at.text_input(key="hs.w.export.folder").value == "mine"          # a typed name is kept


def test_export_goes_under_the_root_shown_on_the_page(tiny_dir, out_root, tmp_path):
    other = tmp_path / "elsewhere"
    at = new_app(tiny_dir, page="export", policy="global", sparsity="0.5")
    at.text_input(key="hs.w.export.root").set_value(str(other)).run()
    at.text_input(key="hs.w.export.folder").set_value("here").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert (other / "here" / "mask.json").is_file() and not out_root.exists()
    assert any(str(other / "here") in s.value for s in at.success)


def test_a_relative_root_is_refused_with_where_it_would_land(tiny_dir, out_root):
    """Issue 33: a typed `relative/dir` wrote 516 MiB under the server's working folder."""
    from pathlib import Path
    at = new_app(tiny_dir, page="export", policy="global")
    at.text_input(key="hs.w.export.root").set_value("relative/e2e-dir").run()
    no_exception(at)
    error = next(e.value for e in at.error if "relative path" in e.value)
    assert str(Path.cwd() / "relative" / "e2e-dir") in error and "absolute path" in error
    assert at.button(key="export.run").disabled
    assert not (Path.cwd() / "relative").exists()


@pytest.mark.parametrize("root", ["/proc", "/proc/headscope/x"])
def test_an_unwritable_root_says_the_true_reason(tiny_dir, out_root, root):
    """Issue 33: /proc as the export root said "a folder on the path does not exist"."""
    at = new_app(tiny_dir, page="export", policy="global")
    at.text_input(key="hs.w.export.root").set_value(root).run()
    no_exception(at)
    error = next(e.value for e in at.error if "Cannot write into" in e.value)
    assert "takes no new folders" in error and "e.g. /proc or /sys" in error and "does not exist" not in error
    assert at.button(key="export.run").disabled


def test_a_read_only_root_says_so(tiny_dir, out_root, tmp_path):
    import os
    if os.geteuid() == 0:
        pytest.skip("root writes into a folder without write permission")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    at = new_app(tiny_dir, page="export", policy="global")
    at.text_input(key="hs.w.export.root").set_value(str(locked / "sub")).run()
    assert any("permission" in e.value.lower() for e in at.error), [e.value for e in at.error]


def test_exports_off_for_a_class(tiny_dir, out_root, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_EXPORTS", "off")
    at = new_app(tiny_dir, page="export", policy="global")
    no_exception(at)
    assert any("HEADSCOPE_EXPORTS=off" in i.value for i in at.info)
    assert not [t for t in at.text_input if t.key.startswith("hs.w.export")] and not [b for b in at.button if b.key == "export.run"]
    monkeypatch.setenv("HEADSCOPE_EXPORTS", "fixed")
    at = new_app(tiny_dir, page="export", policy="global")
    assert all(t.key != "hs.w.export.root" for t in at.text_input)                 # no root to type
    assert any(str(out_root) in c.value and "fixed by the server" in c.value for c in at.caption)
    assert not at.button(key="export.run").disabled


def test_a_bfloat16_checkpoint_is_exported_in_bfloat16(tmp_path, out_root):
    """Issue 35: the app loads a bfloat16 checkpoint in float32 on a CPU; the export keeps bfloat16 (the
    checkpoint's dtype), and the shared model stays float32."""
    from safetensors.torch import load_file
    from components import cache, state
    from tests._apptools import trivial_tokenizer
    from tests._tiny import tiny_model
    ckpt = tmp_path / "bf16"
    tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16).save_pretrained(ckpt)
    trivial_tokenizer().save_pretrained(ckpt)
    at = new_app(str(ckpt), page="export", policy="groups", sparsity="0.5")
    at.selectbox(key="hs.w.export.format").set_value("pruned").run()
    at.text_input(key="hs.w.export.folder").set_value("bf16-export").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert not at.error and any("bf16-export" in s.value for s in at.success)
    written = {t.dtype for f in (out_root / "bf16-export").glob("*.safetensors") for t in load_file(str(f)).values()}
    assert written == {torch.bfloat16}
    assert next(cache.load(state.ModelKey(str(ckpt))).model.parameters()).dtype == torch.float32
