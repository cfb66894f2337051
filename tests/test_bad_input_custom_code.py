"""Custom model code never runs without consent (every entry point, a real stdin answering yes), every
transformers loading call passes trust_remote_code, and the app's server config is explicit about XSRF
and error details.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import cli
from analysis.compress.export import load_pruned
from analysis.core.errors import HeadscopeError
from tests._bad_input import (ROOT, model_dir, pruned_export, snapshot, copy_folder, edit_json,
                              assert_one_line_error)  # noqa: F401 (fixtures)


# -- 1: custom code never runs without consent, and transformers never prompts -------------------------

EVIL = '''
from pathlib import Path
Path({marker!r}).write_text("custom code ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evil-model"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
'''


def _custom_code_folder(base: Path, kind: str, model_dir: Path, marker: Path) -> Path:
    """A model folder whose config.json has an auto_map to evil.py (which writes `marker`).

    kind "unknown-type": model_type only the custom code defines; "known-type": a llama config
    whose auto_map still points AutoConfig / AutoModel classes at evil.py."""
    folder = copy_folder(model_dir, base / kind)
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                "AutoModelForCausalLM": "evil.EvilModel"}
    changes = dict(auto_map=auto_map)
    if kind == "unknown-type":
        changes.update(model_type="evil-model", architectures=["EvilModel"])
    edit_json(folder / "config.json", **changes)
    return folder


def _pruned_with_custom_code(base: Path, kind: str, pruned_export: Path, marker: Path, stock: bool) -> Path:
    folder = copy_folder(pruned_export, base / f"{kind}-{'stock' if stock else 'layout'}")
    if stock:   # the stock path: weights not written by headscope's pruned writer
        from safetensors.torch import load_file, save_file
        save_file(load_file(str(folder / "model.safetensors")), str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    changes = dict(auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    if kind == "unknown-type":
        changes.update(model_type="evil-model", architectures=["EvilModel"])
    edit_json(folder / "config.json", **changes)
    return folder


def _entry(name: str, folder: Path, trust: bool = False):
    from analysis.arch.models import load_model
    from analysis.measure.streaming import profile_checkpoint
    table = {
        "cli-score-checkpoint": lambda: cli.main(["score", "--quiet", "--checkpoint", str(folder)]),
        "cli-score-model": lambda: cli.main(["score", "--quiet", "--scorer", "magnitude", "--model", str(folder)]),
        "profile_checkpoint": lambda: profile_checkpoint(folder),
        "load_model-folder": lambda: load_model(str(folder)),
        "load_pruned-layout": lambda: load_pruned(folder),
        "load_pruned-stock": lambda: load_pruned(folder),
    }
    return table[name]


ENTRY_POINTS = ["cli-score-checkpoint", "cli-score-model", "profile_checkpoint", "load_model-folder",
                "load_pruned-layout", "load_pruned-stock"]


@pytest.mark.parametrize("kind", ["unknown-type", "known-type"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_custom_code_never_runs_without_consent(entry, kind, tmp_path, model_dir, pruned_export, capsys,
                                                monkeypatch):
    import io
    marker = tmp_path / "MARKER"
    if entry.startswith("load_pruned"):
        folder = _pruned_with_custom_code(tmp_path, kind, pruned_export, marker, stock=entry.endswith("stock"))
    else:
        folder = _custom_code_folder(tmp_path, kind, model_dir, marker)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))       # a user (or script) answering yes
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    before = snapshot(folder)
    try:
        result = _entry(entry, folder)()
    except HeadscopeError as err:
        result = err
    out, err = capsys.readouterr()
    assert not marker.exists(), "the custom code ran"
    assert "custom code" not in out.lower() and "[y/n]" not in out.lower(), out
    assert snapshot(folder) == before
    if kind == "unknown-type":        # the architecture exists only as custom code: refused, saying how
        message = err if entry.startswith("cli") else str(result)
        assert result == 2 if entry.startswith("cli") else isinstance(result, HeadscopeError)
        assert re.search(r"custom (model )?code", message, re.I) and "trust" in message.lower(), message


    # known-type: transformers' own llama classes are used; the auto_map is ignored


@pytest.mark.slow
def test_custom_code_cli_with_a_real_stdin_answering_yes(tmp_path, model_dir):
    marker = tmp_path / "MARKER"
    folder = _custom_code_folder(tmp_path, "unknown-type", model_dir, marker)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run([sys.executable, "-m", "analysis", "score", "--quiet", "--checkpoint", str(folder)],
                          cwd=ROOT, env=env, input=b"y\ny\ny\n", capture_output=True, timeout=300)
    assert done.returncode == 2, done.stderr.decode()
    assert done.stdout == b"" and not marker.exists()
    assert_one_line_error(done.stderr.decode(), r"custom model code", r"--trust-remote-code")


# -- 13: the app's server configuration ---------------------------------------------------------------

def test_streamlit_config_is_explicit_about_xsrf_and_error_details():
    tomllib = pytest.importorskip("tomllib")                   # Python >= 3.11
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["enableXsrfProtection"] is True
    assert config["client"]["showErrorDetails"] == "type"      # type + generic message, no stack trace
    assert config["server"]["address"] == "127.0.0.1"


# -- 1: every transformers loading call in the project says trust_remote_code explicitly -------------

LOADERS = {"from_pretrained", "from_config"}


def test_every_transformers_loading_call_passes_trust_remote_code():
    """A static guard beside the behavioural tests above: a new `from_pretrained` / `from_config`
    without `trust_remote_code=` (or a **kwargs that carries it) would let transformers prompt."""
    import ast
    missing = []
    for path in sorted([*ROOT.glob("analysis/*.py"), *ROOT.glob("components/*.py"), *ROOT.glob("pages/*.py"),
                        *ROOT.glob("bench/*.py"), *ROOT.glob("scripts/*.py"), ROOT / "app.py"]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOADERS):
                continue
            names = {k.arg for k in node.keywords}
            if "trust_remote_code" not in names and None not in names:      # None: a **kwargs expansion
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, f"transformers calls without trust_remote_code: {missing}"
