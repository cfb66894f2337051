"""A KV plan chosen whole against calibration answers at a target KV ratio (issue 52 item 3).

The window scores (analysis.score.kvscores: streaming, retrieval-aware) judge one KV head at a time; heads that
are each harmless alone can together lose an answer. The search judges the plan so far:

- rows: calibration rows only (analysis.measure.splits; RULER's calibration rows, the needle items of the
  calibration half), each a prompt and the answer it asks for, teacher-forced (`AnswerRow`);
- the loss of a plan: the answers' summed NLL per row under the plan (analysis.arch.kvplan.applied: the plan's own
  windowing), against dense's on the same rows;
- the order: KV heads by a prior, lowest first (default `answer_prior`: how much each KV head's output at the
  answer rows changes under the window, from one dense pass over the calibration rows; or any [L, Hkv] score);
- the greedy search (`GreedyPlanSearch`): window the next `block` heads of the order on top of the plan so far,
  re-measure the calibration loss of the whole plan, keep them when the mean increase over dense stays within
  `budget` nats a row, else split the block in halves and try each (a head refused alone is set aside with the
  increase it cost); until the plan holds the target KV. When the budget cannot be held to the target, the heads
  set aside are added cheapest first and the plan says it went over budget.

Cost: one forward pass of every calibration row per evaluation; about needed / block + 2 log2(block) per refused
head evaluations (`GreedyPlanSearch.evaluations`), each timed by `estimate`. Stop is checked between layers; a
stopped search raises CancelledError unless `keep_partial` (then the plan so far, marked partial, is returned).

Shapes: plans and priors [L, Hkv]; losses per row [n].
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from analysis.arch.kvplan import WINDOW, KVPlan, applied
from analysis.arch.spans import attention_layers, tapped
from analysis.arch.window import Window, window_of
from analysis.core.errors import CancelledError, InputError, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.long_options import DEFAULT_SEARCH_BLOCK as DEFAULT_BLOCK
from analysis.measure.long_options import DEFAULT_SEARCH_BUDGET as DEFAULT_BUDGET
from analysis.measure.longheads import Answered, attention_rows
from analysis.measure.loss import token_nll
from analysis.measure.probes.longcontext import stop_between_layers
WHAT = "The plan search"


@dataclass(frozen=True)
class AnswerRow(Answered):
    """One calibration row: ids [T] (prompt, then the answer it asks for), the answer at ids[answer:]."""
    ids: torch.Tensor
    answer: int
    source: str = ""


def ruler_answer_rows(rows, tokenizer) -> list[AnswerRow]:
    """AnswerRows of RULER rows (analysis.measure.ruler.RulerRows): the prompt as the harness builds and encodes it,
    then the references as one answer (" a, b, c"), teacher-forced."""
    from analysis.measure.harness import prompt_ids
    out = []
    for task in rows.tasks:
        for doc_id, prompt, _ in rows.contexts(task):
            doc = rows.docs[task][doc_id]
            prompt_part = prompt_ids(tokenizer, prompt)
            answer = tokenizer(" " + ", ".join(doc["outputs"]), add_special_tokens=False)["input_ids"]
            ids = torch.tensor(list(prompt_part) + list(answer), dtype=torch.long)      # [T]
            out.append(AnswerRow(ids, len(prompt_part), f"{rows.split}:{task}@{doc['max_length']}#{doc_id}"))
    return out


def needle_answer_rows(items) -> list[AnswerRow]:
    """AnswerRows of needle items (analysis.measure.longheads.NeedleItem)."""
    return [AnswerRow(it.ids, it.answer, f"needle:{it.kind}@{it.length}:{it.depth:g}") for it in items]


def _keep(model, k: int) -> dict:
    """`logits_to_keep=k` where the model takes it (its last k rows of logits only)."""
    return {"logits_to_keep": int(k)} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _answer_nll(model, row: AnswerRow, device) -> tuple[float, bool]:
    """(summed NLL of the answer, every answer token the argmax) of one row under whatever the model runs now."""
    k = row.targets.numel()
    logits = model(input_ids=row.ids[None].to(device), use_cache=False, **_keep(model, k + 1)).logits  # [1, k+1, V]
    logits = logits[0, :k].float()                                                       # [k, V]
    targets = row.targets.to(logits.device)                                             # [k]
    nll = float(token_nll(logits, targets).double().sum())
    return nll, bool((logits.argmax(-1) == targets).all())


@dataclass
class PlanLoss:
    """The calibration answers' loss of KV plans on `model` (its geometry's plans, the `window`)."""
    model: object
    rows: list
    window: Window
    geometry: object
    should_stop: ShouldStop | None = None
    evaluations: int = 0
    seconds: float = 0.0
    measured: dict = field(default_factory=dict)     # the modes' bytes -> (nll, exact): a plan is measured once

    def of(self, windowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(nll [n], exact [n] bool) of the plan windowing `windowed` [L, Hkv] (None: dense); a plan measured
        before (the search's last kept plan is its result) is read back, not run again."""
        from analysis.arch.adapters import input_device
        g = self.geometry
        modes = np.zeros((g.n_layers, g.n_kv_heads), np.int8)
        if windowed is not None:
            modes[np.asarray(windowed, bool)] = WINDOW
        key = modes.tobytes()
        if key in self.measured:
            return self.measured[key]
        plan = KVPlan(modes, self.window, g.n_heads)
        device = input_device(self.model)
        t0 = time.perf_counter()
        nll, exact = [], []
        with torch.no_grad(), stop_between_layers(self.model, self.should_stop, WHAT), applied(self.model, plan):
            for row in self.rows:
                check_stop(self.should_stop, WHAT)
                a, b = _answer_nll(self.model, row, device)
                nll.append(a)
                exact.append(b)
        self.evaluations += 1
        self.seconds += time.perf_counter() - t0
        self.measured[key] = np.array(nll), np.array(exact)
        return self.measured[key]


