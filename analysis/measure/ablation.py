"""Single-head ablation sweeps: the loss change when each head alone is removed (the oracle).

For every head (l, h) of a causal LM: delta[l, h] = loss(head removed) - loss(dense), with
loss = mean next-token NLL over the same token sequences; for GQA models also every KV group
removed at once (all G query heads of the group, which also empties its K/V rows).

`FastAblation.sweep` exploits that the hidden states entering layer l are the same for every
ablation inside layers >= l:
1. one dense pass captures, for every decoder layer, the exact positional args/kwargs it was
   called with (hidden states, attention mask, rotary embeddings, ... whatever the family
   passes: a forward pre-hook with_kwargs, so no family-specific code);
2. for layer l, layers l..L-1 run once on a batch holding one copy of the cached input per
   ablation (gate rows [R, L, H] through `head_mask`; every captured tensor with a batch
   dimension is repeated R times, mask-major);
3. the "tail" after the last layer (final norm, LM head) is found generically by following
   the last layer's output tensor through the modules it feeds during the dense pass, and
   checked against the model's own logits; a model whose tail cannot be replayed exactly
   (logit soft-capping, ...) falls back to the naive loop (`AblationResult.method` says so).

`naive_sweep` is the reference: one full masked forward per head. Both take ids [n, T].

What is read after the last layer is a readout (`LossReadout`, the default: summed next-token NLL per
sequence; the capability probes pass theirs, analysis.measure.probes.circuit): per-unit sums whose
total over `readout.total(x)` is the metric, so `AblationResult.unit_delta` gives every unit's change
(a bootstrap over units gives CIs of a head's effect).
The LM head's cost (one vocabulary projection per ablation) cannot be shared; `timings` says
where time went.

Multi-process (`team`, analysis.core.distributed): every process runs the dense pass, then the layers
are split (the fast sweep's work per layer is L - l layer passes: heaviest first to the least
loaded process); each layer's deltas are computed exactly as in one process and gathered in
layer order, so the result is the single-process one number for number.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from analysis.arch.hooks import attached
from analysis.measure.tokens import as_sequences, text_sequences
from analysis.arch.adapters import adapter_for, input_device
from analysis.core.distributed import SOLO, Team
from analysis.core.errors import InputError, check_whole_number
from analysis.core.text import MAX_TOKENS_LIMIT, check_max_tokens
from analysis.measure.evaluation import default_text, evaluator_for, gate_batch
from analysis.arch.geometry import HeadGeometry
from analysis.arch.head_gates import head_mask
from analysis.measure.loss import summed_nll
from analysis.core.progress import Progress, ShouldStop, check_stop, report

TAIL_BYTES = 64 * 2**20   # logits memory per tail chunk


@dataclass(frozen=True)
class AblationResult:
    """Loss change per removed head (and per removed KV group for GQA)."""
    base_loss: float                 # dense metric (mean NLL in nats for LMs)
    head_delta: np.ndarray           # [L, H] metric(head removed) - metric(dense)
    group_delta: np.ndarray | None   # [L, H_kv] metric(KV group removed) - dense; None for MHA
    n_tokens: int                    # predictions per loss
    metric: str = "loss"             # "loss" (causal NLL), "pseudo-nll", "1 - fidelity"
    method: str = "fast"             # "fast" | "naive"
    timings: dict = field(default_factory=dict)  # seconds by stage
    unit_delta: np.ndarray | None = None   # [L, R, U] change of each unit's sum (fast sweep; R = H (+ H_kv))
    unit_weight: np.ndarray | None = None  # [U] each unit's share of readout.total (its predictions / items)


def ablation_gates(geometry: HeadGeometry, layer: int, *, groups: bool, heads: bool = True) -> torch.Tensor:
    """Gate rows for every single-head (then every KV-group) ablation of `layer`: [R, L, H]; heads False: the
    KV groups' rows only (what a KV plan prunes by needs no single head)."""
    L, H, G = geometry.n_layers, geometry.n_heads, geometry.group_size
    n_groups = geometry.n_kv_heads if groups and geometry.is_gqa else 0
    n_heads = H if heads else 0
    gates = torch.ones(n_heads + n_groups, L, H)                       # [R, L, H]
    gates[torch.arange(n_heads), layer, torch.arange(n_heads)] = 0.0
    for g in range(n_groups):
        gates[n_heads + g, layer, g * G:(g + 1) * G] = 0.0
    return gates


