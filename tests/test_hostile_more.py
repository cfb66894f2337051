"""Hostile inputs, issue 25: the 18 classes that still crashed, hung or ran code.

Same contract as tests/test_hostile.py (whose helpers it reuses): a user error exits 2 with one
line naming the problem and the fix, no traceback, nothing in the working folder created, changed
or deleted; the library raises a HeadscopeError. The CLI cases run in-process (`cli.main`) for
speed, and a selection again through the real CLI in a subprocess (`python -m analysis ...`),
where warnings and tracebacks would show. Numbers in comments are the issue's class numbers.

Root-only cases (mknod of a character device, a full tmpfs) skip with the reason elsewhere.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis import cli
from analysis.core.errors import HeadscopeError, InputError, ModelLoadError
from tests._tiny import tiny_input_ids, tiny_model
from tests.test_hostile import (SENTINEL, Case, Env, assert_one_line_error, check_cli_case, ckpt,  # noqa: F401
                                hostile_env, model_dir, pruned_export, snapshot, tmpfs, _fill)

ROOT = Path(__file__).resolve().parents[1]
LONG = "a" * 5000


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _config_case(env: Env, data=None, text: str | None = None, **changes) -> Path:
    """A copy of the tiny model folder whose config.json is `text`, `data`, or the original + changes."""
    import shutil
    folder = env.inputs / "model"
    shutil.copytree(env.model, folder)
    cfg = folder / "config.json"
    if text is None:
        text = json.dumps(data if data is not None or not changes else {**json.loads(cfg.read_text()), **changes})
    cfg.write_text(text)
    return folder


def _nan_weights(env: Env, value=float("nan")) -> Path:
    """A copy of the tiny model folder with one NaN (or Inf) in layer 0's q_proj."""
    import shutil
    from safetensors.torch import load_file, save_file
    folder = env.inputs / "nan"
    shutil.copytree(env.model, folder)
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if k.endswith("layers.0.self_attn.q_proj.weight"))
    state[name] = state[name].clone()
    state[name][3, 5] = value
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _fifo(env: Env, name: str = "fifo") -> Path:
    path = env.inputs / name
    os.mkfifo(path)
    return path


PIPE = ["pipeline", "--quiet", "--recovery-steps", "1", "--eval-tokens", "32", "--no-int8", "--formats", "pruned"]
EVAL = ["evaluate", "--quiet", "--sparsity", "0.25"]

