"""EleutherAI's lm-evaluation-harness on a model in memory: the field's zero-shot benchmarks (BoolQ, PIQA,
HellaSwag, WinoGrande, ARC-Easy, ARC-Challenge, OpenBookQA, WikiText-2 perplexity, or any log-likelihood
task of a local task folder), dense vs a cut, with the harness's own standard errors.

Nothing is downloaded: the datasets library runs offline for the whole run. A task comes from
- **a task folder** (`task_dir`): YAML task configs in the harness's own format (the harness indexes the
  folder). headscope reads a relative `dataset_kwargs.data_files` / `data_dir` path, or a `dataset_path`
  that names a folder, relative to the config's own folder (the harness alone would read it relative to
  the working directory), and refuses a config whose files are not there;
- **the standard tasks** (`STANDARD_TASKS`, by the harness's names): the harness's own config of the task
  (prompts, choices, metrics, helpers: exactly what the field reports), its data from
  `task_dir/<task>/<split>.jsonl` (or `.json`, `.parquet`, `.csv`; `<split>-*.parquet` shards too) when
  that file is there, else from the HF datasets cache (a cache filled on a machine that has the hub).
  A folder's own config of the same name wins.

The model is any causal LM in memory behind the harness's `HFLM` (it takes a model object; with
transformers 5.23 it works as it is), subclassed only to report progress and check Stop at every forward
batch: batching, tokenization and log-likelihoods are the harness's. A cut is gates through
`analysis.arch.head_gates.head_mask` on the dense model (the one masking mechanism; it computes what
surgery computes), or a model of its own (surgery's twin, an export folder's weights) that the caller
built. The dense model is never changed: the harness gets a copy of the tokenizer (it may add a pad token)
and its `tie_weights` call is skipped for the run (it could re-tie an untied head).

Generative tasks (`generate_until`) run too, greedily, one prompt at a time: the harness's prompts, its
stop rules (the task's `until` strings and the tokenizer's EOS, cut from the text as the harness cuts them,
the model's EOS token id as transformers' generate stops on it) and its `process_results` scoring; the
decode loop is headscope's own (`generate_greedy` over analysis.measure.decode: a prefill, then one token a step
with a KV cache), so each row's real KV-cache bytes after the prompt and at the end, and its decode speed, are recorded
(`HarnessRun.generations`). A sampling task (do_sample, a temperature above 0) is refused with one line.

`lm_eval` is imported only here and only when a run needs it: `harness_missing()` is the one line that says
what to install.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from analysis.core.errors import InputError, check_whole_number, first_line, shorten
from analysis.core.progress import Progress, ShouldStop, check_stop, report, scaled

HARNESS_VERSION = "0.4.13"
HARNESS_REQUIREMENT = f"lm_eval=={HARNESS_VERSION}"
DOCS = "docs/HARNESS.md"
DEFAULT_BATCH_SIZE = 8
BOOTSTRAP_ITERS = 1000          # the harness's resampled stderrs (median, F1, ...); acc's is in closed form
FEWSHOT_SEED = 1234             # the harness's default (simple_evaluate's fewshot_random_seed)
LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
GENERATE_TYPES = ("generate_until",)
REQUEST_TYPE = {"multiple_choice": "loglikelihood", "loglikelihood": "loglikelihood",       # output type ->
                "loglikelihood_rolling": "loglikelihood_rolling", "generate_until": "generate_until"}   # the LM call
DATA_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}   # suffix -> datasets builder
LOGITS_COPIES = 2               # a forward batch holds its logits and their log-softmax at once
MEMORY_SHARE = 0.8              # of the free memory, what a perplexity batch's logits may take
TASK_CONFIG_MAX_BYTES = 2**20   # a task config (or a file it includes) is a few KiB
TASK_MODULE_MAX_BYTES = 16 * 2**20   # a `!function` module next to a config
SKIPPED_FOLDERS = ("__pycache__", ".ipynb_checkpoints")   # what the harness's task index skips (lm_eval.tasks._index)


@dataclass(frozen=True)
class StandardTask:
    """A task the field reports, run from the harness's own config with the user's data."""
    label: str
    config: str                 # the harness's config, relative to lm_eval/tasks/
    fields: str                 # what each record of the data file holds


STANDARD_TASKS: dict[str, StandardTask] = {
    "boolq": StandardTask("BoolQ", "super_glue/boolq/default.yaml", "passage, question, label (0 = no, 1 = yes)"),
    "piqa": StandardTask("PIQA", "piqa/piqa.yaml", "goal, sol1, sol2, label (0 or 1)"),
    "hellaswag": StandardTask("HellaSwag", "hellaswag/hellaswag.yaml",
                              "activity_label, ctx_a, ctx_b, endings (4 strings), label (\"0\" .. \"3\")"),
    "winogrande": StandardTask("WinoGrande", "winogrande/default.yaml",
                               "sentence (one _ where the option goes), option1, option2, answer (\"1\" or \"2\")"),
    "arc_easy": StandardTask("ARC-Easy", "arc/arc_easy.yaml",
                             "question, choices {text: [...], label: [...]}, answerKey"),
    "arc_challenge": StandardTask("ARC-Challenge", "arc/arc_challenge.yaml",
                                  "question, choices {text: [...], label: [...]}, answerKey"),
    "openbookqa": StandardTask("OpenBookQA", "openbookqa/openbookqa.yaml",
                               "question_stem, choices {text: [...], label: [...]}, answerKey"),
    "wikitext": StandardTask("WikiText-2", "wikitext/wikitext.yaml", "page (one whole article per record)"),
}


# -- the harness, imported on demand ----------------------------------------------------------------------

def installed() -> bool:
    """Whether lm_eval is there, without importing it (a page asks on every run; `harness_missing` imports)."""
    import importlib.util
    try:
        return importlib.util.find_spec("lm_eval") is not None
    except (ImportError, ValueError):          # a broken or blocked package
        return False


def harness_missing() -> str:
    """"" when lm-evaluation-harness imports, else the one line that says what to install."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as err:
        return (f"lm-evaluation-harness is not installed ({first_line(err)}): install it with "
                f"`pip install {HARNESS_REQUIREMENT}` in this environment (.venv/bin/python -m pip install "
                f"{HARNESS_REQUIREMENT}).")
    return ""


