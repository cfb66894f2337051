"""Long jobs across every session of this server: who computes what on which model, how far it is, who
waits behind the model's lock, and this machine's measured pace (the time estimates).

One `Board` per server process (`board()`, an `st.cache_resource`), shared by all sessions (a class on
one server, issue 33):
- a `Job` for every long computation that runs or waits: its label, the model whose lock it needs, the
  cached call it computes (`call`: so a second session asking for the same result waits for that run,
  shown with its progress, instead of queueing a second one), when it got the lock, its fraction done
  and last message, and its estimate before it started;
- the queue per model: jobs take the model's lock in the order they asked for it (`first_in_line`), so
  the position and the wait shown to a waiting session (`waiting_words`) are the real ones;
- the pace: the seconds of each kind of job on each model as a function of its work (`record` after a
  job, `estimate` before one), measured on this machine as jobs finish. Before any job of a kind has
  finished, the estimate is the model's measured forward speed (`forward_rate`: seconds per token of a
  forward pass) times the kind's forward tokens per unit (`FORWARD_TOKENS`); one finished job makes it
  proportional to that job's pace; two or more of different sizes, a fixed cost plus a cost per unit
  (least squares over the last PACE_POINTS runs: a check of 256 or 512 tokens took the same 14 s here,
  which a proportional pace got 2x wrong).
- `left_words(job)`: the time left, from the pace before the job has reported progress and from its
  own measured pace (elapsed / fraction, blended with the prior as the fraction grows) after: it
  moves every second (the progress bar's ticker redraws it), it is never a frozen number.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import streamlit as st

from analysis.measure.compensation import COMPENSATION_TOKENS

# forward-pass tokens per unit of work, by kind of job: the prior before a job of that kind has run here.
# A unit is what the call site counts (e.g. evaluated tokens x masks); the factor says how many tokens of a
# full forward pass one unit costs (1: one forward of that token; 0.5: half the layers on average, ...).
FORWARD_TOKENS = {
    "evaluate": 1.0,        # tokens x masks, each through the whole model once (windows overlap a little)
    "sweep": 1.0,           # tokens x distinct masks x 2 splits
    "curve": 1.0,           # tokens x sparsity levels
    "ablation": 0.6,        # tokens x heads: each head's removal replays the layers after it (half, plus the head)
    "roles": 3.0,           # tokens: eager attention with probabilities kept, plus the scoring passes
    "redundancy": 3.0,      # tokens: head outputs or patterns kept and compared
    "attribution": 3.0,     # tokens x integration steps: a forward and a backward each
    "detectors": 6.0,       # tokens: several detectors, each its own passes
    "long-detectors": 1.0,  # n * (1 + n / 2048) per pass of n tokens (longstate.long_work): one forward each
    "speed": 4.0,           # timed forward tokens (dense, masked and pruned, repeats)
    "deploy": 40.0,         # tokens: two GGUF files written and run in llama.cpp, two PyTorch perplexities
    "export": 200.0,        # the model's parameters in millions: a copy, the cut and the files written
    "harness": 1.0,         # the harness's request tokens (dense and cut), each through the whole model once
    # the pipeline's phases count forward-token units themselves (pipeline_units)
    **{f"pipeline.{phase}": 1.0 for phase in ("dense", "rounds", "int8", "curves", "roles")},
}
# kinds whose work is already this machine's predicted seconds (the long-context passes: rows x the seconds of one
# row at its length, analysis.measure.longpass.scan_seconds from analysis.measure.probes.longcontext.row_seconds'
# two short timings): the prior is the work itself, and the measured pace corrects it run after run
PREDICTED_SECONDS = ("long-scan", "long-plan", "kv-importance", "ruler")   # ruler: RulerWork.seconds (components/ruler)
PREDICTED_BOUNDS = {"ruler": "every row writing all the tokens it may, so at most"}   # what a prior counts, said
PACE_POINTS = 6             # the last runs of a kind kept for its pace (seconds = fixed + per unit x work)
PRIOR_TRUST = 0.25          # how much a job's own progress must show before its own pace replaces the prior


@dataclass
class Job:
    label: str                       # what the bar says, e.g. "Evaluating"
    model: str                       # the model key's repr: the lock it queues for ("" for none)
    call: str = ""                   # the cached call it computes (function and arguments), "" when none
    kind: str = ""                   # the pace's name for this work (FORWARD_TOKENS)
    work: float = 0.0                # units of work (the kind's unit)
    expected_s: float | None = None  # the estimate before it started (None: no pace known yet)
    created: float = field(default_factory=time.monotonic)
    started: float | None = None     # when it got the model's lock (None: waiting)
    fraction: float = 0.0
    message: str = ""
    number: int = 0                  # arrival order
    clock: "PhaseClock | None" = None  # a job of phases (the pipeline): its time left comes from the clock

    def elapsed(self, now: float | None = None) -> float:
        return 0.0 if self.started is None else (now or time.monotonic()) - self.started

    def left_s(self, now: float | None = None) -> float | None:
        """Seconds left: the prior until progress shows, then this run's own pace blended in; None when
        nothing is known (no pace and no progress yet)."""
        if self.clock is not None:
            return self.clock.left_s(now)
        elapsed = self.elapsed(now)
        f = min(max(self.fraction, 0.0), 1.0)
        own = elapsed / f if f >= 0.02 else None                      # this run's projected total
        if own is None:
            return None if self.expected_s is None else max(self.expected_s - elapsed, 0.0)
        trust = min(f / PRIOR_TRUST, 1.0) if self.expected_s is not None else 1.0
        total = trust * own + (1 - trust) * max(self.expected_s or 0.0, elapsed)
        return max(total - elapsed, 0.0)


def seconds_words(seconds: float) -> str:
    """"about 40 s" / "about 3.5 min"."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{seconds / 60:.1f} min"


