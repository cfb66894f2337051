"""Heads for long contexts: retrieval heads and streaming heads, measured on real long text.

- **Retrieval score** (after Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
  Factuality"). An item is a haystack of real built-in text (analysis.measure.haystack) with a needle
  sentence placed at a depth ("The secret words are: w1 w2 ... ." or "The secret number is: 4 7 1 ...",
  seeded), then a question, then the needle's content as the answer, teacher-forced. At answer step t the
  query at the position that predicts answer token w_t is read; a head **copies** at that step when its
  top-1 attention lands on a position inside the needle that holds w_t. A head's score on an item is its
  copies / answer tokens; its retrieval score is the mean over items (lengths x depths x needles). A head
  with score >= 0.1 (Wu et al.'s cut: it copy-pastes at least 10 % of the needle tokens) is a retrieval
  head. The model's own teacher-forced top-1 accuracy on the answer tokens comes with it (does it
  retrieve at all at that length?).
- **Streaming score** (DuoAttention's question, Xiao et al. 2024, answered cheaply). For each KV head:
  how much its attention output changes when it reads only `sinks` first tokens + a `recent` window
  (analysis.arch.spans.band: the same rule as the KV plan's windows) instead of every earlier token. For
  a sample of query rows beyond the window, both outputs are computed from the tapped post-RoPE q/k/v of
  one dense forward pass (no second pass); per row, the relative L2 change of the KV group's output
  (its G query heads' outputs side by side) is ||o_full - o_window|| / ||o_full||; the score is the mean
  over rows and sequences. 0 = windowing changes nothing (a streaming head: window it); near 1 or more =
  the head's output comes from tokens the window drops (keep it full). A KV head "needs its whole
  context" at >= 0.5: at least half its output, measured this way, comes from outside the window.
- **The end-to-end oracle** of the streaming score (`windowing_effect`): the model run under
  analysis.arch.spans.windowed with one KV head alone windowed, per KV head: the next-token loss change
  and the KL divergence of the next-token distributions from the dense model's, on the predictions made
  beyond the window. L x Hkv forward passes: for tests and benchmarks, not for the app.

- **Where the last positions look** (`last_rows`, the Walkthrough's real head): every head's attention from
  the last few positions of one text over all its keys, their top-1 keys, and the same output change under
  the window per query head; one tapped pass (`row_attention`: the rows' probabilities, full and windowed,
  the one home of that arithmetic, which the streaming score reads too).

Everything reads attention through `analysis.arch.spans.tapped` and computes only the rows it needs
(the answer rows; the sampled rows) against all keys: never [B, H, T, T] probabilities at 4k tokens.
The forward pass asks for the logits of its last rows only (`logits_to_keep`), so a 4k context never
holds [T, V] logits either.

Shapes: scores [L, H] in the original head slots (a pruned head scores 0); per KV head [L, Hkv].
"""
from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

import numpy as np
import torch

from analysis.arch.adapters import adapter_for, input_device
from analysis.arch.spans import attention_layers, band, tapped, windowed
from analysis.arch.window import Window, window_of
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.evaluation import context_length
from analysis.measure.haystack import haystack, place, sentence_ends
from analysis.measure.splits import SCORE_SPLIT, TEST, salted
from analysis.measure.headmaps import Detection, gates_array, head_slots, masked, place as place_heads, zero_pruned

from analysis.measure.long_options import (DEFAULT_DEPTHS, DEFAULT_NEEDLES, DEFAULT_QUERIES,  # noqa: F401,E402
                                           DEFAULT_SEQUENCES, MAX_NEEDLES,
                                           MAX_QUERIES, MAX_SEQUENCES, RETRIEVAL_LENGTHS, RETRIEVAL_THRESHOLD,
                                           STREAMING_LENGTHS, STREAMING_THRESHOLD)

MIN_HAYSTACK = 32                    # tokens of real text an item holds at least
NEEDLE_WORDS = 5
NEEDLE_DIGITS = 7
WORDS = ("apple", "river", "candle", "garden", "silver", "window", "tiger", "orange", "castle", "pencil",
         "forest", "button", "rocket", "mirror", "ladder", "basket", "violin", "desert", "planet", "wallet",
         "island", "hammer", "jacket", "lemon", "bridge", "camera", "dragon", "feather", "helmet", "kettle",
         "lantern", "marble", "needle", "parrot", "saddle", "tunnel", "anchor", "blanket", "cherry", "dolphin")
