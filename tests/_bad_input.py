"""Shared by the bad-input tests (tests/test_bad_input_*.py): the tiny model folders they attack, the
snapshot that proves nothing in a working folder changed, the one-line error check, the CLI battery's
`Case` / `Env` and its runner, a real tmpfs (full or read-only disk), and the distillation pair.

The contract every bad-input test holds: a user error exits 2 with one line naming the problem and the
fix, no traceback, nothing in the working folder created, changed or deleted; the library raises a
HeadscopeError. Faults for real: a full disk and a read-only file system are small tmpfs mounts (root
only, skipped with the reason otherwise); kills are SIGKILL / SIGTERM sent to a real CLI process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from analysis import cli
from analysis.compress.export import export
from tests._apptools import tiny_model_dir
from tests._tiny import tiny_input_ids, tiny_model


ROOT = Path(__file__).resolve().parents[1]


SENTINEL = b"OLD RESULT\n"


# -- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A 2-layer tiny Llama checkpoint (single model.safetensors) for --checkpoint streaming."""
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_model("llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer tiny Llama folder with a tokenizer, for --model."""
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def pruned_export(tmp_path_factory, model_dir) -> Path:
    """A real headscope 'pruned' export of the tiny model."""
    from analysis.arch.models import load_model
    lm = load_model(str(model_dir))
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = True
    return export("pruned", lm.model, pruned, tmp_path_factory.mktemp("exports"), "base").path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file (and empty folder) under `folder` -> its bytes: what 'nothing changed' compares."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_file() and not path.is_symlink():
            out[rel] = path.read_bytes()
        elif path.is_dir() and not any(path.iterdir()):
            out[rel + "/"] = b""
    return out


def copy_folder(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def assert_one_line_error(err: str, problem: str, fix: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got: {err!r}"
    assert "Traceback" not in err and "LOAD REPORT" not in err, err
    line = errors[0]
    assert re.search(problem, line, re.I), f"the message does not name the problem ({problem!r}): {line}"
    assert re.search(fix, line, re.I), f"the message does not name the fix ({fix!r}): {line}"
    return line


# -- the CLI battery -------------------------------------------------------------------------------

@dataclass
class Env:
    ckpt: Path          # a pristine checkpoint (read only)
    model: Path         # a pristine model folder (read only)
    inputs: Path        # where a case builds its hostile inputs
    work: Path          # the folder whose files must not change; holds the sentinel `old.json`

    @property
    def out(self) -> Path:
        return self.work / "old.json"


@dataclass
class Case:
    id: str
    argv: Callable[[Env], list]
    problem: str
    fix: str
    code: int = 2


def write_input(env: Env, name: str, data) -> Path:
    path = env.inputs / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


SCORE = ["score", "--quiet"]


EXPORT = ["export", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25"]


EVALUATE = ["evaluate", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25", "--max-tokens", "16"]


ABLATION = ["score", "--quiet", "--scorer", "ablation"]


def hostile_env(tmp_path, ckpt, model_dir) -> Env:
    """Fresh input and work folders, with the sentinel --out file in place."""
    env = Env(ckpt=ckpt, model=model_dir, inputs=tmp_path / "inputs", work=tmp_path / "work")
    env.inputs.mkdir()
    env.work.mkdir()
    env.out.write_bytes(SENTINEL)
    return env


def check_cli_case(case: Case, env: Env, capsys, max_seconds: float) -> None:
    """Run one hostile CLI case in-process: its exit code, no result, one error line naming the problem
    and the fix, nothing in the work folder changed (the sentinel --out included), within max_seconds."""
    argv = [str(a) for a in case.argv(env)]
    before = snapshot(env.work)
    started = time.perf_counter()
    code = cli.main(argv)
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == case.code, (code, err)
    assert out == "", "an error run must not print a result"
    assert_one_line_error(err, case.problem, case.fix)
    assert snapshot(env.work) == before, "a file was created, changed or deleted"
    assert env.out.read_bytes() == SENTINEL
    assert seconds < max_seconds, f"took {seconds:.1f} s: it read more than it could use"


# -- 3 and 12: a real full disk and a real read-only file system (tmpfs) -----------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs folder; unmounted at the end. Skips where mounting is impossible."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full or read-only disk) needs root")
    mounted = []

    def mount(options: str = "size=5m") -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill_disk(folder: Path, leave: int = 0) -> None:
    """Fill the disk at `folder` until at most `leave` bytes are free."""
    with open(folder / "filler", "wb") as handle:
        chunk = b"\xff" * 65536
        try:
            while os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize > leave + len(chunk):
                handle.write(chunk)
                handle.flush()
            while True:
                if os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize <= leave:
                    break
                handle.write(b"\xff" * 4096)
                handle.flush()
        except OSError:
            pass


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


LONG = "a" * 5000


def make_fifo(env: Env, name: str = "fifo") -> Path:
    path = env.inputs / name
    os.mkfifo(path)
    return path


PIPE = ["pipeline", "--quiet", "--recovery-steps", "1", "--eval-tokens", "32", "--no-int8", "--formats", "pruned"]


EVAL = ["evaluate", "--quiet", "--sparsity", "0.25"]


def real_cli(argv, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "analysis", *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# -- 1 and 11, 12: distillation checkpoints -----------------------------------------------------------

def distill_pair():
    from analysis.compress.surgery import prune_heads
    teacher = tiny_model("llama")
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 1] = True
    student, _ = prune_heads(teacher, pruned)
    return teacher, student


IDS = tiny_input_ids(4, 16)


CFG = dict(steps=2, lr=1e-2, batch_size=2, seq_len=16, checkpoint_every=1)


class Payload:
    """Unpickling this runs os.system: what a crafted checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
