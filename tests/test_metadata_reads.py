"""Small metadata files on hostile inputs, issue 36 classes 2, 3 and 6 (load_pruned), and their siblings.

Every metadata read is bounded and refuses what is not a regular file (analysis.core.files): a FIFO, a
link to /dev/zero or a 2 GiB sparse file where mask.json, run.json, head_layout.json, config.json, a
tokenizer file or a built-in marker belongs is one error line (or, for the leftover cleaner, "not
headscope's": left alone), at once, in bounded memory:
- class 2: the leftover cleaner (every export into a folder runs it) and `pipeline --overwrite`;
- class 3: `roles` on an export reads head_layout.json through load_pruned's reader: bytes that are not
  UTF-8, a FIFO, a /dev/zero link, a folder or a 2 GiB file are one line naming head_layout.json (not a
  plain-model load blaming ignore_mismatched_sizes);
- class 6: load_pruned refuses full-size (zeroed-export) weights under an uneven head_layout.json;
- siblings: load_pruned's config.json, a model folder's tokenizer files (transformers reads them
  unbounded), the built-in marker the GGUF export reads.
A case that would hang on a FIFO runs in a thread that the test releases (`released_fifo`); one that would
read /dev/zero runs in a subprocess killed at 2 GiB (`run_cli`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from analysis.core.errors import HeadscopeError
from tests._input_checks import model_dir  # noqa: F401  (a fixture)
from tests._input_checks import cli_error, cli_run, in_thread, one_error_line, peak_memory, released_fifo, run_cli

ROLES = ["roles", "--quiet", "--detector", "induction", "--n-sequences", "1", "--length", "4"]



@pytest.fixture(scope="module")
def exports(tmp_path_factory, model_dir) -> dict[str, Path]:
    """A pruned export (uneven: layer 0 loses a head) and a zeroed export of the same mask."""
    from analysis.arch.models import load_model
    from analysis.compress.export import export
    lm = load_model(str(model_dir))
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = True
    root = tmp_path_factory.mktemp("meta-exports")
    return {fmt: export(fmt, lm.model, pruned, root, fmt, tokenizer=lm.tokenizer).path for fmt in ("pruned", "zeroed")}


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as handle:
        handle.truncate(size)                     # all NUL bytes, no disk used
    return path


def _cli_in_thread(argv, seconds: float, release) -> tuple[int, str]:
    """(exit code, stderr) of the CLI run in a thread that `release` unblocks if it waits on a FIFO."""
    from analysis import cli

    def call():
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = cli.main([str(a) for a in argv])
        return code, err.getvalue()
    return in_thread(call, seconds, release)


def _release(path: Path):
    def release():
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    return release


# -- class 2: the leftover cleaner and --overwrite -------------------------------------------------------

def _leftover(root: Path) -> Path:
    folder = root / ".old-run.tmp-999999999-abcd"          # a dead process's temporary folder
    folder.mkdir(parents=True)
    return folder


def test_leftover_cleaner_leaves_a_fifo_mask_json_alone(tmp_path):
    from analysis.compress.export.folder import clean_leftovers
    leftover = _leftover(tmp_path)
    with released_fifo(leftover / "mask.json") as fifo:
        notes = in_thread(lambda: clean_leftovers(tmp_path), 20, _release(fifo))
    assert notes == [] and leftover.is_dir()               # not headscope's: never deleted


def test_export_into_a_folder_with_a_fifo_leftover_starts(tmp_path, model_dir):
    """The cleaner runs before every export into the folder: a FIFO there stopped every export, whatever
    its name."""
    root = tmp_path / "exports"
    leftover = _leftover(root)
    with released_fifo(leftover / "mask.json") as fifo:
        code, err = _cli_in_thread(["export", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25", "--model",
                                    model_dir, "--out-dir", root, "--name", "next"], 60, _release(fifo))
    assert code == 0, err
    assert (root / "next" / "mask.json").is_file() and leftover.is_dir()


def test_export_into_a_folder_with_a_dev_zero_leftover_reads_nothing(tmp_path, model_dir):
    root = tmp_path / "exports"
    leftover = _leftover(root)
    os.symlink("/dev/zero", leftover / "mask.json")
    code, err, _ = run_cli(["export", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25", "--model",
                            model_dir, "--out-dir", root, "--name", "next"], timeout=180)
    assert code == 0, err
    assert (root / "next" / "mask.json").is_file() and leftover.is_dir()


PIPELINE = ["pipeline", "--quiet", "--no-int8", "--formats", "pruned", "--eval-tokens", "16", "--overwrite"]


def test_pipeline_overwrite_over_a_fifo_run_json(tmp_path, model_dir):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    with released_fifo(run / "run.json") as fifo:
        code, err = _cli_in_thread([*PIPELINE, "--model", model_dir, "--out-dir", tmp_path / "runs", "--name", "r1"],
                                   60, _release(fifo))
    assert code == 2
    one_error_line(err, r"not a headscope export", r"another name|move")
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]


def test_pipeline_overwrite_over_a_dev_zero_run_json(tmp_path, model_dir):
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    os.symlink("/dev/zero", run / "run.json")
    code, err, _ = run_cli([*PIPELINE, "--model", model_dir, "--out-dir", tmp_path / "runs", "--name", "r1"],
                           timeout=180)
    assert code == 2
    one_error_line(err, r"not a headscope export", r"another name|move")
    assert os.path.islink(run / "run.json")


def test_is_headscope_export_reads_a_huge_mask_json_bounded(tmp_path):
    from analysis.compress.export.folder import is_headscope_export
    _sparse(tmp_path / "mask.json", 2 * 2**30)
    with peak_memory() as peak:
        assert not is_headscope_export(tmp_path)
    assert peak["grew"] < 256 * 2**20, peak


# -- class 3: roles reads head_layout.json through load_pruned's reader -------------------------------

def _layout_case(exports, tmp_path, kind: str) -> Path:
    folder = tmp_path / kind
    shutil.copytree(exports["pruned"], folder)
    layout = folder / "head_layout.json"
    layout.unlink()
    if kind == "not-utf8":
        layout.write_bytes(b"\xff\xfe{\"heads\": 1}")
    elif kind == "dev-zero":
        os.symlink("/dev/zero", layout)
    elif kind == "folder":
        layout.mkdir()
    elif kind == "sparse-2gib":
        _sparse(layout, 2 * 2**30)
    elif kind == "fifo":
        os.mkfifo(layout)
    return folder


LAYOUT_CASES = {"not-utf8": r"head_layout\.json.*not UTF-8", "fifo": r"head_layout\.json.*pipe \(FIFO\)",
                "dev-zero": r"head_layout\.json.*character device", "folder": r"head_layout\.json.*is a folder",
                "sparse-2gib": r"head_layout\.json.*larger than 64 MiB"}


@pytest.mark.parametrize("kind", LAYOUT_CASES)
def test_roles_on_an_export_with_a_broken_layout(kind, exports, tmp_path):
    folder = _layout_case(exports, tmp_path, kind)
    with peak_memory() as peak:
        cli_error([*ROLES, "--model", folder], LAYOUT_CASES[kind], r"export the pruned model again", seconds=30)
    assert peak["grew"] < 256 * 2**20, peak


@pytest.mark.parametrize("kind", LAYOUT_CASES)
def test_load_pruned_refuses_the_same_layouts(kind, exports, tmp_path):
    from analysis.compress.export import load_pruned
    folder = _layout_case(exports, tmp_path, kind)
    with pytest.raises(HeadscopeError, match=LAYOUT_CASES[kind]):
        load_pruned(folder)


# -- class 6: full-size weights under an uneven layout ---------------------------------------------------

def test_load_pruned_refuses_zeroed_weights_under_an_uneven_layout(exports, tmp_path):
    from analysis.compress.export import load_pruned
    folder = tmp_path / "zeroed-with-layout"
    shutil.copytree(exports["zeroed"], folder)
    shutil.copy(exports["pruned"] / "head_layout.json", folder / "head_layout.json")
    with pytest.raises(HeadscopeError, match="per-layer head counts.*not headscope's pruned format"):
        load_pruned(folder)
    cli_error([*ROLES, "--model", folder], r"per-layer head counts", r"export the pruned model again", seconds=30)


def test_load_pruned_still_loads_the_real_exports(exports):
    from analysis.compress.export import load_pruned
    model = load_pruned(exports["pruned"])
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 3 * 8       # 3 of 4 heads kept in layer 0
    code, out, err = cli_run([*ROLES, "--model", exports["pruned"]], seconds=60)
    assert code == 0, err
    assert json.loads(out)["model"]["pruned_export"] is True


# -- siblings: config.json, tokenizer files, markers ---------------------------------------------------------

def test_load_pruned_reads_config_json_bounded(exports, tmp_path):
    from analysis.compress.export import load_pruned
    folder = tmp_path / "cfg"
    shutil.copytree(exports["pruned"], folder)
    (folder / "config.json").unlink()
    _sparse(folder / "config.json", 2 * 2**30)
    with peak_memory() as peak, pytest.raises(HeadscopeError, match=r"config\.json.*larger than"):
        load_pruned(folder)
    assert peak["grew"] < 256 * 2**20, peak


@pytest.mark.parametrize("kind", ["sparse", "dev-zero"])
def test_tokenizer_files_are_checked_before_transformers_reads_them(kind, model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "tokenizer.json").unlink()
    if kind == "sparse":
        _sparse(folder / "tokenizer.json", 300 * 2**20)
        problem = r"tokenizer\.json.*larger than 256 MiB"
    else:
        os.symlink("/dev/zero", folder / "tokenizer.json")
        problem = r"tokenizer\.json.*character device"
    with peak_memory() as peak:
        cli_error(["score", "--quiet", "--scorer", "magnitude", "--model", folder], problem, r"replace it",
                  seconds=60)
    assert peak["grew"] < 256 * 2**20, peak


def test_builtin_marker_is_read_bounded(model_dir, tmp_path):
    """The GGUF export asks a model's folder for headscope's built-in marker: a FIFO there hung it."""
    from types import SimpleNamespace

    from analysis.compress.export.gguf.format import BUILTIN_MARKER, tokenizer_source
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    with released_fifo(folder / BUILTIN_MARKER) as fifo:
        holder = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(folder)))
        source = in_thread(lambda: tokenizer_source(holder), 20, _release(fifo))
    assert source == folder                                   # not a built-in: its own tokenizer.json
