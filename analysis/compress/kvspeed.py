"""Measured KV-cache bytes, prefill time and decode time of KV plans against the dense model, in one run.

For one context length, the dense model (transformers' DynamicCache, its own kernel) and each plan as
headscope runs it (`analysis.compress.kvruntime.kv_plan_model`: the pruned twin, its windows, the compact
cache) are timed side by side:
- **prefill**: one forward over `context` random tokens that fills the cache (logits of the last token
  only, as a generation's prefill), `repeats` rounds after `warmup`, the order rotating every round
  (`analysis.compress.speed.alternating_times`);
- **decode**: from the cache each model's last prefill left, `decode_steps` greedy steps per round, the
  median per step (self-timed: the prefill is never inside a decode time), in the same rotating rounds;
- **KV bytes**: the real K / V tensors of the cache after the prefill (`analysis.arch.kvcache.kv_cache_bytes`)
  next to what the plan predicts (`KVPlan.kv_bytes`); they are equal by construction and reported both.
Ratios are dense / plan per round (above 1 = the plan is faster), min / median / max over the rounds, in
wall-clock and in this process's CPU time (`*_cpu`: the steadier one on a shared machine, with one torch
thread), next to the predictions:
- FLOPs (`planned_flops`): the matmuls of the model that runs (the twin has fewer projections) plus the
  attention scores (QK^T and AV) over the keys each query reads: every earlier token for a full KV head, at
  most sinks + recent for a windowed one (a prefill of S tokens: S queries, causal; a decode step: one);
- KV bytes read per decode step: the plan's KV bytes over dense's (a step reads the whole cache).

What a plan keeps (its long-context probe accuracies) depends on which heads it windows, not on how many:
bench/bench_kv_quality.py measures that side for plans made from the heads' scores.
"""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from analysis.arch.adapters import adapter_for, input_device
from analysis.arch.kvcache import kv_cache_bytes
from analysis.arch.models import count_parameters
from analysis.compress.kvruntime import KVPlanModel, kv_plan_model
from analysis.compress.speed import FlopCount, alternating_times, forward_flops
from analysis.compress.surgery import HeadLayout
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, no_progress
from analysis.core.threads import torch_threads
from analysis.measure.evaluation import context_length
from analysis.arch.kvplan import KVPlan
from analysis.arch.window import Window

DENSE = "dense"
KV_RATIO_NOTE = (
    "Ratios are dense over the plan, per round, then the median (min-max over the rounds): above 1 the plan is "
    "faster. Predicted: FLOPs of the model that runs (its projections, MLP and LM head, plus the attention "
    "scores over the keys each query reads: every earlier token for a full KV head, at most sinks + recent for "
    "a windowed one); KV read: the bytes a decode step reads from the cache (all of it), plan over dense.")


def read_keys(tokens: int, context: int, cap: int) -> int:
    """Score entries of `tokens` queries ending a context of `context` tokens, each reading every earlier key
    (itself included) up to `cap` of them: the sum over positions p = context - tokens .. context - 1 of
    min(p + 1, cap)."""
    first, last = context - tokens + 1, context                          # keys read by the first / last query
    top = min(last, cap)
    growing = (first + top) * (top - first + 1) // 2 if top >= first else 0
    return growing + max(0, last - max(first, cap + 1) + 1) * cap