MORE_CASES = [
    # 3: devices and FIFOs are refused before a byte is read (no hang, no 3 GiB read)
    Case("train-text-dev-zero", lambda e: [*PIPE, "--model", e.model, "--train-text", "/dev/zero",
                                           "--out-dir", e.work, "--name", "run"], r"character device", r"\.txt"),
    Case("eval-text-fifo", lambda e: [*PIPE, "--model", e.model, "--eval-text", _fifo(e),
                                      "--out-dir", e.work, "--name", "run"], r"pipe \(FIFO\)", r"\.txt"),
    Case("ablation-file-dev-zero", lambda e: ["score", "--quiet", "--model", e.model, "--scorer", "ablation",
                                              "--ablation-file", "/dev/zero"], r"character device", r"\.npy"),
    Case("ablation-file-fifo", lambda e: ["score", "--quiet", "--model", e.model, "--scorer", "ablation",
                                          "--ablation-file", _fifo(e)], r"pipe \(FIFO\)", r"\.npy"),
    # 4: --max-tokens validated before anything is allocated
    Case("evaluate-max-tokens-1e12", lambda e: [*EVAL, "--model", e.model, "--max-tokens", str(10**12)],
         r"--max-tokens must be a whole number", r"from 1 to"),
    Case("evaluate-max-tokens-1e30", lambda e: [*EVAL, "--model", e.model, "--max-tokens", str(10**30)],
         r"--max-tokens must be a whole number", r"from 1 to"),
    Case("ablate-max-tokens-1e9", lambda e: ["ablate", "--quiet", "--model", e.model, "--max-tokens", str(10**9)],
         r"--max-tokens must be a whole number", r"from 2 to"),
    Case("sweep-max-tokens-1e12", lambda e: ["sweep", "--quiet", "--model", e.model, "--sparsity", "0.25",
                                             "--max-tokens", str(10**12)], r"max-tokens", r"whole number"),
    # 5: config.json that is JSON but not a config, or impossible geometry (--model and --checkpoint)
    *[Case(f"config-{name}-{opt[2:]}", (lambda e, kw=kw, opt=opt: ["score", "--quiet", opt, _config_case(e, **kw)]),
           problem, r"original config\.json")
      for opt in ("--model", "--checkpoint")
      for name, kw, problem in [
          ("list", dict(data=[1, 2]), r"JSON list, not a config"),
          ("null", dict(text="null"), r"JSON null, not a config"),
          ("deep", dict(text="[" * 50_000 + "]" * 50_000), r"nested too deeply"),
          ("heads-0", dict(num_attention_heads=0), r"num_attention_heads"),
          ("layers-two", dict(num_hidden_layers="two"), r"num_hidden_layers"),
          ("3-heads-hidden-64", dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=64, head_dim=None),
           r"3 attention heads do not divide the hidden size 64"),
      ]],
    # 6: names too long (errno 36)
    Case("model-5000-chars", lambda e: ["score", "--quiet", "--model", LONG], r"name is too long", r"shorter"),
    Case("checkpoint-5000-chars", lambda e: ["score", "--quiet", "--checkpoint", LONG], r"name is too long",
         r"shorter"),
    Case("out-300-char-name", lambda e: ["score", "--quiet", "--checkpoint", e.ckpt, "--out",
                                         e.work / ("b" * 300 + ".json")], r"name is too long", r"shorter"),
    Case("text-file-300-char-name", lambda e: [*EVAL, "--model", e.model, "--text-file", e.work / ("t" * 300)],
         r"name is too long", r"shorter"),
    # 7: a seed numpy refuses
    Case("random-seed-negative", lambda e: ["score", "--quiet", "--checkpoint", e.ckpt, "--scorer", "random",
                                            "--seed=-1"], r"seed must be a whole number", r"from 0 to"),
    # 8: NaN / Inf weights, in memory (--model) and streaming (--checkpoint)
    Case("nan-weights-model", lambda e: ["score", "--quiet", "--model", _nan_weights(e)],
         r"NaN or infinite values in layer 0", r"intact copy"),
    Case("nan-weights-checkpoint", lambda e: ["score", "--quiet", "--checkpoint", _nan_weights(e)],
         r"NaN or infinite values in layer 0 \(tensor model\.layers\.0\.self_attn\.q_proj\.weight\)", r"intact copy"),
    Case("inf-weights-checkpoint", lambda e: ["score", "--quiet", "--checkpoint", _nan_weights(e, float("inf"))],
         r"NaN or infinite values in layer 0", r"intact copy"),
    # 9: pipeline outputs checked before the first round
    Case("pipeline-formats-twice", lambda e: [*PIPE[:-1], "pruned,pruned", "--model", e.model, "--out-dir", e.work,
                                              "--name", "run"], r"names a format twice", r"each format once"),
    Case("pipeline-existing-run", lambda e: ((e.work / "run").mkdir(), (e.work / "run" / "x").write_text("x"),
                                             [*PIPE, "--model", e.model, "--out-dir", e.work, "--name", "run"])[-1],
         r"already exists", r"choose another name"),
    # 10: infinite loss settings
    Case("pipeline-temperature-inf", lambda e: [*PIPE, "--model", e.model, "--temperature", "inf",
                                                "--out-dir", e.work, "--name", "run"], r"temperature", r"finite"),
    Case("pipeline-hidden-weight-inf", lambda e: [*PIPE, "--model", e.model, "--hidden-weight", "inf",
                                                  "--out-dir", e.work, "--name", "run"], r"hidden_weight", r"finite"),
    # 13: an empty --out-dir, like an empty --out
    Case("export-out-dir-empty", lambda e: ["export", "--quiet", "--model", e.model, "--sparsity", "0.25",
                                            "--out-dir=", "--name", "x"], r"--out-dir\) is empty", r"folder path"),
    Case("pipeline-out-dir-empty", lambda e: [*PIPE, "--model", e.model, "--out-dir=", "--name", "x"],
         r"--out-dir\) is empty", r"folder path"),
]


@pytest.mark.parametrize("case", MORE_CASES, ids=[c.id for c in MORE_CASES])
def test_cli_more_hostile_input(case: Case, ckpt, model_dir, tmp_path, capsys, monkeypatch):
    env = hostile_env(tmp_path, ckpt, model_dir)
    monkeypatch.chdir(env.work)                          # "" must not mean "write here" either
    check_cli_case(case, env, capsys, max_seconds=60)


