"""RULER offline (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"):
the tasks of lm-evaluation-harness's `ruler` group that need no download, their rows generated here, run
through the harness bridge (analysis.measure.harness: greedy generation, the harness's prompts, stop rules
and string-match scoring), dense vs a cut, per task and length with bootstrap CIs.

The tasks are declared once (`RULER_TASKS`: the harness's config, which of its generators makes the rows
and with which keywords, as its own task functions call them). Rows come from the harness's own generators
(prepare_niah.generate_samples, vt_utils / cwe_utils / fwe_utils) called with the tokenizer already loaded
(never the harness's get_tokenizer, which loads with trust_remote_code=True), only as many samples as asked,
and deterministic per (task, length, seed, tokenizer): the global `random` / `np.random` states (and
cwe_utils' own RNG) are seeded for the block and restored after. The essay-haystack tasks (niah_single_2,
niah_single_3, niah_multikey_1, niah_multiquery, niah_multivalue) read the built-in Wikipedia text
(analysis.core.text, CC BY-SA 4.0) instead of Paul Graham's essays (a download), split into sentences by
headscope's own splitter (nltk's punkt data is a download); the output says so. qa_squad / qa_hotpot
download their data and are refused with one line. Importing the harness's RULER modules calls
nltk.download("punkt_tab") and prints: both are blocked for the import.

Every row fits its length: the prompt the harness builds (its doc_to_text, target delimiter and gen_prefix,
tokenized as its HFLM does) plus the task's max_gen_toks is at most the length; a generator that overshoots
(fwe sizes its text to the whole length; the needle tasks do not count the gen_prefix) is run again with
that much less room, until every row fits. The harness's process_results keys its metric by the row's
length (with its DEFAULT_SEQ_LENGTHS = [4096] set to -1): each task's metric list is the lengths run here.

Per task and length: the score (RULER's string_match_all: the share of a row's references found in its
generation, 0..1), a 95 % bootstrap CI over rows; dense and cut read the same rows and resample them the
same way, so the cut - dense difference has its own CI; **lost** when the cut's CI lies below dense's mean
(analysis.measure.probes.breaks.compare's rule); the average over tasks per length (a row index is one
resampling unit across tasks: every task has the same rows per length). The cut is an analysis.arch.cut.Cut
(`ruler_report(cut=)`: a mask, a KV plan generating with its compact cache, a model of its own). The exact
rows (token ids split into context / question, references, max_new_tokens, stop strings) export as JSONL for
a peer tool.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import re
from dataclasses import dataclass, field

from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, report
from analysis.measure.splits import TEST, check_split, disjoint, salted

RULER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)   # RULER's lengths, and 1k / 2k
DEFAULT_LENGTHS = (1024,)
DEFAULT_SAMPLES = 25
MAX_SAMPLES = 500               # what the harness's generators make per task and length
FIT_TRIES = 4                   # generator runs with less room until every row fits its length
METRIC = "string_match_all"
ESSAY_NOTE = ("the essay haystack is headscope's built-in Wikipedia text (lead paragraphs, CC BY-SA 4.0) instead "
              "of Paul Graham's essays")
ESSAY_CHARS_PER_TOKEN = 16      # text taken for an essay haystack: far more than any tokenizer needs
VT_ICL_LENGTH = 500             # vt_utils.get_dataset's in-context example: its own length and steps
VT_ICL_STEP = 5
SEED_SALT = "headscope-ruler"


@dataclass(frozen=True)
class RulerTask:
    """One task of the harness's `ruler` group: its config, and how its rows are made."""
    label: str
    config: str                     # the harness's YAML, relative to lm_eval/tasks/ruler/
    generator: str = ""             # GENERATORS key: "niah" | "vt" | "cwe" | "fwe"
    options: dict = field(default_factory=dict)   # the generator's keywords, as the harness's task function passes them
    downloads: str = ""             # what it would download (refused)

    @property
    def haystack(self) -> str:
        return self.options.get("type_haystack", "")


def _niah(label: str, config: str, haystack: str, key: str, value: str, **counts) -> RulerTask:
    return RulerTask(label, config, "niah", dict(type_haystack=haystack, type_needle_k=key, type_needle_v=value,
                                                 **counts))


