"""The measured side of a cut: sizes and wall-clock / CPU times of dense and the cut, side by side in one run, next
to what analysis.compress.cost predicts.

Two reports share one way of timing:
- `measure(model, cut)`: one cut of any kind (a mask, a KV plan, a model of its own) against dense. Its variants:
  "dense"; "masked", the cut on the dense model as every quality report runs it (`cut.running`: the head gates,
  or the plan's masked path with its compact cache; absent for a model of its own); "pruned", its deployable form
  (analysis.compress.kvruntime.physical: surgery's twin of a mask, the plan's twin with its compact cache, or the
  model of its own as it is). Parameters and safetensors bytes before / after, FLOPs (counted), the prefill of
  each length and a decode step, and the real KV bytes each variant's cache holds after the decode context;
- `measure_kv(model, {name: plan}, context=...)`: dense against each plan's twin at one context, a row each with
  its KV bytes (real and predicted), prefill and decode times and their per-round ratio spreads in wall and CPU
  time, next to the predictions (what bench/bench_kv_policies.py writes).

How it times (`alternating_times`): `warmup` untimed rounds, then `repeats` rounds in which every variant runs
once, the order rotating each round (drift hits all alike), with a fixed torch thread count; every time is read
through analysis.core.clock.Clock, after the device finished its kernels (CUDA / MPS synchronized). A prefill is
what a generation runs on a causal LM (the prompt into the variant's own new cache, the LM head on the last token:
analysis.measure.decode.prefill) and a whole forward on an encoder. A decode step (`DecodeSteps`) runs the one
decode loop (analysis.measure.decode.decode) with its clock: the prompt is prefilled once, untimed; each round
decodes `steps` tokens from a copy of that cache (so every round reads the same context) and keeps the median of
its steps' forwards. Ratios are taken per round, then their min / median / max (`Timings.ratio_spread`): load
that drifts between rounds cancels out.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from analysis.arch.adapters import adapter_for, in_memory_copy, input_device, is_dispatched
from analysis.arch.cut import Cut, checked, running
from analysis.arch.kvcache import kv_cache_bytes
from analysis.arch.kvplan import KVPlan
from analysis.arch.models import count_parameters, model_kind
from analysis.compress.cost import FLOP_NOTE, attention_weights, cut_flops, kv_bytes, predict
from analysis.compress.kvruntime import physical
from analysis.compress.surgery import predicted_counts
from analysis.core.clock import Clock
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, no_progress
from analysis.core.threads import torch_threads
from analysis.measure import decode as decoding
from analysis.measure.evaluation import context_length

PREFILL_LENGTHS = (128, 512, 1024)
VARIANTS = ("dense", "masked", "pruned")
DENSE = "dense"
RATIO_NOTE = (
    "A column 'A vs B (x)' is B's time divided by A's: how many times faster A runs than B, so above 1 "
    "means A is faster and below 1 slower. 'predicted by FLOPs' is dense FLOPs / pruned FLOPs; 'share of "
    "predicted saving' is the measured time saving of pruned over its baseline (masked, or dense for a model of "
    "its own) divided by the predicted saving (1.0 = as predicted). The masked model is the dense model under the "
    "cut as the quality reports run it: for a mask one Python hook per layer that multiplies the heads' outputs by "
    "their gates (the same FLOPs plus a fixed cost per layer), for a KV plan the gates and the windows' kernel. In "
    "a decode step (one new token) the model's own work is small, so that fixed cost is a large share and masked "
    "decode is slower than dense; the masked path is how the app evaluates a cut, not a way to deploy one.")
KV_RATIO_NOTE = (
    "Ratios are dense over the plan, per round, then the median (min-max over the rounds): above 1 the plan is "
    "faster. Predicted: FLOPs of the model that runs (its projections, MLP and LM head, plus the attention "
    "scores over the keys each query reads: every earlier token for a full KV head, at most sinks + recent for "
    "a windowed one); KV read: the bytes a decode step reads from the cache (all of it), plan over dense.")


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------

def saved_bytes(model: nn.Module) -> int:
    """Size of the model's weights written as one safetensors file (tied tensors stored once); a
    dispatched / offloaded model is gathered into memory for it."""
    from safetensors.torch import save_model
    model = in_memory_copy(model) if is_dispatched(model) else model
    with tempfile.TemporaryDirectory(prefix="headscope-size-") as folder:
        path = Path(folder) / "model.safetensors"
        save_model(model, str(path))
        return path.stat().st_size


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

@dataclass
class Timings:
    """Seconds per call, per name, one entry per round: wall clock and this process's CPU time.

    CPU time is the steadier measure on a machine shared with other work (time spent
    descheduled is not counted); with one torch thread it equals wall time on an idle machine."""
    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]

    def median_ms(self, clock: str = "wall") -> dict[str, float]:
        return {name: 1e3 * statistics.median(t) for name, t in getattr(self, clock).items()}

    def paired_ratio(self, numerator: str, denominator: str, clock: str = "wall") -> float:
        """Median over rounds of time(numerator) / time(denominator) within the same round:
        load that drifts between rounds cancels out."""
        return self.ratio_spread(numerator, denominator, clock)["median"]

    def ratio_spread(self, numerator: str, denominator: str, clock: str = "wall") -> dict[str, float]:
        """{"min", "median", "max", "rounds"} of the per-round ratios time(numerator) / time(denominator):
        what a bench prints so a reader sees how far one ratio can be trusted (issue 25 part 3)."""
        t = getattr(self, clock)
        ratios = [a / b for a, b in zip(t[numerator], t[denominator])]
        return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios), "rounds": len(ratios)}


def alternating_times(calls: dict[str, Callable[[], object]], *, repeats: int = 5, warmup: int = 1,
                      should_stop: ShouldStop | None = None, self_timed: bool = False, device="cpu") -> Timings:
    """Time each named callable: `warmup` untimed rounds, then `repeats` rounds in which every
    callable runs once, the order rotating each round (so drift hits all alike). Times are read with
    analysis.core.clock.Clock(device): after `device` finished the call's kernels.
    self_timed=True: each callable times itself and returns (wall, CPU) seconds (a decode step
    whose prefill must stay outside the time: `DecodeSteps`)."""
    names = list(calls)
    clock = Clock(device)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                calls[name]()
        wall = {name: [] for name in names}
        cpu = {name: [] for name in names}
        for r in range(repeats):
            check_stop(should_stop, "Timing")
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = None if self_timed else clock.now()
                out = calls[name]()
                spent = out if self_timed else clock.since(start)
                wall[name].append(spent[0])
                cpu[name].append(spent[1])
    return Timings(wall, cpu)


class DecodeSteps:
    """A self-timed callable for `alternating_times(self_timed=True)`: `steps` greedy decode calls after the prompt
    ids [B, T] through the one decode loop (analysis.measure.decode) with its clock; returns the median (wall, CPU)
    seconds of one call's forward. The prompt is prefilled once, untimed, at the first call into `new_cache()`
    (None: the model's own cache); every call decodes from a copy of that cache, so each reads the same context.
    Call it where the model runs (inside its cut's `running()`)."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, steps: int, *,
                 new_cache: Callable[[], object] = lambda: None):
        self.model, self.prompt, self.new_cache = model, prompt, new_cache             # prompt [B, T]
        self.steps = check_whole_number(steps, "The decode steps")
        self.clock = Clock(input_device(model))
        self.prefilled: tuple[torch.Tensor, object] | None = None       # (the prompt's last logits [B, V], its cache)

    @property
    def cache(self):
        """The cache the prompt's prefill left (None before the first call)."""
        return None if self.prefilled is None else self.prefilled[1]

    def __call__(self) -> tuple[float, float]:
        if self.prefilled is None:
            self.prefilled = decoding.prefill(self.model, self.prompt, cache=self.new_cache())
        last, cache = self.prefilled
        run = decoding.decode(self.model, last, copy.deepcopy(cache), self.steps + 1, clock=self.clock,
                              keep_logits=False)
        walls, cpus = zip(*run.step_seconds)
        return statistics.median(walls), statistics.median(cpus)


def cut_call(cut: Cut | None, dense: nn.Module, fn: Callable[[nn.Module], object]) -> Callable[[], object]:
    """A callable that runs fn(the module to call) inside `cut.running(dense)` (entered and left at every call, so
    the dense model also serves as dense; None: the dense model as it is). Installing the gates costs microseconds."""
    def run():
        with running(cut, dense) as model:
            return fn(model)
    return run


def saving_ratio(measured_speedup: float, predicted_speedup: float) -> float:
    """Measured time saving (1 - 1/measured) over the predicted saving (1 - 1/predicted)."""
    predicted = 1.0 - 1.0 / predicted_speedup
    return (1.0 - 1.0 / measured_speedup) / predicted if predicted > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# Variants: what is timed side by side
# ---------------------------------------------------------------------------------------------

@dataclass
class Variant:
    """One timed side: a name and the cut it runs on the dense model (None: dense; a model of its own: its model)."""
    name: str
    cut: Cut | None
    decode: DecodeSteps | None = None

    @property
    def own(self) -> bool:
        """Whether it runs a module of its own (its `running()` is entered once for the whole measurement)."""
        return self.cut is not None and self.cut.kind == "model"

    def new_cache(self, block: int = 0):
        return None if self.cut is None else self.cut.new_cache(block=block)


@contextmanager
def _entered(variants: list[Variant], dense: nn.Module) -> Iterator[dict]:
    """{name: the module to call}, with the running() of every variant that owns its module entered for the block;
    a variant on the dense model enters its cut at every call (`_call`)."""
    with ExitStack() as stack:
        yield {v.name: stack.enter_context(v.cut.running(dense)) if v.own else dense for v in variants}


def _call(v: Variant, dense: nn.Module, module: nn.Module, fn: Callable[[nn.Module], object]) -> Callable[[], object]:
    return (lambda: fn(module)) if v.own else cut_call(v.cut, dense, fn)


def _prefill_calls(variants, dense, modules, ids, causal: bool, block: int) -> dict[str, Callable[[], object]]:
    """name -> one prefill of ids: a generation's (into the variant's new cache, the last token's logits) on a
    causal LM, a whole forward otherwise."""
    def make(v: Variant):
        if causal:
            return _call(v, dense, modules[v.name], lambda m: decoding.prefill(m, ids, cache=v.new_cache(block)))
        return _call(v, dense, modules[v.name], lambda m: m(input_ids=ids))
    return {v.name: make(v) for v in variants}


def _decode_calls(variants, dense, modules, ids, steps: int, block: int) -> dict[str, Callable[[], object]]:
    """name -> a self-timed DecodeSteps after ids (kept on the variant: its prefilled cache is read after)."""
    out = {}
    for v in variants:
        v.decode = DecodeSteps(modules[v.name], ids, steps, new_cache=lambda v=v: v.new_cache(block))
        out[v.name] = _call(v, dense, modules[v.name], lambda m, v=v: v.decode())
    return out


def _checked_model(source) -> nn.Module:
    model = source if isinstance(source, nn.Module) else getattr(source, "model", None)   # a LoadedModel's
    if not isinstance(model, nn.Module):
        raise InputError(f"The speed report needs a model (or a loaded model); got {type(source).__name__}.")
    return model


# ---------------------------------------------------------------------------------------------
# One cut against dense
# ---------------------------------------------------------------------------------------------

@dataclass
class SpeedReport:
    """Everything measured for one cut (module docstring). Latencies are medians in milliseconds."""
    cut: dict                                   # the cut's as_dict()
    threads: int
    repeats: int
    decode_steps: int
    variants: list                              # the variants timed ("dense", ["masked",] "pruned")
    parameters: dict[str, int]                  # dense / pruned
    file_bytes: dict[str, int]                  # dense / pruned
    attention_parameters: dict[str, int]        # dense / pruned (Q/K/V/O weights)
    flops: dict[str, dict[str, int]]            # "prefill@S" / "decode@C" -> dense / pruned totals (counted)
    attention_flops: dict[str, dict[str, int]]  # same keys, attention share only
    latency_ms: dict[str, dict[str, float]]     # "prefill@S" / "decode@C" -> variant -> wall ms
    cpu_ms: dict[str, dict[str, float]]         # same, process CPU time (steadier on a busy machine)
    kv_bytes: dict[str, int]                    # variant -> the real K / V bytes of its cache after decode@C's prompt
    kv_bytes_predicted: dict[str, int | None]   # dense / pruned: analysis.compress.cost.kv_bytes
    heads_pruned: int
    heads_total: int
    skipped: list[str] = field(default_factory=list)
    predicted: dict = field(default_factory=dict)  # a mask's masks.SurgeryCounts: what the Prune page showed
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> str:
        """What the pruned model is compared with: the masked model (same weights, gates), else dense."""
        return "masked" if "masked" in self.variants else DENSE

    def predicted_speedup(self, key: str) -> float:
        """Dense FLOPs / pruned FLOPs (what a perfect implementation would gain)."""
        f = self.flops[key]
        return f["dense"] / f["pruned"]

    def measured_speedup(self, key: str, baseline: str | None = None, variant: str = "pruned",
                         clock: str = "wall") -> float:
        ms = (self.latency_ms if clock == "wall" else self.cpu_ms)[key]
        return ms[baseline or self.baseline] / ms[variant]

    def saving_ratio(self, key: str, clock: str = "wall") -> float:
        """Measured time saving of pruned over its baseline / FLOP-predicted saving (1.0 = as predicted)."""
        return saving_ratio(self.measured_speedup(key, clock=clock), self.predicted_speedup(key))

    def rows(self) -> list[dict]:
        """One row per measured setting, for a table (ratios explained by `RATIO_NOTE`)."""
        base = self.baseline
        out = []
        for key, ms in self.latency_ms.items():
            row = {"setting": key, **{f"{v} ms": round(ms[v], 2) for v in VARIANTS if v in ms},
                   f"pruned vs {base} (x)": round(self.measured_speedup(key), 3),
                   "predicted by FLOPs (x)": round(self.predicted_speedup(key), 3),
                   "share of predicted saving": round(self.saving_ratio(key), 3),
                   f"pruned vs {base}, CPU time (x)": round(self.measured_speedup(key, clock="cpu"), 3)}
            if base == "masked":
                row["masked vs dense (x)"] = round(self.measured_speedup(key, DENSE, "masked"), 3)
            out.append(row)
        return out

    def as_dict(self) -> dict:
        return asdict(self)


def measure(model: nn.Module, cut: Cut, *, kv_policy: str = "auto", prefill: tuple[int, ...] = PREFILL_LENGTHS,
            decode_context: int = 128, decode_steps: int = 8, repeats: int = 5, warmup: int = 1,
            threads: int | None = None, batch: int = 1, seed: int = 0, measure_files: bool = True, block: int = 0,
            progress: Progress | None = None, should_stop: ShouldStop | None = None) -> SpeedReport:
    """Measure dense vs the cut on the dense model ("masked") vs its deployable form ("pruned") for `cut` (a Cut of
    any kind; module docstring): a prefill of each length in `prefill` and, on a causal LM, `decode_steps` decode
    steps after `decode_context` tokens. kv_policy: how surgery cuts a mask; block: queries per block of a compact
    cache's banded prefill (0: its default). `model` is not changed (the cut's hooks are removed after each call;
    its twin shares the untouched weights and only runs forward)."""
    report = progress or no_progress
    seed = check_seed(seed, "The random ids' seed")               # the settings first, before any model work
    decode_steps = check_whole_number(decode_steps, "The decode steps", low=1)
    decode_context = check_whole_number(decode_context, "The decode context", low=1)
    repeats = check_whole_number(repeats, "The rounds", low=1)
    warmup = check_whole_number(warmup, "The warm-up rounds", low=0)
    batch = check_whole_number(batch, "The batch size", low=1)
    prefill = tuple(check_whole_number(s, "A prefill length", low=1) for s in prefill)
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    cut = checked(cut, g, required=True)
    report(0.0, "building the deployable form of the cut")
    deployed = physical(cut, model, kv_policy=kv_policy)
    variants = [Variant(DENSE, None)] + ([] if cut.kind == "model" else [Variant("masked", cut)]) + \
        [Variant("pruned", deployed)]
    smaller = deployed.model
    limit = context_length(model, default=1 << 30)
    lengths = [s for s in prefill if s <= limit]
    skipped = [f"prefill@{s} (model max positions {limit})" for s in prefill if s > limit]
    causal = model_kind(model) == "causal-lm"
    logits = 1 if causal else None                     # what a prefill computes the LM head on (cost.FLOP_NOTE)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.get_text_config().vocab_size)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, n), generator=gen).to(input_device(model))  # [batch, n]

    settings = [(f"prefill@{s}", s) for s in lengths]
    if causal and decode_context + decode_steps <= limit:
        settings.append((f"decode@{decode_context}", decode_context))
    elif causal:
        skipped.append(f"decode@{decode_context} (model max positions {limit})")
    latency, latency_cpu, flops, attn_flops, sizes = {}, {}, {}, {}, {}
    with torch_threads(threads) as n_threads, _entered(variants, model) as modules:
        for i, (key, n) in enumerate(settings):
            report(0.1 + 0.8 * i / len(settings), f"timing {key}")
            inputs = ids(n)
            if key.startswith("prefill"):
                times = alternating_times(_prefill_calls(variants, model, modules, inputs, causal, block),
                                          repeats=repeats, warmup=warmup, should_stop=should_stop,
                                          device=inputs.device)
                dense_f = cut_flops(model, None, n, n, logits=logits, adapter=adapter)
                small_f = cut_flops(model, deployed, n, n, logits=logits, adapter=adapter)
            else:
                times = alternating_times(_decode_calls(variants, model, modules, inputs, decode_steps, block),
                                          repeats=repeats, warmup=warmup, should_stop=should_stop,
                                          self_timed=True, device=inputs.device)
                sizes = {v.name: kv_cache_bytes(v.decode.cache) for v in variants}
                dense_f = cut_flops(model, None, 1, n, adapter=adapter)
                small_f = cut_flops(model, deployed, 1, n, adapter=adapter)
            latency[key] = times.median_ms("wall")
            latency_cpu[key] = times.median_ms("cpu")
            flops[key] = {"dense": dense_f.total, "pruned": small_f.total}
            attn_flops[key] = {"dense": dense_f.attention, "pruned": small_f.attention}
        for v in variants:
            v.decode = None
    report(0.9, "measuring file sizes")
    files = ({"dense": saved_bytes(model), "pruned": saved_bytes(smaller)} if measure_files else {})
    report(1.0, "done")
    predicted = ({} if cut.kind != "mask" else
                 predicted_counts(model, cut.mask, kv_policy=kv_policy, seq_len=min(prefill, default=128),
                                  adapter=adapter).as_dict())
    kept = sum(adapter.query_heads(smaller))
    return SpeedReport(
        cut=cut.as_dict(), threads=n_threads, repeats=repeats, decode_steps=decode_steps,
        variants=[v.name for v in variants],
        parameters={"dense": count_parameters(model), "pruned": count_parameters(smaller)},
        file_bytes=files,
        attention_parameters={"dense": attention_weights(model, adapter), "pruned": attention_weights(smaller)},
        flops=flops, attention_flops=attn_flops, latency_ms=latency, cpu_ms=latency_cpu, kv_bytes=sizes,
        kv_bytes_predicted=({} if not sizes else
                            {"dense": kv_bytes(model, None, decode_context, adapter=adapter),
                             "pruned": kv_bytes(model, cut, decode_context, kv_policy=kv_policy, adapter=adapter)}),
        heads_pruned=g.n_total_heads - kept if cut.mask is None else int(cut.mask.sum()),
        heads_total=g.n_total_heads, skipped=skipped, predicted=predicted, notes=[RATIO_NOTE, FLOP_NOTE])


# ---------------------------------------------------------------------------------------------
# Many KV plans against dense (the benches)
# ---------------------------------------------------------------------------------------------

@dataclass
class KVSpeedReport:
    """dense against each plan's twin at one context (module docstring). rows[0] is dense."""
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


def _spread(times: Timings, name: str, clock: str = "wall") -> dict:
    """dense / `name` per round: {"min", "median", "max", "rounds"}."""
    return times.ratio_spread(DENSE, name, clock) if name != DENSE else {"min": 1.0, "median": 1.0, "max": 1.0,
                                                                         "rounds": len(times.wall[DENSE])}


def measure_kv(source, plans: dict[str, KVPlan], *, context: int, decode_steps: int = 8, repeats: int = 3,
               warmup: int = 1, threads: int | None = None, seed: int = 0, block: int = 0,
               progress: Progress | None = None, should_stop: ShouldStop | None = None) -> KVSpeedReport:
    """Dense vs each plan's twin (`physical(Cut.of_plan(plan))`: surgery without the pruned KV heads, its windows, its
    compact cache) at `context` tokens: KV bytes, prefill and decode time, ratios and predictions (module
    docstring). `source`: a model or a LoadedModel; it is not changed."""
    report = progress or no_progress
    model = _checked_model(source)
    context = check_whole_number(context, "The context", low=2)
    decode_steps = check_whole_number(decode_steps, "The decode steps", low=1)
    repeats = check_whole_number(repeats, "The rounds", low=1)
    warmup = check_whole_number(warmup, "The warm-up rounds", low=0)
    seed = check_seed(seed, "The random ids' seed")
    limit = context_length(model, default=1 << 30)
    if context + decode_steps > limit:
        raise InputError(f"A context of {context} tokens (and {decode_steps} decoded after it) is longer than this "
                         f"model reads ({limit}); use at most {limit - decode_steps}.")
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    for name, plan in plans.items():
        if name == DENSE:
            raise InputError(f"'{DENSE}' is the dense model's row; give the plan another name.")
        plan.check_geometry(g)
    report(0.0, "building the plans' twins")
    cuts = {name: Cut.of_plan(plan, {"name": name}) for name, plan in plans.items()}
    variants = [Variant(DENSE, None)] + [Variant(name, physical(c, model)) for name, c in cuts.items()]
    ids = torch.randint(0, int(model.config.get_text_config().vocab_size), (1, context),
                        generator=torch.Generator().manual_seed(seed)).to(input_device(model))   # [1, context]
    dtype_bytes = next(model.parameters()).element_size()
    with torch_threads(threads) as n_threads, _entered(variants, model) as modules:
        report(0.05, f"timing prefill at {context} tokens")
        pre = alternating_times(_prefill_calls(variants, model, modules, ids, True, block), repeats=repeats,
                                warmup=warmup, should_stop=should_stop, device=ids.device)
        check_stop(should_stop, "Timing")
        report(0.6, f"timing decode after {context} tokens")
        dec = alternating_times(_decode_calls(variants, model, modules, ids, decode_steps, block), repeats=repeats,
                                warmup=warmup, should_stop=should_stop, self_timed=True, device=ids.device)
        sizes = {v.name: kv_cache_bytes(v.decode.cache) for v in variants}
        for v in variants:
            v.decode = None
    rows = []
    for v in variants:
        plan = plans.get(v.name) or KVPlan.full(g)
        p = predict(model, cuts.get(v.name) or Cut.of_plan(plan), context, dtype_bytes=dtype_bytes, adapter=adapter)
        own = v.name != DENSE
        rows.append({
            "name": v.name, "plan": plan.describe() if own else "dense", "counts": plan.counts(),
            "sinks": plan.window.sinks if own else None, "recent": plan.window.recent if own else None,
            "parameters": count_parameters(v.cut.model if own else model),
            "kv_bytes": sizes[v.name], "kv_bytes_predicted": p.cut.kv_bytes,
            "kv_ratio": sizes[v.name] / sizes[DENSE], "kv_ratio_predicted": plan.kv_ratio(context),
            "prefill_ms": pre.median_ms("wall")[v.name], "prefill_cpu_ms": pre.median_ms("cpu")[v.name],
            "decode_ms": dec.median_ms("wall")[v.name], "decode_cpu_ms": dec.median_ms("cpu")[v.name],
            "prefill_speedup": _spread(pre, v.name), "decode_speedup": _spread(dec, v.name),
            "prefill_speedup_cpu": _spread(pre, v.name, "cpu"), "decode_speedup_cpu": _spread(dec, v.name, "cpu"),
            "prefill_speedup_predicted": p.ratio("prefill_flops"),
            "decode_speedup_predicted": p.ratio("decode_flops"),
            "kv_read_ratio_predicted": plan.kv_ratio(context),
        })
    report(1.0, "done")
    return KVSpeedReport(context=context, threads=n_threads, repeats=repeats, decode_steps=decode_steps, rows=rows,
                         notes=[KV_RATIO_NOTE, FLOP_NOTE])
