"""One dense long-context pass that feeds every long-context measure (issue 46).

The long-context measures all run the dense model over long rows of built-in text: the retrieval detector
(which head's top-1 key at each answer step is the needle token it copies), the streaming score (how much a
window of sinks + recent tokens changes each KV head's output at rows beyond it), the long-context probes'
dense side (the logit difference of each read digit or token). Run separately they read the same text three
times. Here one pass per row records all three:

- `ScanRow`: a row (its ids [T]), the positions read (each predicting a target token), the span of the needle
  those targets come from, and the query rows the streaming score samples (analysis.measure.longheads.
  query_rows). `recording(model, rows, window=...)` is a block inside which **any** forward whose input rows
  are among `rows` (compared by their ids) gets the taps of analysis.measure.longheads (`_copy_tap`, the
  retrieval detector's; `_window_tap`, the streaming score's: the same functions, on the same q / k / v) and
  the model's own top-1 at the read positions; forwards of other inputs (a decode step, another row) pass
  untouched. So whatever runs the passes decides their layout: `long_scan` runs the probes' own
  `measure_long` inside the block, and the numbers it gives are the probes' dense numbers, unchanged.
- `long_scan(model, built, window=..., queries=...)` -> `LongScan`: the long-context probes `built`
  (analysis.measure.probes.longcontext.build_long) measured on the dense model, with the retrieval and the
  streaming score read from the same passes, on the same rows (each row's asked needle is the retrieval
  needle; its digits, or copied tokens, are the answer steps). `LongScan.dense(built)` is the probes' dense
  side (what analysis.score.longcontext.long_context_report takes as `dense=`), `.retrieval()` and
  `.streaming()` the two detectors' `Detection`s (the same fields as RetrievalDetector / StreamingDetector
  give), `to_tree` / `from_tree` its stored form (analysis.core.store: the raw per-row and per-item values,
  from which everything else is recomputed).

Exactness: the probes' dense side is the probes' own passes, number for number. The retrieval and streaming
taps are the detectors' own functions on the q / k / v of those passes: a whole-row pass gives exactly what
retrieval_scores / streaming_scores give on the row; a digit-answer row is read as the probes read it (a prefill
of its prompt, then its answer through the cache), which differs from one pass over the row only by the rotary
embedding's float32 rounding (tests/test_longpass.py: top-1 keys equal, streaming within 1e-6 relative, float64).
The sums over rows follow the separate runs' order.

A seam for more readers (RULER's dense answers: analysis/measure/ruler.py + harness.py, being built): a reader
that runs its own forwards over rows (a prefill, then greedy decoding) calls them inside `recording(model,
its ScanRows)`: its prefill of each row then feeds the retrieval and streaming taps too (its decode steps,
one token each, are not rows and pass untouched), and its own outputs (generated answers) are its own to
keep beside the scan's. Nothing else changes: rows are matched by their ids, not by who runs them.

Precision: `precision="bfloat16"` runs the passes under torch.autocast (matmuls in bfloat16 where the CPU has
the instructions: AVX-512 BF16 or AMX, analysis.core.placement.fast_bfloat16), the taps still in float32; a
choice, with its effect measured beside it (bench/bench_long_minute.py, docs/results.md).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from analysis.arch.adapters import adapter_for
from analysis.arch.attention import check_precision, precision_block  # noqa: F401 (re-exported: the scan's precision)
from analysis.arch.spans import attention_layers, tapped
from analysis.arch.window import Window, window_of
from analysis.core.errors import InputError, check_whole_number
from analysis.core.progress import Progress, ShouldStop
from analysis.measure.headmaps import Detection
from analysis.measure.long_options import (DEFAULT_QUERIES, MAX_QUERIES, PRECISION_CHOICES, RETRIEVAL_THRESHOLD,
                                           STREAMING_THRESHOLD)
from analysis.measure.longheads import _copy_tap, _own_window, _relative, _window_tap, per_kv, query_rows

PRECISIONS = PRECISION_CHOICES              # declared in long_options (the CLI reads them without torch)
# the modules whose source computes a scan (their bytes are in a stored scan's key: analysis.core.store)
SCAN_MODULES = ("analysis.measure.longpass", "analysis.measure.longheads", "analysis.measure.probes.longcontext",
                "analysis.measure.probes.measure", "analysis.measure.probes.items", "analysis.measure.haystack",
                "analysis.core.text", "analysis.arch.spans", "analysis.arch.window", "analysis.arch.attention")


@dataclass(frozen=True)
class ScanRow:
    """One row a scan reads: ids [T]; reads [k] positions, each predicting targets[k]; the needle span
    (start, end) the targets are copied from (None: no retrieval reads); queries [n] the streaming score's
    query rows (None: none)."""
    ids: torch.Tensor
    reads: torch.Tensor
    targets: torch.Tensor
    needle: tuple[int, int] | None
    queries: torch.Tensor | None

    # the attributes analysis.measure.longheads' copy tap reads (a NeedleItem's)
    @property
    def rows(self) -> torch.Tensor:
        return self.reads

    @property
    def needle_start(self) -> int:
        return int(self.needle[0])

    @property
    def needle_end(self) -> int:
        return int(self.needle[1])


@dataclass
class Recorded:
    """What `recording` gathered per row (index into its rows; None until every position the row needs was
    computed by some forward)."""
    copy: list                   # [L, H] float64: share of the row's answer steps each head copies
    top1: list                   # [k] bool: the model's own top-1 at each read is the target
    stream_head: list            # [L, H] float64: mean relative output change under the window (per query head)
    stream_kv: list              # [L, Hkv] float64: the same per KV head (its G query heads side by side)


@dataclass
class _Seen:
    """One row's pieces from the forwards that computed some of its positions (a whole-row pass, or a prefill of
    its prompt and a cached pass over its answer): per layer, (positions, hits [H, k]) and (positions, diff [H, n],
    norm [H, n]) chunks; the top-1 right or wrong per read position; the positions already computed."""
    hits: dict = field(default_factory=dict)
    stream: dict = field(default_factory=dict)
    top1: dict = field(default_factory=dict)
    done: set = field(default_factory=set)


def _row_index(rows: list[ScanRow]) -> dict:
    """bytes of a row's ids -> its index (rows with equal ids are one row)."""
    out: dict = {}
    for i, r in enumerate(rows):
        out.setdefault(r.ids.to(torch.long).numpy().tobytes(), i)
    return out