RULER_TASKS: dict[str, RulerTask] = {
    "niah_single_1": _niah("NIAH single 1 (repeated noise)", "niah_single_1.yaml", "repeat", "words", "numbers"),
    "niah_single_2": _niah("NIAH single 2 (essay)", "niah_single_2.yaml", "essay", "words", "numbers"),
    "niah_single_3": _niah("NIAH single 3 (essay, UUID)", "niah_single_3.yaml", "essay", "words", "uuids"),
    "niah_multikey_1": _niah("NIAH multi-key 1 (essay)", "niah_multikey_1.yaml", "essay", "words", "numbers",
                             num_needle_k=4),
    "niah_multikey_2": _niah("NIAH multi-key 2 (needle haystack)", "niah_multikey_2.yaml", "needle", "words",
                             "numbers"),
    "niah_multikey_3": _niah("NIAH multi-key 3 (needle haystack, UUIDs)", "niah_multikey_3.yaml", "needle", "uuids",
                             "uuids"),
    "niah_multiquery": _niah("NIAH multi-query (essay)", "niah_multiquery.yaml", "essay", "words", "numbers",
                             num_needle_q=4),
    "niah_multivalue": _niah("NIAH multi-value (essay)", "niah_multivalue.yaml", "essay", "words", "numbers",
                             num_needle_v=4),
    "ruler_vt": RulerTask("Variable tracking", "vt.yaml", "vt"),
    "ruler_cwe": RulerTask("Common words", "cwe.yaml", "cwe"),
    "ruler_fwe": RulerTask("Frequent words", "fwe.yaml", "fwe"),
    "ruler_qa_squad": RulerTask("QA (SQuAD v2)", "qa_squad.yaml",
                                downloads="SQuAD v2's dev set from rajpurkar.github.io"),
    "ruler_qa_hotpot": RulerTask("QA (HotpotQA)", "qa_hotpot.yaml", downloads="HotpotQA's dev set from the hub"),
}
OFFLINE_TASKS = tuple(n for n, t in RULER_TASKS.items() if not t.downloads)


# -- checks (light: the CLI's parser and refusals read these) ---------------------------------------------------

def check_tasks(names) -> tuple[str, ...]:
    """The requested RULER task names ("all" or None: every offline task), in order, once each; InputError
    (one line) for an unknown name or a task that downloads its data."""
    if names is None or names == "all" or names == ["all"]:
        return OFFLINE_TASKS
    if isinstance(names, str):
        names = names.split(",")
    out = tuple(dict.fromkeys(n.strip() for n in names if n and n.strip()))
    if not out:
        raise InputError(f"Name at least one RULER task (or all): {', '.join(OFFLINE_TASKS)}.")
    for name in out:
        spec = RULER_TASKS.get(name)
        if spec is None:
            raise InputError(f"No RULER task {name!r}: the tasks that run offline are {', '.join(OFFLINE_TASKS)}.")
        if spec.downloads:
            raise InputError(f"RULER's {name} reads {spec.downloads}, a download; nothing is downloaded here. The "
                             f"tasks that run offline: {', '.join(OFFLINE_TASKS)}.")
    return out


def check_ruler_lengths(lengths, limit: int | None = None) -> tuple[int, ...]:
    """Lengths among RULER_LENGTHS and at most `limit` (the model's context), once each in ascending order."""
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = (lengths,)
    values = tuple(lengths)
    if not values:
        raise InputError(f"Give at least one RULER length: {', '.join(map(str, RULER_LENGTHS))} tokens.")
    for n in values:
        check_whole_number(n, "A RULER length", low=1)
        if int(n) not in RULER_LENGTHS:
            raise InputError(f"A RULER length is one of {', '.join(map(str, RULER_LENGTHS))} tokens; got {n}.")
        if limit is not None and int(n) > limit:
            fits = [x for x in RULER_LENGTHS if x <= limit]
            raise InputError(f"A RULER length of {n} tokens is longer than this model reads ({limit}); "
                             + (f"use at most {fits[-1]}." if fits else
                                f"RULER's shortest rows ({RULER_LENGTHS[0]} tokens) do not fit this model."))
    return tuple(sorted({int(n) for n in values}))


def check_samples(samples, what: str = "The RULER samples per task and length") -> int:
    return check_whole_number(samples, what, low=1, high=MAX_SAMPLES)


# -- the harness's RULER modules, imported without their download -----------------------------------------------

@contextlib.contextmanager
def _no_nltk_download():
    """prepare_niah calls nltk.download("punkt_tab") when it is imported (a download, and a print): for the
    block nltk.download refuses, and whatever the import prints is dropped; restored after."""
    import nltk
    saved = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        nltk.download = saved


@functools.lru_cache(maxsize=1)
def _modules() -> dict:
    """The harness's RULER modules by name (imported once, under `_no_nltk_download`)."""
    missing = _ruler_missing()
    if missing:
        raise InputError(missing)
    with _no_nltk_download():
        from lm_eval.tasks.ruler import common_utils, cwe_utils, fwe_utils, niah_utils, prepare_niah, vt_utils
    return dict(common=common_utils, cwe=cwe_utils, fwe=fwe_utils, niah=niah_utils, prepare=prepare_niah,
                vt=vt_utils)


def _ruler_missing() -> str:
    """"" when the harness and what its RULER tasks import (wonderwords, nltk) are there, else the one line."""
    from analysis.measure.harness import harness_missing
    missing = harness_missing()
    if missing:
        return missing
    import importlib.util
    absent = [n for n in ("wonderwords", "nltk") if importlib.util.find_spec(n) is None]
    if absent:
        return (f"The harness's RULER tasks need {' and '.join(absent)}: install requirements.txt "
                f"(.venv/bin/python -m pip install -r requirements.txt; scripts/setup.sh does it).")
    return ""


def _config(spec: RulerTask) -> dict:
    """The harness's own config of the task (its include resolved, its !function helpers imported)."""
    from pathlib import Path

    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml
    _modules()
    with _no_nltk_download():
        return dict(load_yaml(Path(lm_eval.tasks.__file__).parent / "ruler" / spec.config, resolve_func=True))