# the real CLI in a subprocess: one line on stderr, nothing before it (no warning, no traceback)
SUBPROCESS_CASES = ["random-seed-negative", "evaluate-max-tokens-1e30", "model-5000-chars",
                    "config-list-checkpoint", "nan-weights-checkpoint", "export-out-dir-empty",
                    "ablation-file-fifo", "pipeline-temperature-inf"]


def _cli(argv, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "analysis", *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_real_cli_subprocess(case_id, ckpt, model_dir, tmp_path):
    case = next(c for c in MORE_CASES if c.id == case_id)
    env = hostile_env(tmp_path, ckpt, model_dir)
    argv = case.argv(env)
    before = snapshot(env.work)
    done = _cli(argv, cwd=env.work)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected the error line alone on stderr: {done.stderr!r}"
    assert_one_line_error(done.stderr, case.problem, case.fix)
    assert snapshot(env.work) == before


# -- 1 and 11, 12: distillation checkpoints -----------------------------------------------------------

def _pair():
    from analysis.compress.surgery import prune_heads
    teacher = tiny_model("llama")
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 1] = True
    student, _ = prune_heads(teacher, pruned)
    return teacher, student


IDS = tiny_input_ids(4, 16)
CFG = dict(steps=2, lr=1e-2, batch_size=2, seq_len=16, checkpoint_every=1)