def _starting(ids: torch.Tensor, rows: list[ScanRow], index: dict) -> tuple[int | None, int]:
    """(row, its tokens in `ids`) for a forward that starts a row at position 0: the whole row, the row's first
    tokens (a prefill of its prompt), or the row right-padded; (None, 0) for anything else or an ambiguous
    prefix."""
    i = index.get(ids.numpy().tobytes())
    if i is not None:
        return i, int(ids.numel())
    n = int(ids.numel())
    prefix = [i for i, r in enumerate(rows) if r.ids.numel() > n and torch.equal(r.ids[:n], ids)]
    if len(prefix) == 1:
        return prefix[0], n
    for length in sorted({int(r.ids.numel()) for r in rows if r.ids.numel() < n}, reverse=True):
        i = index.get(ids[:length].numpy().tobytes())
        if i is not None:
            return i, length
    return None, 0


@contextmanager
def recording(model, rows: list[ScanRow], *, window: Window = Window(), retrieval: bool = True,
              streaming: bool = True):
    """Inside the block every forward of `model` that computes positions of `rows` records them (module docstring);
    yields the Recorded lists, filled when the block ends. A forward is recognised by its tokens: one that starts
    at position 0 by its ids (a whole row, a prompt's prefill, a padded row); one that continues a cache (its
    length the offset) as the next tokens of the row the same batch position started, when they are that row's
    tokens there. Positions are taken once (a greedy decode step that repeats a position already computed, or
    writes another token, is left alone). Hooks and the tap are removed in finally."""
    window = window_of(window)
    geo = adapter_for(model).geometry(model)
    modules = attention_layers(model)
    own = [_own_window(m) for m in modules]
    kept = [torch.ones(geo.n_heads, dtype=torch.float64) for _ in range(geo.n_layers)]
    index = _row_index(rows)
    n = len(rows)
    rec = Recorded([None] * n, [None] * n, [None] * n, [None] * n)
    seen = [_Seen() for _ in rows]
    current: list = []                        # per batch row of the running forward: (row, offset, new positions)
    started: list = []                        # the rows the last forward from position 0 started, by batch position
    head = model.get_output_embeddings()
    if head is None or model.base_model is model:
        raise InputError("A long-context scan reads a causal language model's predictions; this model has no "
                         "language-model head.")

    def identify(module, args, kwargs):
        current.clear()
        x = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return
        cache = kwargs.get("past_key_values")
        offset = 0 if cache is None else int(cache.get_seq_length())
        ids = x.detach().to("cpu", torch.long)                           # [b, q]
        if offset == 0:
            started[:] = [_starting(ids[j], rows, index)[0] for j in range(ids.shape[0])]
        for j in range(ids.shape[0]):
            i = started[j] if j < len(started) else None
            if i is None:
                current.append((None, offset, None))
                continue
            row = rows[i].ids
            q = min(ids.shape[1], max(0, row.numel() - offset))             # the row's tokens in this forward
            if q == 0 or not torch.equal(row[offset:offset + q], ids[j, :q]):
                current.append((None, offset, None))
                continue
            new = torch.tensor([p for p in range(offset, offset + q) if p not in seen[i].done], dtype=torch.long)
            current.append((i, offset, new))

    def tap(layer: int, query, key, value) -> None:
        for j, (i, offset, new) in enumerate(current):
            if i is None or not new.numel():
                continue
            row, state = rows[i], seen[i]
            q, k, v = query[j:j + 1], key[j:j + 1], value[j:j + 1]          # keys: every position so far
            if retrieval and row.needle is not None:
                keep = torch.isin(row.reads, new)                       # [k] the reads this forward computes
                if keep.any():
                    part: dict = {}
                    sub = ScanRow(row.ids, row.reads[keep], row.targets[keep], row.needle, None)
                    _copy_tap(sub, q.device, part, own)(layer, q, k, v)
                    state.hits.setdefault(layer, []).append((sub.reads, part[layer].cpu()))
            if streaming and row.queries is not None:
                mine = row.queries[torch.isin(row.queries, new)]          # [n'] its query rows here
                if mine.numel():
                    part = {}
                    _window_tap(mine, window, modules, kept, part)(layer, q, k, v)
                    diff, norm = part[layer]
                    state.stream.setdefault(layer, []).append((mine, diff.cpu(), norm.cpu()))

    def hidden_states(module, args, output):
        hidden = output[0]                                               # [b, q, D] (the final norm's output)
        for j, (i, offset, new) in enumerate(current):
            if i is None or not new.numel():
                continue
            row = rows[i]
            keep = torch.isin(row.reads, new)
            if keep.any():
                picked = hidden[j, (row.reads[keep] - offset).to(hidden.device)]       # [k', D]
                right = (head(picked).float().argmax(-1).cpu() == row.targets[keep]).numpy()
                seen[i].top1.update(zip(row.reads[keep].tolist(), right.tolist()))

    def finished(module, args, kwargs, output):
        for i, _, new in current:
            if i is not None:
                seen[i].done.update(new.tolist())
        current.clear()

    handles = [model.register_forward_pre_hook(identify, with_kwargs=True),
               model.base_model.register_forward_hook(hidden_states),
               model.register_forward_hook(finished, with_kwargs=True)]
    try:
        with tapped(model, tap):
            yield rec
        for i, (row, state) in enumerate(zip(rows, seen)):
            _assemble(rec, i, row, state, geo, retrieval, streaming)
    finally:
        for h in handles:
            h.remove()