# -- rows ----------------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """Sentences of `text`: split after '.', '!' or '?' followed by white space (headscope's stand-in for
    nltk's punkt, whose data is a download); the pieces joined by one space give the text back, modulo spaces."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


@functools.lru_cache(maxsize=4)
def _essay_words(chars: int, split: str = TEST) -> tuple[str, ...]:
    """The built-in text as the harness's essay haystack is made: white space runs to one space, split into
    words; the evaluation half for test rows, the calibration half for calibration rows (analysis.measure.splits)."""
    from analysis.core.text import calibration_text, evaluation_text
    text = (evaluation_text if split == TEST else calibration_text)(max_chars=chars)
    return tuple(re.sub(r"\s+", " ", text).split(" "))


def _niah_rows(spec: RulerTask, tokenizer, length: int, n: int, split: str = TEST) -> list[dict]:
    m = _modules()
    kind = spec.haystack
    haystack = (list(_essay_words(ESSAY_CHARS_PER_TOKEN * length, split)) if kind == "essay"
                else m["prepare"].get_haystack(type_haystack=kind))
    return m["prepare"].generate_samples(haystack, TOKENIZER=tokenizer, max_seq_length=length,
                                         template=m["niah"].TEMPLATE, num_samples=n, **spec.options)


def _vt_rows(spec: RulerTask, tokenizer, length: int, n: int, split: str = TEST) -> list[dict]:
    vt = _modules()["vt"]                                        # as vt_utils.get_dataset, n samples
    icl = vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=VT_ICL_LENGTH,
                                         incremental=VT_ICL_STEP)[0]
    return vt.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=n, max_seq_length=length, icl_example=icl)


def _cwe_rows(spec: RulerTask, tokenizer, length: int, n: int, split: str = TEST) -> list[dict]:
    return _modules()["cwe"].sys_word_pair_random(num_samples=n, max_seq_length=length, tokenizer=tokenizer)


def _fwe_rows(spec: RulerTask, tokenizer, length: int, n: int, split: str = TEST) -> list[dict]:
    return _modules()["fwe"].sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=n)


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _vt_floor(tokenizer, length: int) -> int:
    """The tokens vt's smallest prompts need beyond their room (> 0: its generator would loop for ever): the
    in-context example at its own 500 tokens, then a row of the fewest noise lines with that example."""
    vt = _modules()["vt"]
    gen = vt.CONFIG["variable_tracking"]["tokens_to_generate"]
    icl = _tokens(tokenizer, vt.generate_input_output(VT_ICL_STEP, 1, 4, is_icl=True)[0]) + gen
    row = _tokens(tokenizer, vt.generate_input_output(10, 1, 4, is_icl=False)[0]) + gen + icl
    return max(icl - VT_ICL_LENGTH, row - length)


def _cwe_floor(tokenizer, length: int) -> int:
    """cwe's smallest prompt (its first 10 words, with its example) beyond the length (> 0: its generator
    would loop for ever or make rows without answers)."""
    cwe = _modules()["cwe"]
    example, text, answer = cwe.generate_input_output(10, length)
    listed = " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer))
    return _tokens(tokenizer, example + "\n" + text + " " + listed) + cwe.CONFIG["tokens_to_generate"] - length


def _fwe_floor(tokenizer, length: int) -> int:
    """fwe's template without any coded words beyond the length (> 0: its generator would loop for ever)."""
    fwe = _modules()["fwe"]
    return _tokens(tokenizer, fwe.TEMPLATE.format(context="", query="")) + fwe.CONFIG["tokens_to_generate"] - length


@dataclass(frozen=True)
class Generator:
    """How one kind of RULER task makes its rows: `rows(spec, tokenizer, length, n, split)` (the harness's
    generator; the split picks the essay haystack's half of the built-in text),
    `floor(tokenizer, length)` (tokens its smallest prompt lacks; None: the generator says so itself) and
    `reserve` (tokens it is first given less than the length: fwe sizes its text to the whole length, leaving
    no room for its 50 generated tokens)."""
    rows: object
    floor: object = None
    reserve: int = 0


GENERATORS = {"niah": Generator(_niah_rows), "vt": Generator(_vt_rows, _vt_floor),
              "cwe": Generator(_cwe_rows, _cwe_floor), "fwe": Generator(_fwe_rows, _fwe_floor, reserve=50)}


def row_seed(task: str, length: int, seed: int, split: str = TEST) -> int:
    """The global RNG seed of one (task, length, seed) block: a digest, so tasks, lengths and splits draw apart
    (the test split's is the seed rows were always made with)."""
    digest = hashlib.sha256(salted(split, f"{SEED_SALT}:{task}:{length}:{seed}").encode()).digest()
    return int.from_bytes(digest[:4], "big")