def answer_prior(model, rows: list[AnswerRow], window: Window, geometry, *,
                 should_stop: ShouldStop | None = None) -> np.ndarray:
    """[L, Hkv] how much each KV head's attention output at the answer rows changes under the window (relative
    L2, the largest of its query heads, mean over rows): one dense pass per row, the order the search tries heads
    in (lowest first)."""
    from analysis.arch.adapters import input_device
    modules = attention_layers(model)
    g = geometry
    total = np.zeros((g.n_layers, g.n_kv_heads))
    device = input_device(model)
    for row in rows:
        check_stop(should_stop, WHAT)
        q_rows = row.rows[row.rows >= window.size]
        if not q_rows.numel():
            continue
        per = np.zeros((g.n_layers, g.n_heads))

        def tap(layer, query, key, value, q_rows=q_rows, per=per):
            o_full, o_win = attention_rows(modules[layer], query, key, value, q_rows, window)   # [H, n, d]
            diff = ((o_full - o_win) ** 2).sum(-1).double().mean(-1)                           # [H]
            norm = ((o_full ** 2).sum(-1).double().mean(-1)).clamp_min(1e-300)                  # [H]
            per[layer] = (diff / norm).sqrt().cpu().numpy()
        with torch.no_grad(), stop_between_layers(model, should_stop, WHAT), tapped(model, tap):
            model(input_ids=row.ids[None].to(device), use_cache=False, **_keep(model, 1))
        total += per.reshape(g.n_layers, g.n_kv_heads, -1).max(-1)
    return total / max(len(rows), 1)


def heads_for_ratio(target: float, context: int, window: Window, n_kv: int) -> int:
    """The fewest windowed KV heads (every other full) whose cache at `context` tokens is at most `target` of dense."""
    keep = window.kept(context) / context
    if keep >= 1.0:
        raise InputError(f"A window of {window.describe()} holds all {context:,} tokens: windowing frees nothing "
                         f"there; use a longer context or a smaller window.")
    need = int(np.ceil((1.0 - target) / (1.0 - keep) * n_kv - 1e-9))
    if need > n_kv:
        raise InputError(f"Windowing every KV head holds {keep:.2f} of dense at {context:,} tokens, above the target "
                         f"{target:g}; prune heads too, or use a smaller window.")
    return max(need, 0)


def check_target(target) -> float:
    """A KV target as a fraction of dense, 0 < target <= 1; InputError (one line) otherwise."""
    try:
        t = float(target)
    except (TypeError, ValueError):
        raise InputError(f"The KV target is a fraction of dense's cache, above 0 and at most 1; got {target!r}.") from None
    if isinstance(target, bool) or not (0.0 < t <= 1.0) or not np.isfinite(t):
        raise InputError(f"The KV target is a fraction of dense's cache, above 0 and at most 1; got {target!r}.")
    return t