def _ordered(chunks: list, positions: torch.Tensor) -> list[torch.Tensor] | None:
    """The chunks' tensors (after their positions) put together along the last axis in the order of `positions`
    (ascending); None unless they hold each position exactly once."""
    got = torch.cat([c[0] for c in chunks])                              # [m]
    order = torch.argsort(got)
    if not torch.equal(got[order], positions):
        return None
    return [torch.cat([c[t] for c in chunks], -1)[..., order] for t in range(1, len(chunks[0]))]


def _assemble(rec: Recorded, i: int, row: ScanRow, state: _Seen, geo, retrieval: bool, streaming: bool) -> None:
    """Row i's per-row values from its chunks, the arithmetic of retrieval_scores / streaming_scores."""
    if row.reads.numel() and all(int(p) in state.top1 for p in row.reads):
        rec.top1[i] = np.array([state.top1[int(p)] for p in row.reads], dtype=bool)
    if retrieval and row.needle is not None and len(state.hits) == geo.n_layers:
        per_layer = [_ordered(state.hits[l], row.reads) for l in range(geo.n_layers)]
        if all(p is not None for p in per_layer):
            rec.copy[i] = np.stack([p[0].double().mean(-1).numpy() for p in per_layer])     # [L, H]
    if streaming and row.queries is not None and len(state.stream) == geo.n_layers:
        per_layer = [_ordered(state.stream[l], row.queries) for l in range(geo.n_layers)]
        if all(p is not None for p in per_layer):
            G = geo.group_size
            heads, kvs = [], []
            for diff, norm in per_layer:
                heads.append(_relative(diff, norm).mean(-1).numpy())                         # [H]
                gd = diff.reshape(geo.n_kv_heads, G, -1).sum(1)                              # [Hkv, n]
                gn = norm.reshape(geo.n_kv_heads, G, -1).sum(1)
                kvs.append(_relative(gd, gn).mean(-1).numpy())                               # [Hkv]
            rec.stream_head[i], rec.stream_kv[i] = np.stack(heads), np.stack(kvs)