@contextlib.contextmanager
def seeded_generators(seed: int):
    """The block the harness's generators run in: `random`, `np.random` and cwe_utils' own RNG seeded with
    `seed` (states restored after), prepare_niah's sentence splitter replaced by `sentences`, the generators'
    progress bars off and their prints dropped; every patched attribute restored in finally."""
    import random

    import numpy as np
    from tqdm import tqdm
    m = _modules()
    quiet_bar = functools.partial(tqdm, disable=True)
    patches = [(m["prepare"], "cached_sent_tokenize", sentences)] + [(m[k], "tqdm", quiet_bar)
                                                                      for k in ("prepare", "vt", "cwe", "fwe")]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    states = random.getstate(), np.random.get_state(), m["cwe"].RNG.getstate()
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        m["cwe"].RNG.seed(seed)
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        random.setstate(states[0])
        np.random.set_state(states[1])
        m["cwe"].RNG.setstate(states[2])


def _generate(name: str, tokenizer, length: int, room: int, n: int, seed: int, split: str = TEST) -> list[dict]:
    """n rows of task `name` made by its generator for `room` tokens (InputError when it cannot make them)."""
    from analysis.measure.harness import quiet
    spec = RULER_TASKS[name]
    gen = GENERATORS[spec.generator]
    with quiet(), seeded_generators(row_seed(name, length, seed, split)):
        short = 0 if gen.floor is None else gen.floor(tokenizer, room)
        if short > 0:
            raise InputError(f"RULER's {name} does not fit {length} tokens with this tokenizer: its smallest prompt "
                             f"and answer take {short} tokens more (the tokenizer splits its words finely).")
        try:
            docs = gen.rows(spec, tokenizer, room, n, split)
        except (ValueError, AssertionError, RuntimeError) as err:
            raise InputError(f"RULER's {name} could not make rows of {length} tokens with this tokenizer: "
                             f"{str(err).splitlines()[0][:200]}") from None
    if len(docs) < n:
        raise InputError(f"RULER's {name} made {len(docs)} of {n} rows of {length} tokens with this tokenizer (the "
                         f"others did not fit).")
    return [dict(doc) for doc in docs]


@dataclass
class RulerRows:
    """The rows of a RULER run: per task its documents (every length's, shortest first, `samples` each) and
    the harness's tasks over them (`prepared`), ready for analysis.measure.harness.run_harness."""
    tasks: tuple
    lengths: tuple
    samples: int
    seed: int
    docs: dict                     # task -> [doc]: input, outputs, gen_prefix, max_length (the row's length), ...
    prepared: object               # harness.PreparedTasks
    reserve: dict                  # (task, length) -> tokens the generator was given less than the length
    notes: tuple = ()
    split: str = TEST              # analysis.measure.splits: test rows (verdicts) or calibration rows (searches)
    cells: tuple = ()              # the (task, length) pairs made, when not every task at every length (a test set)

    def has(self, task: str, length: int) -> bool:
        """Whether rows of `task` at `length` were made (every pair of tasks x lengths unless `cells` says)."""
        return not self.cells or (task, length) in self.cells

    def doc_ids(self, task: str, length: int) -> list[int]:
        return [i for i, d in enumerate(self.docs[task]) if d["max_length"] == length]

    def n_rows(self) -> int:
        return sum(len(d) for d in self.docs.values())

    def contexts(self, task: str) -> list[tuple]:
        """(doc_id, prompt, generation_kwargs) of every request of the task, as the harness builds them."""
        from analysis.measure.harness import quiet
        harness_task = self.prepared.tasks[task]
        with quiet():
            harness_task.build_all_requests(limit=None, rank=0, world_size=1)
        return [(int(i.doc_id), i.args[0], i.args[1]) for i in harness_task.instances]

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of every prompt and its generation rules, as the harness builds them (computed once)."""
        digest = hashlib.sha256()
        for task in self.tasks:
            for doc_id, prompt, gen_kwargs in self.contexts(task):
                digest.update(json.dumps([task, doc_id, prompt, gen_kwargs], sort_keys=True, default=str).encode())
        return digest.hexdigest()

    def info(self) -> dict:
        return dict(tasks={t: dict(label=RULER_TASKS[t].label, config=RULER_TASKS[t].config,
                                   haystack=RULER_TASKS[t].haystack or RULER_TASKS[t].generator)
                           for t in self.tasks},
                    lengths=list(self.lengths), samples=self.samples, seed=self.seed, split=self.split,
                    reserve={f"{t}@{n}": r for (t, n), r in self.reserve.items() if r}, notes=list(self.notes),
                    **({"made": [f"{t}@{n}" for t, n in self.cells]} if self.cells else {}))


def _scorer(process_results, lengths):
    """The harness's process_results keyed by the lengths run here (its own keys are its DEFAULT_SEQ_LENGTHS)."""
    keys = [str(n) for n in lengths]

    def process(doc, results):
        metrics = dict.fromkeys(keys, -1.0)
        metrics.update((k, v) for k, v in process_results(doc, results).items() if k in metrics)
        return metrics
    return process


def _harness_config(name: str, docs: list[dict], lengths) -> dict:
    """The harness's own config of task `name` with `docs` as its data (in memory) and the lengths as metrics."""
    import datasets
    cfg = _config(RULER_TASKS[name])
    aggregate = cfg["metric_list"][0]["aggregation"]
    data = datasets.Dataset.from_list(docs)
    cfg.update(custom_dataset=lambda **_: {"test": data},
               metric_list=[dict(metric=str(n), aggregation=aggregate, higher_is_better=True) for n in lengths],
               process_results=_scorer(cfg["process_results"], lengths))
    return cfg


