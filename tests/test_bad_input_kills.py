"""Killed runs: exports and pipelines killed with SIGKILL / SIGTERM while writing leave nothing behind, an
overwrite killed between its renames is recovered, dead runs' temporaries are removed by the next run, and
a signal inside a finalizer stops at the next cancel point.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from analysis import cli
from analysis.compress.export import export
from tests._apptools import tiny_model_dir
from tests._bad_input import (ROOT, model_dir, pruned_export, snapshot, assert_one_line_error, dead_pid, PIPE,
                              real_cli, distill_pair, IDS, CFG)  # noqa: F401 (fixtures)


# -- 5: killed exports (SIGKILL, SIGTERM) and an overwrite killed between its renames -------------------

@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory) -> Path:
    """A ~70 MB tiny-architecture Llama (vocab 32000, hidden 256): its export takes long enough to kill."""
    return tiny_model_dir(tmp_path_factory.mktemp("big") / "big", num_hidden_layers=2, hidden_size=256,
                          intermediate_size=512, vocab_size=32000)


def _start_export(root: Path, name: str, model: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "analysis", "export", "--quiet", "--model", str(model), "--scorer", "magnitude",
            "--sparsity", "0.25", "--export-format", "zeroed", "--out-dir", str(root), "--name", name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _kill_while_writing(procs: dict[str, tuple[subprocess.Popen, int]], root: Path) -> dict[str, list[Path]]:
    """name -> (process, signal): send each its signal once its temporary folder exists (with the
    in-progress marker, i.e. the export is writing); returns the temporaries seen per name."""
    seen, deadline = {}, time.monotonic() + 120
    while len(seen) < len(procs) and time.monotonic() < deadline:
        for name, (proc, sig) in procs.items():
            if name in seen:
                continue
            temps = [t for t in root.glob(f".{name}.tmp-*") if (t / ".headscope-export-in-progress").exists()]
            if temps:
                proc.send_signal(sig)
                seen[name] = temps
            elif proc.poll() is not None:
                pytest.fail(f"the export ended before it could be killed: {proc.communicate()[1].decode()[-500:]}")
        time.sleep(0.002)
    for proc, _ in procs.values():
        proc.wait(60)
    assert len(seen) == len(procs), "timed out waiting for the exports to start writing"
    return seen


@pytest.mark.slow
def test_killed_exports_leave_nothing_behind(tmp_path, big_model_dir, model_dir):
    root = tmp_path / "exports"
    root.mkdir()
    procs = {"term": (_start_export(root, "term", big_model_dir), signal.SIGTERM),
             "kill": (_start_export(root, "kill", big_model_dir), signal.SIGKILL)}
    temps = _kill_while_writing(procs, root)
    term, kill = procs["term"][0], procs["kill"][0]
    # SIGTERM is handled like Ctrl-C: the temporary folder is removed, exit status 130
    err = term.stderr.read().decode()
    assert term.returncode == 130, err
    assert_one_line_error(err, r"interrupted", r"run the command again")
    assert not any(t.exists() for t in temps["term"]) and not (root / "term").exists()
    # SIGKILL cannot be handled: the temporary folder stays, and the next export into the root removes it
    assert kill.returncode == -signal.SIGKILL and all(t.exists() for t in temps["kill"])
    from analysis.arch.models import load_model
    lm = load_model(str(model_dir))
    result = export("zeroed", lm.model, np.zeros((2, 4), dtype=bool), root, "next")
    assert any("killed" in note for note in result.notes), result.notes
    assert sorted(os.listdir(root)) == ["next"]


def test_overwrite_killed_between_renames_is_recovered(pruned_export, tmp_path, model_dir):
    """State after a kill between the two renames of an overwrite: only `.NAME.old-PID-*` exists."""
    from analysis.arch.models import load_model
    root = tmp_path / "root"
    root.mkdir()
    old = root / f".base.old-{dead_pid()}-abc123"
    shutil.copytree(pruned_export, old)
    kept = snapshot(old)
    stale_tmp = root / f".base.tmp-{dead_pid()}-xyz"
    stale_tmp.mkdir()
    (stale_tmp / ".headscope-export-in-progress").write_text("{}")
    (stale_tmp / "model.safetensors").write_bytes(b"\0" * 1000)
    not_ours = root / f".notes.tmp-{dead_pid()}-u"        # same pattern, but no marker: left alone
    not_ours.mkdir()
    (not_ours / "user.txt").write_text("mine")
    lm = load_model(str(model_dir))
    result = export("zeroed", lm.model, np.zeros((2, 4), dtype=bool), root, "other")
    assert any("Recovered the previous export" in n for n in result.notes), result.notes
    assert snapshot(root / "base") == kept and not old.exists() and not stale_tmp.exists()
    assert (not_ours / "user.txt").read_text() == "mine"


def test_sigkill_temporaries_are_removed_by_the_next_run(tmp_path):
    from analysis.compress.recover.distill import CHECKPOINT_FILE, DistillConfig, distill
    from analysis.arch.models import BUILTIN_MODELS, _cached_builtin
    dead = dead_pid()
    leftover = tmp_path / f".{CHECKPOINT_FILE}.tmp-{dead}-abc123"
    leftover.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".{CHECKPOINT_FILE}.tmp-{os.getpid()}-def456"    # a live run's: left alone
    alive.write_bytes(b"in progress")
    distill(*distill_pair(), IDS, DistillConfig(**CFG), checkpoint_dir=tmp_path)
    assert not leftover.exists() and alive.exists()
    # the built-in model cache: a conversion killed earlier leaves .smollm2-135m.tmp-<pid>-*
    cache = tmp_path / "cache"
    models = cache / "models"
    models.mkdir(parents=True)
    killed = models / f".smollm2-135m.tmp-{dead}-xyz"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"partial")
    converted = _cached_builtin(BUILTIN_MODELS["smollm2-135m"], cache, {"source": "test"}, None,
                                convert=lambda tmp, progress: (tmp / "done").write_text("x"))
    assert not killed.exists() and (converted / "done").exists()


# -- 14: a signal landing in a finalizer is not lost -----------------------------------------------

def test_a_signal_inside_a_finalizer_stops_at_the_next_cancel_point():
    from analysis.cli.main import sigterm_as_interrupt
    from analysis.core.progress import check_stop

    class SignalsWhenCollected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)         # lands inside __del__, like tqdm.__del__

    with sigterm_as_interrupt():
        obj = SignalsWhenCollected()
        del obj                                          # the handler runs inside the finalizer
        with pytest.raises(KeyboardInterrupt):
            check_stop(None)
    check_stop(None)                                     # the flag is cleared after the command


@pytest.mark.slow
def test_pipeline_overwrite_replaces_its_own_run_and_nothing_else(model_dir, tmp_path, capsys):
    argv = [*PIPE, "--model", str(model_dir), "--target", "0.25", "--step", "0.25", "--train-batch", "2",
            "--train-seq-len", "16", "--out-dir", str(tmp_path), "--name", "run"]
    assert cli.main(argv) == 0
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["pruned", "report", "run.json"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    capsys.readouterr()
    assert cli.main(argv) == 2                                         # exists: refused before the rounds
    assert cli.main([*argv, "--overwrite"]) == 0                       # its own run: replaced
    assert sorted(p.name for p in run.iterdir()) == ["pruned", "report", "run.json"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli.main([*argv[:-1], "other", "--overwrite"]) == 2         # not a headscope run: left alone
    assert_one_line_error(capsys.readouterr().err, r"not a headscope export", r"choose another name")
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_killed_pipeline_leaves_no_run_and_the_rerun_works(model_dir, tmp_path):
    """SIGTERM: the temporary run folder is removed (exit 130); SIGKILL: it stays, marked, and the
    next run into the same --out-dir removes it and writes the run."""
    argv = [*PIPE, "--model", model_dir, "--target", "0.5", "--step", "0.25", "--train-batch", "2",
            "--train-seq-len", "16", "--out-dir", tmp_path, "--name", "run"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    # the runs that are killed train long (the last --recovery-steps wins), so the signal lands inside
    # the rounds however fast the machine is: with 1 step a round a quick CPU could finish in the 1 s
    killed = [*argv, "--recovery-steps", "5000"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-m", "analysis", *map(str, killed)], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob(".run.tmp-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.communicate()[1].decode()[-500:]
        time.sleep(1.0)                                        # inside the rounds
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert not (tmp_path / "run").exists()
        if sig == signal.SIGTERM:
            assert proc.returncode == 130, err.decode()[-500:]
            assert not list(tmp_path.glob(".run.tmp-*")), "SIGTERM left the temporary run folder"
        else:
            assert proc.returncode == -signal.SIGKILL and list(tmp_path.glob(".run.tmp-*"))
    done = real_cli(argv, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-800:]
    assert "Removed .run.tmp-" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
