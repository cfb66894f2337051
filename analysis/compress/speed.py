"""The measured report of a pruned model: size, FLOPs and wall-clock latency, side by side.

For one mask it compares three models in one run: dense, masked (the same dense model with the
`head_mask` hooks: the paper's zeroing, same FLOPs) and physically pruned (`prune_heads`):
- parameters and safetensors file size, before and after;
- FLOPs, counted for the whole forward (every matmul module: attention projections, MLP, LM head;
  plus attention scores QK^T and AV over the full score matrix), with the attention share
  reported separately; the FLOP-predicted speedup is dense FLOPs / pruned FLOPs;
- latency: prefill of 128 / 512 / 1024 tokens (clipped to the model's maximum positions) and
  per-token decode with a KV cache (causal LMs), medians of repeats run in alternating order
  after a warm-up, with a fixed torch thread count;
- the KV-cache effect of the layout (expanded GQA groups cost cache, emptied groups save it).

FLOP conventions: a matmul of an [n, k] input with a [k, m] weight is 2*n*k*m FLOPs. Prefill of
S tokens: 2*S*P_matmul + L*4*S*S*H'*d; decode at context C: 2*P_matmul + L*4*C*H'*d. Embedding
lookups, norms, activations and softmax are not counted (small next to the matmuls).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from analysis.arch.adapters import Adapter, adapter_for, in_memory_copy, input_device, is_dispatched
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.arch.models import count_parameters
from analysis.core.errors import check_seed
from analysis.core.progress import Progress, ShouldStop, check_stop, no_progress
from analysis.core.threads import torch_threads
from analysis.arch.resize import matmul_module_types
from analysis.compress.surgery import HeadLayout, predicted_counts, prune_heads

PREFILL_LENGTHS = (128, 512, 1024)
RATIO_NOTE = (
    "A column 'A vs B (x)' is B's time divided by A's: how many times faster A runs than B, so above 1 "
    "means A is faster and below 1 slower. 'predicted by FLOPs' is dense FLOPs / pruned FLOPs; 'share of "
    "predicted saving' is the measured time saving of pruned over masked divided by the predicted saving "
    "(1.0 = as predicted). The masked model is the dense model plus one Python hook per layer that "
    "multiplies the heads' outputs by their gates: the same FLOPs plus a fixed cost per layer. In a decode "
    "step (one new token) the model's own work is small, so that fixed cost is a large share and masked "
    "decode is slower than dense; the hooks are how the app evaluates a mask, not a way to deploy one.")
VARIANTS = ("dense", "masked", "pruned")


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
# FLOPs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one forward: every matmul module, of which the attention projections, plus the
    attention scores (QK^T and AV)."""
    matmul: int
    attention_projections: int
    attention_scores: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention_scores

    @property
    def attention(self) -> int:
        return self.attention_projections + self.attention_scores


def _matmul_weights(model: nn.Module) -> int:
    """Sum of weight elements over distinct matmul modules (a tied LM head is still a matmul)."""
    types = matmul_module_types()
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, types) and id(module) not in seen:
            seen.add(id(module))
            total += module.weight.numel()
    return total


def _projection_weights(model: nn.Module, adapter: Adapter, n_layers: int) -> int:
    return sum(m.weight.numel() for layer in range(n_layers)
               for m in adapter.projection_modules(model, layer).values())


def _heads_per_layer(adapter: Adapter, model: nn.Module, layout: HeadLayout | None) -> list[int]:
    g = adapter.geometry(model)
    if layout is None:
        return [g.n_heads] * g.n_layers
    return [layout.layer_counts(layer)[0] for layer in range(layout.n_layers)]


def forward_flops(model: nn.Module, tokens: int, context: int, *, layout: HeadLayout | None = None,
                  adapter: Adapter | None = None) -> FlopCount:
    """FLOPs of a forward of `tokens` new tokens attending over `context` keys each.

    Prefill of S tokens: tokens = context = S (the full score matrix, as eager and SDPA's math
    kernel compute it). Decode of one token at context C: tokens = 1, context = C. `layout`: the
    pruned model's head layout (`model` is then the pruned model)."""
    adapter = adapter or adapter_for(model)
    g = adapter.geometry(model)
    heads = _heads_per_layer(adapter, model, layout)
    scores = sum(4 * tokens * context * h * g.head_dim for h in heads)      # QK^T and AV, 2 FLOPs per MAC
    return FlopCount(matmul=2 * tokens * _matmul_weights(model),
                     attention_projections=2 * tokens * _projection_weights(model, adapter, g.n_layers),
                     attention_scores=scores)


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
                      should_stop: ShouldStop | None = None, self_timed: bool = False) -> Timings:
    """Time each named callable: `warmup` untimed rounds, then `repeats` rounds in which every
    callable runs once, the order rotating each round (so drift hits all alike).
    self_timed=True: each callable times itself and returns (wall, CPU) seconds (a decode step
    whose prefill must stay outside the time: `decode_step`)."""
    names = list(calls)
    with torch.inference_mode():
        for _ in range(warmup):
            for name in names:
                calls[name]()
        wall = {name: [] for name in names}
        cpu = {name: [] for name in names}
        for r in range(repeats):
            check_stop(should_stop, "Timing")
            for name in names[r % len(names):] + names[:r % len(names)]:
                start, start_cpu = time.perf_counter(), time.process_time()
                out = calls[name]()
                spent = out if self_timed else (time.perf_counter() - start, time.process_time() - start_cpu)
                wall[name].append(spent[0])
                cpu[name].append(spent[1])
    return Timings(wall, cpu)