def _prepared(names, docs: dict, lengths):
    from analysis.measure.harness import TaskSource, prepare_configs, tasks_folder
    configs = {n: _harness_config(n, docs[n], lengths) for n in names}
    sources = {n: TaskSource(n, str(tasks_folder() / "ruler" / RULER_TASKS[n].config),
                             "generated here (" + (ESSAY_NOTE if RULER_TASKS[n].haystack == "essay"
                                                   else "the harness's own generator") + ")") for n in names}
    return prepare_configs(configs, sources)


def build_ruler(names, tokenizer, lengths=DEFAULT_LENGTHS, *, samples: int = DEFAULT_SAMPLES, seed: int = 0,
                split: str = TEST, limit: int | None = None, cells=None, progress: Progress | None = None,
                should_stop: ShouldStop | None = None) -> RulerRows:
    """The rows of RULER tasks `names` (None / "all": every offline task) at `lengths` (at most `limit`, the
    model's context), `samples` per task and length, deterministic per seed, split and tokenizer (`split`:
    test rows, what verdicts read, or calibration rows drawn apart from them; analysis.measure.splits).
    `cells` ((task, length) pairs; None: every task at every length): only those, e.g. dense's test set
    (analysis.measure.densemap), where a task passes at some lengths only; `names` and `lengths` are then theirs.
    A cell's rows are the same rows whichever other cells are made with it.
    InputError (one line, before any row is made) for a task that downloads, an unknown task, a length above
    the limit or not RULER's, a sample count out of 1..500, an unknown split, a tokenizer that cannot make the
    rows."""
    from analysis.core.progress import check_stop
    if cells is not None:
        cells = tuple(dict.fromkeys((str(t), int(n)) for t, n in cells))
        if not cells:
            raise InputError("No RULER cells to make: give at least one (task, length).")
        names, lengths = tuple(dict.fromkeys(t for t, _ in cells)), tuple(sorted({n for _, n in cells}))
    names = check_tasks(names)
    lengths = check_ruler_lengths(lengths, limit)
    samples = check_samples(samples)
    seed = check_seed(seed, "The RULER seed")
    split = check_split(split)
    missing = _ruler_missing()
    if missing:
        raise InputError(missing)
    if _tokens(tokenizer, "The quick brown fox jumps over the lazy dog.") == 0:
        raise InputError("This tokenizer encodes text to no tokens: RULER's rows cannot be sized with it.")
    reserve = {(n, length): GENERATORS[RULER_TASKS[n].generator].reserve for n in names for length in lengths
               if cells is None or (n, length) in cells}
    docs: dict = {n: [] for n in names}
    todo = list(reserve)
    for _ in range(FIT_TRIES):
        for i, (name, length) in enumerate(todo):
            check_stop(should_stop, "Making RULER's rows")
            report(progress, i / len(todo), f"making {name} rows at {length:,} tokens")
            made = _generate(name, tokenizer, length, length - reserve[name, length], samples, seed, split)
            for doc in made:
                doc["max_length"] = length                      # the budget, whatever room the generator had
            docs[name] = sorted([d for d in docs[name] if d["max_length"] != length] + made,
                                key=lambda d: d["max_length"])
        rows = RulerRows(names, lengths, samples, seed, docs, _prepared(names, docs, lengths), dict(reserve),
                         split=split, cells=() if cells is None else cells)
        over = _overflow(rows, tokenizer)
        if not over:
            break
        for key, tokens in over.items():
            reserve[key] += tokens
        todo = list(over)
    else:
        where = ", ".join(f"{n} at {length}" for n, length in over)
        raise InputError(f"RULER's rows do not fit their length with this tokenizer ({where}) after {FIT_TRIES} "
                         f"tries with less room.")
    rows.notes = (ESSAY_NOTE,) if any(RULER_TASKS[n].haystack == "essay" for n in names) else ()
    report(progress, 1.0, "RULER rows made")
    return rows


def prompt_lengths(rows: RulerRows, tokenizer) -> dict:
    """(task, doc_id) -> the tokens the model reads for that row's prompt (as the harness builds and encodes it)."""
    from analysis.measure.harness import prompt_ids
    return {(task, doc_id): len(prompt_ids(tokenizer, prompt))
            for task in rows.tasks for doc_id, prompt, _ in rows.contexts(task)}


def row_keys(rows: RulerRows, tokenizer) -> dict:
    """task -> [(prompt token ids, references)] of every row, as the model reads it: what `check_apart` compares."""
    from analysis.measure.harness import prompt_ids
    return {task: [(tuple(prompt_ids(tokenizer, prompt)), tuple(rows.docs[task][doc_id]["outputs"]))
                   for doc_id, prompt, _ in rows.contexts(task)] for task in rows.tasks}


def check_apart(calibration: RulerRows, test: RulerRows, tokenizer) -> None:
    """InputError (one line) unless `calibration` are calibration rows, `test` test rows, and no prompt (token for
    token) or answer of one is in the other (analysis.measure.splits.disjoint)."""
    from analysis.measure.splits import CALIBRATION
    if calibration.split != CALIBRATION or test.split != TEST:
        raise InputError(f"A plan is chosen on calibration rows and judged on test rows; got {calibration.split} "
                         f"rows to choose on and {test.split} rows to judge on.")
    disjoint(row_keys(calibration, tokenizer), row_keys(test, tokenizer), "RULER rows")


