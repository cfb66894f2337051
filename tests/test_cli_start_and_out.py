"""Two older CLI cases still open before issue 36 (class 6), run through the real CLI in a subprocess:

- Ctrl-C during the start-up imports (seconds of torch / transformers, before the CLI's own handler is
  in place) printed a KeyboardInterrupt traceback; now one error line and exit 130. The SIGINT is made to
  land there on every machine: an import hook in the child sends it when `analysis.cli.common` is imported.
- `--out /proc/self/fd/1` whose stdout is a deleted file made a new regular file named
  "<name> (deleted)", exit 0; now it is refused before any work, one line, exit 2. An existing file or a
  pipe behind the same link are still written (the link itself is kept).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._input_checks import model_dir  # noqa: F401  (a fixture)
from tests._input_checks import ROOT, one_error_line

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# the child: an import hook that sends SIGINT to itself as the CLI's heavy imports start, then the CLI
TRIP = """
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal (a background job inherits SIG_IGN)
class Trip:
    def find_spec(self, name, path=None, target=None):
        if name == "analysis.cli.common":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Trip())
sys.argv = ["analysis", "score", "--quiet"]
runpy.run_module("analysis", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_during_start_up_imports_is_one_line():
    done = subprocess.run([sys.executable, "-c", TRIP], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 130, done.stderr[-2000:]
    one_error_line(done.stderr, r"interrupted", r"nothing was written")
    assert done.stdout == ""


def test_the_headscope_command_starts_through_the_same_guard():
    """The console script runs analysis.__main__:run, which holds the guard (pyproject.toml)."""
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["headscope"] == "analysis.__main__:run"
    from analysis.__main__ import run
    assert callable(run)



def _score_into(stdout, cwd: Path, model_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "analysis", "score", "--quiet", "--scorer", "magnitude", "--model",
                           str(model_dir), "--out", "/proc/self/fd/1"], cwd=cwd, env=ENV, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_out_to_a_deleted_stdout_is_refused(model_dir, tmp_path):
    target = tmp_path / "result.json"
    with open(target, "w") as handle:
        target.unlink()                                   # stdout is now a file without a name
        done = _score_into(handle, tmp_path, model_dir)
    assert done.returncode == 2, done.stderr[-2000:]
    one_error_line(done.stderr, r"link to a file that was deleted", r"Give the path of a file")
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)   # no "result.json (deleted)"


def test_out_to_an_existing_stdout_file_is_still_written(model_dir, tmp_path):
    import json
    target = tmp_path / "result.json"
    with open(target, "w") as handle:
        done = _score_into(handle, tmp_path, model_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(target.read_text())["scores"]
