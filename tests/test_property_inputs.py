"""Property (hypothesis): random bytes and random truncations of a real GGUF file and of a real export
folder's JSON files, fed to `deploy-report`, `roles` and `load_pruned` (issue 36).

For every damaged input: the CLI exits 2 with exactly one "error: " line (or 0 where the damage left a file
that still says the same thing, e.g. a JSON file cut after its last brace), never a traceback or any other
exception; `load_pruned` raises a HeadscopeError or returns a model; and the peak resident memory of the
call stays within MEMORY_BOUND of what the process held before (the readers are capped: a damaged header
that claims 2**40 tensors or a 10 GB string is refused from its numbers, never allocated).

A GGUF truncation always cuts into a tensor or the header, and random bytes never carry the magic number,
so llama.cpp itself never runs on a damaged file here (a crash inside it would take the test process). The
inputs are tiny exports (2 layers x 4 heads, hidden 32); max_examples is modest, deadline None.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.core.errors import HeadscopeError
from tests._apptools import tiny_model_dir
from tests._input_checks import cli_run, one_error_line, peak_memory

MEMORY_BOUND = 512 * 2**20


def examples(n: int):
    """Settings of a property: n examples, no deadline, the same examples on every machine and run."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny model, its dense and cut GGUF exports, and a pruned export (uneven layer 0)."""
    from analysis.arch.models import load_model
    from analysis.compress.export import export
    root = tmp_path_factory.mktemp("property")
    model = tiny_model_dir(root / "tiny", num_hidden_layers=2)
    lm = load_model(str(model))
    pruned = np.zeros((2, 4), dtype=bool)
    out = {"model": model, "root": root}
    out["dense"] = export("gguf", lm.model, pruned, root / "ex", "dense", gguf_type="f32").path
    pruned[:, :2] = True                                  # one whole KV group per layer
    out["cut"] = export("gguf", lm.model, pruned, root / "ex", "cut", gguf_type="f32").path
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = True
    out["pruned"] = export("pruned", lm.model, pruned, root / "ex", "pruned", tokenizer=lm.tokenizer).path
    code, _, err = cli_run(_roles(out["pruned"]), seconds=120)    # warm: imports and first runs outside the bound
    assert code == 0, err
    return out


def _roles(folder: Path) -> list:
    return ["roles", "--quiet", "--detector", "previous-token", "--detector", "induction", "--n-sequences", "1",
            "--length", "4", "--max-tokens", "32", "--seq-len", "16", "--model", folder]


def _report(inputs, pruned, dense=None) -> list:
    return ["deploy-report", "--quiet", "--model", inputs["model"], "--dense", dense or inputs["dense"] / "model.gguf",
            "--pruned", pruned, "--max-tokens", "16", "--speed-context", "8"]


@st.composite
def damaged(draw, original: bytes):
    """(kind, bytes): random bytes, or the original cut short (never whole)."""
    if draw(st.booleans()):
        return "random", draw(st.binary(max_size=2048))
    return "truncated", original[:draw(st.integers(min_value=0, max_value=len(original) - 1))]


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
        return True
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False


def _still_same_json(original: bytes, data: bytes) -> bool:
    """A damaged JSON file that still parses to the original's value (a cut after the closing brace)."""
    try:
        return json.loads(data) == json.loads(original)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False


def _check_cli(argv, *, may_succeed: bool) -> None:
    with peak_memory() as peak:
        code, _, err = cli_run(argv, seconds=120)
    assert peak["grew"] < MEMORY_BOUND, f"{peak['grew'] / 2**20:.0f} MiB"
    if code == 0 and may_succeed:
        return
    assert code == 2, (code, err[-2000:])
    one_error_line(err)


@examples(100)
@given(data=st.data(), role=st.sampled_from(["pruned", "dense"]))
def test_deploy_report_on_a_damaged_gguf(inputs, data, role):
    original = (inputs["dense"] / "model.gguf").read_bytes()
    kind, damage = data.draw(damaged(original))
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "model.gguf"
        bad.write_bytes(damage)
        argv = _report(inputs, bad) if role == "pruned" else _report(inputs, inputs["cut"], dense=bad)
        _check_cli(argv, may_succeed=False)


@examples(25)
@given(data=st.data())
def test_deploy_report_on_an_export_folder_with_a_damaged_mask_json(inputs, data):
    """The report reads an export folder's model.gguf and mask.json (its head_layout.json it never reads)."""
    original = (inputs["cut"] / "mask.json").read_bytes()
    kind, damage = data.draw(damaged(original))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(inputs["cut"], Path(tmp) / "cut"))
        (folder / "mask.json").write_bytes(damage)
        _check_cli(_report(inputs, folder), may_succeed=_still_same_json(original, damage))


EXPORT_JSON = ["head_layout.json", "config.json", "mask.json", "tokenizer.json", "tokenizer_config.json"]


@examples(50)
@given(data=st.data(), name=st.sampled_from(EXPORT_JSON))
def test_roles_and_load_pruned_on_an_export_with_a_damaged_json(inputs, data, name):
    from analysis.compress.export import load_pruned
    original = (inputs["pruned"] / name).read_bytes()
    kind, damage = data.draw(damaged(original))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(inputs["pruned"], Path(tmp) / "pruned"))
        (folder / name).write_bytes(damage)
        same = _still_same_json(original, damage)
        # roles reads every file but mask.json (a damaged one changes nothing it uses); a tokenizer file that
        # is other JSON may still give transformers a tokenizer
        _check_cli(_roles(folder), may_succeed=same or name == "mask.json"
                   or (name.startswith("tokenizer") and _is_json(damage)))
        with peak_memory() as peak:
            try:
                load_pruned(folder)
                loaded = True
            except HeadscopeError:
                loaded = False
        assert peak["grew"] < MEMORY_BOUND, f"{peak['grew'] / 2**20:.0f} MiB"
        if name in ("head_layout.json", "config.json") and not same:
            assert not loaded, "load_pruned accepted a damaged " + name
