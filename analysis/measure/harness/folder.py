"""A task folder made safe before the harness reads it: every *.yaml its task index opens, every config one
includes and every `!function` module one imports is a regular file inside the folder (InputError, one line,
otherwise). The configs are read by a YAML loader that runs nothing.
"""
from __future__ import annotations

import functools
from pathlib import Path

from analysis.core.errors import InputError, shorten
from analysis.measure.harness.runtime import DOCS

TASK_CONFIG_MAX_BYTES = 2**20   # a task config (or a file it includes) is a few KiB
TASK_MODULE_MAX_BYTES = 16 * 2**20   # a `!function` module next to a config
SKIPPED_FOLDERS = ("__pycache__", ".ipynb_checkpoints")   # what the harness's task index skips (lm_eval.tasks._index)


def check_folder(task_dir) -> Path | None:
    """The task folder, resolved, made safe before the harness reads it (InputError, one line, otherwise):
    every *.yaml its task index opens is a regular file inside the folder (a FIFO named pipe.yaml hung it), and
    so is every config one includes and every `!function` module one imports (an include reaching outside the
    folder ran a module from there; `!function this.s` imported `this` from Python's path)."""
    if task_dir is None or str(task_dir).strip() == "":
        return None
    folder = Path(str(task_dir)).expanduser()
    if not folder.is_dir():
        raise InputError(f"The task folder {folder} is not a folder: give a folder of task configs "
                         f"and/or <task>/<split>.jsonl data files ({DOCS}).")
    folder, seen = folder.resolve(), set()
    for path in sorted(folder.glob("**/*.yaml")):                     # the files the harness's index opens
        if not any(part in SKIPPED_FOLDERS for part in path.relative_to(folder).parts):
            _check_config(path, folder, seen)
    return folder


class _Function(str):
    """A `!function module.name` reference of a task config, read without importing anything."""


@functools.cache
def _scan_loader():
    """A YAML loader of the harness's syntax that runs nothing: `!function` gives a `_Function`, any other tag
    None (so it reads every file the harness's own loader reads, and sees every include and module it would)."""
    import yaml
    base = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader

    class Scan(base):
        pass
    Scan.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))
    Scan.add_multi_constructor("", lambda loader, suffix, node: None)
    return Scan


def _inside(path: Path, folder: Path, what: str, fix: str) -> Path:
    """`path` resolved (what the harness opens: it resolves a config's path, and reads includes and modules from
    its folder), InputError unless it lies inside `folder`."""
    real = path.resolve()
    if not real.is_relative_to(folder):
        raise InputError(f"{what} {shorten(path, 120)} leads outside the task folder {shorten(folder, 120)} (to "
                         f"{shorten(real, 120)}); {fix}.")
    return real


def _check_config(path: Path, folder: Path, seen: set, what: str = "The task config") -> None:
    """One task config and, recursively, the configs it includes: regular files inside the folder, each
    `!function` module a regular file inside the folder next to the config that names it."""
    import yaml

    from analysis.core.files import read_file_bytes
    fix = (f"a task folder holds regular files only, and its configs include and import files inside it "
           f"({shorten(folder, 120)}; {DOCS})")
    real = _inside(path, folder, what, fix)
    if real in seen:
        return
    seen.add(real)
    raw = read_file_bytes(real, TASK_CONFIG_MAX_BYTES, what=what, fix=fix)
    try:
        cfg = yaml.load(raw, Loader=_scan_loader())     # noqa: S506 - the loader constructs plain data only
    except (yaml.YAMLError, RecursionError):
        return                                          # the harness cannot read it either: it skips the file
    if not isinstance(cfg, dict):
        return
    includes = cfg.get("include")
    for name in includes if isinstance(includes, list) else [] if includes is None else [includes]:
        _check_config(real.parent / str(name), folder, seen,          # an absolute name replaces the folder
                      f"{shorten(real.name, 80)}'s include")
    for spec in _functions(cfg):
        _check_module(spec, real, folder, fix)


def _functions(cfg: dict) -> list[str]:
    """Every `!function` reference in a config read by `_scan_loader`; each list or mapping visited once (YAML
    aliases can make a small file a huge tree: "billion laughs")."""
    found, todo, seen = [], [cfg], set()
    while todo:
        value = todo.pop()
        if isinstance(value, _Function):
            found.append(str(value))
        elif isinstance(value, (dict, list)) and id(value) not in seen:
            seen.add(id(value))
            todo.extend(value.values() if isinstance(value, dict) else value)
    return found


def _check_module(spec: str, config: Path, folder: Path, fix: str) -> None:
    """`!function pkg.module.name` of `config`: the harness imports pkg/module.py from the config's folder when
    that file is there, else `pkg.module` from Python's path (`this` prints the Zen of Python into the CLI's
    JSON); only a regular file inside the task folder is allowed."""
    from analysis.core.files import check_regular_size
    module = spec.rpartition(".")[0]
    if not module:
        return                                          # no module: the harness refuses the config itself
    file = config.parent / f"{module.replace('.', '/')}.py"
    if not file.exists():
        raise InputError(f"The task config {shorten(config, 120)} names `!function {shorten(spec, 80)}`, but "
                         f"{shorten(file, 120)} is not there: the harness would import {shorten(module, 60)!r} from "
                         f"Python's path instead. Put {file.name} next to the config; {fix}.")
    real = _inside(file, folder, f"The module of `!function {shorten(spec, 80)}`", fix)
    check_regular_size(real, TASK_MODULE_MAX_BYTES, what="The task module", fix=fix)