def require_harness() -> None:
    """InputError with `harness_missing()`'s line when the harness is not installed."""
    missing = harness_missing()
    if missing:
        raise InputError(missing)


def _tasks_folder() -> Path:
    import lm_eval.tasks
    return Path(lm_eval.tasks.__file__).parent


_QUIET_LOCK = threading.Lock()
_quiet_depth = 0
_saved: dict = {}


@contextlib.contextmanager
def _quiet():
    """The harness's and datasets' own logging and progress bars off for a run (headscope reports progress
    itself); restored when the last run in this process ends."""
    global _quiet_depth
    import logging

    import datasets
    import lm_eval.api.task as task_module
    from tqdm import tqdm
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            _saved.update(level=logging.getLogger("lm_eval").level, tqdm=task_module.tqdm,
                          bars=datasets.is_progress_bar_enabled())
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
            task_module.tqdm = functools.partial(tqdm, disable=True)       # build_all_requests' bar
            datasets.disable_progress_bars()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                logging.getLogger("lm_eval").setLevel(_saved["level"])
                task_module.tqdm = _saved["tqdm"]
                if _saved["bars"]:
                    datasets.enable_progress_bars()


@contextlib.contextmanager
def _offline():
    """The datasets library offline for the block (nothing from a hub: a hub dataset must be in the cache)."""
    import datasets.config
    import huggingface_hub.constants as hub
    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


# -- tasks -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSource:
    """Where a task's config and data come from (what the report says about it)."""
    name: str
    config: str                 # the YAML file (the harness's own for a standard task)
    data: str                   # the data files, or "HF datasets cache: <path> (<name>)"
    output_type: str = ""
    n_docs: int = 0             # documents measured (after the limit)

    def as_dict(self) -> dict:
        return dict(config=self.config, data=self.data, output_type=self.output_type, n_docs=self.n_docs)


@dataclass
class PreparedTasks:
    """The harness's Task objects of the requested names, built once (dense and cut read the same ones: the
    harness rebuilds each run's requests), and where each came from."""
    names: tuple
    loaded: dict                # the harness's TaskDict: {"tasks": {...}, "groups": {...}, "group_map": {...}}
    sources: dict               # name -> TaskSource
    task_dir: str | None
    limit: int | None

    @property
    def tasks(self) -> dict:
        return self.loaded["tasks"]

    def n_docs(self, task_name: str) -> int:
        n = len(self.tasks[task_name].eval_docs)
        return n if self.limit is None else min(n, self.limit)

    def request_types(self) -> list[str]:
        """The harness's request calls of a run, in its order (log-likelihoods, rolling log-likelihoods,
        generations: as the tasks come)."""
        return list(dict.fromkeys(REQUEST_TYPE[task.OUTPUT_TYPE] for task in self.tasks.values()))


def _check_folder(task_dir) -> Path | None:
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


def _folder_manager(folder: Path | None):
    """The harness's TaskManager over the folder's configs only (not its 14,000 built-in ones)."""
    from lm_eval.tasks import TaskManager
    try:
        return TaskManager(include_path=str(folder) if folder else None, include_defaults=False)
    except Exception as err:  # noqa: BLE001 - a broken config in the user's folder: one line naming it
        raise InputError(f"The harness could not read the task configs in {folder}: {first_line(err)}") from None


def folder_tasks(task_dir) -> list[str]:
    """The task, group and tag names the folder's configs define (sorted; [] without a folder)."""
    require_harness()
    folder = _check_folder(task_dir)
    return [] if folder is None else list(_folder_manager(folder).all_tasks)


def known_tasks(task_dir) -> list[str]:
    """Every name a run may ask for: the folder's own tasks, then the standard tasks it does not define
    (without a folder: the standard tasks, and lm_eval is not imported: a page asks on every run)."""
    if task_dir is None or str(task_dir).strip() == "":
        return list(STANDARD_TASKS)
    own = folder_tasks(task_dir)
    return own + [n for n in STANDARD_TASKS if n not in own]


def _split_of(cfg: dict) -> str:
    """The split the harness evaluates: the test split when the config has one, else the validation split."""
    split = cfg.get("test_split") or cfg.get("validation_split")
    if not split:
        raise InputError(f"Task {cfg.get('task')!r} names neither a test_split nor a validation_split: the harness "
                         f"has nothing to evaluate.")
    return str(split)