def layer_list(geometry: HeadGeometry, layers=None) -> list[int]:
    """Sorted unique layer indices to sweep (default all); InputError when out of range."""
    if layers is None:
        return list(range(geometry.n_layers))
    out = sorted({int(l) for l in layers})
    if not out or out[0] < 0 or out[-1] >= geometry.n_layers:
        raise InputError(f"Layers {list(layers)} are not valid; pick from 0 to {geometry.n_layers - 1}.")
    return out


def apply_chain(chain, hidden: torch.Tensor) -> torch.Tensor:
    """The modules after the last layer (`_DenseCapture.tail`) applied to hidden [..., D] -> logits [..., V]."""
    for m in chain:
        hidden = _first(m(hidden))
    return hidden


class LossReadout:
    """The loss sweep's readout: units = sequences, unit sum = summed next-token NLL (float64), the
    metric = their total / the number of predictions (mean NLL, nats)."""
    metric = "loss"

    def total(self, x: torch.Tensor) -> int:
        return int(x[:, 1:].numel())

    def weights(self, x: torch.Tensor) -> np.ndarray:
        """Each unit's share of `total` [n]."""
        return np.full(x.shape[0], x.shape[1] - 1, dtype=np.float64)

    def dense(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Unit sums [n] from the full logits [n, T, V]."""
        return summed_nll(logits[:, :-1], x[:, 1:])                     # [n]

    def replay(self, chain, hidden: torch.Tensor, x: torch.Tensor, r: int) -> torch.Tensor:
        """Unit sums [r, n] of r ablations from the last layer's output hidden [r*n, T, D] (mask-major)."""
        targets = x[:, 1:].repeat(r, 1)                                  # [r*n, T-1]
        N, Tp = targets.shape
        vocab = chain[-1].weight.shape[0] if hasattr(chain[-1], "weight") else 50000
        rows = max(1, TAIL_BYTES // max(1, Tp * vocab * 4))
        nll = torch.cat([summed_nll(apply_chain(chain, hidden[i:i + rows, :-1]), targets[i:i + rows])
                         for i in range(0, N, rows)])                    # [r*n]
        return nll.reshape(r, x.shape[0])                                # [r, n]


LOSS = LossReadout()


@torch.no_grad()
def full_forward_metric(model, x: torch.Tensor, readout=LOSS) -> float:
    """The readout's metric of one full forward. x [n, T]."""
    logits = model(input_ids=x, use_cache=False).logits                 # [n, T, V]
    return float(readout.dense(logits, x).sum() / readout.total(x))


def full_forward_loss(model, x: torch.Tensor) -> float:
    """Mean next-token NLL of a full forward. x [n, T]."""
    return full_forward_metric(model, x, LOSS)


# ---------------------------------------------------------------------------------------------
# Naive reference
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def naive_layer_deltas(model, x: torch.Tensor, layer: int, base_loss: float, *, groups: bool = True,
                       should_stop: ShouldStop | None = None, readout=LOSS) -> np.ndarray:
    """Metric change [R] of every single-head (then KV-group) ablation of `layer`, one forward each."""
    adapter = adapter_for(model)
    gates = ablation_gates(adapter.geometry(model), layer, groups=groups)  # [R, L, H]
    out = np.zeros(gates.shape[0])
    for r in range(gates.shape[0]):
        check_stop(should_stop, "Ablation sweep")
        with head_mask(model, gates[r], adapter=adapter):
            out[r] = full_forward_metric(model, x, readout) - base_loss
    return out


@torch.no_grad()
def naive_sweep(model, ids, *, groups: bool = True, layers=None, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, team: Team | None = None, readout=LOSS) -> AblationResult:
    """Reference: one full forward per ablated head (and per KV group), same metric as the fast sweep.

    layers: which layers to sweep (default all); rows of other layers are NaN. team: the
    processes that split the layers (module docstring). readout: what is read (default the loss)."""
    x = as_sequences(ids, "Ablation").to(input_device(model))                        # [n, T]
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    t0 = time.perf_counter()
    base = full_forward_metric(model, x, readout)
    todo = layer_list(geo, layers)
    out = np.full((geo.n_layers, ablation_gates(geo, 0, groups=groups).shape[0]), np.nan)  # [L, R]

    def run(i: int) -> np.ndarray:
        deltas = naive_layer_deltas(model, x, todo[i], base, groups=groups, should_stop=should_stop,
                                    readout=readout)                      # [R]
        report(progress, (i + 1) / len(todo), f"naive ablation: layer {todo[i] + 1}/{geo.n_layers}")
        return deltas

    for l, deltas in zip(todo, (team or SOLO).map(run, len(todo), what="the ablation sweep")):
        out[l] = deltas
    H = geo.n_heads
    return AblationResult(base, out[:, :H], out[:, H:] if out.shape[1] > H else None,
                          readout.total(x), readout.metric, "naive", {"total": time.perf_counter() - t0})


# ---------------------------------------------------------------------------------------------
# Fast sweep
# ---------------------------------------------------------------------------------------------

def _walk(obj, path=()):
    """Yield (path, tensor) for every tensor inside nested tuples/lists/dicts."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from _walk(o, path + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))


def batch_paths(call_1, call_2) -> set:
    """Paths of the tensors in a layer call whose leading dim doubles when the batch doubles.

    call_1 / call_2: (args, kwargs) of the same layer at batch 1 and batch 2. Tensors laid out
    [batch * k, ...] (e.g. Bloom's ALiBi [batch * heads, 1, T]) count as batched too."""
    dims = {p: t.shape[0] for p, t in _walk(call_1) if t.dim() >= 1}
    return {p for p, t in _walk(call_2) if t.dim() >= 1 and p in dims and t.shape[0] == 2 * dims[p]}


def repeat_batched(obj, paths: set, reps: int, path=()):
    """Repeat the tensors at `paths` `reps` times along dim 0 (mask-major: [reps * batch, ...])."""
    if isinstance(obj, torch.Tensor):
        return obj.repeat(reps, *([1] * (obj.dim() - 1))) if path in paths else obj
    if isinstance(obj, tuple):
        return tuple(repeat_batched(o, paths, reps, path + (i,)) for i, o in enumerate(obj))
    if isinstance(obj, list):
        return [repeat_batched(o, paths, reps, path + (i,)) for i, o in enumerate(obj)]
    if isinstance(obj, dict):
        return {k: repeat_batched(v, paths, reps, path + (k,)) for k, v in obj.items()}
    return obj


class _StopForward(Exception):
    """Raised inside a probe pass once the last layer's call has been captured."""


def probe_calls(model, layers, x: torch.Tensor, n_calls: int | None = None) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of the first `n_calls` layers (default all) for input x [b, T].

    The forward stops as soon as the last wanted call is captured (before that layer runs)."""
    calls = []
    n_calls = len(layers) if n_calls is None else n_calls

    def pre(module, args, kwargs):
        calls.append((args, kwargs))
        if len(calls) >= n_calls:
            raise _StopForward

    with attached() as hooks:
        for layer in layers:
            hooks.before(layer, pre, with_kwargs=True)
        try:
            model(input_ids=x, use_cache=False)
        except _StopForward:
            pass
    return calls


def _hidden_path(call) -> tuple:
    args, _ = call
    return (0, 0) if args else (1, "hidden_states")


def representative_calls(calls) -> list[int]:
    """For each layer, the first layer whose call passes the very same tensors (hidden states
    aside): most families hand every layer the same mask and rotary objects, so probing the
    first layer's call is enough; families with per-layer masks get one probe per kind."""
    seen: dict[tuple, int] = {}
    out = []
    for j, call in enumerate(calls):
        hidden = _hidden_path(call)
        sig = tuple((p, id(t)) for p, t in _walk(call) if p != hidden)
        out.append(seen.setdefault(sig, j))
    return out


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _same_tensor(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.data_ptr() == b.data_ptr())


class _DenseCapture:
    """One dense forward that records each layer's call and the modules after the last layer."""

    def __init__(self, model, adapter):
        self.model, self.layers = model, adapter.layers(model)
        self.calls: list[tuple[tuple, dict]] = []
        self.flow: list[tuple[int, torch.nn.Module, torch.Tensor, torch.Tensor]] = []  # (entry, module, in, out)
        self.last_out = None

    def run(self, x: torch.Tensor):
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        pending, counter = {}, itertools.count()

        def pre_layer(module, args, kwargs):
            self.calls.append((args, kwargs))

        def post_last(module, args, kwargs, output):
            self.last_out = _first(output)

        def pre_any(module, args):
            if args and isinstance(args[0], torch.Tensor):
                pending[id(module)] = (next(counter), args[0])

        def post_any(module, args, output):
            if id(module) in pending and isinstance(_first(output), torch.Tensor):
                entry, inp = pending.pop(id(module))
                self.flow.append((entry, module, inp, _first(output)))

        with attached() as hooks:
            for layer in self.layers:
                hooks.before(layer, pre_layer, with_kwargs=True)
            hooks.after(self.layers[-1], post_last, with_kwargs=True)
            for m in self.model.modules():
                if id(m) not in inside and m is not self.model and m is not self.model.base_model:
                    hooks.before(m, pre_any)
                    hooks.after(m, post_any)
            logits = self.model(input_ids=x, use_cache=False).logits   # [n, T, V]
        if len(self.calls) != len(self.layers):
            raise InputError(f"Captured {len(self.calls)} layer calls for {len(self.layers)} layers; "
                             "this model reuses or skips layers, use method='naive'.")
        return logits

    def tail(self, logits: torch.Tensor) -> list[torch.nn.Module] | None:
        """Modules that map the last layer's output to the logits, in order (None if not a chain).

        Sorted by entry order, outer modules come first, so the first module fed the current
        tensor is the outermost one (e.g. a whole MLM head rather than its first Linear)."""
        chain, t = [], self.last_out
        order = sorted(self.flow, key=lambda rec: rec[0])
        while not _same_tensor(t, logits):
            nxt = next(((m, o) for _, m, i, o in order if _same_tensor(i, t) and m not in chain), None)
            if nxt is None:
                return None
            chain.append(nxt[0])
            t = nxt[1]
        return chain

    def checked_tail(self, logits: torch.Tensor) -> list[torch.nn.Module] | None:
        """`tail`, kept only when replaying it on the last layer's output gives the model's own logits
        (None otherwise: logit soft-capping, a tail that is not a chain of modules)."""
        chain = self.tail(logits)
        if chain is None or not torch.allclose(apply_chain(chain, self.last_out), logits, atol=1e-5, rtol=1e-4):
            return None
        return chain


def tail_chain(model, x: torch.Tensor, adapter=None) -> list[torch.nn.Module] | None:
    """The modules after the last layer (final norm, LM head), found on one dense pass of x [n, T] and checked
    against the model's own logits; None when they cannot be replayed exactly. The tail does not depend on
    the input, so a few tokens are enough to find it."""
    cap = _DenseCapture(model, adapter or adapter_for(model))
    return cap.checked_tail(cap.run(x))


def call_batch_paths(model, calls, x: torch.Tensor) -> list[set]:
    """Per layer, the paths of the tensors in its captured call that carry the batch (`batch_paths`), from two
    probes of x[:1] at batch 1 and 2 (only up to the last layer whose call differs: `representative_calls`).
    x may be shorter than the captured pass: which tensors carry the batch does not depend on the length."""
    rep = representative_calls(calls)                                   # [L] layer whose call to probe
    blocks = adapter_for(model).layers(model)
    one, two = (probe_calls(model, blocks, x[:1].repeat(b, 1), max(rep) + 1) for b in (1, 2))
    return [batch_paths(one[r], two[r]) for r in rep]


def replay(blocks, calls, batched, hidden: torch.Tensor, reps: int, start: int, stop: int | None = None,
           each: Callable[[int], None] | None = None) -> torch.Tensor:
    """Layers start .. stop - 1 (default: to the last) of a captured dense pass run again on `hidden`
    [reps*n, T, D]: each layer's captured call with its batched tensors repeated `reps` times (mask-major) and
    `hidden` as its input. Returns the last of them's output [reps*n, T, D]; each(j) after layer j (a stop
    check, progress). Whatever is active around the call (head gates, attention spans) applies."""
    for j in range(start, len(blocks) if stop is None else stop):
        args, kwargs = repeat_batched(calls[j], batched[j], reps)
        args, kwargs = _with_input(args, kwargs, hidden)
        hidden = _first(blocks[j](*args, **kwargs))                    # [reps*n, T, D]
        if each is not None:
            each(j)
    return hidden


def _input_of(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _with_input(args, kwargs, hidden):
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


@dataclass
class PreparedSweep:
    """What one dense pass leaves for the per-layer ablation passes (see FastAblation.prepare)."""
    x: torch.Tensor                  # [n, T] token ids
    base_loss: float                 # dense metric (the readout's; mean NLL for the loss)
    calls: list                      # per layer: (args, kwargs) it was called with
    batched: list                    # per layer: paths of the call tensors that carry the batch
    layer_inputs: list               # per layer: hidden states entering it [n, T, D]
    chain: list                      # modules from the last layer's output to the logits
    prefix_seconds: float
    base_units: np.ndarray | None = None   # [U] the readout's dense unit sums (float64)


class FastAblation:
    """Single-head (and KV-group) ablation sweep with prefix reuse and batched gates; verb: sweep.

    `sweep` = `prepare` (one dense pass, two short probes) + `layer_deltas` per layer; the two
    steps are public so a benchmark can interleave layers with the naive loop. `readout`: what is
    read after the last layer (default the loss; module docstring)."""

    def __init__(self, batch_size: int = 16, groups: bool = True, readout=LOSS, heads: bool = True):
        self.batch_size = max(1, int(batch_size))   # sequences per forward pass (rows * n)
        self.groups = groups
        self.readout = readout
        self.heads = heads                           # False: the KV groups alone (head_delta is [L, 0])

    @torch.no_grad()
    def prepare(self, model, ids) -> PreparedSweep | None:
        """Dense pass: layer calls, layer inputs, the tail; None when the tail is not replayable."""
        x = as_sequences(ids, "Ablation").to(input_device(model))                    # [n, T]
        adapter = adapter_for(model)
        t0 = time.perf_counter()
        cap = _DenseCapture(model, adapter)
        logits = cap.run(x)                                              # [n, T, V]
        units = self.readout.dense(logits, x).double().cpu().numpy()     # [U]
        base = float(units.sum() / self.readout.total(x))
        chain = cap.checked_tail(logits)
        if chain is None:
            return None
        layer_inputs = [_input_of(a, k).detach().clone() for a, k in cap.calls]  # L x [n, T, D]
        batched = call_batch_paths(model, cap.calls, x)
        return PreparedSweep(x, base, cap.calls, batched, layer_inputs, chain, time.perf_counter() - t0, units)

    @torch.no_grad()
    def layer_units(self, model, prep: PreparedSweep, layer: int, timings: dict | None = None,
                    should_stop: ShouldStop | None = None,
                    on_part: Callable[[float], None] | None = None) -> np.ndarray:
        """The readout's unit sums [R, U] under every single-head (then KV-group) ablation of `layer`;
        `on_part(f)` with the fraction f of the layer's work done after each replayed block (progress
        inside a layer: the first layers replay every layer after them, so one layer can take many
        seconds on a CPU)."""
        adapter = adapter_for(model)
        geo = adapter.geometry(model)
        blocks = adapter.layers(model)
        n = prep.x.shape[0]
        gates = ablation_gates(geo, layer, groups=self.groups, heads=self.heads)   # [R, L, H]
        out = None                                                       # [R, U]
        timings = {} if timings is None else timings
        rows_per_pass = max(1, self.batch_size // n)
        for start in range(0, gates.shape[0], rows_per_pass):
            check_stop(should_stop, "Ablation sweep")
            g = gates[start:start + rows_per_pass]                       # [r, L, H]
            r = g.shape[0]
            t1 = time.perf_counter()
            hidden = prep.layer_inputs[layer].repeat(r, 1, 1)            # [r*n, T, D]

            def each(j: int) -> None:
                if on_part is not None:
                    on_part((start + r * (j - layer + 1) / (geo.n_layers - layer)) / gates.shape[0])

            with head_mask(model, g, adapter=adapter):
                hidden = replay(blocks, prep.calls, prep.batched, hidden, r, layer, each=each)   # [r*n, T, D]
            t2 = time.perf_counter()
            units = self.readout.replay(prep.chain, hidden, prep.x, r).double().cpu().numpy()  # [r, U]
            out = np.zeros((gates.shape[0], units.shape[1])) if out is None else out
            out[start:start + r] = units
            timings["layers"] = timings.get("layers", 0.0) + t2 - t1
            timings["lm_head"] = timings.get("lm_head", 0.0) + time.perf_counter() - t2
        return out

    def layer_deltas(self, model, prep: PreparedSweep, layer: int, timings: dict | None = None,
                     should_stop: ShouldStop | None = None,
                     on_part: Callable[[float], None] | None = None) -> np.ndarray:
        """Metric change [R] for every single-head (then KV-group) ablation of `layer` (`layer_units`, summed)."""
        units = self.layer_units(model, prep, layer, timings, should_stop, on_part)   # [R, U]
        return units.sum(1) / self.readout.total(prep.x) - prep.base_loss

    def sweep(self, model, ids, *, layers=None, progress: Progress | None = None,
              should_stop: ShouldStop | None = None, team: Team | None = None) -> AblationResult:
        """Metric change per removed head for ids [n, T]; `layers` limits the sweep (others NaN);
        `team` splits the layers over the processes of a launch (module docstring)."""
        x = as_sequences(ids, "Ablation").to(input_device(model))                    # [n, T]
        geo = adapter_for(model).geometry(model)
        todo = layer_list(geo, layers)
        t0 = time.perf_counter()
        report(progress, 0.0, "ablation sweep: running the dense model once (the inputs every layer replays)")
        prep = self.prepare(model, x)
        if prep is None:
            result = naive_sweep(model, x, groups=self.groups, layers=layers, progress=progress,
                                 should_stop=should_stop, team=team, readout=self.readout)
            return AblationResult(result.base_loss, result.head_delta, result.group_delta, result.n_tokens,
                                  result.metric, "naive (tail after the last layer is not replayable)",
                                  result.timings)
        timings = {"prefix": prep.prefix_seconds, "layers": 0.0, "lm_head": 0.0}
        R = ablation_gates(geo, 0, groups=self.groups, heads=self.heads).shape[0]
        units = np.full((geo.n_layers, R, prep.base_units.size), np.nan)   # [L, R, U]
        work = [geo.n_layers - l for l in todo]                          # layer passes per swept layer
        team = team or SOLO
        mine = sum(work[i] for i in team.mine(len(todo), work))
        done = 0

        def run(i: int) -> np.ndarray:
            nonlocal done

            def on_part(part: float) -> None:
                report(progress, (done + work[i] * part) / mine,
                       f"ablation sweep: layer {todo[i] + 1}/{geo.n_layers}, {100 * part:.0f}% of its ablations")

            sums = self.layer_units(model, prep, todo[i], timings, should_stop, on_part)  # [R, U]
            done += work[i]
            report(progress, done / mine, f"ablation sweep: layer {todo[i] + 1}/{geo.n_layers}")
            return sums

        for l, sums in zip(todo, team.map(run, len(todo), weights=work, what="the ablation sweep")):
            units[l] = sums
        timings["total"] = time.perf_counter() - t0
        total = self.readout.total(x)
        out = units.sum(2) / total - prep.base_loss                     # [L, R]
        H = geo.n_heads if self.heads else 0
        return AblationResult(prep.base_loss, out[:, :H], out[:, H:] if R > H else None, total,
                              self.readout.metric, "fast", timings, unit_delta=units - prep.base_units,
                              unit_weight=self.readout.weights(x))


# ---------------------------------------------------------------------------------------------
# Loaded-model entry point (any kind)
# ---------------------------------------------------------------------------------------------

def head_ablation(loaded, text: str | bytes | None = None, *, max_tokens: int = 256, seq_len: int = 256,
                  method: str = "fast", groups: bool = True, batch_size: int = 16,
                  progress: Progress | None = None, should_stop: ShouldStop | None = None,
                  team: Team | None = None, heads: bool = True) -> AblationResult:
    """Single-head ablation effects of `loaded` on `text` (None = built-in evaluation text).

    Causal LMs: next-token loss change (fast sweep, or method="naive"). Masked LMs: pseudo-NLL
    change; encoders: drop of embedding fidelity (1 - cosine); both evaluate all masks in
    batched passes of the evaluator. Uses the first `max_tokens` tokens split into sequences of
    at most `seq_len`. team: the processes of a launch that split the work (analysis.core.distributed).
    heads False (causal LMs, fast sweep): the KV groups alone, a quarter of the work on a G = 3 model (head_delta
    is then [L, 0]; the naive method and the other kinds measure the heads anyway)."""
    if method not in ("fast", "naive"):
        raise InputError(f"Unknown ablation method {method!r}; use 'fast' or 'naive'.")
    check_max_tokens(max_tokens)                                       # before a byte of text is tokenized
    seq_len = check_whole_number(seq_len, "seq_len", low=2, high=MAX_TOKENS_LIMIT)
    batch_size = check_whole_number(batch_size, "batch_size", low=1, high=2**16)
    text = default_text() if text is None else text
    if loaded.kind == "causal-lm":
        x = text_sequences(loaded.tokenizer, text, max_tokens=max_tokens, seq_len=seq_len)  # [n, T]
        if method == "naive":
            return naive_sweep(loaded.model, x, groups=groups, progress=progress, should_stop=should_stop,
                               team=team)
        return FastAblation(batch_size, groups, heads=heads).sweep(loaded.model, x, progress=progress,
                                                                   should_stop=should_stop, team=team)
    return _evaluator_sweep(loaded, text, max_tokens, groups, batch_size, progress, should_stop, team)


def _evaluator_sweep(loaded, text, max_tokens, groups, batch_size, progress, should_stop,
                     team=None) -> AblationResult:
    model = loaded.model
    geo = adapter_for(model).geometry(model)
    ev = evaluator_for(loaded.kind, batch_size=batch_size)
    inputs = ev.prepare(loaded.tokenizer, text, max_tokens)
    gates = torch.cat([torch.ones(1, geo.n_layers, geo.n_heads)] +
                      [ablation_gates(geo, l, groups=groups) for l in range(geo.n_layers)])  # [1+L*R, L, H]
    res = ev.measure(model, inputs, gate_batch(model, gates), progress=progress, should_stop=should_stop, team=team)
    if res.mean_nll is not None:
        vals, metric = res.mean_nll, "pseudo-nll"                       # [1+L*R]
    else:
        vals, metric = 1.0 - res.values, "1 - fidelity"
    delta = (vals[1:] - vals[0]).reshape(geo.n_layers, -1)              # [L, R]
    H = geo.n_heads
    return AblationResult(float(vals[0]), delta[:, :H], delta[:, H:] if delta.shape[1] > H else None,
                          res.n_tokens, metric, "batched masks")