def _overflow(rows: RulerRows, tokenizer) -> dict:
    """(task, length) -> tokens over, where some row's prompt + max_gen_toks exceeds its length."""
    from analysis.measure.harness import generation_rules, prompt_ids
    out: dict = {}
    for task in rows.tasks:
        for doc_id, prompt, gen_kwargs in rows.contexts(task):
            length = rows.docs[task][doc_id]["max_length"]
            over = len(prompt_ids(tokenizer, prompt)) + generation_rules(gen_kwargs, None)[1] - length
            if over > 0:
                out[task, length] = max(out.get((task, length), 0), over)
    return out


# -- the exact rows, for a peer tool --------------------------------------------------------------------------

def export_rows(rows: RulerRows, tokenizer) -> list[dict]:
    """One record per row: task, length, index (the row within its task and length), doc_id (within its task,
    every length), the prompt's token ids split into context_ids (up to the
    row's last line) and question_ids (its last line: the question, and the answer prefix; context_ids +
    question_ids are exactly what the model reads), their texts, the references, max_new_tokens, the stop
    strings (the task's until and the tokenizer's EOS text) and eos_token_id. InputError for a tokenizer without
    character offsets (a slow tokenizer)."""
    from analysis.measure.harness import generation_rules, prompt_encoding
    eos = tokenizer.eos_token_id
    eos_text = None if eos is None else tokenizer.decode(eos, skip_special_tokens=False)
    out = []
    for task in rows.tasks:
        for doc_id, prompt, gen_kwargs in rows.contexts(task):
            doc = rows.docs[task][doc_id]
            try:
                enc = prompt_encoding(tokenizer, prompt, offsets=True)
            except NotImplementedError:
                raise InputError("Exporting RULER's rows splits their tokens by character offsets, which this "
                                 "(slow) tokenizer does not give; use a fast tokenizer.") from None
            cut = _question_start(prompt, doc["input"])
            ids, spans = list(enc["input_ids"]), enc["offset_mapping"]
            k = next((i for i, (_, end) in enumerate(spans) if end > cut), len(ids))
            until, max_new = generation_rules(gen_kwargs, eos_text)
            index = rows.doc_ids(task, doc["max_length"]).index(doc_id)
            out.append(dict(task=task, length=doc["max_length"], index=index, doc_id=doc_id, context_ids=ids[:k],
                            question_ids=ids[k:], context=prompt[:cut], question=prompt[cut:],
                            references=list(doc["outputs"]), max_new_tokens=max_new, until=until,
                            eos_token_id=eos, metric=METRIC))
    return out


def _question_start(prompt: str, text: str) -> int:
    """Where the question starts in a prompt: the last line of the row's own text (the harness's prompt is that
    text, the target delimiter and the answer prefix), so the question carries the answer prefix with it."""
    return (text.rfind("\n") if prompt.startswith(text) else prompt.rfind("\n")) + 1


def rows_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


# -- the report -------------------------------------------------------------------------------------------------

AVERAGE = "average"
COSTS = ("prefill_s", "decode_s", "tokens_per_s", "new_tokens", "kv_bytes_prompt", "kv_bytes_end")


@dataclass(frozen=True)
class RulerCell:
    """One task (or the average over tasks) at one length: dense (and cut) score with CIs, costs per row."""
    task: str
    label: str
    length: int
    n: int
    dense: dict                     # score, low, high, + the mean of each of COSTS over the rows
    cut: dict | None = None
    change: dict | None = None      # score, low, high of cut - dense (paired resamples)
    lost: bool = False

    def row(self) -> dict:
        out = dict(task=self.task, label=self.label, length=self.length, n=self.n)
        out.update({f"dense_{k}": v for k, v in self.dense.items()})
        if self.cut is not None:
            out.update({f"cut_{k}": v for k, v in self.cut.items()})
            out.update(change=self.change["score"], change_low=self.change["low"], change_high=self.change["high"],
                       lost=self.lost)
        return out