def _local_files(folder: Path | None, name: str, split: str) -> list[Path]:
    """DIR/<task>/<split>.<ext> (or <split>-*.<ext> shards) for a standard task, in one format."""
    if folder is None or not (folder / name).is_dir():
        return []
    for suffix in DATA_LOADERS:
        one = folder / name / f"{split}{suffix}"
        if one.is_file():
            return [one]
        shards = sorted(p for p in (folder / name).glob(f"{split}-*{suffix}") if p.is_file())
        if shards:
            return shards
    return []


def _hub_words(cfg: dict) -> str:
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    return f"{path}" + (f" ({name})" if name else "")


def _cache_dir() -> str:
    import datasets.config
    return str(datasets.config.HF_DATASETS_CACHE)


def _standard_config(name: str, folder: Path | None) -> tuple[dict, TaskSource]:
    """The harness's own config of a standard task, its data pointed at the folder's file when there is one."""
    from lm_eval.tasks._yaml_loader import load_yaml       # the harness's own reader (!function, include:)
    spec = STANDARD_TASKS[name]
    path = _tasks_folder() / spec.config
    cfg = dict(load_yaml(path, resolve_func=True))
    split = _split_of(cfg)
    files = _local_files(folder, name, split)
    if not files:
        return cfg, TaskSource(name, str(path), f"HF datasets cache: {_hub_words(cfg)} in {_cache_dir()}")
    loader = DATA_LOADERS[files[0].suffix]
    cfg.update(dataset_path=loader, dataset_name=None, dataset_kwargs={"data_files": {split: [str(p) for p in files]}},
               training_split=None, validation_split=split if split == cfg.get("validation_split") else None,
               test_split=split if split == cfg.get("test_split") else None, fewshot_split=None)
    return cfg, TaskSource(name, str(path), ", ".join(str(p) for p in files))


def _is_pattern(p: str) -> bool:
    return any(c in p for c in "*?[") or "://" in p


def _resolved(value, base: Path, missing: list):
    """data_files (a path, a list of them, or split -> either) with relative paths made absolute under base;
    plain paths that are not files are added to `missing`."""
    if isinstance(value, dict):
        return {k: _resolved(v, base, missing) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_resolved(v, base, missing) for v in value]
    p = str(value)
    if _is_pattern(p):
        return p if Path(p).is_absolute() or "://" in p else str(base / p)
    full = Path(p).expanduser()
    full = full if full.is_absolute() else base / full
    if not full.exists():
        missing.append(str(full))
    elif not full.is_dir():                             # the datasets library would read a FIFO for ever
        from analysis.core.files import open_regular
        with open_regular(full, what="The task's data file", fix=f"give its data as regular files ({DOCS})"):
            pass
    return str(full)


def _folder_config(name: str, yaml_path: Path) -> tuple[dict, TaskSource]:
    """A folder task's config with its local paths read relative to the config's folder."""
    from lm_eval.tasks._yaml_loader import load_yaml
    try:
        cfg = dict(load_yaml(yaml_path, resolve_func=True))
    except Exception as err:  # noqa: BLE001 - the user's YAML or its helper file: one line
        raise InputError(f"Task {name!r} ({yaml_path}) could not be read: {first_line(err)}") from None
    base, missing = yaml_path.parent, []
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    for key in ("data_files", "data_dir"):
        if kwargs.get(key) is not None:
            kwargs[key] = _resolved(kwargs[key], base, missing)
    if kwargs:
        cfg["dataset_kwargs"] = kwargs
    dataset_path = str(cfg.get("dataset_path") or "")
    local = Path(dataset_path).expanduser()
    local = local if local.is_absolute() else base / local
    if dataset_path and (local.exists() or dataset_path.startswith((".", "/", "~"))):
        if not local.exists():
            missing.append(str(local))
        cfg["dataset_path"] = str(local)
    if missing:
        raise InputError(f"Task {name!r} ({yaml_path.name}) reads {', '.join(missing)}, which "
                         f"{'is' if len(missing) == 1 else 'are'} not there: put the task's data there, or fix the "
                         f"path in {yaml_path} (a relative path is read from the config's folder; {DOCS}).")
    data = kwargs.get("data_files") or kwargs.get("data_dir")
    words = (", ".join(_flat(data)) if data else cfg["dataset_path"] if local.exists()
             else f"HF datasets cache: {_hub_words(cfg)} in {_cache_dir()}")
    return cfg, TaskSource(name, str(yaml_path), words)