# ---------------------------------------------------------------------------------------------
# The long-context probes' rows, scanned
# ---------------------------------------------------------------------------------------------

def probe_rows(built: dict, *, window: Window = Window(), queries: int = DEFAULT_QUERIES) -> list[tuple]:
    """[(key (name, length), row, ScanRow)] of every row of the probes `built`, in their order: the reads are the
    row's scored items' positions (once each: depths that land on one spot share a row) and correct tokens, the
    needle the probe's asked needle
    (LongProbe.needle_spans), the queries `query_rows` of the row's length."""
    window = window_of(window)
    queries = check_whole_number(queries, "The number of query rows", low=1, high=MAX_QUERIES)
    out = []
    for key, (_, probe, items) in built.items():
        spans = getattr(probe, "needle_spans", None)
        if spans is None or len(spans) != items.ids.shape[0]:
            raise InputError(f"The {key[0]} probe does not say where its needles are; a scan reads long-context "
                             f"probes (passkey, needle, long-copying).")
        scored = items.scored
        for r in range(items.ids.shape[0]):
            T = int(items.lengths[r])
            mine = torch.nonzero((items.row == r) & scored).flatten()                 # [k] item indices
            reads, first = np.unique(items.position[mine].numpy(), return_index=True)  # depths sharing a row: once
            out.append((key, r, ScanRow(items.ids[r, :T].clone(), torch.as_tensor(reads),
                                        items.correct[mine][torch.as_tensor(first)], tuple(int(v) for v in spans[r]),
                                        None if window.covers(T) else query_rows(T, window, queries))))
    return out


