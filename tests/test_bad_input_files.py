"""Bad files given to the library: hostile mask.json files, tampered or pickled exports, crafted
distillation checkpoints, head layouts that do not match their model, devices / FIFOs / huge files where
a file is read, checkpoints larger than memory, and text files cut at a character boundary.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.arch.geometry import HeadGeometry
from analysis.compress.export import load_pruned, mask_from_json, mask_record
from analysis.core.errors import HeadscopeError, InputError, ModelLoadError
from tests._bad_input import (model_dir, pruned_export, snapshot, copy_folder, edit_json, distill_pair, IDS, CFG,
                              Payload)  # noqa: F401 (fixtures)
from tests._tiny import tiny_model


# -- 8: mask.json (library: read_mask_json / mask_from_json) -----------------------------------------

GEOMETRY = HeadGeometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden=32)


def _mask_data(**changes) -> dict:
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[1, 2] = True
    data = json.loads(mask_record(pruned, geometry=GEOMETRY, model="m", model_type="llama",
                                  scores=np.ones((2, 4))).to_json())
    data.update(changes)
    return data


MASK_CASES = {
    "kept-strings": (_mask_data(kept=[["12", "3"], [0]]), r"kept/0/\d.*not of type 'integer'"),
    "kept-float": (_mask_data(kept=[[1.7], [0]]), r"kept/0/0.*integer"),
    "kept-true": (_mask_data(kept=[[True], [0]]), r"kept/0/0.*integer"),
    "kept-duplicates": (_mask_data(kept=[[1, 1], [0]]), r"kept/0.*non-unique"),
    "kept-out-of-range": (_mask_data(kept=[[0, 7], [0]]), r"do not fit 2 layers x 4 heads"),
    "kept-too-few-rows": (_mask_data(kept=[[0]]), r"do not fit 2 layers"),
    "n-layers-float": (_mask_data(n_layers=2.9), r"n_layers.*integer"),
    "n-heads-zero": (_mask_data(n_heads=0), r"n_heads.*less than the minimum"),
    "n-heads-1e13": (_mask_data(n_heads=10**13), r"n_heads.*greater than the maximum"),
    "n-kv-not-dividing": (_mask_data(n_kv_heads=3), r"does not divide"),
    "format-text": (_mask_data(format="abc"), r"format.*integer"),
    "format-null": (_mask_data(format=None), r"format.*integer"),
    "scores-wrong-shape": (_mask_data(scores=[[1.0, 2.0]]), r"scores must be 2 rows of 4"),
    "scores-nan": (json.dumps(_mask_data()).replace('"scores": [[1.0', '"scores": [[NaN'), r"scores must be 2 rows"),
    "not-an-object": ("[1, 2]", r"must hold a JSON object"),
    "invalid-json": ("{oops", r"not valid JSON"),
    "deep-nesting": ("{\"kept\": " + "[" * 100000 + "]" * 100000 + "}", r"nested too deeply"),
    "missing-kept": ({k: v for k, v in _mask_data().items() if k != "kept"}, r"'kept' is a required property"),
}


@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_mask_json_hostile(name, tmp_path):
    data, problem = MASK_CASES[name]
    path = tmp_path / "mask.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    before = snapshot(tmp_path)
    with pytest.raises(InputError) as info:
        mask_from_json(path)
    message = str(info.value)
    assert re.search(problem, message, re.I), message
    assert re.search(r"export the mask again", message, re.I), message
    assert snapshot(tmp_path) == before


def test_mask_json_format_from_the_future_says_update():
    with pytest.raises(InputError, match="Update headscope"):
        mask_from_json(_mask_data(format=99))


def test_mask_json_for_another_model_is_refused():
    other = HeadGeometry(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, hidden=32)
    with pytest.raises(InputError, match="use the mask exported for this model"):
        mask_from_json(_mask_data(), geometry=other)
    assert mask_from_json(_mask_data(), geometry=GEOMETRY)[1, 2]


# -- 9: tampered exports (load_pruned) ---------------------------------------------------------------

def _tamper_architectures(value):
    return lambda f: edit_json(f / "config.json", architectures=value)


def _bin_only(folder: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {folder.parent / 'PICKLE_RAN'}",))
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"w": Evil()}, handle)


PRUNED_CASES = {
    "architectures-os": (_tamper_architectures(["os"]), r"no llama model class", r"export the pruned model again"),
    "architectures-other-family": (_tamper_architectures(["BertModel"]), r"no llama model class", r"export"),
    "architectures-base-class": (_tamper_architectures(["PreTrainedModel"]), r"no llama model class", r"export"),
    "architectures-not-strings": (_tamper_architectures([1, None]), r"no llama model class", r"export"),
    "architectures-dunder": (_tamper_architectures(["__loader__"]), r"no llama model class", r"export"),
    "pickle-bin-only": (_bin_only, r"pickle file", r"export the pruned model again"),
    "layout-not-json": (lambda f: (f / "head_layout.json").write_text("{oops"), r"not valid JSON", r"export"),
    "layout-head-out-of-range": (lambda f: edit_json(f / "head_layout.json", heads=[[9], [0, 1, 2, 3]]),
                                 r"head_layout\.json", r"export the pruned model again"),
    "layout-strings": (lambda f: edit_json(f / "head_layout.json", n_heads="4"), r"n_heads.*integer", r"export"),
    "weights-truncated": (lambda f: (f / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{"),
                          r"cannot read the pruned checkpoint", r"export it again"),
    "index-outside": (lambda f: (f / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../../x.safetensors"}})), r"outside the checkpoint folder", r"plain file"),
}


@pytest.mark.parametrize("name", sorted(PRUNED_CASES))
def test_load_pruned_tampered(name, pruned_export, tmp_path):
    edit, problem, fix = PRUNED_CASES[name]
    folder = copy_folder(pruned_export, tmp_path / "export")
    edit(folder)
    before = snapshot(tmp_path)
    with pytest.raises(HeadscopeError) as info:
        load_pruned(folder)
    message = str(info.value)
    assert re.search(problem, message, re.I) and re.search(fix, message, re.I), message
    assert "weights_only" not in message and not (tmp_path / "PICKLE_RAN").exists()
    assert snapshot(tmp_path) == before


# -- 12: messages that mislead --------------------------------------------------------------------------

def test_malicious_pickle_is_not_called_damaged(model_dir, tmp_path, capfd):
    from analysis.arch.models import load_model
    folder = copy_folder(model_dir, tmp_path / "m")
    _bin_only(folder)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(folder))
    message = str(info.value)
    assert "pickle" in message and "safetensors" in message
    assert "damaged" not in message and "weights_only" not in message and "likely succeed" not in message
    assert not (tmp_path / "PICKLE_RAN").exists()


def test_memory_guard_offers_no_option_that_does_not_exist(model_dir):
    from analysis.arch.models import load_model
    with pytest.raises(ModelLoadError) as info:
        load_model(str(model_dir), available_bytes=1)
    assert "bfloat16" not in str(info.value) and "close other programs" in str(info.value).lower()


def test_no_load_report_table_before_the_error(model_dir, tmp_path, capfd):
    from safetensors.torch import load_file, save_file
    from analysis.arch.models import load_model
    folder = copy_folder(model_dir, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    state.pop(next(k for k in state if "q_proj" in k))
    save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ModelLoadError, match="lack 1 tensors"):
        load_model(str(folder))
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_streaming_memory_guard_checks_each_tensor_before_reading(tmp_path):
    from analysis.arch.checkpoint import check_tensor_header
    g = HeadGeometry(n_layers=1, n_heads=96, n_kv_heads=96, head_dim=1024, hidden=98304)
    with pytest.raises(ModelLoadError, match="GiB of RAM to profile") as info:
        check_tensor_header("q.weight", "q", [98304, 98304], g, tmp_path / "x.safetensors", available_bytes=2**30)
    assert "bfloat16" not in str(info.value) and "more memory" in str(info.value)
    check_tensor_header("q.weight", "q", [98304, 98304], g, tmp_path / "x.safetensors", available_bytes=2**40)


# -- 7: the text-file cap keeps whole characters and reads no more than it can use ----------------------

@pytest.mark.parametrize("char", ["a", "é", "€", "𐀀"])           # 1, 2, 3 and 4 UTF-8 bytes
def test_text_file_cap_cuts_at_a_character_boundary(char, tmp_path):
    from analysis.core.text import clean_user_text, read_text_file
    path = tmp_path / "long.txt"
    path.write_text(char * 5000, encoding="utf-8")
    for cap in range(1001, 1009):
        data = read_text_file(path, cap)
        assert len(data) <= cap and len(data) > cap - 4
        assert clean_user_text(data) == char * (len(data) // len(char.encode()))
    assert read_text_file(path, 10**9) == path.read_bytes()          # under the cap: the whole file


def test_a_crafted_checkpoint_never_runs_its_code_on_resume(tmp_path):
    from analysis.compress.recover.distill import CHECKPOINT_FILE, DistillConfig, distill
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "ck"
    folder.mkdir()
    cfg = DistillConfig(**CFG)
    # a torch.save'd dict that also holds the payload (what torch.load(weights_only=False) would run),
    # then a plain pickle under the checkpoint's name
    torch.save({"step": 1, "fingerprint": cfg.fingerprint(), "evil": Payload(marker)}, folder / CHECKPOINT_FILE)
    with pytest.raises(InputError, match=r"cannot be read \(it holds objects other than tensors"):
        distill(*distill_pair(), IDS, cfg, checkpoint_dir=folder, resume=True)
    assert not marker.exists(), "the checkpoint's payload ran"
    (folder / CHECKPOINT_FILE).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InputError, match=r"cannot be read"):
        distill(*distill_pair(), IDS, cfg, checkpoint_dir=folder, resume=True)
    assert not marker.exists(), "the pickle's payload ran"


def test_resume_with_a_student_of_another_shape_is_a_clear_error(tmp_path):
    from analysis.compress.recover.distill import DistillConfig, distill
    from analysis.compress.surgery import prune_heads
    cfg = DistillConfig(**CFG)
    distill(*distill_pair(), IDS, cfg, checkpoint_dir=tmp_path)
    teacher = tiny_model("llama")
    other = np.zeros((2, 4), dtype=bool)
    other[0, :2] = True                                  # two heads cut: other q/o shapes
    student, _ = prune_heads(teacher, other)
    with pytest.raises(InputError, match="student of another shape"):
        distill(teacher, student, IDS, cfg, checkpoint_dir=tmp_path, resume=True)


# -- 3, 15: the capped reader in the library ----------------------------------------------------------

def test_read_mask_json_refuses_devices_fifos_and_huge_files(tmp_path):
    from analysis.compress.export import read_mask_json
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="character device"):
        read_mask_json("/dev/zero")
    with pytest.raises(InputError, match=r"pipe \(FIFO\)"):
        read_mask_json(str(fifo))
    huge = tmp_path / "mask.json"
    with open(huge, "wb") as handle:
        handle.truncate(70 * 10**6)                                   # 70 MB, no disk used
    with pytest.raises(InputError, match="larger than"):
        read_mask_json(str(huge))


# -- 16, 17: library API validation -------------------------------------------------------------------

def _pruned_copy(pruned_export: Path, tmp_path: Path) -> Path:
    import shutil
    return Path(shutil.copytree(pruned_export, tmp_path / "copy"))


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "gpt2", r"is for a 'gpt2' model"),
    ("kv_policy", "bogus", r"kv_policy 'bogus' is not one of"),
])
def test_load_pruned_cross_checks_head_layout_metadata(pruned_export, tmp_path, field, value, match):
    from analysis.compress.export import LAYOUT_FILE, load_pruned
    folder = _pruned_copy(pruned_export, tmp_path)
    layout = json.loads((folder / LAYOUT_FILE).read_text())
    layout[field] = value
    (folder / LAYOUT_FILE).write_text(json.dumps(layout))
    with pytest.raises(HeadscopeError, match=match):
        load_pruned(folder)


def test_strict_layout_with_copied_kv_heads_is_refused():
    from analysis.compress.surgery import HeadLayout
    layout = HeadLayout(model_type="llama", n_heads=4, n_kv_heads=2, head_dim=8, heads=[[0, 2]], kv_heads=[[0, 1]],
                        kv_policy="expand")
    layout.validate()
    expanded = HeadLayout(model_type="llama", n_heads=4, n_kv_heads=2, head_dim=8, heads=[[0, 1]], kv_heads=[[0, 0]],
                          kv_policy="strict")
    with pytest.raises(InputError, match="'strict' never copies a KV head"):
        expanded.validate()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bool", "int64"])
def test_load_pruned_refuses_dtypes_no_model_is_built_in(pruned_export, tmp_path, dtype):
    from analysis.compress.export import load_pruned
    folder = _pruned_copy(pruned_export, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = dtype
    cfg.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=rf"dtype (torch\.)?{dtype}.*cannot be built in"):
        load_pruned(folder)