@dataclass(frozen=True)
class RulerReport:
    """Every task x length cell and the average over tasks per length; the harness runs behind them."""
    cells: list
    rows: RulerRows
    dense: object                   # harness.HarnessRun (pass back as dense= to reuse it)
    cut_run: object = None
    cut: dict | None = None         # the cut's as_dict(), None: dense only

    @property
    def lost(self) -> list:
        return [c for c in self.cells if c.lost]

    def warnings(self) -> list[str]:
        return [f"the cut loses RULER {c.label if c.task != AVERAGE else 'on average'} at {c.length} tokens: "
                f"score {c.cut['score']:.2f} [{c.cut['low']:.2f}, {c.cut['high']:.2f}] against dense "
                f"{c.dense['score']:.2f}" for c in self.lost]

    def table(self) -> list[dict]:
        return [c.row() for c in self.cells]

    def as_dict(self) -> dict:
        from analysis.measure.harness import HARNESS_VERSION
        return dict(harness=HARNESS_VERSION, metric=METRIC, **self.rows.info(), cut=self.cut, cells=self.table(),
                    lost=[(c.task, c.length) for c in self.lost], warnings=self.warnings(),
                    seconds=dict(dense=self.dense.seconds, cut=None if self.cut_run is None else self.cut_run.seconds),
                    generations=dict(dense=self.dense.generations,
                                     cut=None if self.cut_run is None else self.cut_run.generations))

    def markdown(self, title: str = "RULER") -> str:
        cut = self.cut is not None
        head = (f"## {title}\n\nScore = RULER's string_match_all (the share of a row's references in its generation), "
                "mean over rows [95 % bootstrap CI]; s / row = prefill + generation."
                + (" LOST = the cut's CI lies below the dense score." if cut else "")
                + "".join(f" Note: {n}." for n in self.rows.notes) + "\n\n"
                "| task | tokens | rows | dense score | dense s / row |"
                + (" cut score | cut - dense | |" if cut else "")
                + "\n|---|---:|---:|---:|---:|" + ("---:|---:|---|" if cut else "") + "\n")
        lines = []
        for c in self.cells:
            line = (f"| {c.label} | {c.length} | {c.n} | {_ci(c.dense)} | "
                    f"{c.dense['prefill_s'] + c.dense['decode_s']:.2f} |")
            if cut:
                line += f" {_ci(c.cut)} | {_ci(c.change, signed=True)} | {'**LOST**' if c.lost else ''} |"
            lines.append(line)
        return head + "\n".join(lines) + "\n"


def _ci(d: dict, signed: bool = False) -> str:
    fmt = "+.3f" if signed else ".3f"
    return f"{d['score']:{fmt}} [{d['low']:{fmt}}, {d['high']:{fmt}}]"


def _logged(run, task: str) -> dict:
    """doc_id -> the run's logged sample of that row (its generation; its metric at its own length)."""
    return {s["doc_id"]: s for s in run.samples[task]}


def _side(mean, ci, b: int, gens: list[dict]) -> dict:
    import numpy as np
    out = dict(score=float(mean[b]), low=float(ci[b, 0]), high=float(ci[b, 1]))
    for key in COSTS:
        xs = [g[key] for g in gens if g.get(key) is not None]
        out[key] = float(np.mean(xs)) if xs else None
    return out


def ruler_cells(rows: RulerRows, dense, cut_run=None, seed: int = 0) -> list[RulerCell]:
    """Every task x length cell and the average over tasks per length, from the logged samples and generations
    of harness runs of `rows` (dense; cut, when given, on the same rows: paired resamples)."""
    import numpy as np
    runs = [dense] + ([] if cut_run is None else [cut_run])
    cells, per_length = [], {n: [] for n in rows.lengths}
    for task in rows.tasks:
        samples = [_logged(r, task) for r in runs]
        gens = [{g["doc_id"]: g for g in r.generations.get(task, [])} for r in runs]
        for length in rows.lengths:
            if not rows.has(task, length):
                continue
            ids = rows.doc_ids(task, length)
            key = str(length)
            values = np.array([[float(s[i]["metrics"][key]) for i in ids] for s in samples])   # [sides, n]
            costs = [[g[i] for i in ids] for g in gens]
            per_length[length].append((values, costs))
            cells.append(score_cell(task, RULER_TASKS[task].label, length, values, costs, seed))
    for length, parts in per_length.items():          # every task made at a length has the same rows there
        values = np.mean([v for v, _ in parts], axis=0)                 # [sides, n]: row i's mean over tasks
        gens = [[g for _, gs in parts for g in gs[b]] for b in range(values.shape[0])]
        cells.append(score_cell(AVERAGE, "Average over tasks", length, values, gens, seed))
    return cells


def score_cell(task: str, label: str, length: int, values, gens, seed: int) -> RulerCell:
    """One cell from values [sides, n] (row scores; dense first, then the cut: paired resamples of the rows, the
    change cut - dense as a third row) and each side's per-row costs (generations; dicts with COSTS keys)."""
    import numpy as np

    from analysis.measure.probes.breaks import is_lost
    from analysis.measure.probes.measure import bootstrap
    n = values.shape[1]
    stacked = values if values.shape[0] == 1 else np.vstack([values, values[1:] - values[:1]])  # dense, cut, change
    mean, ci = bootstrap(stacked, np.arange(n), seed=seed)
    dense = _side(mean, ci, 0, gens[0])
    if values.shape[0] == 1:
        return RulerCell(task, label, length, n, dense)
    cut = _side(mean, ci, 1, gens[1])
    change = dict(score=float(mean[2]), low=float(ci[2, 0]), high=float(ci[2, 1]))
    return RulerCell(task, label, length, n, dense, cut, change, is_lost(dense["score"], cut["high"]))