def _flat(value) -> list[str]:
    """The paths of a data_files value (a path, a list, or split -> either), in order."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _flat(v)]
    return [str(value)]


def _no_data_line(name: str, cfg: dict, source: TaskSource, folder: Path | None, err: BaseException) -> str:
    """The one line for a task whose data is not here: where to put which files."""
    split = cfg.get("test_split") or cfg.get("validation_split") or "validation"
    if name in STANDARD_TASKS and source.config.startswith(str(_tasks_folder())):
        spec = STANDARD_TASKS[name]
        where = (f"at {folder / name / (split + '.jsonl')} (or .parquet)" if folder is not None
                 else f"at DIR/{name}/{split}.jsonl (or .parquet) and give the task folder DIR (--task-dir)")
        return (f"{name} ({spec.label}) has no data here: put its {split} split, one JSON record per line with the "
                f"fields {spec.fields}, {where}, or fill the HF datasets cache ({_cache_dir()}) with "
                f"{_hub_words(cfg)} on a machine that has the hub; nothing is downloaded here ({DOCS}).")
    return (f"Task {name!r} ({source.config}) reads {source.data}, which is not available offline "
            f"({first_line(err)}): point its dataset_path / data_files at local files, or fill the HF datasets "
            f"cache on a machine that has the hub ({DOCS}).")


def _build(manager, spec, name: str, cfg: dict | None, source: TaskSource, folder: Path | None) -> dict:
    """The harness's TaskDict of one spec (a full config dict or a registered name); data problems in one line."""
    try:
        return manager.load([spec])
    except (ConnectionError, FileNotFoundError) as err:
        raise InputError(_no_data_line(name, cfg or {}, source, folder, err)) from None
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - a config or data the harness cannot use: one line naming the task
        if type(err).__name__ in ("DatasetNotFoundError", "EmptyDatasetError", "DataFilesNotFoundError"):
            raise InputError(_no_data_line(name, cfg or {}, source, folder, err)) from None
        raise InputError(f"Task {name!r} ({source.config}) could not be built from its data: "
                         f"{first_line(err)}") from None


def _unknown_line(name: str, folder: Path | None, own: list[str]) -> str:
    standard = ", ".join(STANDARD_TASKS)
    if folder is None:
        return (f"No task {name!r}: without a task folder only the standard tasks ({standard}) are known, their "
                f"data from the HF datasets cache; give a task folder (--task-dir) for other tasks ({DOCS}).")
    there = ", ".join(own) if own else "none"
    return (f"No task {name!r} in {folder}: its configs define {there}; the standard tasks ({standard}) read "
            f"{folder}/<task>/<split>.jsonl ({DOCS}).")


def check_task_names(names) -> tuple[str, ...]:
    """The requested names, stripped, in order, once each (InputError for none)."""
    if isinstance(names, str):
        names = names.split(",")
    out = tuple(dict.fromkeys(n.strip() for n in names if n and n.strip()))
    if not out:
        raise InputError(f"Name at least one task, e.g. boolq,piqa (the standard tasks: {', '.join(STANDARD_TASKS)}; "
                         f"or the tasks of your task folder).")
    return out


def prepare_tasks(names, task_dir=None, *, limit: int | None = None) -> PreparedTasks:
    """The harness's tasks of `names` (a list or "a,b"), from the task folder or the standard configs, with
    their data checked and loaded (offline). InputError, one line, for: the harness missing, a name the
    folder does not define (naming those it does), data that is not here (where to put which files), an
    output type headscope has no call for, a generation that samples."""
    require_harness()
    names = check_task_names(names)
    if limit is not None:
        check_whole_number(limit, "--limit (documents per task)", low=1)
    folder = _check_folder(task_dir)
    manager = _folder_manager(folder)
    own = list(manager.all_tasks)
    merged = {"tasks": {}, "groups": {}, "group_map": {}}
    sources = {}
    with _quiet(), _offline():
        for name in names:
            entry = manager.task_index.get(name)
            if entry is not None and entry.yaml_path is not None and entry.kind.name == "TASK":
                cfg, source = _folder_config(name, Path(entry.yaml_path))
                spec = cfg
            elif entry is not None:                        # a group, tag or Python task: as the harness builds it
                cfg, source = None, TaskSource(name, str(entry.yaml_path or "(Python task)"), "(as its configs say)")
                spec = name
            elif name in STANDARD_TASKS:
                cfg, source = _standard_config(name, folder)
                spec = cfg
            else:
                raise InputError(_unknown_line(name, folder, own))
            built = _build(manager, spec, name, cfg, source, folder)
            for key in merged:
                merged[key].update(built.get(key, {}))
            sources[name] = source
    return _checked(names, merged, sources, folder, limit)


def prepare_configs(configs: dict, sources: dict, *, limit: int | None = None) -> PreparedTasks:
    """PreparedTasks from task configs built in memory (name -> the harness's config dict, e.g. one of its own
    YAMLs with the dataset replaced by a `custom_dataset` function; name -> TaskSource saying where it came
    from), checked like `prepare_tasks`' (output types, zero-shot unless the config says otherwise)."""
    require_harness()
    if limit is not None:
        check_whole_number(limit, "--limit (documents per task)", low=1)
    manager = _folder_manager(None)
    merged = {"tasks": {}, "groups": {}, "group_map": {}}
    with _quiet(), _offline():
        for name, cfg in configs.items():
            built = _build(manager, cfg, name, cfg, sources[name], None)
            for key in merged:
                merged[key].update(built.get(key, {}))
    return _checked(tuple(configs), merged, dict(sources), None, limit)


def _check_output(name: str, task) -> None:
    """One line for a task headscope cannot run: an output type it has no LM call for, or a generation that
    samples (headscope generates greedily)."""
    if task.OUTPUT_TYPE not in LOGLIKELIHOOD_TYPES + GENERATE_TYPES:
        raise InputError(f"Task {name!r} has output_type {task.OUTPUT_TYPE}; headscope runs the harness's "
                         f"{', '.join(LOGLIKELIHOOD_TYPES + GENERATE_TYPES)} tasks ({DOCS}).")
    if task.OUTPUT_TYPE in GENERATE_TYPES:
        kwargs = task.get_config("generation_kwargs") or {}
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
            raise InputError(f"Task {name!r} samples its generations (generation_kwargs {kwargs}); headscope "
                             f"generates greedily (do_sample false, temperature 0), the same tokens on every run.")