def planned_flops(model: nn.Module, windowed, *, window: Window, tokens: int, context: int,
                  layout: HeadLayout | None = None, logits: int | None = None) -> FlopCount:
    """FLOPs of the last `tokens` tokens of a context of `context` (a prefill: tokens = context; a decode step:
    tokens = 1): the matmuls of `model` (`speed.forward_flops`; `layout`: the twin's, model is then the
    twin) plus the attention scores (QK^T and AV) over the keys each query reads: every earlier token for a
    full KV head, at most sinks + recent for a windowed one (windowed[l][j]), causal (what the kernels compute:
    SDPA's causal prefill skips the masked half). logits: tokens the LM head runs on (a prefill keeping the
    last logits: 1; default every token)."""
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    base = forward_flops(model, tokens, context, layout=layout, adapter=adapter)
    heads = ([g.n_heads] * g.n_layers if layout is None
             else [layout.layer_counts(l)[0] for l in range(layout.n_layers)])
    full, banded = read_keys(tokens, context, context), read_keys(tokens, context, window.size)
    scores = 0
    for l, row in enumerate(windowed):
        row = [bool(w) for w in row]
        if row:
            scores += sum(4 * (banded if w else full) * (heads[l] // len(row)) * g.head_dim for w in row)
    matmul = base.matmul
    if logits is not None:
        head = model.get_output_embeddings()
        matmul -= 2 * (tokens - logits) * (head.weight.numel() if head is not None else 0)
    return FlopCount(matmul=matmul, attention_projections=base.attention_projections, attention_scores=scores)


@dataclass
class _Runner:
    """One row of the comparison: the model that runs, its cache factory, its block (spans), its window."""
    name: str
    model: nn.Module
    cache: Callable[[], object]
    running: Callable[[], object]
    windowed: list                       # [L][Hkv_l] bool: windowed KV heads of the model that runs
    layout: HeadLayout | None
    plan: KVPlan | None
    last: dict = field(default_factory=dict)     # the cache and next token the last prefill left


@dataclass
class KVSpeedReport:
    """The measured comparison at one context (module docstring). rows[0] is dense."""
    context: int
    threads: int
    repeats: int
    decode_steps: int
    rows: list[dict]
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> dict:
        return next(r for r in self.rows if r["name"] == name)

    def as_dict(self) -> dict:
        return asdict(self)


def _runners(model: nn.Module, plans: dict[str, KVPlan], block: int) -> list[_Runner]:
    g = adapter_for(model).geometry(model)
    dense = _Runner(DENSE, model, lambda: None, nullcontext, [[False] * g.n_kv_heads] * g.n_layers, None, None)
    out = [dense]
    for name, plan in plans.items():
        if name == DENSE:
            raise InputError(f"'{DENSE}' is the dense model's row; give the plan another name.")
        planned: KVPlanModel = kv_plan_model(model, plan)
        out.append(_Runner(name, planned.model, lambda p=planned: p.cache(block), planned.running, planned.windowed,
                           planned.layout, plan))
    return out


def _prefill(runner: _Runner, ids: torch.Tensor) -> Callable[[], None]:
    def run():
        out = runner.model(input_ids=ids, past_key_values=runner.cache(), use_cache=True, logits_to_keep=1)
        runner.last = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}   # [B, 1]
    return run


def _decode(runner: _Runner, steps: int) -> Callable[[], tuple[float, float]]:
    """`steps` greedy steps from the cache the runner's last prefill (or decode) left: median (wall, CPU) s."""
    def run() -> tuple[float, float]:
        cache, token = runner.last["cache"], runner.last["token"]
        wall, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            out = runner.model(input_ids=token, past_key_values=cache, use_cache=True)
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
            token = out.logits[:, -1:].argmax(-1)
        runner.last["token"] = token
        return statistics.median(wall), statistics.median(cpu)
    return run


def _spread(times, name: str, clock: str = "wall") -> dict:
    """dense / `name` per round: {"min", "median", "max", "rounds"}."""
    return times.ratio_spread(DENSE, name, clock) if name != DENSE else {"min": 1.0, "median": 1.0, "max": 1.0,
                                                                         "rounds": len(times.wall[DENSE])}


def measure_kv(source, plans: dict[str, KVPlan], *, context: int, decode_steps: int = 8, repeats: int = 3,
               warmup: int = 1, threads: int | None = None, seed: int = 0, block: int = 0,
               progress: Progress | None = None, should_stop: ShouldStop | None = None) -> KVSpeedReport:
    """Dense vs each plan at `context` tokens: KV bytes, prefill and decode time, ratios and predictions (the
    module docstring). `source`: a model or a LoadedModel; it is not changed (each plan runs on its twin)."""
    report = progress or no_progress
    model = source if isinstance(source, nn.Module) else getattr(source, "model", None)
    if not isinstance(model, nn.Module):
        raise InputError(f"measure_kv needs a model (or a loaded model); got {type(source).__name__}.")
    context = check_whole_number(context, "The context", low=2)
    decode_steps = check_whole_number(decode_steps, "The decode steps", low=1)
    repeats = check_whole_number(repeats, "The rounds", low=1)
    warmup = check_whole_number(warmup, "The warm-up rounds", low=0)
    seed = check_seed(seed, "The random ids' seed")
    limit = context_length(model, default=1 << 30)
    needed = context + decode_steps * (warmup + repeats) + 1
    if needed > limit:
        raise InputError(f"A context of {context} tokens (and {needed - context} decoded after it) is longer than "
                         f"this model reads ({limit}); use at most {limit - (needed - context)}.")
    g = adapter_for(model).geometry(model)
    for plan in plans.values():
        plan.check_geometry(g)
    report(0.0, "building the plans' twins")
    runners = _runners(model, plans, block)
    ids = torch.randint(0, int(model.config.get_text_config().vocab_size), (1, context),
                        generator=torch.Generator().manual_seed(seed)).to(input_device(model))   # [1, context]
    dtype_bytes = next(model.parameters()).element_size()
    rows = []
    with torch_threads(threads) as n_threads, ExitStack() as stack:
        for runner in runners:
            stack.enter_context(runner.running())
        report(0.05, f"timing prefill at {context} tokens")
        prefill = alternating_times({r.name: _prefill(r, ids) for r in runners}, repeats=repeats, warmup=warmup,
                                    should_stop=should_stop)
        sizes = {r.name: kv_cache_bytes(r.last["cache"]) for r in runners}
        check_stop(should_stop, "Timing")
        report(0.6, f"timing decode after {context} tokens")
        decode = alternating_times({r.name: _decode(r, decode_steps) for r in runners}, repeats=repeats,
                                   warmup=warmup, should_stop=should_stop, self_timed=True)
        for r in runners:
            r.last = {}
    dense_plan = KVPlan.full(g)
    dense_pre = planned_flops(model, runners[0].windowed, window=Window(), tokens=context, context=context, logits=1)
    dense_dec = planned_flops(model, runners[0].windowed, window=Window(), tokens=1, context=context)
    for r in runners:
        plan = r.plan or dense_plan
        pre = planned_flops(r.model, r.windowed, window=plan.window, tokens=context, context=context,
                            layout=r.layout, logits=1)
        dec = planned_flops(r.model, r.windowed, window=plan.window, tokens=1, context=context, layout=r.layout)
        predicted = plan.kv_bytes(context, head_dim=g.head_dim, dtype_bytes=dtype_bytes)
        rows.append({
            "name": r.name, "plan": "dense" if r.plan is None else plan.describe(), "counts": plan.counts(),
            "sinks": plan.window.sinks if r.plan is not None else None,
            "recent": plan.window.recent if r.plan is not None else None,
            "parameters": count_parameters(r.model),
            "kv_bytes": sizes[r.name], "kv_bytes_predicted": predicted,
            "kv_ratio": sizes[r.name] / sizes[DENSE], "kv_ratio_predicted": plan.kv_ratio(context),
            "prefill_ms": prefill.median_ms("wall")[r.name], "prefill_cpu_ms": prefill.median_ms("cpu")[r.name],
            "decode_ms": decode.median_ms("wall")[r.name], "decode_cpu_ms": decode.median_ms("cpu")[r.name],
            "prefill_speedup": _spread(prefill, r.name), "decode_speedup": _spread(decode, r.name),
            "prefill_speedup_cpu": _spread(prefill, r.name, "cpu"), "decode_speedup_cpu": _spread(decode, r.name, "cpu"),
            "prefill_speedup_predicted": dense_pre.total / pre.total,
            "decode_speedup_predicted": dense_dec.total / dec.total,
            "kv_read_ratio_predicted": plan.kv_ratio(context),
        })
    report(1.0, "done")
    return KVSpeedReport(context=context, threads=n_threads, repeats=repeats, decode_steps=decode_steps, rows=rows,
                         notes=[KV_RATIO_NOTE])