class Board:
    """The server's jobs and pace (see the module docstring). Every method takes the board's lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: list[Job] = []
        self._count = itertools.count()
        self._pace: dict[tuple[str, str], list[tuple[float, float]]] = {}   # (kind, model) -> [(work, seconds)]

    # -- jobs --------------------------------------------------------------------------------------
    def add(self, job: Job) -> Job:
        with self._lock:
            job.number = next(self._count)
            job.expected_s = self._estimate(job.kind, job.model, job.work) if job.expected_s is None else job.expected_s
            self._jobs.append(job)
        return job

    def remove(self, job: Job) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def start(self, job: Job) -> None:
        with self._lock:
            job.started = time.monotonic()

    def update(self, job: Job, fraction: float, message: str) -> None:
        job.fraction, job.message = float(fraction), message      # two plain stores: no lock needed

    def running_call(self, call: str, other_than: Job | None = None) -> Job | None:
        """The job (of any session) computing cached call `call` now, if one is."""
        with self._lock:
            return next((j for j in self._jobs if call and j.call == call and j is not other_than), None)

    def ahead(self, job: Job) -> list[Job]:
        """The jobs on the same model before `job`: the one holding the lock first, then the waiting ones in
        arrival order."""
        with self._lock:
            same = [j for j in self._jobs if j.model == job.model and j is not job and j.model]
            return sorted([j for j in same if j.started is not None], key=lambda j: j.started) + sorted(
                [j for j in same if j.started is None and j.number < job.number], key=lambda j: j.number)

    def first_in_line(self, job: Job) -> bool:
        """Whether no job that asked before `job` still waits for the same model."""
        with self._lock:
            return not any(j.model == job.model and j.started is None and j.number < job.number
                           for j in self._jobs if j is not job)

    def waiting_words(self, job: Job) -> str:
        """"waiting: 2nd in line behind 'Ablating heads' (about 40 s left) and 1 more (about 20 s); expected
        wait about 1.0 min"."""
        ahead = self.ahead(job)
        if not ahead:
            return "waiting for the model (about to start)"
        now = time.monotonic()
        lefts = [j.left_s(now) if j.started is not None else j.expected_s for j in ahead]
        first = ahead[0]
        words = (f"waiting: {_ordinal(len(ahead) + 1)} in line behind '{first.label}'"
                 + (f" ({seconds_words(lefts[0])} left)" if lefts[0] is not None else "")
                 + (f" and {len(ahead) - 1} more" if len(ahead) > 1 else ""))
        if all(x is not None for x in lefts):
            words += f"; expected wait about {seconds_words(sum(lefts))}"
        else:
            words += "; the wait is not known yet (a job without a measured pace is ahead)"
        return words

    # -- pace --------------------------------------------------------------------------------------
    def record(self, kind: str, model: str, work: float, seconds: float) -> None:
        """A finished job's (work, seconds) joins the pace of its kind on its model."""
        if not kind or work <= 0 or seconds <= 0:
            return
        with self._lock:
            points = self._pace.setdefault((kind, model), [])
            points.append((float(work), float(seconds)))
            del points[:-PACE_POINTS]

    def estimate(self, kind: str, model: str, work: float) -> float | None:
        with self._lock:
            return self._estimate(kind, model, work)

    def _estimate(self, kind: str, model: str, work: float) -> float | None:
        if not kind or work <= 0:
            return None
        points = self._pace.get((kind, model))
        if points:
            return fit_seconds(points, work)
        if kind in PREDICTED_SECONDS:
            return float(work)
        if kind in FORWARD_TOKENS and ("forward", model) in self._pace:
            return FORWARD_TOKENS[kind] * fit_seconds(self._pace[("forward", model)], 1.0) * work
        return None

    def knows(self, kind: str, model: str) -> bool:
        """Whether a job of `kind` has finished on `model` (the estimate is measured, not the prior)."""
        with self._lock:
            return (kind, model) in self._pace


