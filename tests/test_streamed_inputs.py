"""Streamed checkpoints on hostile inputs, issue 36 class 5 (and the in-memory export, its sibling).

- NaN weights: scoring refuses them (their norms), but a mask file skips scoring: an all-NaN checkpoint
  cut with --mask-file was exported with exit 0 and computed NaN. The streamed export now reads and
  checks every attention tensor (cut or kept whole), the in-memory export every weight: one line, nothing
  written, no temporary folder left.
- Free memory: `export --checkpoint` read each tensor whole without the free-memory check that
  `score --checkpoint` makes (a 4 GiB sparse embedding was read past 3 GiB, and the kill left `.tmp`
  folders). Both now call `analysis.arch.checkpoint.check_tensor_memory` before a byte is read; the
  refusal comes before the temporary folder exists. Free memory is made small here by replacing
  psutil's reading (a real machine's free memory differs from machine to machine).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from analysis.core.errors import HeadscopeError
from tests._input_checks import model_dir  # noqa: F401  (a fixture)
from tests._input_checks import cli_error, cli_run



@pytest.fixture(scope="module")
def mask_file(tmp_path_factory, model_dir) -> Path:
    """mask.json of an uneven cut: one head of layer 0 only (layer 1 is kept whole)."""
    from analysis.compress.export import mask_record
    from analysis.arch.models import load_model
    import numpy as np
    lm = load_model(str(model_dir))
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = True
    path = tmp_path_factory.mktemp("mask") / "mask.json"
    path.write_text(mask_record(pruned, geometry=lm.geometry, model="tiny", model_type="llama").to_json())
    return path


def _poisoned(model_dir: Path, folder: Path, which) -> Path:
    """A copy of the model folder whose tensors named by which(name) are NaN."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, folder)
    state = load_file(folder / "model.safetensors")
    state = {k: torch.full_like(v, float("nan")) if which(k) else v for k, v in state.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _export(source_flag: str, source: Path, mask: Path, out: Path, fmt: str) -> list:
    return ["export", "--quiet", source_flag, source, "--mask-file", mask, "--out-dir", out, "--name", "cut",
            "--export-format", fmt]


def _nothing_left(out: Path) -> None:
    assert not out.exists() or list(out.iterdir()) == [], sorted(os.listdir(out))


@pytest.mark.parametrize("fmt", ["pruned", "stock", "gguf"])
def test_all_nan_checkpoint_is_refused_by_the_streamed_export(fmt, model_dir, mask_file, tmp_path):
    source = _poisoned(model_dir, tmp_path / "nan", lambda name: True)
    if fmt == "stock":                         # stock needs the same counts in every layer
        from analysis.compress.export import read_mask_json
        record = read_mask_json(mask_file)
        record.kept = [[0, 1], [0, 1]]                 # KV group 0 of each layer: a stock llama of 2 heads
        mask = tmp_path / "uniform.json"
        mask.write_text(record.to_json())
    else:
        mask = mask_file
    out = tmp_path / "exports"
    cli_error(_export("--checkpoint", source, mask, out, fmt), r"NaN or infinite", r"intact copy", seconds=120)
    _nothing_left(out)


def test_nan_in_a_layer_the_cut_keeps_whole_is_refused(model_dir, mask_file, tmp_path):
    """Layer 1 is not cut (its attention tensors were copied byte for byte): they are checked too."""
    source = _poisoned(model_dir, tmp_path / "nan1", lambda name: "layers.1.self_attn.v_proj" in name)
    out = tmp_path / "exports"
    cli_error(_export("--checkpoint", source, mask_file, out, "pruned"), r"layers\.1\.self_attn\.v_proj.*NaN",
              seconds=120)
    _nothing_left(out)


@pytest.mark.parametrize("fmt", ["pruned", "gguf"])
def test_nan_model_with_a_mask_file_is_refused_in_memory(fmt, model_dir, mask_file, tmp_path):
    source = _poisoned(model_dir, tmp_path / "nan", lambda name: "layers.0.mlp" in name)
    out = tmp_path / "exports"
    cli_error(_export("--model", source, mask_file, out, fmt), r"layers\.0\.mlp.*NaN or infinite", seconds=120)
    _nothing_left(out)


def test_the_library_refuses_nan_weights_for_the_app(model_dir, mask_file, tmp_path):
    """The Export page calls export_checkpoint (weights only) and export (a loaded model)."""
    from analysis.arch.models import load_model
    from analysis.compress.export import export, read_mask_json
    from analysis.compress.export.streamed import export_checkpoint
    source = _poisoned(model_dir, tmp_path / "nan", lambda name: "self_attn" in name)
    pruned = read_mask_json(mask_file).pruned()
    with pytest.raises(HeadscopeError, match="NaN or infinite"):
        export_checkpoint("pruned", source, pruned, tmp_path / "out" / "a")
    with pytest.raises(HeadscopeError, match="NaN or infinite"):
        export("pruned", load_model(str(source)).model, pruned, tmp_path / "out", "b")
    _nothing_left(tmp_path / "out")


@pytest.fixture
def little_free_memory(monkeypatch):
    """psutil says 4 KiB of RAM are free: less than any attention tensor of the tiny model needs (a 32 x 32
    float32 Q is 4 KiB, read and cut)."""
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=4096, total=2**34))


@pytest.mark.parametrize("fmt", ["gguf", "pruned"])
def test_streamed_export_checks_free_memory_like_score(fmt, model_dir, mask_file, tmp_path, little_free_memory):
    out = tmp_path / "exports"
    cli_error(_export("--checkpoint", model_dir, mask_file, out, fmt), r"needs about .* GiB of RAM to export",
              r"Close other programs", seconds=60)
    _nothing_left(out)                                  # refused before the temporary folder: no .tmp left
    cli_error(["score", "--quiet", "--checkpoint", model_dir, "--scorer", "magnitude"],
              r"needs about .* GiB of RAM to profile", r"Close other programs", seconds=60)


def test_streamed_export_runs_with_enough_memory(model_dir, mask_file, tmp_path):
    code, _, err = cli_run(_export("--checkpoint", model_dir, mask_file, tmp_path / "exports", "gguf"), seconds=120)
    assert code == 0, err
    assert (tmp_path / "exports" / "cut" / "model.gguf").is_file()
