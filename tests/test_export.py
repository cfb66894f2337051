"""Exports: each format reloads and computes what the masked model computes; mask.json rebuilds the
mask; exports are atomic and confined to the output root.
"""
import errno
import json
import os
import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.core.errors import HeadscopeError, InputError, ModelLoadError, UnsupportedModelError
from analysis.compress.export import (ExportError, atomic_folder, export, export_to, load_pruned, mask_from_json,
                                     mask_record, read_mask_json, resolve_under)
from analysis.compress.export import folder as folder_mod
from analysis.compress.export import formats as formats_mod
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.score.masks import plan_mask
from analysis.arch.resize import SURGERY
from tests._tiny import FAMILIES, TINY_SPECS, tiny_config, tiny_input_ids, tiny_model
from tests._masks import forward, masked_forward, surgery_masks

TOL = 1e-4
STOCK_FAMILIES = [f for f in FAMILIES if SURGERY[f].stock_config is not None]


def _hard_mask(family):
    """Emptied layer 0 plus an uneven GQA group in layer 1."""
    g = adapter_for(tiny_config(family)).geometry(tiny_config(family))
    pruned = np.zeros((g.n_layers, g.n_heads), bool)
    pruned[0] = True
    pruned[1, 1] = True
    return pruned


def _no_leftovers(parent):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_export_loads_and_matches(family, tmp_path):
    model = tiny_model(family)
    ids = tiny_input_ids()
    g = adapter_for(model).geometry(model)
    masks = surgery_masks(g, zlib.crc32(family.encode()))
    for name in ("emptied-layer", "uneven-groups", "random0"):
        pruned = masks[name]
        result = export_to("pruned", model, pruned, tmp_path / name)
        assert {"config.json", "model.safetensors", "head_layout.json", "mask.json"} <= set(result.files)
        loaded = load_pruned(result.path, attn_implementation="eager")
        assert (forward(loaded, ids) - masked_forward(model, pruned, ids)).abs().max().item() <= TOL, name
        assert np.array_equal(mask_from_json(result.path), pruned)
        assert result.layout.pruned_mask().tolist() == pruned.tolist()
    assert _no_leftovers(tmp_path) == []


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "phi3"])
def test_zeroed_export_loads_anywhere(family, tmp_path):
    model = tiny_model(family)
    ids = tiny_input_ids()
    pruned = _hard_mask(family)
    result = export_to("zeroed", model, pruned, tmp_path / "z")
    auto_cls = TINY_SPECS[family][0]
    loaded = auto_cls.from_pretrained(result.path, attn_implementation="eager").eval()
    assert (forward(loaded, ids) - masked_forward(model, pruned, ids)).abs().max().item() <= TOL
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    assert np.array_equal(mask_from_json(result.path / "mask.json"), pruned)


def _uniform_masks(g):
    """Every layer loses 2 of 4 heads: whole groups (H'=2, H_kv'=1) or one head per group (2, 2)."""
    per_group = np.zeros((g.n_layers, g.n_heads), bool)
    per_group[:, 1::2] = True
    whole_group = np.zeros((g.n_layers, g.n_heads), bool)
    whole_group[:, 2:] = True
    return {"one-per-group": per_group, "whole-group": whole_group}


@pytest.mark.parametrize("family", STOCK_FAMILIES)
def test_stock_from_pretrained_loads_uniform_export(family, tmp_path):
    model = tiny_model(family)
    ids = tiny_input_ids()
    g = adapter_for(model).geometry(model)
    auto_cls = TINY_SPECS[family][0]
    for name, pruned in _uniform_masks(g).items():
        result = export_to("stock", model, pruned, tmp_path / name)
        config = json.loads((result.path / "config.json").read_text())
        loaded = auto_cls.from_pretrained(result.path, attn_implementation="eager").eval()   # stock code
        assert type(loaded).__module__.startswith("transformers.")
        assert (forward(loaded, ids) - masked_forward(model, pruned, ids)).abs().max().item() <= TOL, name
        assert config["num_attention_heads"] == 2 and config["head_dim"] == g.head_dim
        assert sum(p.numel() for p in loaded.parameters()) < sum(p.numel() for p in model.parameters())
        again = load_pruned(result.path, attn_implementation="eager")          # also via the headscope loader
        assert (forward(again, ids) - forward(loaded, ids)).abs().max().item() <= TOL