def ruler_report(loaded, rows: RulerRows, *, cut=None, dense=None, progress: Progress | None = None,
                 should_stop: ShouldStop | None = None) -> RulerReport:
    """RULER's rows on `loaded` (dense; a HarnessRun of these rows given as `dense` is reused) and on a `cut`
    (analysis.arch.cut.Cut: a mask, a KV plan generating with its compact cache, a model of its own; None: dense
    only), through the harness bridge: greedy generations one prompt at a time, the harness's scoring. The
    rows' lengths are checked against the model's context (and the cut model's) before any generation."""
    from analysis.core.progress import scaled
    from analysis.measure.evaluation import context_length
    from analysis.measure.harness import run_harness
    if loaded.kind != "causal-lm":
        raise InputError(f"RULER scores a causal language model's generations; {loaded.name} is a {loaded.kind} "
                         f"model.")
    from analysis.arch.cut import checked
    limit = context_length(loaded.model, default=2**31)
    cut = checked(cut, loaded.geometry)
    if cut is not None:
        if cut.model is not None:
            limit = min(limit, context_length(cut.model, default=2**31))
    check_ruler_lengths(rows.lengths, limit)
    # one row at a time on both sides: each row's prefill and decode seconds are compared with the cut's, and a
    # windowed cut generates one at a time (analysis.measure.harness.generation_batch_for)
    run = functools.partial(run_harness, loaded.model, loaded.tokenizer, rows.prepared, batch_size=1,
                            keep_samples=True, generation_batch=1, should_stop=should_stop)
    cut_progress = progress
    if dense is None:
        dense = run(progress=scaled(progress, 0.0, 0.5 if cut is not None else 1.0))
        cut_progress = scaled(progress, 0.5, 1.0)
    measured = None if cut is None else run(cut=cut, adapter=loaded.adapter, progress=cut_progress)
    return RulerReport(ruler_cells(rows, dense, measured, rows.seed), rows, dense, measured,
                       None if cut is None else cut.as_dict())


# -- the dense side kept on disk -------------------------------------------------------------------------------

DENSE_MEASURE = "ruler-dense"        # the store's name of a dense side (analysis.core.store)
# the modules whose source makes a dense side (their bytes are in its key: every module of the harness package)
DENSE_MODULES = ("analysis.measure.ruler", "analysis.measure.decode", "analysis.measure.decode_rows",
                 "analysis.measure.harness",
                 *(f"analysis.measure.harness.{name}" for name in ("runtime", "folder", "tasks", "generation", "lm", "runs")))


def rows_settings(rows: RulerRows) -> dict:
    """The identity of `rows` for the store: the settings that made them and a digest of every prompt and its
    generation rules exactly as the harness builds them (another tokenizer or lm-eval's templates: other rows)."""
    import importlib.metadata
    return dict(tasks=list(rows.tasks), lengths=list(rows.lengths), samples=int(rows.samples), seed=int(rows.seed),
                split=rows.split, rows=rows.digest, lm_eval=importlib.metadata.version("lm_eval"))


def stored_dense(loaded, rows: RulerRows, *, compute: bool = True, refresh: bool = False, store=None,
                 on_refused=None, progress: Progress | None = None, should_stop: ShouldStop | None = None,
                 fingerprint: str | None = None):
    """(HarnessRun | None, Lookup): the dense model's run of `rows` (ruler_report's `dense=`), read back when this
    model's run of these very rows by this code is stored (analysis.core.store), else (`compute`) generated and
    stored; None with the Lookup of a miss when not `compute`. The CLI and the app share it: the dense side of a
    4k run costs minutes to hours on 2 cores and survives a restart."""
    from dataclasses import asdict

    from analysis.arch.stored import remembered
    from analysis.measure.harness import HarnessRun

    def run():
        return ruler_report(loaded, rows, progress=progress, should_stop=should_stop).dense

    return remembered(loaded, DENSE_MEASURE, rows_settings(rows), run if compute else None, modules=DENSE_MODULES,
                      to_tree=asdict, from_tree=lambda tree: HarnessRun(**tree), store=store, refresh=refresh,
                      on_refused=on_refused, fingerprint=fingerprint)


# -- the time a run takes ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RulerWork:
    """What a run costs: rows and generated tokens (at most) per length, passes (dense, cut)."""
    rows: dict                      # length -> rows
    new_tokens: dict                # length -> tokens generated at most: its rows' max_gen_toks
    passes: int = 1

    @property
    def steps(self) -> int:
        """Decode steps at most, every length."""
        return sum(self.new_tokens.values())

    def seconds(self, per_row: dict, per_step: dict) -> float:
        """At most this long: each row's prefill (`row_seconds` at its length) and every token it may generate
        (`step_seconds` at its length, one row a batch: the harness bridge generates row by row), both from
        analysis.measure.probes.longcontext."""
        return self.passes * sum(per_row[n] * r + per_step[n] * self.new_tokens[n] for n, r in self.rows.items())


def ruler_work(rows: RulerRows, *, cut: bool = False, dense: bool = True) -> RulerWork:
    """The rows' work for the sides that run: dense (False when it is stored) and the cut."""
    from analysis.measure.harness import generation_rules
    per: dict = {}
    new: dict = {}
    for task in rows.tasks:
        for doc_id, _, gen_kwargs in rows.contexts(task):
            length = rows.docs[task][doc_id]["max_length"]
            per[length] = per.get(length, 0) + 1
            new[length] = new.get(length, 0) + generation_rules(gen_kwargs, None)[1]
    return RulerWork(dict(sorted(per.items())), dict(sorted(new.items())), int(dense) + int(cut))
