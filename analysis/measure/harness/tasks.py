"""The harness's tasks, built offline, checked, one line for every refusal. A task comes from
- **a task folder** (`task_dir`): YAML task configs in the harness's own format (the harness indexes the
  folder; analysis.measure.harness.folder checks it first). headscope reads a relative
  `dataset_kwargs.data_files` / `data_dir` path, or a `dataset_path` that names a folder, relative to the
  config's own folder (the harness alone would read it relative to the working directory), and refuses a
  config whose files are not there;
- **the standard tasks** (`STANDARD_TASKS`, by the harness's names): the harness's own config of the task
  (prompts, choices, metrics, helpers: exactly what the field reports), its data from
  `task_dir/<task>/<split>.jsonl` (or `.json`, `.parquet`, `.csv`; `<split>-*.parquet` shards too) when
  that file is there, else from the HF datasets cache (a cache filled on a machine that has the hub).
  A folder's own config of the same name wins;
- **configs built in memory** (`prepare_configs`: RULER's rows).

`prepare_tasks` / `prepare_configs` give the `PreparedTasks` a run reads; `request_tokens` the work a time
estimate scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from analysis.core.errors import InputError, check_whole_number, first_line
from analysis.measure.harness.folder import check_folder
from analysis.measure.harness.runtime import DOCS, offline, quiet, require_harness, tasks_folder

FEWSHOT_SEED = 1234             # the harness's default (simple_evaluate's fewshot_random_seed)
LOGLIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
GENERATE_TYPES = ("generate_until",)
REQUEST_TYPE = {"multiple_choice": "loglikelihood", "loglikelihood": "loglikelihood",       # output type ->
                "loglikelihood_rolling": "loglikelihood_rolling", "generate_until": "generate_until"}   # the LM call
DATA_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}   # suffix -> datasets builder


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
    folder = check_folder(task_dir)
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
    path = tasks_folder() / spec.config
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
    if name in STANDARD_TASKS and source.config.startswith(str(tasks_folder())):
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
    folder = check_folder(task_dir)
    manager = _folder_manager(folder)
    own = list(manager.all_tasks)
    merged = {"tasks": {}, "groups": {}, "group_map": {}}
    sources = {}
    with quiet(), offline():
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
    with quiet(), offline():
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
    with quiet():
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