def _plain(fn: Callable[[], object]) -> Callable[[], object]:
    return fn


# device type -> wait for its queued kernels (a GPU call returns before its work is done)
_SYNCHRONIZE: dict[str, Callable[[], None]] = {"cuda": lambda: torch.cuda.synchronize(),
                                               "mps": lambda: torch.mps.synchronize()}


def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """`fn`, then a wait for the device's kernels, so a timing covers the work (no-op on the CPU)."""
    sync = _SYNCHRONIZE.get(device.type)
    if sync is None:
        return fn

    def run():
        out = fn()
        sync()
        return out
    return run


def masked_call(model: nn.Module, gates: torch.Tensor, fn: Callable[[], object],
                adapter: Adapter | None = None) -> Callable[[], object]:
    """`fn` run with the head-mask hooks installed on `model` (removed after every call, so the
    same model also serves as the dense one). Installing L hooks costs microseconds."""
    def run():
        with head_mask(model, gates, adapter=adapter):
            return fn()
    return run


def decode_step(model: nn.Module, prompt: torch.Tensor, steps: int) -> Callable[[], tuple[float, float]]:
    """A callable that prefills `prompt` (untimed) and returns the median (wall, CPU) seconds per
    decode step."""
    sync = _SYNCHRONIZE.get(prompt.device.type, lambda: None)

    def run() -> tuple[float, float]:
        out = model(input_ids=prompt, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)     # [B, 1]
        wall, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            sync()
            cpu.append(time.process_time() - start_cpu)
            wall.append(time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return statistics.median(wall), statistics.median(cpu)
    return run


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def saving_ratio(measured_speedup: float, predicted_speedup: float) -> float:
    """Measured time saving (1 - 1/measured) over the predicted saving (1 - 1/predicted)."""
    predicted = 1.0 - 1.0 / predicted_speedup
    return (1.0 - 1.0 / measured_speedup) / predicted if predicted > 0 else float("nan")


@dataclass
class SpeedReport:
    """Everything measured for one mask. Latencies are medians in milliseconds."""
    threads: int
    repeats: int
    parameters: dict[str, int]                  # dense / pruned
    file_bytes: dict[str, int]                  # dense / pruned
    attention_parameters: dict[str, int]        # dense / pruned (Q/K/V/O weights)
    flops: dict[str, dict[str, int]]            # "prefill@S" / "decode@C" -> dense / pruned totals
    attention_flops: dict[str, dict[str, int]]  # same keys, attention share only
    latency_ms: dict[str, dict[str, float]]     # "prefill@S" / "decode@C" -> variant -> wall ms
    cpu_ms: dict[str, dict[str, float]]         # same, process CPU time (steadier on a busy machine)
    kv_cache: dict
    heads_pruned: int
    heads_total: int
    skipped: list[str] = field(default_factory=list)
    predicted: dict = field(default_factory=dict)  # masks.SurgeryCounts of the mask: what the Prune page showed

    def predicted_speedup(self, key: str) -> float:
        """Dense FLOPs / pruned FLOPs (what a perfect implementation would gain)."""
        f = self.flops[key]
        return f["dense"] / f["pruned"]

    def measured_speedup(self, key: str, baseline: str = "masked", variant: str = "pruned",
                         clock: str = "wall") -> float:
        ms = (self.latency_ms if clock == "wall" else self.cpu_ms)[key]
        return ms[baseline] / ms[variant]

    def saving_ratio(self, key: str, clock: str = "wall") -> float:
        """Measured time saving of pruned over masked / FLOP-predicted saving (1.0 = as predicted)."""
        return saving_ratio(self.measured_speedup(key, clock=clock), self.predicted_speedup(key))

    def rows(self) -> list[dict]:
        """One row per measured setting, for a table (ratios explained by `RATIO_NOTE`)."""
        out = []
        for key, ms in self.latency_ms.items():
            out.append({"setting": key, **{f"{v} ms": round(ms[v], 2) for v in VARIANTS if v in ms},
                        "pruned vs masked (x)": round(self.measured_speedup(key), 3),
                        "predicted by FLOPs (x)": round(self.predicted_speedup(key), 3),
                        "share of predicted saving": round(self.saving_ratio(key), 3),
                        "pruned vs masked, CPU time (x)": round(self.measured_speedup(key, clock="cpu"), 3),
                        "masked vs dense (x)": round(self.measured_speedup(key, "dense", "masked"), 3)})
        return out

    def as_dict(self) -> dict:
        return asdict(self)


def measure(model: nn.Module, pruned, *, kv_policy: str = "auto", prefill: tuple[int, ...] = PREFILL_LENGTHS,
            decode_context: int = 128, decode_steps: int = 8, repeats: int = 5, warmup: int = 1,
            threads: int | None = None, batch: int = 1, seed: int = 0, measure_files: bool = True,
            progress: Progress | None = None, should_stop: ShouldStop | None = None) -> SpeedReport:
    """Measure dense vs masked vs physically pruned for the mask `pruned` [L, H] (see module doc).

    `model` is not changed (the mask hooks are removed after each call; surgery builds a twin that
    shares its untouched weights, only run forward here)."""
    report = progress or no_progress
    seed = check_seed(seed, "The random ids' seed")
    adapter = adapter_for(model)
    g = adapter.geometry(model)
    report(0.0, "physically pruning a copy")
    smaller, layout = prune_heads(model, pruned, adapter=adapter, kv_policy=kv_policy)
    predicted = predicted_counts(model, pruned, kv_policy=kv_policy, seq_len=min(prefill, default=128), adapter=adapter)
    gates = gates_from_mask(pruned)                                           # [L, H]
    cfg = model.config.get_text_config()
    max_positions = int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or 1 << 30)
    lengths = [s for s in prefill if s <= max_positions]
    skipped = [f"prefill@{s} (model max positions {max_positions})" for s in prefill if s > max_positions]
    causal = bool(getattr(model, "can_generate", lambda: False)())
    gen = torch.Generator().manual_seed(seed)
    vocab = int(cfg.vocab_size)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, n), generator=gen).to(input_device(model))  # [batch, n]

    models = {"dense": model, "masked": model, "pruned": smaller}
    wrap = {"dense": _plain, "masked": lambda fn: masked_call(model, gates, fn, adapter), "pruned": _plain}
    latency, latency_cpu, flops, attn_flops = {}, {}, {}, {}
    settings = [(f"prefill@{s}", s) for s in lengths]
    if causal and decode_context + decode_steps + 1 <= max_positions:
        settings.append((f"decode@{decode_context}", decode_context))
    elif causal:
        skipped.append(f"decode@{decode_context} (model max positions {max_positions})")
    with torch_threads(threads) as n_threads:
        for i, (key, n) in enumerate(settings):
            report(0.1 + 0.8 * i / len(settings), f"timing {key}")
            inputs = ids(n)
            if key.startswith("prefill"):
                calls = {name: synchronized(wrap[name](lambda m=m: m(input_ids=inputs)), inputs.device)
                         for name, m in models.items()}
                times = alternating_times(calls, repeats=repeats, warmup=warmup, should_stop=should_stop)
                latency[key] = times.median_ms("wall")
                latency_cpu[key] = times.median_ms("cpu")
                dense_f = forward_flops(model, n, n, adapter=adapter)
                small_f = forward_flops(smaller, n, n, layout=layout, adapter=adapter)
            else:
                steps = {name: wrap[name](decode_step(m, inputs, decode_steps)) for name, m in models.items()}
                times = alternating_times(steps, repeats=repeats, warmup=warmup, should_stop=should_stop,
                                          self_timed=True)
                latency[key] = times.median_ms("wall")
                latency_cpu[key] = times.median_ms("cpu")
                dense_f = forward_flops(model, 1, n, adapter=adapter)
                small_f = forward_flops(smaller, 1, n, layout=layout, adapter=adapter)
            flops[key] = {"dense": dense_f.total, "pruned": small_f.total}
            attn_flops[key] = {"dense": dense_f.attention, "pruned": small_f.attention}
    report(0.9, "measuring file sizes")
    files = ({"dense": saved_bytes(model), "pruned": saved_bytes(smaller)} if measure_files else {})
    report(1.0, "done")
    return SpeedReport(
        threads=n_threads, repeats=repeats,
        parameters={"dense": count_parameters(model), "pruned": count_parameters(smaller)},
        file_bytes=files,
        attention_parameters={"dense": _projection_weights(model, adapter, g.n_layers),
                              "pruned": _projection_weights(smaller, adapter, g.n_layers)},
        flops=flops, attention_flops=attn_flops, latency_ms=latency, cpu_ms=latency_cpu,
        kv_cache=layout.kv_cache_report(),
        heads_pruned=int(np.asarray(pruned, bool).sum()), heads_total=g.n_total_heads, skipped=skipped,
        predicted=predicted.as_dict())