@dataclass
class LongScan:
    """A scan's raw values (module docstring) and what they were measured with."""
    keys: list                         # [(name, length)] of the probes, in order
    rows: list                         # per row: (key index, row in that key's items, length, depth label)
    copy: np.ndarray                   # [R, L, H] float64
    stream_head: np.ndarray            # [R, L, H] float64 (NaN: a row the window covers, not streamed)
    stream_kv: np.ndarray              # [R, L, Hkv] float64
    top1: list                         # per row: [k] bool
    values: dict                       # key index -> (diff [1, n], nll [1, n]) of the probe's items
    seconds: dict                      # key index -> seconds of its passes
    written: dict                      # key index -> each row's generated answer [S] (None: not generated)
    window: Window
    queries: int
    seed: int
    group_size: int
    precision: str = "float32"
    total_seconds: float = 0.0
    notes: tuple = field(default_factory=tuple)

    # -- the measures -------------------------------------------------------------------------------
    def dense(self, built: dict) -> dict:
        """(name, length) -> LongScores: the probes' dense side of `built` (the items the scan read;
        analysis.score.longcontext keys it by the items' digest for long_context_report's `dense=`)."""
        from analysis.measure.probes.longcontext import long_scores
        out = {}
        for k, key in enumerate(self.keys):
            if key in built:
                spec, probe, items = built[key]
                diff, nll = self.values[k]
                out[key] = long_scores(spec, probe, items, diff, nll, seed=self.seed, seconds=self.seconds.get(k, 0.0),
                                       written=self.written.get(k))
        return out

    def retrieval(self) -> Detection:
        """The retrieval score on the scanned rows (RetrievalDetector's Detection: share of answer steps at which
        each head's top-1 key is the needle token it copies, mean over rows)."""
        n = len(self.rows)
        total = None
        for i in range(n):
            total = self.copy[i] if total is None else total + self.copy[i]
        scores = total / n
        accuracy = np.array([float(np.mean(t)) for t in self.top1])
        lengths = sorted({r[2] for r in self.rows})
        by_length = {L: float(np.mean([a for a, r in zip(accuracy, self.rows) if r[2] == L])) for L in lengths}
        extras = dict(lengths=lengths, depths=self._depths(), seed=self.seed, n_items=n,
                      answer_accuracy=float(accuracy.mean()), accuracy_by_length=by_length,
                      kv_scores=per_kv(scores, self.group_size, "max"), rows=self.describe_rows())
        return Detection("retrieval", scores, RETRIEVAL_THRESHOLD, "share of needle tokens copied", extras)

    def streaming(self) -> Detection:
        """The streaming score on the scanned rows (StreamingDetector's Detection: relative output change under
        the window, per KV head, mean over the sampled query rows of every row)."""
        L, H = self.stream_head.shape[1:]
        streamed = [i for i in range(len(self.rows)) if not np.isnan(self.stream_kv[i]).any()]
        if not streamed:
            raise InputError(f"Every scanned row fits inside the window ({self.window.describe()}): the streaming "
                             f"score needs rows longer than {self.window.size} tokens.")
        kv_sum, head_sum = np.zeros(self.stream_kv.shape[1:]), np.zeros((L, H))
        for i in streamed:
            head_sum += self.stream_head[i]
            kv_sum += self.stream_kv[i]
        kv, head = kv_sum / len(streamed), head_sum / len(streamed)
        extras = dict(lengths=sorted({self.rows[i][2] for i in streamed}), **self.window.as_dict(),
                      queries=self.queries, n_sequences=len(streamed), seed=self.seed, kv_scores=kv, head_scores=head,
                      rows=self.describe_rows())
        return Detection("streaming", np.repeat(kv, self.group_size, axis=1), STREAMING_THRESHOLD,
                         "relative output change", extras)

    def _depths(self) -> list:
        return list(dict.fromkeys(r[3] for r in self.rows))

    def describe_rows(self) -> str:
        names = ", ".join(dict.fromkeys(k[0] for k in self.keys))
        lengths = ", ".join(f"{n:,}" for n in dict.fromkeys(k[1] for k in self.keys))
        return f"{len(self.rows)} rows of the long-context probes ({names}) at {lengths} tokens"

    # -- stored form ---------------------------------------------------------------------------------
    def to_tree(self) -> dict:
        return dict(keys=[list(k) for k in self.keys], rows=[list(r) for r in self.rows], copy=self.copy,
                    stream_head=self.stream_head, stream_kv=self.stream_kv, top1=list(self.top1),
                    values={str(k): list(v) for k, v in self.values.items()},
                    seconds={str(k): float(v) for k, v in self.seconds.items()},
                    written={str(k): None if v is None else list(v) for k, v in self.written.items()},
                    window=self.window.as_dict(),
                    queries=self.queries, seed=self.seed, group_size=self.group_size, precision=self.precision,
                    total_seconds=self.total_seconds, notes=list(self.notes))

    @classmethod
    def from_tree(cls, t: dict) -> "LongScan":
        keys = [(str(k[0]), int(k[1])) for k in t["keys"]]
        copy, sh, skv = (np.asarray(t[n], dtype=np.float64) for n in ("copy", "stream_head", "stream_kv"))
        rows = [(int(r[0]), int(r[1]), int(r[2]), str(r[3])) for r in t["rows"]]
        if not (copy.ndim == sh.ndim == skv.ndim == 3 and len(copy) == len(sh) == len(skv) == len(rows)
                and len(t["top1"]) == len(rows)):
            raise ValueError("a scan's arrays do not match its rows")
        values = {int(k): (np.asarray(v[0], dtype=np.float64), np.asarray(v[1], dtype=np.float64))
                  for k, v in t["values"].items()}
        if set(values) != set(range(len(keys))):
            raise ValueError("a scan's probe values do not match its probes")
        written = {int(k): None if v is None else tuple(str(w) for w in v) for k, v in t["written"].items()}
        return cls(keys, rows, copy, sh, skv, [np.asarray(v, dtype=bool) for v in t["top1"]], values,
                   {int(k): float(v) for k, v in t["seconds"].items()}, written, Window(**t["window"]),
                   int(t["queries"]), int(t["seed"]), int(t["group_size"]), str(t["precision"]),
                   float(t["total_seconds"]), tuple(t["notes"]))