def fit_seconds(points: list[tuple[float, float]], work: float) -> float:
    """Seconds for `work` from measured (work, seconds) points: fixed + per unit x work, least squares, both
    at least 0, when the points have two sizes or more; else proportional to the newest point."""
    w = np.array([p[0] for p in points])
    t = np.array([p[1] for p in points])
    if np.ptp(w) > 0.05 * w.max():
        per_unit, fixed = np.polyfit(w, t, 1)
        if per_unit < 0:                                   # no growth with the size measured: the mean
            return float(t.mean())
        if fixed < 0:                                      # through the origin instead
            return float(work * (w @ t) / (w @ w))
        return float(fixed + per_unit * work)
    return float(t[-1] / w[-1] * work)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


@st.cache_resource(show_spinner=False)
def board() -> Board:
    """The server's one Board (shared by every session)."""
    return Board()


# the job of the cached call running in this thread (exclusive() queues it for the model's lock)
CURRENT: ContextVar[Job | None] = ContextVar("headscope_job", default=None)


def call_key(fn, args: tuple) -> str:
    """A digest naming a cached call: the function and its arguments (arrays by their bytes)."""
    h = hashlib.sha1(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}".encode())
    for a in args:
        if isinstance(a, np.ndarray):
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        else:
            h.update(repr(a).encode())
    return h.hexdigest()


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# -- the pipeline's estimate, phase by phase ---------------------------------------------------------------
# analysis.compress.recover.report.compression_report reports fixed fractions: the dense model's stage until 0.05,
# the rounds over 0.05 .. 0.65, INT8 from 0.7, the frontier from 0.8, the curves from 0.85, the kept heads'
# roles from 0.95. Each phase has its own pace (kind "pipeline.<phase>", in forward-token units), recorded
# when it ends.
PIPELINE_PHASES = (("dense", 0.0), ("rounds", 0.05), ("int8", 0.7), ("frontier", 0.8), ("curves", 0.85),
                   ("roles", 0.95))
