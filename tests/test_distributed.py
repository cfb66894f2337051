"""Multi-process runs (analysis/core/distributed.py) under a real launcher: 2 CPU processes (gloo) started by
`accelerate launch --multi_gpu --num_processes 2` give exactly (==) the single-process numbers of a z
sweep, every calibration scorer, a sparsity curve, the results script's window sums and the naive and
fast ablation sweeps (the `ablate` CLI command); a killed worker and a hung worker each end the run
with one clear error line within the timeout. Plus the pure helpers (owners, timeout parsing)."""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from analysis import cli

from analysis.core import distributed
from analysis.core.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCH_LIMIT_S = 240          # a hung run is a failure, not a stuck CI job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, env: dict | None = None, timeout: float = LAUNCH_LIMIT_S) -> tuple[subprocess.CompletedProcess, float]:
    """`accelerate launch` 2 CPU processes of `args` (a script or -m module and its options)."""
    cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           *map(str, args)]
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                **(env or {})}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests._apptools import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-dist"))


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    return a == b or (a != a and b != b)      # NaN == NaN here


def test_library_work_on_two_processes_equals_one_process(model_dir, tmp_path):
    from analysis.arch.models import load_model
    from tests._distributed_driver import compute

    out = tmp_path / "two.pkl"
    proc, _ = launch(ROOT / "tests" / "_distributed_driver.py", model_dir, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = pickle.loads(out.read_bytes())
    assert two.pop("world") == 2
    one = compute(load_model(str(model_dir)), distributed.SOLO)
    assert one.keys() == two.keys()
    for key in one:
        assert _equal(one[key], two[key]), key
    assert len(one["sweep"]["rows"]) == 6 and np.isfinite(one["window-sums"]).all()
    assert len(set(one["sweep"]["rows"][i]["mask_id"] for i in range(6))) > 1     # several masks evaluated


def test_ablate_command_on_two_processes_equals_one_process(model_dir, tmp_path, capsys):
    argv = ["ablate", "--model", model_dir, "--max-tokens", "64", "--seq-len", "16", "--batch-size", "8"]
    out = tmp_path / "ablate.json"
    proc, _ = launch("-m", "analysis", *argv, "--quiet", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads(out.read_text())
    assert cli.main([str(a) for a in argv] + ["--quiet"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["method"] == two["method"] == "fast"
    for key in ("base", "n_tokens", "head_delta", "group_delta"):
        assert one[key] == two[key], key
    assert np.asarray(one["head_delta"]).shape == (4, 4) and np.asarray(one["group_delta"]).shape == (4, 2)


def test_a_killed_worker_ends_the_run_with_one_clear_error(model_dir, tmp_path):
    out = tmp_path / "sweep.json"
    proc, seconds = launch("-m", "analysis", "sweep", "--model", model_dir, "--sparsity", "0.25", "--max-tokens", "640",
                           "--quiet", "--out", out, env={distributed.FAULT_ENV: "kill:1",
                                                         distributed.TIMEOUT_ENV: "30"})
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: the 2-process run")]
    assert ours, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines()            # no traceback from our code
                if line.strip().startswith('File "') and f"{os.sep}analysis{os.sep}" in line], proc.stderr[-3000:]
    assert not out.exists()                              # nothing written
    assert seconds < LAUNCH_LIMIT_S


def test_a_hung_worker_ends_the_run_within_the_timeout(model_dir, tmp_path):
    timeout = 6
    proc, seconds = launch("-m", "analysis", "ablate", "--model", model_dir, "--max-tokens", "64", "--seq-len", "16",
                           "--quiet", env={distributed.FAULT_ENV: "hang:1", distributed.TIMEOUT_ENV: str(timeout)})
    assert proc.returncode != 0
    lost = [line for line in proc.stderr.splitlines() if line.startswith("error: the 2-process run lost a worker")]
    assert lost and f"within {timeout} s" in lost[0], proc.stderr[-3000:]
    assert proc.stdout.strip() == ""
    assert seconds < 120


def test_owners_split_every_item_once_and_balance_weights():
    assert distributed.owners(5, 2) == [0, 1, 0, 1, 0]
    work = [4, 3, 2, 1]                                   # fast ablation: layer l costs L - l passes
    own = distributed.owners(4, 2, work)
    loads = [sum(w for w, r in zip(work, own) if r == rank) for rank in range(2)]
    assert sorted(own) == [0, 0, 1, 1] and loads == [5, 5]
    teams = [distributed.Team(rank, 3) for rank in range(3)]
    assert sorted(i for t in teams for i in t.mine(10, range(10))) == list(range(10))


def test_solo_map_and_fold_are_plain_loops():
    solo = distributed.SOLO
    assert solo.map(lambda i: i * i, 4) == [0, 1, 4, 9]
    assert solo.fold(lambda i: float(i), 4, lambda acc, x: x if acc is None else acc + x) == 6.0
    assert solo.all_gather("x") == ["x"] and not solo.is_distributed and solo.is_main


@pytest.mark.parametrize("text", ["0", "-3", "soon", "inf"])
def test_bad_timeouts_are_input_errors(text):
    with pytest.raises(InputError, match=distributed.TIMEOUT_ENV):
        distributed.timeout_seconds({distributed.TIMEOUT_ENV: text})
    assert distributed.timeout_seconds({}) == distributed.DEFAULT_TIMEOUT_S
    assert distributed.team({"WORLD_SIZE": "1"}) is distributed.SOLO


def test_gpu_check_quick_cpu_mode_runs_every_item_but_the_launch():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick",
                           "--skip-multiprocess", "--dtypes", "float32,bfloat16"], cwd=ROOT, capture_output=True,
                          text=True, timeout=LAUNCH_LIMIT_S, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    for item in ("[exactness]", "[scoring]", "[perplexity]", "[ablation]", "[prefill]", "[multiprocess]"):
        assert item in out
    assert out.count("-> PASS") >= 2 and "0 failed" in out       # float32 and bfloat16 exactness