def _checked(names, merged: dict, sources: dict, folder: Path | None, limit: int | None) -> PreparedTasks:
    """The built tasks checked (`_check_output`), zero-shot unless a config says otherwise, with the harness's
    few-shot seed, and each source's output types and document count filled in."""
    for task_name, task in merged["tasks"].items():
        _check_output(task_name, task)
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)    # zero-shot unless the config says otherwise
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    prepared = PreparedTasks(names, merged, sources, None if folder is None else str(folder), limit)
    for name, source in sources.items():
        leaves = [t for t in merged["tasks"] if t == name] or list(merged["group_map"].get(name, []))
        sources[name] = TaskSource(source.name, source.config, source.data,
                                   output_type=", ".join(sorted({merged["tasks"][t].OUTPUT_TYPE for t in leaves
                                                                 if t in merged["tasks"]})),
                                   n_docs=sum(prepared.n_docs(t) for t in leaves if t in merged["tasks"]))
    return prepared


def request_tokens(prepared: PreparedTasks, tokenizer, *, sample: int = 32) -> int:
    """About how many tokens one run puts through the model (the work a time estimate scales): each task's
    requests of its first `sample` documents tokenized, scaled to its documents (the limit applied)."""
    total = 0.0
    with _quiet():
        for name, task in prepared.tasks.items():
            n = prepared.n_docs(name)
            k = min(n, sample)
            if k == 0:
                continue
            task.build_all_requests(limit=k, rank=0, world_size=1)
            tokens = sum(len(tokenizer("".join(str(a) for a in inst.args if isinstance(a, str))).input_ids)
                         for inst in task.instances)
            total += tokens * n / k
    return int(math.ceil(total))


# -- generation -------------------------------------------------------------------------------------------

def prompt_encoding(tokenizer, context: str, *, add_bos_token: bool | None = None, offsets: bool = False):
    """The harness's HFLM encoding of a generation prompt (its tok_batch_encode of one string, before any
    truncation): the tokenizer's own special tokens unless the text already starts with its BOS token, or as
    add_bos_token says (HFLM's option; None: the tokenizer's default). offsets: each token's character span too
    (a fast tokenizer's offset_mapping)."""
    from lm_eval.models.utils import has_bos_prefix
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        special = {"add_special_tokens": False}
    else:
        special = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
    return tokenizer(context, return_offsets_mapping=offsets, **special)


def prompt_ids(tokenizer, context: str, *, add_bos_token: bool | None = None) -> list[int]:
    """The token ids the harness's HFLM feeds for a generation prompt (`prompt_encoding`)."""
    return list(prompt_encoding(tokenizer, context, add_bos_token=add_bos_token)["input_ids"])


def generation_rules(gen_kwargs: dict, eos_text: str | None, default_max: int = 256) -> tuple[list[str], int]:
    """(stop strings, max new tokens) of a request's generation_kwargs, as HFLM.generate_until reads them:
    the task's `until` (a string or a list) with the EOS text added, and max_gen_toks (or an alias; HFLM's
    default 256 when none is given)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    kwargs = normalize_gen_kwargs(gen_kwargs, default_max)
    return handle_stop_sequences(kwargs.pop("until", None), eos=eos_text), int(kwargs.pop("max_gen_toks"))


def eos_ids(model) -> tuple[int, ...]:
    """The token ids transformers' generate stops on: the model's generation config's eos_token_id."""
    eos = model.generation_config.eos_token_id
    return () if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))