# (needle sentence before the content, question that ends where the answer's content starts)
NEEDLE_KINDS = {
    "words": (" The secret words are:", "\n\nWhat are the secret words? The secret words are:"),
    "number": (" The secret number is:", "\n\nWhat is the secret number? The secret number is:"),
}


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------

def check_lengths(lengths, limit: int | None = None, what: str = "context length") -> tuple[int, ...]:
    """Lengths as whole numbers >= 2, at most `limit` (the model's context), duplicates dropped."""
    if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
        lengths = (lengths,)
    try:
        values = tuple(lengths)
    except TypeError:
        raise InputError(f"A {what} is a number of tokens; got {lengths!r}.") from None
    if not values:
        raise InputError(f"Give at least one {what} (tokens).")
    out = tuple(dict.fromkeys(check_whole_number(n, f"The {what}", low=2) for n in values))
    if limit is not None:
        over = [n for n in out if n > limit]
        if over:
            raise InputError(f"A {what} of {over[0]} tokens is longer than this model reads ({limit}); use at most "
                             f"{limit}.")
    return out


def check_depths(depths) -> tuple[float, ...]:
    """Depths as floats in [0, 1], duplicates dropped."""
    if isinstance(depths, (int, float)) and not isinstance(depths, bool):
        depths = (depths,)
    try:
        values = tuple(float(d) for d in depths)
    except (TypeError, ValueError):
        raise InputError(f"Depths are fractions of the context, 0 to 1; got {depths!r}.") from None
    if not values:
        raise InputError("Give at least one depth (a fraction of the context, 0 to 1).")
    bad = [d for d in values if not 0.0 <= d <= 1.0]
    if bad:
        raise InputError(f"A depth is a fraction of the context, 0 to 1; got {bad[0]:g}.")
    return tuple(dict.fromkeys(values))


