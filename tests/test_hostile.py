"""Hostile input and faults (issue 11): a battery of bad inputs against the CLI and the library.

Every case asserts (1) the exit status (2 for a user error; the library raises a HeadscopeError),
(2) that the one-line message names the problem and the fix, and (3) that nothing was created,
half-written or deleted in the working folder (a snapshot of every file's bytes before and after).
Classes, as numbered in the issue: 1 custom code, 2 shard paths, 3 --out, 4 --overwrite,
5 killed exports, 6 hostile checkpoints, 7 --text-file, 8 mask.json, 9 tampered exports,
10 export names, 11 other arguments, 12 misleading messages, 13 the app's server config.

Faults for real: a full disk and a read-only file system are small tmpfs mounts (root only,
skipped with the reason otherwise); kills are SIGKILL / SIGTERM sent to a real CLI process.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from analysis import cli
from analysis.core.errors import HeadscopeError, InputError, ModelLoadError
from analysis.compress.export import export, load_pruned, mask_from_json, mask_record
from analysis.arch.geometry import HeadGeometry
from tests._apptools import tiny_model_dir
from tests._tiny import tiny_model

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


def _ckpt_with(env: Env, edit: Callable[[Path], None]) -> Path:
    folder = copy_folder(env.ckpt, env.inputs / "ckpt")
    edit(folder)
    return folder


def _indexed(folder: Path, shard_name: str, weight_map=None) -> None:
    """Replace the single file by an index that maps every tensor to `shard_name`."""
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    index = {"metadata": {}, "weight_map": weight_map if weight_map is not None else {n: shard_name for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _outside_shard(folder: Path) -> None:
    """An index naming '../outside.safetensors': a real, readable shard one level up."""
    shutil.copy(folder / "model.safetensors", folder.parent / "outside.safetensors")
    _indexed(folder, "../outside.safetensors")
    (folder / "model.safetensors").unlink()


def _absolute_shard(folder: Path) -> None:
    target = folder.parent / "abs.safetensors"
    shutil.copy(folder / "model.safetensors", target)
    _indexed(folder, str(target))
    (folder / "model.safetensors").unlink()


def _rewrite_tensor(folder: Path, name: str, shape) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    state = load_file(str(folder / "model.safetensors"))
    state[name] = torch.zeros(shape)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _huge_header(folder: Path) -> None:
    """A safetensors file whose header claims a 36 GiB float32 tensor (the file is a few bytes)."""
    header = json.dumps({"model.layers.0.self_attn.q_proj.weight":
                         {"dtype": "F32", "shape": [98304, 98304], "data_offsets": [0, 98304 * 98304 * 4]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)


def _user_folder(env: Env, name: str, files: dict[str, str]) -> None:
    folder = env.work / "exports" / name
    folder.mkdir(parents=True)
    for file, text in files.items():
        (folder / file).write_text(text)


def _write(env: Env, name: str, data) -> Path:
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


def _export_name(name: str) -> Callable[[Env], list]:
    return lambda e: [*EXPORT, "--model", e.model, "--out-dir", e.work / "exports", f"--name={name}"]


CLI_CASES = [
    # 2: shard paths that leave the checkpoint folder
    Case("shard-dotdot", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, _outside_shard)],
         r"outside the checkpoint folder", r"plain file names"),
    Case("shard-absolute", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, _absolute_shard)],
         r"outside the checkpoint folder", r"plain file names"),
    Case("model-folder-shard-dotdot", lambda e: [*SCORE, "--scorer", "magnitude", "--model",
                                                 _ckpt_with(e, _outside_shard)],
         r"outside the checkpoint folder", r"plain file names"),
    # 3: --out paths that cannot be written (checked before any work)
    Case("out-missing-folder", lambda e: [*SCORE, "--checkpoint", e.ckpt, "--out", e.work / "nope" / "x.json"],
         r"does not exist", r"create it first"),
    Case("out-is-a-folder", lambda e: [*SCORE, "--checkpoint", e.ckpt, "--out", e.work],
         r"is a folder", r"path of a file"),
    Case("out-under-a-file", lambda e: [*SCORE, "--checkpoint", e.ckpt, "--out", e.out / "x.json"],
         r"is a file, not a folder", r"inside a folder"),
    Case("out-empty", lambda e: [*SCORE, "--checkpoint", e.ckpt, "--out", ""], r"empty", r"give a file path"),
    Case("out-nul", lambda e: [*SCORE, "--checkpoint", e.ckpt, "--out", str(e.work / "a\x00b")],
         r"NUL", r"give a file path"),
    # 4: --overwrite never deletes what headscope did not write
    Case("overwrite-user-folder", lambda e: (_user_folder(e, "mine", {"notes.txt": "precious"}),
                                             [*_export_name("mine")(e), "--overwrite"])[1],
         r"not a headscope export", r"choose another name"),
    Case("overwrite-other-tools-mask", lambda e: (_user_folder(e, "other", {"mask.json": '{"tool": "other"}'}),
                                                  [*_export_name("other")(e), "--overwrite"])[1],
         r"not a headscope export", r"choose another name"),
    Case("occupied-without-overwrite", lambda e: (_user_folder(e, "taken", {"a.txt": "x"}),
                                                  _export_name("taken")(e))[1],
         r"already exists", r"choose another name|allow overwriting"),
    # 6: hostile checkpoints for --checkpoint streaming
    Case("tensor-wrong-shape", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: _rewrite_tensor(
        f, "model.layers.0.self_attn.q_proj.weight", (16, 32)))], r"has shape \[16, 32\]", r"config\.json that belongs"),
    Case("config-does-not-match", lambda e: [*SCORE, "--checkpoint", _ckpt_with(
        e, lambda f: edit_json(f / "config.json", hidden_size=64))], r"has shape", r"config\.json that belongs"),
    Case("header-claims-36-GiB", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, _huge_header)],
         r"could not read|has shape|no tensor", r"re-download|config\.json"),
    Case("weight-map-is-a-list", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: _indexed(f, "", ["x"]))],
         r"weight_map must map", r"re-download or re-save"),
    Case("index-not-json", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (
        f / "model.safetensors.index.json").write_text("{oops"))], r"not a valid safetensors index", r"re-save"),
    Case("index-without-weight-map", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (
        f / "model.safetensors.index.json").write_text("{}"))], r"not a valid safetensors index", r"re-save"),
    Case("index-deeply-nested", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (
        f / "model.safetensors.index.json").write_text("[" * 100000 + "]" * 100000))],
         r"not a valid safetensors index", r"re-save"),
    Case("missing-shard", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: _indexed(f, "gone.safetensors"))],
         r"missing 1 of its shards", r"copy every file"),
    Case("truncated-weights", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (
        f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:300]))],
         r"could not read", r"re-download|re-save"),
    Case("config-not-json", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (
        f / "config.json").write_text("{oops"))], r"could not read .*config\.json", r"original config\.json"),
    Case("config-missing", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (f / "config.json").unlink())],
         r"no config\.json", r"copy the model's config\.json"),
    Case("no-weights", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: (f / "model.safetensors").unlink())],
         r"no \.safetensors weights", r"re-save"),
    Case("checkpoint-missing", lambda e: [*SCORE, "--checkpoint", e.inputs / "nowhere"],
         r"not a checkpoint folder", r"pass the folder"),
    Case("unknown-model-type", lambda e: [*SCORE, "--checkpoint", _ckpt_with(e, lambda f: edit_json(
        f / "config.json", model_type="no-such-type"))], r"could not read", r"original config\.json"),
    Case("checkpoint-needs-model", lambda e: [*SCORE, "--scorer", "wanda", "--checkpoint", e.ckpt],
         r"streams weights only", r"--model"),
    # 7: --text-file that never ends, is no file, or holds no text
    Case("text-dev-zero", lambda e: [*EVALUATE, "--model", e.model, "--text-file", "/dev/zero"],
         r"device, pipe", r"save the text"),
    Case("text-fifo", lambda e: (os.mkfifo(e.inputs / "fifo"), [*EVALUATE, "--model", e.model, "--text-file",
                                                                 e.inputs / "fifo"])[1],
         r"device, pipe", r"save the text"),
    Case("text-folder", lambda e: [*EVALUATE, "--model", e.model, "--text-file", e.inputs],
         r"is a folder", r"save the text"),
    Case("text-missing", lambda e: [*EVALUATE, "--model", e.model, "--text-file", e.inputs / "none.txt"],
         r"cannot read", r"check the path"),
    Case("text-not-utf8", lambda e: [*EVALUATE, "--model", e.model, "--text-file",
                                     _write(e, "latin1.txt", "café w5 w6".encode("latin-1"))],
         r"not UTF-8", r"save it as UTF-8"),
    Case("text-empty", lambda e: [*EVALUATE, "--model", e.model, "--text-file", _write(e, "empty.txt", "  \n")],
         r"empty", r"paste or upload"),
    Case("text-path-empty", lambda e: [*EVALUATE, "--model", e.model, "--text-file", ""],
         r"empty", r"give the path"),
    Case("text-sparse-10-GiB", lambda e: [*EVALUATE, "--model", e.model, "--text-file", _sparse(e, 10 * 2**30)],
         r"empty", r"paste or upload"),
    # 10: export names that are not one safe folder name
    Case("name-300-chars", _export_name("x" * 300), r"not allowed", r"choose a name such as"),
    Case("name-nul", _export_name("bad\x00name"), r"NUL", r"plain folder name"),
    Case("name-newline", _export_name("two\nlines"), r"not allowed", r"choose a name such as"),
    Case("name-hidden", _export_name(".hidden"), r"not allowed", r"not starting with '\.'"),
    Case("name-dash", _export_name("-rf"), r"not allowed", r"choose a name such as"),
    Case("name-tab", _export_name("a\tb"), r"not allowed", r"control characters"),
    Case("name-empty", _export_name(""), r"give a folder name", r"inside the output folder"),
    Case("name-escapes", _export_name("../../etc"), r"outside the output folder", r"folder name inside it"),
    Case("name-double-slash", _export_name("a//b"), r"not allowed", r"choose a name such as"),
    # 11: other arguments
    Case("ablation-non-numeric", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                            _write(e, "abl.json", '[[0.1, "abc", 0, 0], [0, 0, 0, 0]]')],
         r"could not read --ablation-file", r"list of lists of numbers"),
    Case("ablation-ragged", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                       _write(e, "abl.json", [[0.1, 0.2], [0.3]])],
         r"could not read --ablation-file", r"list of lists of numbers"),
    Case("ablation-nan", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                    _write(e, "abl.json", "[[NaN, 0, 0, 0], [0, 0, 0, 0]]")],
         r"NaN or infinite", r"list of lists of numbers"),
    Case("ablation-1d", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", _write(e, "abl.json", [1, 2])],
         r"shape \[2\]", r"one row per layer"),
    Case("ablation-missing", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", e.inputs / "none.json"],
         r"(could not|cannot) read --ablation-file", r"\.npy file"),
    Case("ablation-pickled-npy", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", _pickled_npy(e)],
         r"could not read --ablation-file", r"\.npy file"),
    Case("ablation-not-json", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                         _write(e, "abl.json", "[[1, 2")], r"could not read", r"list of lists"),
    Case("model-empty", lambda e: [*SCORE, "--model", ""], r"--model is empty", r"built-in name"),
    Case("model-blank", lambda e: [*SCORE, "--model", "   "], r"--model is empty", r"built-in name"),
    Case("checkpoint-empty", lambda e: [*SCORE, "--checkpoint", ""], r"--checkpoint is empty", r"built-in name"),
    Case("model-missing-path", lambda e: [*SCORE, "--model", str(e.inputs / "no" / "such")],
         r"does not exist", r"built-in model"),
    Case("z-values-garbage", lambda e: ["sweep", "--quiet", "--model", e.model, "--sparsity", "0.25",
                                        "--z-values", "1,abc"], r"comma-separated numbers", r"e\.g\."),
]


def _sparse(env: Env, size: int) -> Path:
    path = env.inputs / "sparse.txt"
    with open(path, "wb") as handle:
        handle.truncate(size)          # all NUL bytes, no disk used
    return path


def _pickled_npy(env: Env) -> Path:
    path = env.inputs / "obj.npy"
    np.save(path, np.array([[object()]], dtype=object), allow_pickle=True)
    return path


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


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_hostile_input(case: Case, ckpt, model_dir, tmp_path, capsys):
    check_cli_case(case, hostile_env(tmp_path, ckpt, model_dir), capsys, max_seconds=30)


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


def _fill(folder: Path, leave: int = 0) -> None:
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


def test_out_on_a_full_disk_keeps_the_old_file(tmpfs, ckpt, capsys):
    disk = tmpfs("size=1m")
    out = disk / "scores.csv"
    out.write_bytes(SENTINEL)
    _fill(disk)
    before = snapshot(disk)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--format", "csv", "--out", str(out)])
    _, err = capsys.readouterr()
    assert code == 2
    line = assert_one_line_error(err, r"disk is full", r"free some space")
    assert "another format" not in line and "previous file was kept" in line
    assert snapshot(disk) == before and out.read_bytes() == SENTINEL


def test_out_on_a_read_only_disk(tmpfs, ckpt, capsys):
    disk = tmpfs("size=1m")
    (disk / "scores.json").write_bytes(SENTINEL)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    code = cli.main(["score", "--quiet", "--checkpoint", str(ckpt), "--out", str(disk / "scores.json")])
    _, err = capsys.readouterr()
    assert code == 2
    assert_one_line_error(err, r"read-only", r"writable disk")
    assert (disk / "scores.json").read_bytes() == SENTINEL


def test_export_on_a_full_disk_says_so_and_keeps_the_previous_export(tmpfs, model_dir, capsys):
    disk = tmpfs("size=5m")
    argv = [*EXPORT, "--model", str(model_dir), "--out-dir", str(disk), "--name", "cut", "--export-format", "zeroed"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    previous = snapshot(disk / "cut")
    _fill(disk, leave=16 * 1024)
    before = snapshot(disk)
    code = cli.main([*argv, "--overwrite"])
    _, err = capsys.readouterr()
    assert code == 2
    line = assert_one_line_error(err, r"disk is full", r"free some space")
    assert "another format" not in line and "previous export was kept" in line
    assert snapshot(disk) == before and snapshot(disk / "cut") == previous


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


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_overwrite_killed_between_renames_is_recovered(pruned_export, tmp_path, model_dir):
    """State after a kill between the two renames of an overwrite: only `.NAME.old-PID-*` exists."""
    from analysis.arch.models import load_model
    root = tmp_path / "root"
    root.mkdir()
    old = root / f".base.old-{_dead_pid()}-abc123"
    shutil.copytree(pruned_export, old)
    kept = snapshot(old)
    stale_tmp = root / f".base.tmp-{_dead_pid()}-xyz"
    stale_tmp.mkdir()
    (stale_tmp / ".headscope-export-in-progress").write_text("{}")
    (stale_tmp / "model.safetensors").write_bytes(b"\0" * 1000)
    not_ours = root / f".notes.tmp-{_dead_pid()}-u"        # same pattern, but no marker: left alone
    not_ours.mkdir()
    (not_ours / "user.txt").write_text("mine")
    lm = load_model(str(model_dir))
    result = export("zeroed", lm.model, np.zeros((2, 4), dtype=bool), root, "other")
    assert any("Recovered the previous export" in n for n in result.notes), result.notes
    assert snapshot(root / "base") == kept and not old.exists() and not stale_tmp.exists()
    assert (not_ours / "user.txt").read_text() == "mine"


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


# -- 13: the app's server configuration ---------------------------------------------------------------

def test_streamlit_config_is_explicit_about_xsrf_and_error_details():
    tomllib = pytest.importorskip("tomllib")                   # Python >= 3.11
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["enableXsrfProtection"] is True
    assert config["client"]["showErrorDetails"] == "type"      # type + generic message, no stack trace
    assert config["server"]["address"] == "127.0.0.1"


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