@dataclass(frozen=True)
class Generated:
    """One greedy generation: the new tokens, why it stopped, and what it cost."""
    tokens: list                   # the generated ids (an EOS that stopped it included)
    stopped: str                   # "eos" | "until" (a stop sequence) | "length" (max_new_tokens)
    prompt_tokens: int
    prefill_s: float               # the prompt's forward pass (its last logits give the first token)
    decode_s: float                # forwards of every later token, summed (each read after the device finished)
    kv_bytes_prompt: int           # the KV cache's real K / V bytes after the prompt
    kv_bytes_end: int              # ... after the last step (the prompt and every new token but the last)

    @property
    def decode_steps(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens of the decode steps per second (None when the prefill's token was the only one)."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 else None

    def row(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, new_tokens=len(self.tokens), stopped=self.stopped,
                    prefill_s=self.prefill_s, decode_s=self.decode_s, tokens_per_s=self.tokens_per_s,
                    kv_bytes_prompt=self.kv_bytes_prompt, kv_bytes_end=self.kv_bytes_end)


def generate_greedy(model, ids, *, max_new_tokens: int, eos=(), stop=(), cache=None,
                    progress: Progress | None = None, should_stop: ShouldStop | None = None) -> Generated:
    """Greedy decoding of one prompt ids [1, T] as transformers' generate does it, through headscope's decode loop
    (analysis.measure.decode.greedy): a prefill, then one token a step with the KV cache `cache` (None: the model's
    own DynamicCache; a KV plan's compact cache for one prompt), stopping after max_new_tokens, on a token in
    `eos`, or when a stop rule (`stop`: callables of the whole sequence [1, T + k] and None, the harness's
    MultiTokenEOSCriteria) says so; the token that stopped it is kept, as generate keeps it. The seconds are the
    prompt's forward and the sum of the decode calls' forwards, each read after the device finished
    (analysis.core.clock)."""
    from analysis.arch.adapters import input_device
    from analysis.arch.kvcache import kv_cache_bytes
    from analysis.core.clock import Clock
    from analysis.measure.decode import Stop, greedy
    check_whole_number(max_new_tokens, "max_new_tokens", low=1)
    run = greedy(model, ids, max_new_tokens, cache=cache, kv_bytes=kv_cache_bytes,
                 stop=Stop(tuple(int(e) for e in eos), tuple(stop)), clock=Clock(input_device(model)),
                 keep_logits=False, progress=progress, should_stop=should_stop)
    return Generated(run.tokens[0].tolist(), run.stopped, int(ids.shape[1]), run.prefill_seconds[0],
                     sum(wall for wall, _ in run.step_seconds), run.kv_bytes[0], run.kv_bytes[-1])


# -- the model behind the harness --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _lm_class():
    """HFLM with progress and Stop at each forward batch (defined on first use: lm_eval loads lazily)."""
    from lm_eval import utils as lm_utils
    from lm_eval.models.huggingface import HFLM

    class HeadscopeLM(HFLM):
        """The harness's HF model class over a model in memory. Additions: `track` sets a progress callback, a
        stop check and where a generation's KV cache comes from; each request call (log-likelihoods, rolling
        log-likelihoods, generations) is a phase whose rows (forward sequences, generated rows) are counted;
        `generate_until` is headscope's (greedy, one prompt at a time, costs recorded in `generations`)."""

        def track(self, progress: Progress | None, should_stop: ShouldStop | None, phases: int,
                  new_cache=None) -> None:
            """new_cache: () -> a KV cache for one prompt and its steps (None: the model's own)."""
            self._progress, self._should_stop = progress, should_stop
            self._phases, self._phase, self._rows, self._done = max(phases, 1), -1, 1, 0
            self._what, self._pending = "", None
            self._new_cache = new_cache or (lambda: None)
            self.generations: dict[str, list] = {}

        def _begin(self, rows: int, what: str) -> None:
            self._phase, self._rows, self._done, self._what = self._phase + 1, max(int(rows), 1), 0, what
            self._tell()

        def _tell(self) -> None:
            fraction = (self._phase + min(self._done / self._rows, 1.0)) / self._phases
            done = int(min(self._done, self._rows))
            report(self._progress, fraction, f"{self._what}: {done} of {self._rows} sequences")

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self._pending = "multiple choice"
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            windows = sum(len(list(lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(r.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))) for r in requests)
            self._pending = None
            self._begin(windows, "perplexity windows")
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            if self._pending is not None:             # a log-likelihood phase: one row per context group
                grouped = self.backend == "causal" and self.logits_cache
                rows = len({tuple(c) + tuple(k[:-1]) for _, c, k in requests}) if grouped else len(requests)
                self._begin(rows, self._pending)
                self._pending = None
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)

        def _within(self, row: int) -> Progress:
            """Progress inside one generated row: `row` rows done and a fraction of this one."""
            def at(fraction: float, message: str) -> None:
                self._done = row + fraction
                self._tell()
            return at

        def generate_until(self, requests, disable_tqdm: bool = False):
            """Each request's greedy generation, one prompt at a time (HFLM.generate_until's tokens, truncation,
            stop rules and text post-processing; headscope's decode loop, which records each row's KV bytes and
            speed in self.generations[task])."""
            import torch
            from lm_eval.models.utils import postprocess_generated_text
            from lm_eval.models.utils_hf import stop_sequences_criteria

            from analysis.measure.probes.longcontext import stop_between_layers
            self._begin(len(requests), "generation")
            eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
            stop_ids, out = eos_ids(self.model), []
            with stop_between_layers(self.model, self._should_stop, "The harness run"):
                for i, request in enumerate(requests):
                    context, gen_kwargs = request.args
                    until, max_new = generation_rules(gen_kwargs, eos_text, self.max_gen_toks)
                    room = self.max_length - max_new
                    if room <= 0:
                        raise InputError(f"Task {request.task_name!r} generates up to {max_new} tokens, as many as the "
                                         f"model reads ({self.max_length}): no room for its prompt.")
                    ids = prompt_ids(self.tokenizer, context, add_bos_token=self.add_bos_token)
                    run = generate_greedy(self.model, torch.tensor([ids[-room:]]), max_new_tokens=max_new,
                                          eos=stop_ids, stop=stop_sequences_criteria(self.tokenizer, until,
                                                                                     min(len(ids), room), 1),
                                          cache=self._new_cache(), progress=self._within(i),
                                          should_stop=self._should_stop)
                    text = postprocess_generated_text(self.tok_decode(run.tokens), until, None)
                    self.generations.setdefault(request.task_name, []).append(
                        dict(doc_id=int(request.doc_id), truncated=len(ids) > room, max_new_tokens=max_new,
                             **run.row()))
                    out.append(text)
                    self._done = i + 1
                    self._tell()
            return out

        def _model_call(self, inps, attn_mask=None, labels=None):
            check_stop(self._should_stop, "The harness run")
            logits = super()._model_call(inps, attn_mask=attn_mask, labels=labels)   # [B, T, V]
            self._done += int(inps.shape[0])
            self._tell()
            return logits

    return HeadscopeLM


@contextlib.contextmanager
def _untied(model):
    """HFLM's constructor calls model.tie_weights(), which may re-tie what a loaded model keeps apart:
    skipped for the construction (an attribute on this instance, removed in finally)."""
    model.tie_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.tie_weights


def _make_lm(model, tokenizer, *, batch_size: int, max_length: int | None):
    with _untied(model):
        return _lm_class()(pretrained=model, tokenizer=copy.deepcopy(tokenizer), backend="causal",
                           batch_size=batch_size, max_length=max_length)


def _check_logit_memory(prepared: PreparedTasks, lm, model, batch_size: int) -> None:
    """A perplexity task runs windows of up to lm.max_length tokens, batch_size at a time, the longest first:
    refuse (one line) a batch whose logits alone would not fit in the free memory, before the run starts."""
    rolling = {n: t for n, t in prepared.tasks.items() if t.OUTPUT_TYPE == "loglikelihood_rolling"}
    if not rolling:
        return
    import psutil
    import torch
    longest = windows = 0
    for task in rolling.values():
        for i, doc in enumerate(task.eval_docs):
            if prepared.limit is not None and i >= prepared.limit:
                break
            n = len(lm.tok_encode(task.doc_to_target(doc)))               # the harness's own tokens
            longest = max(longest, min(n + 1, lm.max_length))
            windows += max(1, math.ceil(n / lm.max_length))
    rows = min(batch_size, max(windows, 1))
    vocab = int(model.get_output_embeddings().weight.shape[0])
    itemsize = torch.finfo(next(model.parameters()).dtype).bits // 8
    need = LOGITS_COPIES * rows * longest * vocab * itemsize
    device = next(model.parameters()).device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if need > MEMORY_SHARE * free:
        one = need // rows
        raise InputError(f"The perplexity task(s) {', '.join(rolling)} run windows of up to {longest} tokens, {rows} "
                         f"at a time: their logits alone take about {need / 2**30:.1f} GiB, more than the "
                         f"{MEMORY_SHARE * free / 2**30:.1f} GiB free to use. Give a smaller batch size "
                         f"(--harness-batch-size; 1 takes {one / 2**30:.1f} GiB) or a shorter window (--max-length).")


# -- runs ----------------------------------------------------------------------------------------------

def _number(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None                                         # the harness writes "N/A" where it has no stderr
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class HarnessRun:
    """One model's results: per task, each metric's value and the harness's stderr (None where it gives none)."""
    metrics: dict                 # task -> {metric: (value, stderr | None)}
    higher: dict                  # task -> {metric: higher is better (bool | None)}
    n_samples: dict               # task -> documents measured
    seconds: float
    batch_size: int
    max_length: int
    samples: dict = field(default_factory=dict)   # task -> [{doc_id, arguments, loglikelihoods | generation,
                                                  #           metrics}] (keep_samples)
    generations: dict = field(default_factory=dict)   # task -> [Generated.row() + doc_id, truncated, max_new_tokens]

    def as_dict(self) -> dict:
        return dict(metrics={t: {m: dict(value=v, stderr=s) for m, (v, s) in ms.items()}
                             for t, ms in self.metrics.items()},
                    n_samples=self.n_samples, seconds=self.seconds, batch_size=self.batch_size,
                    max_length=self.max_length, generations=self.generations)


def _sample(d: dict) -> dict:
    """One logged document: its requests' log-likelihoods, or its generation; its metric values."""
    out = dict(doc_id=int(d["doc_id"]), arguments=[tuple(a) for a in d["arguments"]],
               metrics={m: d[m] for m in d.get("metrics", ()) if m in d})
    if d["resps"] and d["resps"][0] and isinstance(d["resps"][0][0], str):
        return dict(out, generation=d["filtered_resps"][0])             # generate_until: [[text]]
    return dict(out, loglikelihoods=[float(r[0][0] if isinstance(r[0], (tuple, list)) else r[0]) for r in d["resps"]])


def _parse(results: dict, seconds: float, batch_size: int, max_length: int, keep_samples: bool,
           generations: dict) -> HarnessRun:
    metrics, higher, n_samples, samples = {}, {}, {}, {}
    for task, values in results["results"].items():
        ms = {}
        for key, value in values.items():
            if "," not in key:
                continue                                    # alias, name, sample_len
            metric, filt = key.split(",", 1)
            if metric.endswith("_stderr"):
                continue
            name = metric if filt == "none" else f"{metric} ({filt})"
            ms[name] = (_number(value), _number(values.get(f"{metric}_stderr,{filt}")))
        metrics[task] = ms
        hib = results.get("higher_is_better", {}).get(task, {})
        higher[task] = {m: hib.get(m.split(" (")[0]) for m in ms}
        n = results.get("n-samples", {}).get(task, {})
        n_samples[task] = int(n.get("effective", n.get("original", 0))) if isinstance(n, dict) else 0
    if keep_samples:
        for task, docs in (results.get("samples") or {}).items():
            samples[task] = [_sample(d) for d in docs]
    return HarnessRun(metrics, higher, n_samples, seconds, batch_size, max_length, samples,
                      {t: sorted(rows, key=lambda r: r["doc_id"]) for t, rows in generations.items()})


def run_harness(model, tokenizer, prepared: PreparedTasks, *, cut=None, adapter=None,
                batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None, keep_samples: bool = False,
                progress: Progress | None = None, should_stop: ShouldStop | None = None) -> HarnessRun:
    """The prepared tasks on one causal LM in memory: as it is (cut None), or under a `cut`
    (analysis.arch.cut.Cut: inside `cut.running(model)`, each generation with its own `cut.new_cache()`,
    so a KV plan generates with its compact cache). max_length None: the harness's own (the model's context).
    keep_samples: every request's log-likelihood or generation and each document's metrics too
    (HarnessRun.samples). Generations run one prompt at a time with a fresh KV cache each
    (HarnessRun.generations: each row's KV bytes and speed)."""
    require_harness()
    check_whole_number(batch_size, "the harness batch size", low=1, high=2**16)
    check_whole_number(max_length, "the harness max length", low=2, high=2**24, none_ok=True)
    from lm_eval.evaluator import evaluate

    from analysis.arch.cut import running as cut_running   # torch: imported on use (the CLI's parser reads this)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")       # the harness's bootstrap: no process pool in our process
    new_cache = (lambda: None) if cut is None else cut.new_cache
    with cut_running(cut, model, adapter=adapter) as running:
        with _quiet():
            lm = _make_lm(running, tokenizer, batch_size=batch_size, max_length=max_length)
        _check_logit_memory(prepared, lm, running, batch_size)
        lm.track(progress, should_stop, len(prepared.request_types()), new_cache=new_cache)
        start = time.perf_counter()
        with _quiet(), _offline():
            check_stop(should_stop, "The harness run")
            results = evaluate(lm=lm, task_dict=prepared.loaded, limit=prepared.limit,
                               bootstrap_iters=BOOTSTRAP_ITERS, log_samples=keep_samples)
    report(progress, 1.0, "done")
    return _parse(results, time.perf_counter() - start, batch_size, lm.max_length, keep_samples, lm.generations)


WORSE_STDERRS = 2.0             # a cut is flagged worse beyond this many standard errors of the two runs combined


def worse(change: float | None, higher: bool | None, dense_stderr: float | None, cut_stderr: float | None) -> bool | None:
    """Whether the cut is worse than dense on a metric: a change in the wrong direction larger than WORSE_STDERRS
    times sqrt(dense_stderr^2 + cut_stderr^2) (the same documents on both sides, so this combined error is an
    upper bound of the change's own); any change in the wrong direction where the harness gives no stderr
    (perplexities); None when the direction is not known."""
    if change is None or higher is None:
        return None
    wrong = -change if higher else change
    if dense_stderr is None or cut_stderr is None:
        return wrong > 0
    return wrong > WORSE_STDERRS * math.hypot(dense_stderr, cut_stderr)


@dataclass(frozen=True)
class HarnessReport:
    """Dense vs a cut on the same tasks and documents: one row per task and metric (`worse`: see `worse`)."""
    dense: HarnessRun
    cut: HarnessRun | None
    sources: dict                 # task -> TaskSource
    limit: int | None

    def rows(self) -> list[dict]:
        out = []
        for task, metrics in self.dense.metrics.items():
            for metric, (value, stderr) in metrics.items():
                row = dict(task=task, metric=metric, n=self.dense.n_samples.get(task), dense=value, dense_stderr=stderr)
                higher = self.dense.higher.get(task, {}).get(metric)
                if self.cut is not None:
                    cut, cut_stderr = self.cut.metrics.get(task, {}).get(metric, (None, None))
                    change = None if cut is None or value is None else cut - value
                    row.update(cut=cut, cut_stderr=cut_stderr, change=change,
                               worse=worse(change, higher, stderr, cut_stderr))
                row["higher_is_better"] = higher
                out.append(row)
        return out

    def as_dict(self) -> dict:
        return dict(harness=HARNESS_VERSION, limit=self.limit, batch_size=self.dense.batch_size,
                    max_length=self.dense.max_length, tasks={n: s.as_dict() for n, s in self.sources.items()},
                    rows=self.rows(), seconds=dict(dense=self.dense.seconds,
                                                   cut=None if self.cut is None else self.cut.seconds))


def harness_report(loaded, prepared: PreparedTasks, *, cut=None, dense: HarnessRun | None = None,
                   batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None, keep_samples: bool = False,
                   progress: Progress | None = None, should_stop: ShouldStop | None = None) -> HarnessReport:
    """The prepared tasks on `loaded` (dense; reused when `dense` is given) and on a `cut`
    (analysis.arch.cut.Cut: a mask as gates on loaded.model, a KV plan, or a model of its own); no cut: the
    dense side only."""
    if loaded.kind != "causal-lm":
        raise InputError(f"The harness's tasks score a causal language model's next tokens; {loaded.name} is a "
                         f"{loaded.kind} model.")
    from analysis.arch.cut import checked
    cut = checked(cut, loaded.geometry)
    run = functools.partial(run_harness, tokenizer=loaded.tokenizer, prepared=prepared, batch_size=batch_size,
                            max_length=max_length, keep_samples=keep_samples, should_stop=should_stop)
    if dense is None:
        dense = run(loaded.model, progress=scaled(progress, 0.0, 0.5 if cut is not None else 1.0))
        cut_progress = scaled(progress, 0.5, 1.0)
    else:
        cut_progress = progress                             # the dense side was measured before
    measured = None if cut is None else run(loaded.model, cut=cut, adapter=loaded.adapter, progress=cut_progress)
    return HarnessReport(dense, measured, dict(prepared.sources), prepared.limit)
