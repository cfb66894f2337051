"""A run of the prepared tasks and the report of dense vs a cut: `run_harness` (one model, as it is or under
a cut: gates through `analysis.arch.head_gates.head_mask` on the dense model, a KV plan, or a model of its
own), `HarnessRun` (each metric's value and the harness's stderr), `worse` (the flag a change beyond
WORSE_STDERRS combined standard errors gets) and `harness_report` / `HarnessReport` (dense vs a cut on the
same tasks and documents).
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, field

from analysis.core.errors import InputError, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report, scaled
from analysis.measure.harness.lm import check_logit_memory, make_lm
from analysis.measure.harness.runtime import HARNESS_VERSION, offline, quiet, require_harness
from analysis.measure.harness.tasks import PreparedTasks

DEFAULT_BATCH_SIZE = 8
DEFAULT_GENERATION_BATCH = 8    # prompts generated together (capped by memory: harness.lm.rows_that_fit)
BOOTSTRAP_ITERS = 1000          # the harness's resampled stderrs (median, F1, ...); acc's is in closed form


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
    generation_batch: int = 1     # prompts generated together (1: one at a time; see generation_batch_for)

    def as_dict(self) -> dict:
        return dict(metrics={t: {m: dict(value=v, stderr=s) for m, (v, s) in ms.items()}
                             for t, ms in self.metrics.items()},
                    n_samples=self.n_samples, seconds=self.seconds, batch_size=self.batch_size,
                    max_length=self.max_length, generations=self.generations, generation_batch=self.generation_batch)


def _sample(d: dict) -> dict:
    """One logged document: its requests' log-likelihoods, or its generation; its metric values."""
    out = dict(doc_id=int(d["doc_id"]), arguments=[tuple(a) for a in d["arguments"]],
               metrics={m: d[m] for m in d.get("metrics", ()) if m in d})
    if d["resps"] and d["resps"][0] and isinstance(d["resps"][0][0], str):
        return dict(out, generation=d["filtered_resps"][0])             # generate_until: [[text]]
    return dict(out, loglikelihoods=[float(r[0][0] if isinstance(r[0], (tuple, list)) else r[0]) for r in d["resps"]])


def generation_batch_for(cut, requested: int) -> int:
    """Prompts generated together under `cut`: `requested`, or 1 for a cut whose windowed heads number keys from
    a row's first slot (a KV plan with windows, or a model of its own under one: left padding would make pads
    their sinks; analysis.arch.kvcache)."""
    return 1 if cut is not None and cut.windowed else int(requested)


def _parse(results: dict, seconds: float, batch_size: int, max_length: int, keep_samples: bool,
           generations: dict, generation_batch: int = 1) -> HarnessRun:
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
                      {t: sorted(rows, key=lambda r: r["doc_id"]) for t, rows in generations.items()},
                      generation_batch)


def run_harness(model, tokenizer, prepared: PreparedTasks, *, cut=None, adapter=None,
                batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None, keep_samples: bool = False,
                generation_batch: int = DEFAULT_GENERATION_BATCH,
                progress: Progress | None = None, should_stop: ShouldStop | None = None) -> HarnessRun:
    """The prepared tasks on one causal LM in memory: as it is (cut None), or under a `cut`
    (analysis.arch.cut.Cut: inside `cut.running(model)`, each generation with its own `cut.new_cache()`,
    so a KV plan generates with its compact cache). max_length None: the harness's own (the model's context).
    keep_samples: every request's log-likelihood or generation and each document's metrics too
    (HarnessRun.samples). Generations run `generation_batch` prompts at a time in one left-padded batch (fewer
    where the memory would not hold them; one at a time under a windowed cut: `generation_batch_for`), a fresh
    KV cache for each batch (HarnessRun.generations: each row's KV bytes and speed, in a batch its share of the
    batch's)."""
    require_harness()
    check_whole_number(batch_size, "the harness batch size", low=1, high=2**16)
    check_whole_number(generation_batch, "the harness generation batch", low=1, high=2**16)
    check_whole_number(max_length, "the harness max length", low=2, high=2**24, none_ok=True)
    from lm_eval.evaluator import evaluate

    from analysis.arch.cut import running as cut_running   # torch: imported on use (the CLI's parser reads this)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")       # the harness's bootstrap: no process pool in our process
    new_cache = (lambda: None) if cut is None else cut.new_cache
    with cut_running(cut, model, adapter=adapter) as running:
        with quiet():
            lm = make_lm(running, tokenizer, batch_size=batch_size, max_length=max_length)
        check_logit_memory(prepared, lm, running, batch_size)
        rows = generation_batch_for(cut, generation_batch)
        lm.track(progress, should_stop, len(prepared.request_types()), new_cache=new_cache, generation_batch=rows)
        start = time.perf_counter()
        with quiet(), offline():
            check_stop(should_stop, "The harness run")
            results = evaluate(lm=lm, task_dict=prepared.loaded, limit=prepared.limit,
                               bootstrap_iters=BOOTSTRAP_ITERS, log_samples=keep_samples)
    report(progress, 1.0, "done")
    return _parse(results, time.perf_counter() - start, batch_size, lm.max_length, keep_samples, lm.generations,
                  rows)


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
                    max_length=self.dense.max_length, generation_batch=dict(
                        dense=self.dense.generation_batch, cut=None if self.cut is None else self.cut.generation_batch),
                    tasks={n: s.as_dict() for n, s in self.sources.items()},
                    rows=self.rows(), seconds=dict(dense=self.dense.seconds,
                                                   cut=None if self.cut is None else self.cut.seconds))


def harness_report(loaded, prepared: PreparedTasks, *, cut=None, dense: HarnessRun | None = None,
                   batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None, keep_samples: bool = False,
                   generation_batch: int = DEFAULT_GENERATION_BATCH,
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
                            max_length=max_length, keep_samples=keep_samples, generation_batch=generation_batch,
                            should_stop=should_stop)
    if dense is None:
        dense = run(loaded.model, progress=scaled(progress, 0.0, 0.5 if cut is not None else 1.0))
        cut_progress = scaled(progress, 0.5, 1.0)
    else:
        cut_progress = progress                             # the dense side was measured before
    measured = None if cut is None else run(loaded.model, cut=cut, adapter=loaded.adapter, progress=cut_progress)
    return HarnessReport(dense, measured, dict(prepared.sources), prepared.limit)