def test_stock_export_refusals(tmp_path):
    llama = tiny_model("llama")
    with pytest.raises(InputError, match="same head counts in every layer"):
        export_to("stock", llama, _hard_mask("llama"), tmp_path / "a")
    three = np.zeros((2, 4), bool)
    three[:, 0] = True                    # 3 heads: transformers requires hidden (32) % heads == 0
    with pytest.raises(UnsupportedModelError, match="transformers rejects"):
        export_to("stock", llama, three, tmp_path / "b", kv_policy="expand")
    gpt2 = tiny_model("gpt2")
    with pytest.raises(UnsupportedModelError, match="n_embd / n_head"):
        export_to("stock", gpt2, _uniform_masks(adapter_for(gpt2).geometry(gpt2))["whole-group"], tmp_path / "c")
    assert sorted(os.listdir(tmp_path)) == []


def test_expand_policy_makes_uneven_layers_uniform(tmp_path):
    model = tiny_model("qwen2")
    pruned = np.zeros((2, 4), bool)
    pruned[0, 0] = True                   # layer 0 uneven (1 + 2 kept), layer 1 keeps groups (2 + 1)
    pruned[1, 3] = True
    result = export_to("stock", model, pruned, tmp_path / "s", kv_policy="expand")
    loaded = TINY_SPECS["qwen2"][0].from_pretrained(result.path, attn_implementation="eager").eval()
    ids = tiny_input_ids()
    assert (forward(loaded, ids) - masked_forward(model, pruned, ids)).abs().max().item() <= TOL
    assert loaded.config.num_key_value_heads == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_runtime_matches_pytorch(family, tmp_path):
    model = tiny_model(family)
    pruned = _hard_mask(family)
    result = export_to("onnx", model, pruned, tmp_path / "onnx")
    session = ort.InferenceSession(str(result.path / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = tiny_input_ids(batch=3, seq=7, seed=5)        # not the traced shape [2, 8]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0                                    # left padding in one row
    onnx_out = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with head_mask(model, gates_from_mask(pruned)):
        reference = forward(model, ids, attention_mask=mask).numpy()
    keep = np.ones(onnx_out.shape[:2], bool)
    keep[0, :2] = False                                # padded positions are undefined
    assert np.abs(onnx_out - reference)[keep].max() <= 1e-3
    assert np.array_equal(mask_from_json(result.path), pruned)


def test_generate_on_a_loaded_pruned_model(tmp_path):
    model = tiny_model("llama")
    pruned = _hard_mask("llama")
    result = export_to("pruned", model, pruned, tmp_path / "p")
    loaded = load_pruned(result.path, attn_implementation="eager")
    ids = tiny_input_ids(batch=1, seq=5)
    with head_mask(model, gates_from_mask(pruned)):
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert loaded.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist() == ref.tolist()


def test_load_pruned_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="head_layout.json"):
        load_pruned(tmp_path)
    model = tiny_model("gpt2")
    result = export_to("pruned", model, _hard_mask("gpt2"), tmp_path / "p")
    layout = json.loads((result.path / "head_layout.json").read_text())
    layout["heads"][1] = [0, 1, 2, 3]                  # weights hold 3 heads in layer 1
    layout["kv_heads"][1] = [0, 1, 2, 3]
    (result.path / "head_layout.json").write_text(json.dumps(layout))
    with pytest.raises(ModelLoadError, match="do not fit"):
        load_pruned(result.path)


# ---------------------------------------------------------------------------------------------
# Mask JSON
# ---------------------------------------------------------------------------------------------

def test_mask_json_rebuilds_the_mask_from_scores():
    rng = np.random.default_rng(0)
    scores = rng.random((2, 4))
    scores[0, :2] = 0.0                                 # ties: the tie-break decides
    tiebreak = rng.random((2, 4))
    plan = plan_mask(scores, 0.5, group_size=2, tiebreak=tiebreak)
    model = tiny_model("llama")
    g = adapter_for(model).geometry(model)
    record = mask_record(plan.pruned, geometry=g, model="tiny", model_type="llama", scores=scores,
                         scorer="mp", z=2.0, sparsity=0.5, policy="global", tiebreak=tiebreak)
    text = record.to_json()
    again = read_mask_json(text)
    assert again == record
    assert np.array_equal(mask_from_json(text), plan.pruned)
    rebuilt = plan_mask(np.array(again.scores), again.sparsity, group_size=2, tiebreak=np.array(again.tiebreak),
                        policy=again.policy)
    assert np.array_equal(rebuilt.pruned, plan.pruned)
    data = json.loads(text)
    assert data["tool"] == "headscope" and data["tool_version"] and data["z"] == 2.0
    assert data["kept"] == [np.flatnonzero(~row).tolist() for row in plan.pruned]


def test_mask_json_bad_inputs(tmp_path):
    model = tiny_model("llama")
    g = adapter_for(model).geometry(model)
    with pytest.raises(InputError, match="NaN"):
        mask_record(np.zeros((2, 4), bool), geometry=g, scores=np.full((2, 4), np.nan))
    with pytest.raises(InputError, match="shape"):
        mask_record(np.zeros((2, 3), bool), geometry=g)
    with pytest.raises(InputError, match="not valid JSON"):
        mask_from_json("{oops")
    bad = mask_record(np.zeros((2, 4), bool), geometry=g).to_json().replace('"kept": [', '"kept": [[9], ', 1)
    with pytest.raises(InputError):
        mask_from_json(bad)
    with pytest.raises(InputError, match="Cannot read"):
        mask_from_json(tmp_path / "missing.json")
    with pytest.raises(InputError, match="does not describe"):
        export_to("pruned", model, _hard_mask("llama"), tmp_path / "x",
                      record=mask_record(np.zeros((2, 4), bool), geometry=g))


# ---------------------------------------------------------------------------------------------
# Paths and atomicity
# ---------------------------------------------------------------------------------------------

def test_resolve_under_confines_paths(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    assert resolve_under(root, "a/b") == (root / "a" / "b").resolve()
    assert resolve_under(root, str(root / "c")) == (root / "c").resolve()
    for bad in ("../x", "a/../../x", "/etc/x", str(tmp_path / "elsewhere"), "", "  ", ".", "a/.."):
        with pytest.raises(InputError):
            resolve_under(root, bad)
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(InputError, match="outside"):
        resolve_under(root, "link/escaped")


def test_export_entry_point_refuses_escapes(tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(InputError, match="outside"):
        export("zeroed", model, _hard_mask("gpt2"), tmp_path / "root", "../escape")
    assert not (tmp_path / "escape").exists()
    with pytest.raises(InputError, match="Unknown export format"):
        export("pickle", model, _hard_mask("gpt2"), tmp_path / "root", "x")
    result = export("pruned", model, _hard_mask("gpt2"), tmp_path / "root", "deep/er/x")
    assert result.path == (tmp_path / "root" / "deep" / "er" / "x").resolve()


def test_existing_target_is_not_overwritten_unless_asked(tmp_path):
    model = tiny_model("gpt2")
    target = tmp_path / "t"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(ExportError, match="not empty"):
        export_to("pruned", model, _hard_mask("gpt2"), target)
    assert (target / "keep.txt").read_text() == "precious"
    assert _no_leftovers(tmp_path) == []
    # overwrite replaces only a headscope export: a folder of user files is never deleted (issue 11, class 4)
    with pytest.raises(ExportError, match="not a headscope export"):
        export_to("pruned", model, _hard_mask("gpt2"), target, overwrite=True)
    assert (target / "keep.txt").read_text() == "precious"
    assert _no_leftovers(tmp_path) == []
    (target / "keep.txt").unlink()
    export_to("zeroed", model, _hard_mask("gpt2"), target)
    export_to("pruned", model, _hard_mask("gpt2"), target, overwrite=True)
    assert not (target / "model.safetensors.index.json").exists() and (target / "head_layout.json").exists()
    assert _no_leftovers(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    export_to("zeroed", model, _hard_mask("gpt2"), empty)     # an empty folder is fine
    assert (empty / "mask.json").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_to("zeroed", model, _hard_mask("gpt2"), tmp_path / "file", overwrite=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_folder_real(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ExportError, match="writable"):
            export_to("zeroed", tiny_model("gpt2"), _hard_mask("gpt2"), ro / "x")
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o755)


def test_read_only_folder_simulated(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(folder_mod, "_fresh_dir", denied)   # the temporary folder cannot be made
    with pytest.raises(ExportError, match="writable"):
        export_to("zeroed", tiny_model("gpt2"), _hard_mask("gpt2"), tmp_path / "new" / "x")
    assert os.listdir(tmp_path) == [], "the parent folder created for the export was left behind"


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("boom")])
def test_failure_halfway_leaves_nothing(tmp_path, monkeypatch, failure):
    model = tiny_model("llama")
    target = tmp_path / "t"

    def half_written(tmp, record, tokenizer, layout):
        (tmp / "mask.json").write_text("partial")
        raise failure
    monkeypatch.setattr(formats_mod, "write_common", half_written)
    with pytest.raises(ExportError, match="nothing was left behind") as info:
        export_to("pruned", model, _hard_mask("llama"), target)
    assert isinstance(info.value, HeadscopeError)
    assert os.listdir(tmp_path) == []
    # with overwrite, a failed export leaves the previous export untouched
    monkeypatch.undo()
    export_to("pruned", model, _hard_mask("llama"), target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    monkeypatch.setattr(formats_mod, "write_common", half_written)
    with pytest.raises(ExportError):
        export_to("pruned", model, np.eye(2, 4, dtype=bool), target, overwrite=True)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["t"]


def test_atomic_folder_renames_only_at_the_end(tmp_path):
    target = tmp_path / "t"
    with atomic_folder(target) as tmp:
        (tmp / "a").write_text("1")
        assert not target.exists() and tmp.parent == tmp_path
    assert (target / "a").read_text() == "1" and _no_leftovers(tmp_path) == []


def test_stock_export_without_pruning_loads_for_any_family(tmp_path):
    # nothing pruned: every family's config can say it, and load_pruned reads the save_pretrained keys
    model = tiny_model("gpt_neox")                      # save_pretrained renames lm_head -> embed_out
    nothing = np.zeros((2, 4), bool)
    result = export_to("stock", model, nothing, tmp_path / "s")
    ids = tiny_input_ids()
    loaded = load_pruned(result.path, attn_implementation="eager")
    assert (forward(loaded, ids) - forward(model, ids)).abs().max().item() <= TOL


def test_stock_export_of_a_balanced_mask_reloads_and_matches(tmp_path):
    from analysis.compress.export import stock_check
    # G = 3: a uniform or global mask at 1/3 leaves uneven groups; balanced-uniform keeps 2 of 3 per group
    model = tiny_model("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3)
    g = adapter_for(model).geometry(model)
    scores = np.random.default_rng(7).random((3, 6))
    ids = tiny_input_ids()
    plan = plan_mask(scores, 1 / 3, group_size=3, policy="balanced-uniform")
    assert stock_check(model, plan.pruned).ok
    result = export_to("stock", model, plan.pruned, tmp_path / "balanced", kv_policy="strict")
    loaded = TINY_SPECS["llama"][0].from_pretrained(result.path, attn_implementation="eager").eval()
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (4, 2)
    assert (forward(loaded, ids) - masked_forward(model, plan.pruned, ids)).abs().max().item() <= TOL
    assert sum(p.numel() for p in loaded.parameters()) < sum(p.numel() for p in model.parameters())
    # stock_check agrees with what export_stock does, and names the stock sparsities otherwise
    for policy in ("balanced", "uniform", "global", "groups"):
        pruned = plan_mask(scores, 0.5, group_size=3, policy=policy).pruned
        check = stock_check(model, pruned)
        try:
            export_to("stock", model, pruned, tmp_path / policy)
            exported = True
        except HeadscopeError:
            exported = False
        assert check.ok == exported, policy
        if not check.ok:
            assert "Nearest sparsities that can" in check.message() and check.nearest
            assert any(s == pytest.approx(1 / 3) and p == "balanced-uniform" for s, p, _, _ in check.nearest)
    assert g.group_size == 3


def test_export_folders_get_ordinary_permissions(tmp_path):
    """Not mkdtemp's 0700: an export is a folder like any other (the umask decides)."""
    import os
    from analysis.compress.export import atomic_folder
    umask = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "out") as tmp:
            (tmp / "x.txt").write_text("x")
    finally:
        os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_default_export_root_is_in_home_unless_the_env_says(monkeypatch, tmp_path):
    from pathlib import Path
    from analysis.compress.export import default_export_root
    monkeypatch.delenv("HEADSCOPE_EXPORT_ROOT", raising=False)
    assert default_export_root() == Path.home() / "headscope-exports"
    monkeypatch.setenv("HEADSCOPE_EXPORT_ROOT", str(tmp_path / "x"))
    assert default_export_root() == tmp_path / "x"


@pytest.mark.parametrize("kv_policy", ["auto", "expand"])
def test_mask_json_records_the_kv_policy_of_the_cut(kv_policy, tmp_path):
    """mask.json of a physical cut says which kv_policy built it (it decides the layout); a zeroed
    export keeps the original shapes and says none."""
    model = tiny_model("llama")
    pruned = np.zeros((2, 4), bool)
    pruned[0, 0] = True                                               # uneven groups: the policies differ
    cut = export_to("pruned", model, pruned, tmp_path / f"cut-{kv_policy}", kv_policy=kv_policy)
    assert read_mask_json(cut.path).kv_policy == kv_policy == cut.layout.kv_policy
    zeroed = export_to("zeroed", model, pruned, tmp_path / f"zeroed-{kv_policy}")
    assert read_mask_json(zeroed.path).kv_policy is None