STAGE_TOKENS = 1500          # measuring a stage beyond its evaluation: prefill and decode timings, the safetensors size
INT8_TOKENS = 12000          # the INT8 stages beyond their evaluations: the ONNX export, two quantizations, timings
FRONTIER_FILE_TOKENS = 3000  # a frontier file beyond its evaluation: writing, quantizing, the export's self-check
# a recovery step's forward tokens per training token: the teacher's forward, the student's forward, its re-forward
# under gradient checkpointing, the backward (about two forwards) and the AdamW step over every weight (SmolLM2,
# batch 2 x 64: 3.4 s a step at 281 forward tokens/s, 7.5 per token; the prior said 4 and was 2x low)
DISTILL_FORWARDS = 7.0
PROBE_FORWARDS = 1.2         # the capability probes per prompt token (bench_probes: 1.17x a perplexity check)
# the kept heads' roles (analysis.measure.compensation): every detector before and after recovery, then DLA
# on the dense model, each on its own fixed number of tokens (not the evaluation's)
ROLES_UNITS = (2 * FORWARD_TOKENS["detectors"] + 1.0) * COMPENSATION_TOKENS


def pipeline_units(*, rounds: int, recovery_steps: int, batch: int, seq_len: int, eval_tokens: int, int8: bool,
                   recovering: bool, frontier_types: int = 0, probe_tokens: int = 0) -> dict[str, float]:
    """Forward-token units of each phase of a pipeline run (the pace turns them into seconds). probe_tokens:
    the prompt tokens of the capability probes the report runs on the dense model and on every round (0: none;
    they were left out of this prior, which came out 3x low on a first run: bench/bench_estimates.py)."""
    stage = eval_tokens + STAGE_TOKENS
    probes = PROBE_FORWARDS * probe_tokens
    units = {"dense": stage + probes,
             "rounds": rounds * (DISTILL_FORWARDS * recovery_steps * batch * seq_len + 2 * eval_tokens + stage + probes),
             "int8": INT8_TOKENS + 6 * eval_tokens if int8 else 0,
             "frontier": 2 * frontier_types * (eval_tokens + FRONTIER_FILE_TOKENS),    # dense and final per type
             "curves": rounds * eval_tokens * (3 if recovering else 1),
             "roles": ROLES_UNITS if recovering else 0}
    return {k: float(v) for k, v in units.items() if v}


class PhaseClock:
    """The time left of a pipeline run from its phases: what is left of the current phase's estimate, plus
    the later phases' estimates, scaled up by how far the current phase has overrun its own (the machine is
    slower than the pace said). Each finished phase's time is recorded on the board as that phase's pace.
    (The fractions inside a phase are not time: a round reports 1.0 before its stage is measured.)"""

    def __init__(self, board: Board, model: str, units: dict[str, float]):
        self.board, self.model, self.units = board, model, units
        self.expected = {p: board.estimate(f"pipeline.{p}", model, u) for p, u in units.items()}
        self.measured: dict[str, float] = {}
        self.phase, self.phase_start, self.fraction = None, None, 0.0

    def total_s(self) -> float | None:
        """The whole run's estimate before it starts (None: no pace known)."""
        values = list(self.expected.values())
        return None if any(v is None for v in values) else float(sum(values))

    def _phase_of(self, fraction: float) -> str:
        current = PIPELINE_PHASES[0][0]
        for name, start in PIPELINE_PHASES:
            if fraction >= start - 1e-9:
                current = name
        return current

    def update(self, fraction: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        phase = self._phase_of(fraction)
        if phase != self.phase:
            self._close(now)
            self.phase, self.phase_start = phase, now
        self.fraction = fraction

    def _close(self, now: float) -> None:
        if self.phase is not None and self.phase in self.units:
            self.measured[self.phase] = now - self.phase_start
            self.board.record(f"pipeline.{self.phase}", self.model, self.units[self.phase], now - self.phase_start)

    def finish(self, now: float | None = None) -> None:
        self._close(time.monotonic() if now is None else now)
        self.phase = None

    def left_s(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        if self.phase is None:
            return self.total_s()
        names = [n for n, _ in PIPELINE_PHASES]
        later = [p for p in names[names.index(self.phase) + 1:] if p in self.units]
        if any(self.expected[p] is None for p in later):
            return None
        spent = now - self.phase_start
        expected = self.expected.get(self.phase)
        if expected is None:
            return None
        # a phase past its estimate says the machine is slower than the pace: the later ones are scaled alike
        slower = max(1.0, spent / expected) if expected > 0 else 1.0
        return max(expected - spent, 0.0) + slower * sum(self.expected[p] for p in later)
