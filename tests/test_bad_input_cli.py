"""Bad input to the CLI: a battery of bad arguments, files and models, each run in-process (`cli.main`)
and a selection again through the real CLI in a subprocess, where warnings and tracebacks would show.

Every case asserts (1) the exit status (2 for a user error), (2) that the one-line message names the
problem and the fix, and (3) that nothing was created, half-written or deleted in the working folder
(a snapshot of every file's bytes before and after; tests/_bad_input.py). Numbers in comments are the
classes of the hardening issues (11 and 25) that introduced the cases.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from analysis.core.errors import InputError
from tests._bad_input import (ckpt, model_dir, snapshot, copy_folder, edit_json, assert_one_line_error, Env, Case,
                              write_input, SCORE, EXPORT, EVALUATE, ABLATION, hostile_env, check_cli_case, LONG,
                              make_fifo, PIPE, EVAL, real_cli)  # noqa: F401 (fixtures)


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
                                     write_input(e, "latin1.txt", "café w5 w6".encode("latin-1"))],
         r"not UTF-8", r"save it as UTF-8"),
    Case("text-empty", lambda e: [*EVALUATE, "--model", e.model, "--text-file", write_input(e, "empty.txt", "  \n")],
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
                                            write_input(e, "abl.json", '[[0.1, "abc", 0, 0], [0, 0, 0, 0]]')],
         r"could not read --ablation-file", r"list of lists of numbers"),
    Case("ablation-ragged", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                       write_input(e, "abl.json", [[0.1, 0.2], [0.3]])],
         r"could not read --ablation-file", r"list of lists of numbers"),
    Case("ablation-nan", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                    write_input(e, "abl.json", "[[NaN, 0, 0, 0], [0, 0, 0, 0]]")],
         r"NaN or infinite", r"list of lists of numbers"),
    Case("ablation-1d", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", write_input(e, "abl.json", [1, 2])],
         r"shape \[2\]", r"one row per layer"),
    Case("ablation-missing", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", e.inputs / "none.json"],
         r"(could not|cannot) read --ablation-file", r"\.npy file"),
    Case("ablation-pickled-npy", lambda e: [*ABLATION, "--model", e.model, "--ablation-file", _pickled_npy(e)],
         r"could not read --ablation-file", r"\.npy file"),
    Case("ablation-not-json", lambda e: [*ABLATION, "--model", e.model, "--ablation-file",
                                         write_input(e, "abl.json", "[[1, 2")], r"could not read", r"list of lists"),
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


@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_hostile_input(case: Case, ckpt, model_dir, tmp_path, capsys):
    check_cli_case(case, hostile_env(tmp_path, ckpt, model_dir), capsys, max_seconds=30)


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


MORE_CASES = [
    # 3: devices and FIFOs are refused before a byte is read (no hang, no 3 GiB read)
    Case("train-text-dev-zero", lambda e: [*PIPE, "--model", e.model, "--train-text", "/dev/zero",
                                           "--out-dir", e.work, "--name", "run"], r"character device", r"\.txt"),
    Case("eval-text-fifo", lambda e: [*PIPE, "--model", e.model, "--eval-text", make_fifo(e),
                                      "--out-dir", e.work, "--name", "run"], r"pipe \(FIFO\)", r"\.txt"),
    Case("ablation-file-dev-zero", lambda e: ["score", "--quiet", "--model", e.model, "--scorer", "ablation",
                                              "--ablation-file", "/dev/zero"], r"character device", r"\.npy"),
    Case("ablation-file-fifo", lambda e: ["score", "--quiet", "--model", e.model, "--scorer", "ablation",
                                          "--ablation-file", make_fifo(e)], r"pipe \(FIFO\)", r"\.npy"),
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


@pytest.mark.slow
@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_real_cli_subprocess(case_id, ckpt, model_dir, tmp_path):
    case = next(c for c in MORE_CASES if c.id == case_id)
    env = hostile_env(tmp_path, ckpt, model_dir)
    argv = case.argv(env)
    before = snapshot(env.work)
    done = real_cli(argv, cwd=env.work)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected the error line alone on stderr: {done.stderr!r}"
    assert_one_line_error(done.stderr, case.problem, case.fix)
    assert snapshot(env.work) == before


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
    done = real_cli(["score", "--quiet", "--model", folder], cwd=tmp_path)
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