def default_lengths(preferred: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """The preferred lengths this model reads; its whole context when none fits."""
    return tuple(n for n in preferred if n <= limit) or (limit,)


def whole_model(model, what: str, layout=None):
    """(adapter, geometry) of `model`, InputError (one line) unless it is the whole model: no head layout (an
    export's) and every layer still holding all its heads. `what` (e.g. "The streaming score") is per KV head
    of the whole model; a cut of it is a mask on the dense model."""
    if layout is not None:
        raise InputError(f"{what} is per KV head of the whole model; give the dense model (with a mask), not a "
                         f"physically pruned export.")
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    if any(len(r) != geo.n_heads for r in head_slots(model, None, adapter)):
        raise InputError(f"{what} is per KV head of the whole model; give the dense model (with a mask), not a "
                         f"physically pruned one.")
    return adapter, geo


def _bos(tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [int(bos)]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _logits_kwargs(model, keep: int) -> dict:
    """`logits_to_keep=keep` when the model takes it (its last `keep` rows of logits only)."""
    return {"logits_to_keep": int(keep)} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _own_window(module) -> int | None:
    """The layer's own sliding window (Mistral, Gemma 2/3's local layers), None when it reads everything."""
    w = getattr(module, "sliding_window", None)
    return int(w) if isinstance(w, int) and w > 0 else None


def _paced(tap, n_layers: int, what: str, progress: Progress | None, done: float, share: float,
           should_stop: ShouldStop | None):
    """`tap` that first checks for a stop and reports progress layer by layer (one pass of a 4k context
    takes minutes on a busy CPU: Stop must not wait for the pass to end)."""
    def paced(layer: int, query, key, value) -> None:
        check_stop(should_stop, what)
        report(progress, done + share * layer / n_layers, f"{what.lower()}: layer {layer + 1}/{n_layers}")
        tap(layer, query, key, value)
    return paced


def _readable(rows: torch.Tensor, T: int, own: int | None) -> torch.Tensor:
    """[n, T] bool: key j is readable by query row i in the model's own attention (causal, its own window)."""
    pos = torch.arange(T, device=rows.device)
    ok = pos[None, :] <= rows[:, None]                                  # [n, T]
    return ok if own is None else ok & (rows[:, None] - pos[None, :] < own)


# ---------------------------------------------------------------------------------------------
# Retrieval heads
# ---------------------------------------------------------------------------------------------

class Answered:
    """A row that ends with its answer: `ids` [T] and the answer at ids[answer:] (teacher-forced)."""
    ids: torch.Tensor
    answer: int

    @property
    def rows(self) -> torch.Tensor:
        """[k] the query rows that predict each answer token (row i predicts ids[i + 1])."""
        return torch.arange(self.answer - 1, self.ids.numel() - 1)

    @property
    def targets(self) -> torch.Tensor:
        """[k] the answer tokens."""
        return self.ids[self.answer:]


@dataclass(frozen=True)
class NeedleItem(Answered):
    """One retrieval item: ids [T]; the needle sentence at ids[needle_start:needle_end]; the answer (the
    needle's content, teacher-forced) at ids[answer:] (it ends the row)."""
    ids: torch.Tensor
    needle_start: int
    needle_end: int
    answer: int
    length: int
    depth: float
    kind: str


def needle_content(kind: str, rng: random.Random) -> str:
    """The needle's content: NEEDLE_WORDS words of WORDS, or NEEDLE_DIGITS digits (spaced: one token
    each for most tokenizers; the answer is whatever ids the tokenizer gives)."""
    if kind == "words":
        return " " + " ".join(rng.sample(WORDS, NEEDLE_WORDS))
    return " " + " ".join(str(rng.randrange(10)) for _ in range(NEEDLE_DIGITS))


def needle_items(tokenizer, lengths, depths=DEFAULT_DEPTHS, *, needles: int = DEFAULT_NEEDLES,
                 seed: int = 0, split: str = TEST, should_stop: ShouldStop | None = None) -> list[NeedleItem]:
    """Items for every length x needle x depth, each exactly `length` tokens: [BOS] text-with-needle
    question answer. Needle n has the same content and the same haystack at every depth (only the
    needle moves) and at every length (a longer haystack starts with the same text: seeded by n). `split`:
    test rows (the evaluation half of the built-in text) or calibration rows (the other half, other needles;
    analysis.measure.splits)."""
    lengths = check_lengths(lengths)
    depths = check_depths(depths)
    needles = check_whole_number(needles, "The number of needles", low=1, high=MAX_NEEDLES)
    seed = check_seed(seed)
    bos = _bos(tokenizer)
    kinds = tuple(NEEDLE_KINDS)
    made = []
    for n in range(needles):
        kind = kinds[n % len(kinds)]
        content = needle_content(kind, random.Random(salted(split, f"headscope-needle:{seed}:{n}")))
        lead, question = NEEDLE_KINDS[kind]
        answer = _encode(tokenizer, content)
        needle = _encode(tokenizer, lead) + answer + _encode(tokenizer, ".")
        asked = _encode(tokenizer, question)
        made.append((kind, needle, asked, answer, seed * 1_000_003 + n))
    items = []
    for length in lengths:
        for kind, needle, asked, answer, hay_seed in made:
            fixed = len(bos) + len(needle) + len(asked) + len(answer)
            n_text = length - fixed
            if n_text < MIN_HAYSTACK:
                raise InputError(f"A context of {length} tokens is too short for a retrieval item: its needle, "
                                 f"question and answer take {fixed} tokens, leaving {max(n_text, 0)} of text (it "
                                 f"needs {MIN_HAYSTACK}); use at least {fixed + MIN_HAYSTACK} tokens.")
            filler = haystack(tokenizer, n_text, seed=hay_seed, split=split, should_stop=should_stop)   # [n_text]
            ends = sentence_ends(tokenizer, filler)
            for depth in depths:
                placed = place(filler, needle, depth, ends=ends)
                ids = torch.cat([torch.tensor(bos, dtype=torch.long), placed.ids,
                                 torch.tensor(asked + answer, dtype=torch.long)])   # [length]
                start = len(bos) + placed.start
                items.append(NeedleItem(ids, start, start + len(needle), length - len(answer), length, depth, kind))
    return items


def _copy_tap(item: NeedleItem, device, hits: dict, own: list):
    """A tap that records, per layer, which heads copy at each answer step: hits[layer] = [H_l, k] bool."""
    rows = item.rows.to(device)                                         # [k]
    ids = item.ids.to(device)                                           # [T]
    targets = item.targets.to(device)                                   # [k]

    def tap(layer: int, query, key, value) -> None:
        T = key.shape[2]
        H, Hkv = query.shape[1], key.shape[1]
        q = query[0][:, rows - (T - query.shape[2])].float()           # [H, k, d] (queries are the last rows)
        k = key[0].float().repeat_interleave(H // Hkv, 0)              # [H, T, d]
        s = q @ k.transpose(-1, -2)                                     # [H, k, T] (argmax: scale-free)
        s = s.masked_fill(~_readable(rows, T, own[layer]), float("-inf"))
        top = s.argmax(-1)                                              # [H, k] top-1 key per answer step
        inside = (top >= item.needle_start) & (top < item.needle_end)
        hits[layer] = inside & (ids[top] == targets[None, :])           # [H, k]
    return tap


def retrieval_scores(model, items: list[NeedleItem], *, gates=None, layout=None, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores [L, H]: mean share of answer steps at which each head copies the needle token, over items;
    accuracy [n_items]: the model's teacher-forced top-1 accuracy on each item's answer tokens)."""
    if not items:
        raise InputError("The retrieval score needs at least one item.")
    adapter = adapter_for(model)
    geo = adapter.geometry(model)
    slots = head_slots(model, layout, adapter)
    g = gates_array(model, gates)
    modules = attention_layers(model)
    own = [_own_window(m) for m in modules]
    device = input_device(model)
    sums = [None] * geo.n_layers
    accuracy = []
    for i, item in enumerate(items):
        check_stop(should_stop, "Retrieval scores")
        hits: dict = {}
        k = item.targets.numel()
        x = item.ids[None].to(device)                                   # [1, T]
        tap = _paced(_copy_tap(item, device, hits, own), geo.n_layers, "Retrieval scores", progress, i / len(items),
                     1 / len(items), should_stop)
        with torch.no_grad(), masked(model, g), tapped(model, tap):
            out = model(x, **_logits_kwargs(model, k + 1))
        logits = out.logits[0, -(k + 1):-1].float()                     # [k, V] rows predicting the answer
        accuracy.append(float((logits.argmax(-1).cpu() == item.targets).double().mean()))
        for layer, h in hits.items():
            share = h.double().mean(-1).cpu()                           # [H_l]
            sums[layer] = share if sums[layer] is None else sums[layer] + share
        report(progress, (i + 1) / len(items), f"retrieval scores: item {i + 1}/{len(items)} ({item.length} tokens, "
                                               f"depth {item.depth:g})")
    per_layer = [None if s is None else (s / len(items)).numpy() for s in sums]
    return zero_pruned(place_heads(per_layer, slots, geo.n_heads), g), np.array(accuracy)


class RetrievalDetector:
    """Retrieval heads (Wu et al. 2024: top-1 attention on the needle token being copied); verb: detect."""
    name = "retrieval"
    threshold = RETRIEVAL_THRESHOLD
    unit = "share of needle tokens copied"

    def __init__(self, lengths=None, depths=DEFAULT_DEPTHS, needles: int = DEFAULT_NEEDLES, seed: int = 0,
                 tokenizer=None):
        self.lengths = None if lengths is None else check_lengths(lengths)
        self.depths = check_depths(depths)
        self.needles = check_whole_number(needles, "The number of needles", low=1, high=MAX_NEEDLES)
        self.seed = check_seed(seed)
        self.tokenizer = tokenizer

    def resolved_lengths(self, model) -> tuple[int, ...]:
        """The lengths it reads on `model`: the ones given (checked against its context) or the defaults
        that fit."""
        limit = context_length(model)
        return check_lengths(self.lengths, limit) if self.lengths else default_lengths(RETRIEVAL_LENGTHS, limit)

    def passes(self, model) -> list[int]:
        """The token count of every forward pass `detect` runs (for time estimates)."""
        return [n for n in self.resolved_lengths(model) for _ in range(self.needles * len(self.depths))]

    def items(self, model, should_stop: ShouldStop | None = None) -> list[NeedleItem]:
        if self.tokenizer is None:
            raise InputError("The retrieval detector builds its text with the model's tokenizer; this model has none.")
        return needle_items(self.tokenizer, self.resolved_lengths(model), self.depths, needles=self.needles,
                            seed=self.seed, split=SCORE_SPLIT, should_stop=should_stop)

    @classmethod
    def for_options(cls, tokenizer, options: dict) -> "RetrievalDetector":
        """The detector's builder (its record's `build`): the shared options it takes, and the tokenizer
        (the other detectors' options, e.g. the repeated-token detectors' n_sequences, are theirs)."""
        return cls(tokenizer=tokenizer, **{k: v for k, v in options.items() if k in ("lengths", "depths", "needles", "seed")})

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        items = self.items(model, should_stop)
        scores, accuracy = retrieval_scores(model, items, gates=gates, layout=layout, progress=progress,
                                            should_stop=should_stop)
        lengths = sorted({it.length for it in items})
        by_length = {n: float(np.mean([a for a, it in zip(accuracy, items) if it.length == n])) for n in lengths}
        extras = dict(lengths=lengths, depths=list(self.depths), needles=self.needles, seed=self.seed,
                      n_items=len(items), answer_accuracy=float(accuracy.mean()), accuracy_by_length=by_length,
                      kv_scores=per_kv(scores, _group_size(model), "max"))
        return Detection(self.name, scores, self.threshold, self.unit, extras)


# ---------------------------------------------------------------------------------------------
# Streaming heads
# ---------------------------------------------------------------------------------------------

def _group_size(model) -> int:
    return adapter_for(model).geometry(model).group_size


def per_kv(scores: np.ndarray, group_size: int, how: str = "max") -> np.ndarray:
    """[L, H] -> [L, Hkv]: each KV head's max (or mean) over its G query heads."""
    s = np.asarray(scores, dtype=np.float64)
    grouped = s.reshape(s.shape[0], s.shape[1] // group_size, group_size)   # [L, Hkv, G]
    return grouped.max(-1) if how == "max" else grouped.mean(-1)


def query_rows(T: int, window: Window, n: int) -> torch.Tensor:
    """Up to n query rows spread evenly over the rows a window changes (i >= sinks + recent)."""
    first = window.size
    if window.covers(T):
        raise InputError(f"A context of {T} tokens fits inside the window ({window.describe()}): "
                         f"windowing changes nothing there; use a longer context or a smaller window.")
    return torch.unique(torch.linspace(first, T - 1, min(n, T - first)).round().long())   # [<= n]


def row_attention(module, query, key, value, rows: torch.Tensor, window: Window):
    """(p_full, p_window [H, n, T], v [H, T, d_v]): the attention probabilities of the query `rows` of the first
    sequence over every key the layer's own attention reads and over only the `window` (Window.reads), and the values they weigh, from the tapped query [B, H, q, d] (the last q rows) and key /
    value [B, Hkv, T, d]; at least float32. The window's softmax is the full one renormalised over the band."""
    T = key.shape[2]
    H, Hkv = query.shape[1], key.shape[1]
    dtype = torch.promote_types(query.dtype, torch.float32)
    r = rows.to(query.device)
    q = query[0][:, r - (T - query.shape[2])].to(dtype)                 # [H, n, d]
    k = key[0].to(dtype).repeat_interleave(H // Hkv, 0)                  # [H, T, d]
    v = value[0].to(dtype).repeat_interleave(H // Hkv, 0)                # [H, T, d_v]
    s = (q @ k.transpose(-1, -2)) * float(getattr(module, "scaling", q.shape[-1] ** -0.5))   # [H, n, T]
    cap = getattr(module, "attn_logit_softcapping", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
        s = cap * torch.tanh(s / cap)
    full = _readable(r, T, _own_window(module))                          # [n, T]
    win = full & band(r, torch.arange(T, device=r.device), window)       # [n, T]
    p_full = torch.softmax(s.masked_fill(~full, float("-inf")), -1)      # [H, n, T]
    p_win = torch.softmax(s.masked_fill(~win, float("-inf")), -1)        # [H, n, T]
    return p_full, p_win, v


def attention_rows(module, query, key, value, rows: torch.Tensor, window: Window):
    """(o_full, o_window) [H, n, d_v]: the attention outputs of `row_attention`'s rows, full and windowed."""
    p_full, p_win, v = row_attention(module, query, key, value, rows, window)
    return p_full @ v, p_win @ v                                         # [H, n, d_v] each


def _window_tap(rows: torch.Tensor, window: Window, modules: list, kept: list, out: dict):
    """A tap that stores, per layer, (||o_full - o_window||^2, ||o_full||^2) per query head and row [H, n]
    (heads the mask prunes count 0)."""

    def tap(layer: int, query, key, value) -> None:
        o_full, o_win = attention_rows(modules[layer], query, key, value, rows, window)
        diff = ((o_full - o_win) ** 2).sum(-1).double()                  # [H, n]
        norm = (o_full ** 2).sum(-1).double()                            # [H, n]
        keep = kept[layer].to(diff.device)[:, None]                      # [H, 1]
        out[layer] = (diff * keep, norm * keep)
    return tap


def _relative(diff: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """sqrt(diff / norm) with 0 where the output is 0 (nothing to change)."""
    return torch.where(norm > 0, (diff / norm.clamp_min(1e-300)).sqrt(), torch.zeros_like(diff))


def streaming_scores(model, sequences, *, window: Window = Window(), queries: int = DEFAULT_QUERIES, gates=None, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(per KV head [L, Hkv], per query head [L, H]) relative output change under the window, mean over
    the sampled rows of every sequence (a list of ids [T], or ids [n, T]). One dense pass per sequence.
    A head the mask prunes is left out of its group (a group with none left scores 0)."""
    window = window_of(window)
    queries = check_whole_number(queries, "The number of query rows", low=1, high=MAX_QUERIES)
    _, geo = whole_model(model, "The streaming score")
    g = gates_array(model, gates)
    kept = [torch.ones(geo.n_heads) if g is None else (g[l] != 0).double() for l in range(geo.n_layers)]
    modules = attention_layers(model)
    device = input_device(model)
    seqs = [torch.as_tensor(s) for s in (sequences if isinstance(sequences, (list, tuple)) else list(sequences))]
    G = geo.group_size
    kv_sum = np.zeros((geo.n_layers, geo.n_kv_heads))
    head_sum = np.zeros((geo.n_layers, geo.n_heads))
    count = 0
    for i, ids in enumerate(seqs):
        check_stop(should_stop, "Streaming scores")
        rows = query_rows(int(ids.numel()), window, queries)            # [n]
        out: dict = {}
        tap = _paced(_window_tap(rows, window, modules, kept, out), geo.n_layers, "Streaming scores", progress,
                     i / len(seqs), 1 / len(seqs), should_stop)
        with torch.no_grad(), masked(model, g), tapped(model, tap):
            model(ids.reshape(1, -1).to(device), **_logits_kwargs(model, 1))
        for layer, (diff, norm) in out.items():
            head_sum[layer] += _relative(diff, norm).mean(-1).cpu().numpy()                       # [H]
            gd = diff.reshape(geo.n_kv_heads, G, -1).sum(1)                                        # [Hkv, n]
            gn = norm.reshape(geo.n_kv_heads, G, -1).sum(1)
            kv_sum[layer] += _relative(gd, gn).mean(-1).cpu().numpy()                              # [Hkv]
        count += 1
        report(progress, (i + 1) / len(seqs), f"streaming scores: sequence {i + 1}/{len(seqs)} ({ids.numel()} tokens)")
    head = zero_pruned(head_sum / count, g)
    return kv_sum / count, head


def streaming_text(tokenizer, length: int, *, seed: int = 0, split: str = SCORE_SPLIT,
                   should_stop: ShouldStop | None = None) -> torch.Tensor:
    """ids [length]: [BOS] + built-in text (a haystack without a needle), from the half of `split` (a score's
    rows: the calibration half, apart from every verdict's rows; analysis.measure.splits)."""
    bos = _bos(tokenizer)
    text = haystack(tokenizer, length - len(bos), seed=seed, split=split,
                    should_stop=should_stop)                                             # [length - len(bos)]
    return torch.cat([torch.tensor(bos, dtype=torch.long), text])


class StreamingDetector:
    """Streaming heads (DuoAttention's question): output change under sinks + a recent window; verb: detect."""
    name = "streaming"
    threshold = STREAMING_THRESHOLD
    unit = "relative output change"

    def __init__(self, lengths=None, window: Window = Window(), queries: int = DEFAULT_QUERIES,
                 n_sequences: int = DEFAULT_SEQUENCES, seed: int = 0, tokenizer=None):
        self.lengths = None if lengths is None else check_lengths(lengths)
        self.window = window_of(window)
        self.queries = check_whole_number(queries, "The number of query rows", low=1, high=MAX_QUERIES)
        self.n_sequences = check_whole_number(n_sequences, "The number of sequences", low=1, high=MAX_SEQUENCES)
        self.seed = check_seed(seed)
        self.tokenizer = tokenizer

    def resolved_lengths(self, model) -> tuple[int, ...]:
        limit = context_length(model)
        return check_lengths(self.lengths, limit) if self.lengths else default_lengths(STREAMING_LENGTHS, limit)

    def passes(self, model) -> list[int]:
        return [n for n in self.resolved_lengths(model) for _ in range(self.n_sequences)]

    def sequences(self, model, should_stop: ShouldStop | None = None) -> list[torch.Tensor]:
        if self.tokenizer is None:
            raise InputError("The streaming score reads built-in text through the model's tokenizer; this model has "
                             "none.")
        return [streaming_text(self.tokenizer, n, seed=self.seed * 1_000_003 + i, should_stop=should_stop)
                for n in self.resolved_lengths(model) for i in range(self.n_sequences)]

    @classmethod
    def for_options(cls, tokenizer, options: dict) -> "StreamingDetector":
        """The detector's builder (its record's `build`): the shared options it takes, and the tokenizer
        (the other detectors' options, e.g. the repeated-token detectors' n_sequences, are theirs)."""
        taken = {k: v for k, v in options.items() if k in ("lengths", "queries", "seed")}
        window = Window(**{k: options[k] for k in ("sinks", "recent") if options.get(k) is not None})
        return cls(tokenizer=tokenizer, window=window, **taken)

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        whole_model(model, "The streaming score", layout)
        seqs = self.sequences(model, should_stop)
        kv, head = streaming_scores(model, seqs, window=self.window, queries=self.queries,
                                    gates=gates, progress=progress, should_stop=should_stop)
        G = _group_size(model)
        g = gates_array(model, gates)
        scores = zero_pruned(np.repeat(kv, G, axis=1), g)               # [L, H]: each head shows its KV head's
        extras = dict(lengths=sorted({int(s.numel()) for s in seqs}), **self.window.as_dict(),
                      queries=self.queries, n_sequences=self.n_sequences, seed=self.seed, kv_scores=kv,
                      head_scores=head)
        return Detection(self.name, scores, self.threshold, self.unit, extras)


# ---------------------------------------------------------------------------------------------
# The end-to-end oracle of the streaming score
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowingEffect:
    """Windowing one KV head alone, end to end: loss_delta / kl [L, Hkv] (mean over the predictions made
    beyond the window), the dense loss there and how many predictions that is."""
    loss_delta: np.ndarray
    kl: np.ndarray
    base_loss: float
    n_predictions: int


def _window_logprobs(model, x: torch.Tensor, first: int) -> torch.Tensor:
    """log-probabilities [n, T - 1 - first, V] of the predictions made at rows first .. T-2."""
    T = x.shape[1]
    logits = model(x, **_logits_kwargs(model, T - first)).logits[:, -(T - first):-1]   # [n, T-1-first, V]
    return torch.log_softmax(logits.double(), -1)


def windowing_effect(model, ids, *, window: Window, progress: Progress | None = None,
                     should_stop: ShouldStop | None = None) -> WindowingEffect:
    """For every (layer, KV head): run `model` on ids [n, T] with that KV head alone windowed
    (analysis.arch.spans.windowed) and compare the next-token predictions beyond the window with the
    dense model's: mean NLL change and mean KL(dense || windowed). L x Hkv + 1 forward passes."""
    window = window_of(window)
    x = torch.as_tensor(ids)
    x = (x[None] if x.dim() == 1 else x).to(input_device(model))         # [n, T]
    first = window.size
    if x.shape[1] - 1 <= first:
        raise InputError(f"A context of {x.shape[1]} tokens makes no prediction beyond the window "
                         f"({window.describe()}); use a longer context or a smaller window.")
    geo = adapter_for(model).geometry(model)
    targets = x[:, first + 1:]                                            # [n, T-1-first]
    with torch.no_grad():
        dense = _window_logprobs(model, x, first)                        # [n, m, V]
        base = -dense.gather(-1, targets[..., None])[..., 0]             # [n, m]
        loss = np.zeros((geo.n_layers, geo.n_kv_heads))
        kl = np.zeros_like(loss)
        todo = geo.n_layers * geo.n_kv_heads
        for n in range(todo):
            check_stop(should_stop, "Windowing effect")
            layer, head = divmod(n, geo.n_kv_heads)
            plan = np.zeros((geo.n_layers, geo.n_kv_heads), dtype=bool)
            plan[layer, head] = True
            with windowed(model, plan, window):
                lp = _window_logprobs(model, x, first)                   # [n, m, V]
            loss[layer, head] = float((-lp.gather(-1, targets[..., None])[..., 0] - base).mean())
            kl[layer, head] = float((dense.exp() * (dense - lp)).sum(-1).mean())
            report(progress, (n + 1) / todo, f"windowing effect: layer {layer}, KV head {head}")
    return WindowingEffect(loss, kl, float(base.mean()), int(base.numel()))


# ---------------------------------------------------------------------------------------------
# Where the last positions look (the Walkthrough's real head)
# ---------------------------------------------------------------------------------------------

MAX_LAST_ROWS = 64


@dataclass(frozen=True)
class LastRows:
    """Every head's attention from the last `queries` positions of one text (`last_rows`)."""
    mass: np.ndarray            # [L, H, T] float64: the attention over the keys, mean over the queries
    top1: np.ndarray            # [L, H, Q] int: the most-attended key of each query
    window_change: np.ndarray   # [L, H]: ||o - o_window|| / ||o|| of the head's output, mean over the queries
    window: Window
    queries: int

    @property
    def n_tokens(self) -> int:
        return int(self.mass.shape[-1])

    def share(self, start: int, stop: int) -> np.ndarray:
        """[L, H] attention mass on keys start .. stop - 1."""
        return self.mass[..., max(start, 0):max(stop, 0)].sum(-1)

    def regions(self) -> dict[str, np.ndarray]:
        """[L, H] mass on the sink tokens, on the recent window of the last query, and on everything between."""
        T, w = self.n_tokens, self.window
        sinks = self.share(0, min(w.sinks, T))
        recent = self.share(max(T - w.recent, w.sinks), T)
        return {"sinks": sinks, "recent": recent, "far": np.clip(1.0 - sinks - recent, 0.0, 1.0)}


def last_rows(model, ids, *, queries: int = 8, window: Window = Window(), progress: Progress | None = None,
              should_stop: ShouldStop | None = None) -> LastRows:
    """Where every head looks from the last `queries` positions of ids [T] (one sequence from token 0), and
    what the `window` would change in its output: `row_attention` of those rows in every layer,
    from one tapped dense pass (never the [T, T] probabilities)."""
    queries = check_whole_number(queries, "The number of query rows", low=1, high=MAX_LAST_ROWS)
    window = window_of(window)
    ids = torch.as_tensor(ids).flatten()                                   # [T]
    T = ids.numel()
    if T < queries:
        raise InputError(f"The text has {T} tokens, fewer than the {queries} query rows asked for.")
    modules = attention_layers(model)
    L, H = len(modules), adapter_for(model).geometry(model).n_heads
    mass, top1, change = np.zeros((L, H, T)), np.zeros((L, H, queries), np.int64), np.zeros((L, H))
    rows = torch.arange(T - queries, T)                                    # [Q]

    def tap(layer: int, query, key, value) -> None:
        p, pw, v = row_attention(modules[layer], query, key, value, rows, window)   # [H, Q, T] x 2, [H, T, d]
        out, out_w = p @ v, pw @ v                                         # [H, Q, d_v]
        diff = ((out - out_w) ** 2).sum(-1).double()                       # [H, Q]
        mass[layer] = p.mean(1).double().cpu().numpy()
        top1[layer] = p.argmax(-1).cpu().numpy()
        change[layer] = _relative(diff, (out ** 2).sum(-1).double()).mean(-1).cpu().numpy()

    paced = _paced(tap, L, "Reading the attention rows", progress, 0.0, 1.0, should_stop)
    with torch.no_grad(), tapped(model, paced):
        model(input_ids=ids[None].to(input_device(model)), **_logits_kwargs(model, 1))
    report(progress, 1.0, "done")
    return LastRows(mass, top1, change, window, queries)


__all__ = ["NeedleItem", "needle_items", "retrieval_scores", "RetrievalDetector", "streaming_scores",
           "StreamingDetector", "streaming_text", "attention_rows", "row_attention", "last_rows", "LastRows",
           "per_kv", "query_rows", "windowing_effect", "WindowingEffect", "check_lengths", "check_depths", "whole_model",
           "RETRIEVAL_THRESHOLD", "STREAMING_THRESHOLD"]
