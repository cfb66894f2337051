"""A hostile task folder for `harness --task-dir`, issue 47 item 4 class 2: the folder is made safe before the
harness reads it (analysis.measure.harness.folder.check_folder), and the CLI's stdout carries only the result.

Before the fix: a FIFO named pipe.yaml hung the harness's task index (it opens every *.yaml); a config whose
`include:` reached outside the folder ran a `!function` module from there; `!function this.s` imported `this`
from Python's path, whose print (the Zen of Python) broke the JSON on stdout. Now every *.yaml the index opens,
every file a config includes and every `!function` module is a regular file inside the folder (else one line),
and whatever a task's own module prints goes to stderr.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from analysis.core.errors import InputError
from analysis.measure import harness as H
from tests._apptools import datasets_cache  # noqa: F401 - autouse: the datasets cache in a temporary folder
from tests._input_checks import cli_error, cli_run, in_thread, released_fifo

TASKS = Path(__file__).resolve().parent / "data" / "harness"
CONTEXT = 128
MC = (TASKS / "mc.yaml").read_text()


def _folder(tmp_path: Path, **configs: str) -> Path:
    """tmp_path/tasks: the tiny multiple-choice task (mc.yaml, mc.jsonl) and `configs` (file name -> YAML)."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    shutil.copy(TASKS / "mc.jsonl", folder / "mc.jsonl")
    (folder / "mc.yaml").write_text(MC)
    for name, text in configs.items():
        (folder / name).write_text(text)
    return folder


def _task(name: str, extra: str) -> str:
    """The tiny multiple-choice task renamed, with extra YAML lines (an include, a `!function`)."""
    return MC.replace("task: tiny_mc", f"task: {name}\n{extra}")


def _outside_module(tmp_path: Path) -> Path:
    """tmp_path/outside/evil.py: leaves a marker file when it is imported."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "evil.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n"
                                     "def f(dataset):\n    return dataset\n")
    (outside / "base.yaml").write_text("process_docs: !function evil.f\n")
    return outside


def _refused(folder: Path, pattern: str, name: str = "tiny_mc") -> str:
    for call in (lambda: H.prepare_tasks(name, folder), lambda: H.folder_tasks(folder)):
        with pytest.raises(InputError, match=pattern) as err:
            call()
        assert "\n" not in str(err.value)
    return str(err.value)


def test_an_include_outside_the_folder_is_refused_before_its_module_runs(tmp_path):
    outside = _outside_module(tmp_path)
    for include in ("../outside/base.yaml", str(outside / "base.yaml")):
        folder = _folder(tmp_path, **{"inc.yaml": _task("tiny_inc", f"include: {include}")})
        _refused(folder, r"inc\.yaml's include .*base\.yaml leads outside the task folder")
        assert not (tmp_path / "RAN").exists()
        shutil.rmtree(folder)


def test_a_symlinked_config_outside_the_folder_is_refused(tmp_path):
    outside = _outside_module(tmp_path)
    (outside / "task.yaml").write_text(_task("tiny_out", "process_docs: !function evil.f"))
    folder = _folder(tmp_path)
    (folder / "link.yaml").symlink_to(outside / "task.yaml")
    _refused(folder, r"The task config .*link\.yaml leads outside the task folder .*task\.yaml")
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("spec, problem", [
    ("this.s", r"this\.py is not there: the harness would import 'this' from Python's path"),
    ("..evil.f", r"evil\.py is not there"),
    ("os.path.join", r"os/path\.py is not there"),
])
def test_a_function_module_from_outside_the_folder_is_refused(tmp_path, capsys, spec, problem):
    _outside_module(tmp_path)
    folder = _folder(tmp_path, **{"fn.yaml": _task("tiny_fn", f"process_docs: !function {spec}")})
    _refused(folder, problem, "tiny_fn")
    assert capsys.readouterr().out == "" and not (tmp_path / "RAN").exists()


def test_a_symlinked_module_outside_the_folder_is_refused(tmp_path):
    outside = _outside_module(tmp_path)
    folder = _folder(tmp_path, **{"fn.yaml": _task("tiny_fn", "process_docs: !function helpers.f")})
    (folder / "helpers.py").symlink_to(outside / "evil.py")
    _refused(folder, r"The module of `!function helpers\.f` .*helpers\.py leads outside the task folder", "tiny_fn")
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("fifo, config, problem", [
    ("pipe.yaml", None, r"The task config .*pipe\.yaml is a pipe \(FIFO\)"),
    ("part.yaml.inc", "include: part.yaml.inc", r"fn\.yaml's include .*part\.yaml\.inc is a pipe \(FIFO\)"),
    ("helpers.py", "process_docs: !function helpers.f", r"The task module .*helpers\.py is a pipe \(FIFO\)"),
])
def test_a_fifo_in_the_folder_is_refused_without_hanging(tmp_path, fifo, config, problem):
    folder = _folder(tmp_path, **({"fn.yaml": _task("tiny_fn", config)} if config else {}))
    with released_fifo(folder / fifo) as path:
        for call in (lambda: H.folder_tasks(folder), lambda: H.prepare_tasks("tiny_mc", folder)):
            with pytest.raises(InputError, match=problem):
                in_thread(call, 30, release=lambda: os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK)))


def test_a_fifo_data_file_is_refused_without_hanging(tmp_path):
    folder = _folder(tmp_path, **{"fn.yaml": _task("tiny_fn", "").replace("mc.jsonl", "pipe.jsonl")})
    with released_fifo(folder / "pipe.jsonl") as path:
        with pytest.raises(InputError, match=r"The task's data file .*pipe\.jsonl is a pipe \(FIFO\)"):
            in_thread(lambda: H.prepare_tasks("tiny_fn", folder), 30,
                      release=lambda: os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK)))


def test_cli_fifo_config_is_one_line(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    with released_fifo(folder / "pipe.yaml"):
        cli_error(["harness", "--quiet", "--tasks", "tiny_mc", "--task-dir", folder, "--model", "unused"],
                  r"pipe\.yaml is a pipe \(FIFO\)", r"regular files only", seconds=60)


def test_a_task_module_inside_the_folder_runs_and_its_prints_go_to_stderr(tmp_path):
    """The ordinary case still works (a module next to its config), and what it prints, when the harness
    imports it and for every document, reaches stderr, never the JSON on stdout."""
    from tests._apptools import tiny_model_dir
    folder = _folder(tmp_path, **{"fn.yaml": _task("tiny_fn", "doc_to_text: !function helpers.text")
                                  .replace('doc_to_text: "Q: {{question}}\\nA:"\n', "")})
    (folder / "helpers.py").write_text("print('IMPORTED')\n"
                                       "def text(doc):\n    print('DOC')\n    return 'Q: ' + doc['question'] + '\\nA:'\n")
    model = tiny_model_dir(tmp_path / "model", max_position_embeddings=CONTEXT)
    code, out, err = cli_run(["harness", "--quiet", "--tasks", "tiny_fn", "--task-dir", folder, "--model", model,
                              "--sparsity", "0.25", "--limit", "3"], seconds=240)
    assert code == 0, err[-2000:]
    data = json.loads(out)                                               # the JSON alone
    assert {r["task"] for r in data["rows"]} == {"tiny_fn"}
    assert "IMPORTED" in err and "DOC" in err and "IMPORTED" not in out and "DOC" not in out