def long_scan(model, built: dict, *, tokenizer=None, window: Window = Window(), queries: int = DEFAULT_QUERIES,
              seed: int = 0, precision: str = "float32", progress: Progress | None = None,
              should_stop: ShouldStop | None = None) -> LongScan:
    """The long-context probes `built` on the dense `model` (their own passes: measure_long, with the generated
    answers when given the `tokenizer`), with the retrieval and streaming scores recorded from the same passes
    (module docstring)."""
    from analysis.measure.probes.longcontext import measure_long
    window = window_of(window)
    listed = probe_rows(built, window=window, queries=queries)
    rows = [r for _, _, r in listed]
    keys = list(built)
    t0 = time.perf_counter()
    kept: dict = {}
    with precision_block(model, precision), recording(model, rows, window=window) as rec:
        measure_long(model, built, tokenizer=tokenizer, seed=seed, progress=progress, should_stop=should_stop,
                     values=kept)
    missing = [i for i, r in enumerate(rows) if rec.copy[i] is None or rec.top1[i] is None
               or (r.queries is not None and rec.stream_kv[i] is None)]
    if missing:
        raise RuntimeError(f"The scan's passes missed {len(missing)} of its {len(rows)} rows (their forwards were "
                           "not recognised); nothing was recorded for them.")
    values = {k: kept[key][:2] for k, key in enumerate(keys)}
    seconds = {k: float(kept[key][2]) for k, key in enumerate(keys)}
    written = {k: kept[key][3] for k, key in enumerate(keys)}
    meta = [(keys.index(key), r, int(row.ids.numel()), _row_depth(built[key][2], r)) for key, r, row in listed]
    geo = adapter_for(model).geometry(model)
    nan_head, nan_kv = np.full((geo.n_layers, geo.n_heads), np.nan), np.full((geo.n_layers, geo.n_kv_heads), np.nan)
    return LongScan(keys, meta, np.stack(rec.copy),
                    np.stack([nan_head if h is None else h for h in rec.stream_head]),
                    np.stack([nan_kv if k is None else k for k in rec.stream_kv]),
                    list(rec.top1), values, seconds, written, window, int(queries), int(seed), geo.group_size,
                    precision, time.perf_counter() - t0)


def _row_depth(items, r: int) -> str:
    i = int(torch.nonzero(items.row == r).flatten()[0])
    return items.conditions[i]


__all__ = ["ScanRow", "recording", "probe_rows", "LongScan", "long_scan", "PRECISIONS", "SCAN_MODULES",
           "precision_block", "check_precision"]