class _Payload:
    """Unpickling this runs os.system: what a crafted checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_never_runs_its_code_on_resume(tmp_path):
    from analysis.compress.distill import CHECKPOINT_FILE, DistillConfig, distill
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "ck"
    folder.mkdir()
    cfg = DistillConfig(**CFG)
    # a torch.save'd dict that also holds the payload (what torch.load(weights_only=False) would run),
    # then a plain pickle under the checkpoint's name
    torch.save({"step": 1, "fingerprint": cfg.fingerprint(), "evil": _Payload(marker)}, folder / CHECKPOINT_FILE)
    with pytest.raises(InputError, match=r"cannot be read \(it holds objects other than tensors"):
        distill(*_pair(), IDS, cfg, checkpoint_dir=folder, resume=True)
    assert not marker.exists(), "the checkpoint's payload ran"
    (folder / CHECKPOINT_FILE).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(InputError, match=r"cannot be read"):
        distill(*_pair(), IDS, cfg, checkpoint_dir=folder, resume=True)
    assert not marker.exists(), "the pickle's payload ran"


def test_resume_with_a_student_of_another_shape_is_a_clear_error(tmp_path):
    from analysis.compress.distill import DistillConfig, distill
    from analysis.compress.surgery import prune_heads
    cfg = DistillConfig(**CFG)
    distill(*_pair(), IDS, cfg, checkpoint_dir=tmp_path)
    teacher = tiny_model("llama")
    other = np.zeros((2, 4), dtype=bool)
    other[0, :2] = True                                  # two heads cut: other q/o shapes
    student, _ = prune_heads(teacher, other)
    with pytest.raises(InputError, match="student of another shape"):
        distill(teacher, student, IDS, cfg, checkpoint_dir=tmp_path, resume=True)


def test_sigkill_temporaries_are_removed_by_the_next_run(tmp_path):
    from analysis.compress.distill import CHECKPOINT_FILE, DistillConfig, distill
    from analysis.arch.models import BUILTIN_MODELS, _cached_builtin
    dead = _dead_pid()
    leftover = tmp_path / f".{CHECKPOINT_FILE}.tmp-{dead}-abc123"
    leftover.write_bytes(b"half a checkpoint")
    alive = tmp_path / f".{CHECKPOINT_FILE}.tmp-{os.getpid()}-def456"    # a live run's: left alone
    alive.write_bytes(b"in progress")
    distill(*_pair(), IDS, DistillConfig(**CFG), checkpoint_dir=tmp_path)
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


def test_checkpoint_on_a_full_disk_is_the_projects_error(tmpfs):
    from analysis.compress.distill import CheckpointError, DistillConfig, distill
    disk = tmpfs("size=256k")
    _fill(disk, leave=8192)
    with pytest.raises(CheckpointError, match=r"disk is full.*no earlier checkpoint exists.*free some space"):
        distill(*_pair(), IDS, DistillConfig(**CFG), checkpoint_dir=disk / "ck")
    assert not [p for p in (disk / "ck").iterdir() if ".tmp-" in p.name]


# -- 2: --out onto a device, a FIFO, a link to stdout ------------------------------------------------

def test_out_onto_a_fifo_with_a_reader_writes_into_it(ckpt, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(fifo)])
    reader.join(30)
    assert code == 0 and stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO became a regular file"
    assert json.loads(got[0])["scores"]


def test_out_onto_a_fifo_without_a_reader_is_an_error_not_a_hang(ckpt, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(fifo)])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err, r"pipe has no reader", r"start the reader")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_out_onto_a_character_device_writes_to_it(ckpt, tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("making a character device (mknod) needs root")
    dev = tmp_path / "null"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))        # /dev/null's numbers, in a scratch folder
    except PermissionError as err:
        pytest.skip(f"mknod is not permitted here: {err}")
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(dev)])
    assert code == 0 and stat.S_ISCHR(os.lstat(dev).st_mode), "the device became a regular file"
    assert [p.name for p in tmp_path.iterdir()] == ["null"]            # no temporary left beside it


@pytest.mark.slow
def test_out_onto_a_link_to_stdout_prints_and_keeps_the_link(ckpt, tmp_path):
    link = tmp_path / "stdout"
    os.symlink("/proc/self/fd/1", link)
    done = _cli(["score", "--quiet", "--checkpoint", ckpt, "--out", link], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["scores"]
    assert os.path.islink(link) and os.readlink(link) == "/proc/self/fd/1"


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


@pytest.mark.parametrize("window", [2.5, float("nan"), "8", True, 10**30])
def test_evaluate_validates_window_at_the_library_boundary(model_dir, window):
    from analysis.arch.models import load_model
    from analysis.measure.evaluation import evaluate
    lm = load_model(str(model_dir))
    with pytest.raises(InputError, match="window must be a whole number"):
        evaluate(lm, "some text to evaluate", window=window)
    with pytest.raises(InputError, match="max_tokens must be a whole number"):
        evaluate(lm, "some text", max_tokens=10**12)


# -- 18: no warning before the one line ------------------------------------------------------------

@pytest.mark.slow
def test_a_pickle_model_refusal_is_the_only_line_on_stderr(model_dir, tmp_path):
    """torch's weights-only loader warns "Detected pickle protocol 4 ..." (two lines) before the
    refusal; the CLI holds warnings while a command runs and drops them after a user error."""
    import shutil

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'PICKLE_RAN'}",))

    folder = Path(shutil.copytree(model_dir, tmp_path / "pickled"))
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"w": Evil()}, handle, protocol=4)
    done = _cli(["score", "--quiet", "--model", folder], cwd=tmp_path)
    assert done.returncode == 2
    assert len([line for line in done.stderr.splitlines() if line.strip()]) == 1, done.stderr
    assert_one_line_error(done.stderr, r"pickle", r"safetensors copy")
    assert not (tmp_path / "PICKLE_RAN").exists()


def test_held_warnings_are_shown_after_a_success(caplog):
    """Holding warnings must not hide them from a run that succeeds: emit() shows them again."""
    import logging
    import warnings as w
    from analysis.cli.main import held_warnings
    with w.catch_warnings(record=True) as shown:
        w.simplefilter("always")
        with held_warnings() as held:
            w.warn("a note for the user", UserWarning)
            logging.getLogger("accelerate.test").warning("an accelerate note")
        assert not shown and "an accelerate note" not in caplog.text             # held, not shown
        held.emit()
    assert [str(x.message) for x in shown] == ["a note for the user"]
    assert "an accelerate note" in caplog.text


# -- 9: the pipeline's run folder ----------------------------------------------------------------------

def test_pipeline_on_a_read_only_out_dir_fails_before_the_first_round(tmpfs, model_dir, capsys):
    disk = tmpfs("size=1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    started = time.perf_counter()
    code = cli.main([*PIPE, "--model", str(model_dir), "--out-dir", str(disk / "runs"), "--name", "run"])
    assert code == 2 and time.perf_counter() - started < 30, "it ran the rounds before checking the output"
    assert_one_line_error(capsys.readouterr().err, r"read-only", r"writable")
    assert list(disk.iterdir()) == []


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
    done = _cli(argv, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-800:]
    assert "Removed .run.tmp-" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