@dataclass
class SearchResult:
    """The plan found, its calibration loss and dense's, and how it got there."""
    plan: KVPlan
    dense_nll: np.ndarray                     # [n] per calibration row
    plan_nll: np.ndarray                      # [n]
    dense_exact: np.ndarray                   # [n] bool
    plan_exact: np.ndarray                    # [n] bool
    target: float
    kv_ratio: float                           # what the plan holds at the search's context
    within_budget: bool
    partial: bool
    evaluations: int
    seconds: float
    trace: list = field(default_factory=list)   # (heads tried, kept?, mean increase) per evaluation
    rows_used: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return dict(target=self.target, kv_ratio=self.kv_ratio, within_budget=self.within_budget, partial=self.partial,
                    evaluations=self.evaluations, seconds=round(self.seconds, 1),
                    dense_nll=float(self.dense_nll.mean()), plan_nll=float(self.plan_nll.mean()),
                    dense_exact=float(self.dense_exact.mean()), plan_exact=float(self.plan_exact.mean()),
                    counts=self.plan.counts(), rows_used=self.rows_used)


@dataclass(frozen=True)
class GreedyPlanSearch:
    """Window KV heads block by block in the order of a prior, keeping each block only while the whole plan's
    calibration loss stays within `budget` nats a row of dense's, to the `target` KV at `context` tokens."""
    target: float = 0.5
    context: int = 4096
    window: Window = field(default_factory=Window)
    block: int = DEFAULT_BLOCK
    budget: float = DEFAULT_BUDGET
    name = "greedy"

    def __post_init__(self):
        object.__setattr__(self, "target", check_target(self.target))
        object.__setattr__(self, "window", window_of(self.window))
        check_whole_number(self.block, "The search's block (KV heads tried at once)", low=1, high=4096)
        check_whole_number(self.context, "The context the KV target is measured at", low=1)
        if not np.isfinite(self.budget) or self.budget < 0:
            raise InputError(f"The search's budget is nats a row, 0 or more; got {self.budget!r}.")

    def needed(self, geometry) -> int:
        return heads_for_ratio(self.target, self.context, self.window, geometry.n_layers * geometry.n_kv_heads)

    def evaluations(self, geometry, refused: int = 0) -> int:
        """Evaluations the search makes (at least: every block kept; each refused head costs about 2 log2 block)."""
        n = self.needed(geometry)
        return 1 + int(np.ceil(n / self.block)) + int(refused * 2 * max(np.log2(self.block), 1))

    def estimate(self, geometry, rows: list[AnswerRow], row_seconds) -> float:
        """Seconds, at least: every evaluation's forward passes (`row_seconds(T)`, one row), plus the prior's pass."""
        per = sum(row_seconds(row.ids.numel()) for row in rows)
        return per * (self.evaluations(geometry) + 1)

    def search(self, loaded, rows: list[AnswerRow], *, prior: np.ndarray | None = None,
               progress: Progress | None = None, should_stop: ShouldStop | None = None,
               keep_partial: bool = False, rows_used: dict | None = None) -> SearchResult:
        """The plan, from the calibration `rows` (AnswerRows) on `loaded` (model, geometry)."""
        g = loaded.geometry
        if not rows:
            raise InputError("The plan search needs calibration rows (at least one prompt with its answer).")
        self.needed(g)                                              # the target reachable, before any pass
        t0 = time.perf_counter()
        loss = PlanLoss(loaded.model, rows, self.window, g, should_stop)
        report(progress, 0.0, "the plan search: dense's calibration answers")
        dense_nll, dense_exact = loss.of(None)
        if prior is None:
            prior = answer_prior(loaded.model, rows, self.window, g, should_stop=should_stop)
        step = lambda done, total, msg: report(progress, min(done / max(total, 1), 0.99), msg)   # noqa: E731
        try:
            chosen, within, trace = self.choose(lambda w: loss.of(w)[0], dense_nll, prior, g, step)
        except _Stopped as stop:
            if not keep_partial:
                raise stop.error from None
            return self._result(g, stop.chosen, dense_nll, dense_exact, loss, stop.trace, t0, rows_used,
                                partial=True, within=True)
        return self._result(g, chosen, dense_nll, dense_exact, loss, trace, t0, rows_used, partial=False,
                            within=within)

    def choose(self, evaluate, dense_nll: np.ndarray, prior, geometry, step=None):
        """(chosen [L * Hkv] bool, within budget, trace): the greedy block search itself. evaluate(windowed [L, Hkv]
        bool) -> the calibration rows' NLL [n] under that plan; dense_nll [n]; prior [L, Hkv] (lowest tried first).
        A stop inside `evaluate` (CancelledError, KeyboardInterrupt) ends the search (_Stopped carries the plan so
        far)."""
        g = geometry
        shape = (g.n_layers, g.n_kv_heads)
        need = self.needed(g)
        prior = np.asarray(prior, np.float64)
        if prior.shape != shape or not np.isfinite(prior).all():
            raise InputError(f"The search's prior must be [{shape[0]}, {shape[1]}] finite scores; got "
                             f"{list(prior.shape)}.")
        order = [int(i) for i in np.lexsort((np.arange(prior.size), prior.ravel()))]
        chosen = np.zeros(prior.size, bool)
        current = np.asarray(dense_nll, np.float64)
        trace, refused = [], []
        queue = [order[i:i + self.block] for i in range(0, len(order), self.block)]
        expected = self.evaluations(g)
        done = 0
        while int(chosen.sum()) < need and queue:
            blk = queue.pop(0)[: need - int(chosen.sum())]
            trial = chosen.copy()
            trial[blk] = True
            try:
                if step is not None:
                    step(done, expected, f"the plan search: {int(chosen.sum())} of {need} KV heads windowed, "
                                         f"trying {len(blk)}")
                nll = np.asarray(evaluate(trial.reshape(shape)), np.float64)
            except (CancelledError, KeyboardInterrupt) as err:         # Stop, or Ctrl-C in the CLI
                raise _Stopped(err, chosen, trace) from None
            done += 1
            rise = float((nll - dense_nll).mean())
            ok = rise <= self.budget
            trace.append(dict(heads=[_name(i, g) for i in blk], kept=ok, increase=rise))
            if ok:
                chosen, current = trial, nll
            elif len(blk) > 1:
                half = len(blk) // 2
                queue[:0] = [blk[:half], blk[half:]]
                expected += 2
            else:
                refused.append((float((nll - current).mean()), blk[0]))
        within = int(chosen.sum()) >= need
        for _, i in sorted(refused)[: max(need - int(chosen.sum()), 0)]:
            chosen[i] = True                                    # the budget cannot be held: cheapest first
        return chosen, within, trace

    def _result(self, g, chosen, dense_nll, dense_exact, loss, trace, t0, rows_used, *, partial, within):
        shape = (g.n_layers, g.n_kv_heads)
        modes = np.where(chosen.reshape(shape), WINDOW, 0).astype(np.int8)
        plan = KVPlan(modes, self.window, g.n_heads)
        nll, exact = (loss.of(chosen.reshape(shape)) if not partial else (np.full_like(dense_nll, np.nan),
                                                                           np.zeros_like(dense_exact)))
        ratio = plan.kv_ratio(self.context)
        note = (f"windowed: chosen whole by the greedy plan search on {len(loss.rows)} calibration rows (blocks of "
                f"{self.block}, budget {self.budget:g} nats a row over dense), target KV {self.target:g} of dense at "
                f"{self.context:,} tokens, holds {ratio:.3f}"
                + ("" if within else "; the budget could not be held to the target: the cheapest refused heads "
                                     "were added")
                + ("; STOPPED part way: the plan so far" if partial else ""))
        plan = plan.with_modes(plan.modes, note)
        return SearchResult(plan, dense_nll, nll, dense_exact, exact, self.target, ratio, within, partial,
                            loss.evaluations, time.perf_counter() - t0, trace, dict(rows_used or {}))


class _Stopped(Exception):
    """A search stopped part way: the CancelledError, and the plan so far."""
    def __init__(self, error: BaseException, chosen: np.ndarray, trace: list):
        super().__init__(str(error))
        self.error, self.chosen, self.trace = error, chosen, trace


def _name(i: int, g) -> str:
    return f"L{i // g.n_kv_heads}KV{i % g.n_kv_heads}"


PLAN_SEARCHES = {GreedyPlanSearch.name: GreedyPlanSearch}          # declared by name in measure/long_options


def plan_search(name: str, **options):
    """The search registered as `name` (PLAN_SEARCHES), built with `options`; InputError naming them otherwise."""
    cls = PLAN_SEARCHES.get(name)
    if cls is None:
        raise InputError(f"Unknown plan search {name!r}; use one of {', '.join(PLAN_SEARCHES)}.")
    return cls(**options)


__all__ = ["AnswerRow", "ruler_answer_rows", "needle_answer_rows", "PlanLoss", "answer_prior", "heads_for_ratio",
           "check_target", "SearchResult", "GreedyPlanSearch", "PLAN_SEARCHES", "plan_search"]
