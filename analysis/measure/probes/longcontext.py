"""Long-context probes: find a pass key, the right one of two facts, or a random sequence far back.

Every row is exactly `length` tokens (the whole row: the BOS choice, an instruction, real text, the
needle, the question and the answer up to its last read token), built offline from the built-in
Wikipedia text (analysis.measure.haystack: seeded, a needle after the sentence end nearest its depth):

- **passkey**: an instruction, text, the needle " The pass key is 48213. Remember it. 48213 is the pass
  key." at the depth, more text, then "What is the pass key? The pass key is" and the key read one
  digit at a time (teacher forcing: digit k is read with digits 0..k-1 already given). Each digit is
  an item; its contrast is another digit (the same digit slot of a random other key). A key whose
  digits the tokenizer does not split one token each (most GPT-2-style tokenizers merge numbers) is
  left out and counted. `exact_match` = the share of keys whose every digit is right.
- **needle**: two facts, "The special magic number for <city> is <number>." at the depth and the same
  sentence for another city with another number half a context away (depth + 0.5, wrapped), then the
  question about the first city. Items are the number's digits; the contrast of each is the
  distractor's digit in the same slot (every slot differs), which is also in the context: copying a
  number from the context is not enough, the model must copy the one that belongs to the city asked.
- **long-copying**: `span` random token ids (as the copying probe's repeated_random_tokens) at the
  depth, text, then the same ids again at the end; items are the second copy's positions 1 .. span-1
  (the next token of the first copy, against another token of the sequence): induction at distance.

Units: one sequence (one key, one haystack) is one bootstrap unit: the same key and the same text are read
at every depth (only the needle moves), so depths are compared on the same material, and a sequence's rows
are resampled together. Conditions are
"depth 0.5" etc.; `depth_scores` gives accuracy, logit difference and exact match with bootstrap CIs
per depth and over all depths.

The probes are declared with `long=True` (analysis.measure.probes.registry): never in the default set
of the short probes, run when asked for by name (at their default length through `headscope probes`,
at chosen lengths through `headscope longctx` / analysis.score.longcontext).

Cost: a row is one forward pass of `length` tokens, whose attention grows with the square of the length
(a row of 8,192 tokens cost 2.5x a row of 4,096 on 2 CPU cores). `long_work` counts the rows and tokens per
length, `row_seconds` estimates one row's seconds at each length on this machine from two cheap timings.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch

from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import ShouldStop, check_stop, raise_if_signalled
from analysis.measure.evaluation import context_length
from analysis.measure.haystack import haystack, place, sentence_ends
from analysis.measure.probes.items import Draft, Probe, ProbeItems, Vocabulary
from analysis.measure.probes.measure import _keep_positions, bootstrap, item_values, score_items
from analysis.measure.long_options import (DEFAULT_DEPTHS, MAX_PROBE_SEQUENCES, MIN_PROBE_SEQUENCES,  # noqa: F401
                                           PROBE_LENGTH, PROBE_SEQUENCES)
from analysis.measure.longheads import check_depths, check_lengths
from analysis.measure.probes.registry import long_chosen

DEFAULT_LENGTH, DEFAULT_SEQUENCES = PROBE_LENGTH, PROBE_SEQUENCES     # declared in long_options (light)
MIN_SEQUENCES, MAX_SEQUENCES = MIN_PROBE_SEQUENCES, MAX_PROBE_SEQUENCES
KEY_DIGITS = 5
COPY_SPAN = 16                   # tokens of the long-copying probe's random sequence
MIN_HAYSTACK = 32                # tokens of real text a row must hold at least
DISTRACTOR_SHIFT = 0.5           # the needle probe's second fact sits this far (wrapped) from the first
ALL = "all"                      # the depth_scores key over every depth

PASSKEY_INSTRUCTION = ("A pass key is hidden somewhere in the text below, among a lot of text that has nothing "
                       "to do with it. Find the pass key and remember it: you will be asked for it at the end.\n\n")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
NEEDLE_INSTRUCTION = ("Special magic numbers for a few cities are hidden in the text below. Remember them: you "
                      "will be asked for one of them at the end.\n\n")
NEEDLE_FACT = " The special magic number for {city} is {number}."
NEEDLE_QUESTION = "\n\nWhat is the special magic number for {city}? The special magic number for {city} is"
CITIES = ("Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Berlin", "Dublin", "Vienna", "Prague", "Lisbon",
          "Athens", "Rome", "Warsaw", "Moscow", "Beijing", "Seoul", "Bangkok", "Delhi", "Mumbai", "Nairobi", "Lagos",
          "Sydney", "Toronto", "Chicago", "Boston", "Denver", "Havana", "Santiago", "Bogota", "Quito", "Manila",
          "Jakarta", "Hanoi", "Tehran", "Baghdad", "Istanbul", "Helsinki", "Stockholm", "Copenhagen", "Brussels",
          "Amsterdam", "Zurich", "Geneva", "Munich", "Milan", "Naples", "Venice", "Florence", "Kyoto")


@dataclass(frozen=True)
class Parts:
    """One sequence before the haystack is sized: ids of the instruction, the needles (ids, depth shift:
    0 = at the depth asked, s = at depth + s wrapped), the question + answer, and the reads (index into
    `tail`, contrast id) in order."""
    head: tuple[int, ...]
    needles: tuple[tuple[tuple[int, ...], float], ...]
    tail: tuple[int, ...]
    reads: tuple[tuple[int, int], ...]


def digit_answer(vocab: Vocabulary, prompt: str, number: str) -> tuple[list[int], list[int]] | None:
    """(answer ids, indices of the digits in them) when `prompt + " " + number` tokenizes as the prompt's own
    tokens, then at most some whitespace tokens, then exactly one token per digit of `number`; else None."""
    head, whole = vocab.encode(prompt), vocab.encode(f"{prompt} {number}")
    if whole[:len(head)] != head:
        return None
    tail = whole[len(head):]
    pieces = [vocab.tokenizer.decode([t]).strip() for t in tail]
    digits = [i for i, p in enumerate(pieces) if p]
    if (len(digits) != len(number) or [pieces[i] for i in digits] != list(number)
            or digits != list(range(len(tail) - len(number), len(tail)))):
        return None
    return tail, digits


def other_digits(number: str, rng) -> str:
    """A number of the same length whose every digit differs from `number`'s in the same slot."""
    return "".join(rng.choice([d for d in "0123456789" if d != c and (i or d != "0")]) for i, c in enumerate(number))


def random_key(rng, digits: int = KEY_DIGITS) -> str:
    return str(rng.randrange(1, 10)) + "".join(str(rng.randrange(10)) for _ in range(digits - 1))


def digit_parts(vocab: Vocabulary, head: str, needles, prompt: str, number: str, contrast: str,
                what: str) -> Parts | None:
    """Parts of a digit-answer probe: `number` read digit by digit against `contrast`'s digit in the same slot;
    None (counted under `what`) when the tokenizer does not give one token per digit to both."""
    answer, other = digit_answer(vocab, prompt, number), digit_answer(vocab, prompt, contrast)
    if answer is None or other is None or len(answer[0]) != len(other[0]) or answer[1] != other[1]:
        vocab.reject(what, f"{number}/{contrast}")
        return None
    (tail, at), (tail_c, _) = answer, other
    question = vocab.encode(prompt)
    return Parts(tuple(vocab.encode(head)), tuple((tuple(vocab.encode(t)), s) for t, s in needles),
                 tuple(question + tail), tuple((len(question) + i, tail_c[i]) for i in at))


def insert(filler: torch.Tensor, needles, ends: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """filler [N] with every (ids [k], depth) needle placed after the sentence end nearest its depth (in the
    original text; needles at one spot go in the order given) -> (ids [N + sum k], each needle's start)."""
    spots = [place(filler, torch.tensor(ids, dtype=torch.long), depth, ends=ends).start for ids, depth in needles]
    order = sorted(range(len(needles)), key=lambda i: (spots[i], i))
    pieces, starts, done, shift = [], [0] * len(needles), 0, 0
    for i in order:
        pieces.append(filler[done:spots[i]])
        starts[i] = spots[i] + shift
        pieces.append(torch.tensor(needles[i][0], dtype=torch.long))
        shift += len(needles[i][0])
        done = spots[i]
    pieces.append(filler[done:])
    return torch.cat(pieces), starts                                     # [N + sum k]


def depth_label(depth: float) -> str:
    return f"depth {depth:g}"


class LongProbe(Probe):
    """Base of the long-context probes: `parts` (one sequence's pieces) laid out at every depth, the haystack
    sized so each row is exactly `length` tokens. n_items = sequences per depth (each a bootstrap unit)."""
    abstract = True                  # a base, not a probe: no registry record names it (tests/test_cli_fast.py)
    digit_answers = True             # items are a number's digits: exact match per key is reported

    def __init__(self, n_items: int = DEFAULT_SEQUENCES, seed: int = 0, bos: str = "auto",
                 length: int = DEFAULT_LENGTH, depths=DEFAULT_DEPTHS):
        super().__init__(MIN_SEQUENCES * 4, seed, bos)                    # checks seed and bos; n_items is ours
        self.n_items = check_whole_number(n_items, "The number of sequences per depth", low=MIN_SEQUENCES,
                                          high=MAX_SEQUENCES)
        self.length = check_whole_number(length, "The context length (tokens)", low=1)
        self.depths = check_depths(depths)

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        raise NotImplementedError

    def haystack_seed(self, i: int) -> int:
        return self.seed * 1_000_003 + i

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        if kind != "causal-lm":
            raise InputError(f"The {self.label} probe reads a causal language model's next tokens.")
        bos = self.bos_ids(vocab.tokenizer)
        rng, out, made = self.rng(), [], 0
        self._row_sequence, seen = [], set()                         # the sequence of each row, in layout order
        for _ in range(4 * self.n_items):
            if made >= self.n_items:
                break
            p = self.parts(vocab, made, rng)
            if p is None:
                continue
            fixed = len(bos) + len(p.head) + sum(len(ids) for ids, _ in p.needles) + p.reads[-1][0]
            n = self.length - fixed
            if n < MIN_HAYSTACK:
                raise InputError(f"A context of {self.length} tokens is too short for the {self.label} probe: its "
                                 f"instruction, needle and question take {fixed}, leaving {max(n, 0)} of text "
                                 f"(it needs {MIN_HAYSTACK}); use at least {fixed + MIN_HAYSTACK} tokens.")
            filler = haystack(vocab.tokenizer, n, seed=self.haystack_seed(made))         # [n]
            ends = sentence_ends(vocab.tokenizer, filler)
            for depth in self.depths:
                needles = [(ids, depth if not s else (depth + s) % 1.0) for ids, s in p.needles]
                body, _ = insert(filler, needles, ends)
                tokens = tuple(p.head) + tuple(body.tolist()) + tuple(p.tail)
                if tokens not in seen:                                # depths that land on one spot share a row
                    seen.add(tokens)
                    self._row_sequence.append(made)
                start = len(p.head) + body.numel()
                out += [Draft(tokens, start + at, contrast, depth_label(depth)) for at, contrast in p.reads]
            made += 1
        return out

    def build(self, tokenizer, kind: str) -> ProbeItems:
        """The items with one bootstrap unit per sequence (its rows at every depth share the key and the text,
        so they are resampled together), not per row."""
        items = super().build(tokenizer, kind)
        sequence = torch.tensor(self._row_sequence, dtype=torch.long)      # [S] row -> sequence
        items = replace(items, unit=sequence[items.row])
        return replace(items, notes=self.notes(items))

    def row_exact(self, items: ProbeItems, diff: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(per row, i.e. a key at one depth: every scored item right [B, R] as float, the unit of each row [R])."""
        s = items.scored.numpy()
        rows, units = items.row.numpy()[s], items.unit.numpy()[s]
        ids, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
        wrong = np.zeros((diff.shape[0], ids.size))
        np.add.at(wrong.T, inverse, (diff[:, s] <= 0).T)
        return (wrong == 0).astype(np.float64), units[first]

    def extras(self, items: ProbeItems, diff, nll) -> dict:
        """exact_match (every digit of a key right, per key and depth) and its bootstrap CI over sequences,
        per mask [B]."""
        if not self.digit_answers:
            return {}
        exact, units = self.row_exact(items, diff)                       # [B, R]
        mean, ci = bootstrap(exact, units, seed=self.seed)
        return {"exact_match": mean, "exact_match_low": ci[:, 0], "exact_match_high": ci[:, 1]}

    def notes(self, items: ProbeItems) -> tuple[str, ...]:
        return (f"{self.length} tokens per row at depths {', '.join(f'{d:g}' for d in self.depths)}; "
                f"{items.n_units} sequences, {items.n_items} items",)


class PasskeyProbe(LongProbe):
    """The pass key hidden in text: its digits read one by one."""

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        key = random_key(rng)
        return digit_parts(vocab, PASSKEY_INSTRUCTION, [(PASSKEY_NEEDLE.format(key=key), 0.0)], PASSKEY_QUESTION,
                           key, other_digits(key, rng), "keys whose digits are not one token each")


class NeedleProbe(LongProbe):
    """One of two facts of the same form: the number of the city asked for, against the other city's."""

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        city, other_city = rng.sample(CITIES, 2)
        number = random_key(rng)
        distractor = other_digits(number, rng)
        needles = [(NEEDLE_FACT.format(city=city, number=number), 0.0),
                   (NEEDLE_FACT.format(city=other_city, number=distractor), DISTRACTOR_SHIFT)]
        return digit_parts(vocab, NEEDLE_INSTRUCTION, needles, NEEDLE_QUESTION.format(city=city), number,
                           distractor, "numbers whose digits are not one token each")


class LongCopyingProbe(LongProbe):
    """A random token sequence at the depth, repeated at the end: continue the second copy from the first."""
    digit_answers = False

    def __init__(self, n_items: int = DEFAULT_SEQUENCES, seed: int = 0, bos: str = "auto",
                 length: int = DEFAULT_LENGTH, depths=DEFAULT_DEPTHS, span: int = COPY_SPAN):
        super().__init__(n_items, seed, bos, length, depths)
        self.span = check_whole_number(span, "The copied sequence's length (tokens)", low=4, high=512)
        self._sequences = None

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        from analysis.measure.detectors import repeated_random_tokens
        if self._sequences is None:
            exclude = tuple(getattr(vocab.tokenizer, "all_special_ids", ()) or ())
            self._sequences = repeated_random_tokens(len(vocab.tokenizer), self.n_items, self.span, seed=self.seed,
                                                     exclude=exclude)[:, :self.span].tolist()    # [n, span]
        r = tuple(self._sequences[i])
        N = len(r)
        reads = tuple((k, r[(k + rng.randrange(1, N)) % N]) for k in range(1, N))
        return Parts((), ((r, 0.0),), r, reads)


# -- building at chosen lengths ---------------------------------------------------------------------------

def build_long(names, tokenizer, kind: str, lengths, *, depths=DEFAULT_DEPTHS, n_items: int = DEFAULT_SEQUENCES,
               seed: int = 0, bos: str = "auto", limit: int | None = None, should_stop: ShouldStop | None = None,
               **options) -> dict[tuple[str, int], tuple]:
    """(name, length) -> (spec, probe, items) for every long probe in `names` (None: all) at every length:
    rows of exactly `length` tokens, `n_items` sequences per depth. limit: the model's context length.
    should_stop is checked before each probe and length; Ctrl-C (the signal flag) also before every
    haystack article (`haystack`), so a build of dozens of 8k-token rows stops at once."""
    from analysis.measure.probes.registry import probe_spec
    seed = check_seed(seed, "The long-context probes' seed")
    picked = long_chosen(names, kind)
    lengths, depths = check_lengths(lengths, limit), check_depths(depths)
    out = {}
    for name in picked:
        spec = probe_spec(name)
        for length in lengths:
            check_stop(should_stop, "Building the long-context probes")
            probe = spec.make(n_items=n_items, seed=seed, bos=bos, length=length, depths=depths, **options)
            out[(name, length)] = (spec, probe, probe.build(tokenizer, kind))
    return out


def subset(items: ProbeItems, keep: np.ndarray) -> ProbeItems:
    """The items where keep [n] is True, with only the rows they read."""
    k = torch.as_tensor(np.asarray(keep, dtype=bool))
    rows = items.row[k].unique()                                         # [S'] sorted
    new_row = torch.full((items.ids.shape[0],), -1, dtype=torch.long)
    new_row[rows] = torch.arange(rows.numel())
    return replace(items, ids=items.ids[rows], lengths=items.lengths[rows], row=new_row[items.row[k]],
                   position=items.position[k], correct=items.correct[k], contrast=items.contrast[k],
                   unit=items.unit[k], reference=items.reference[k],
                   conditions=tuple(c for c, kept in zip(items.conditions, keep) if kept))


def depth_scores(spec, probe, items: ProbeItems, diff: np.ndarray, nll: np.ndarray, *, seed: int = 0,
                 seconds: float = 0.0) -> dict:
    """depth label (and ALL) -> ProbeScore of those items (accuracy, logit difference, exact match, CIs [B])."""
    conds = np.array(items.conditions)
    out = {ALL: score_items(spec, probe, items, diff, nll, seed=seed, seconds=seconds)}
    for label in dict.fromkeys(items.conditions):
        keep = conds == label
        out[label] = score_items(spec, probe, subset(items, keep), diff[:, keep], nll[:, keep], seed=seed)
    return out


# -- cost: rows, tokens, seconds ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LongWork:
    """What a run reads: rows per length (one pass), and how many passes (dense, cut) go over them."""
    rows: dict                     # length -> rows
    passes: int = 1

    @property
    def tokens(self) -> dict:
        """length -> tokens read (all passes): the work the app's pace is learned per."""
        return {n: n * r * self.passes for n, r in self.rows.items()}

    @property
    def total_tokens(self) -> int:
        return int(sum(self.tokens.values()))

    def seconds(self, per_row: dict) -> float:
        """The whole run's seconds from one row's seconds at each length (`row_seconds`)."""
        return float(sum(per_row[n] * r * self.passes for n, r in self.rows.items()))


def long_work(built: dict, passes: int = 1) -> LongWork:
    rows: dict[int, int] = {}
    for (_, length), (_, _, items) in built.items():
        rows[length] = rows.get(length, 0) + int(items.ids.shape[0])
    return LongWork(dict(sorted(rows.items())), passes)


@torch.no_grad()
def row_seconds(model, lengths, *, short: int = 256, rows: int = 8, geometry=None) -> dict[int, float]:
    """length -> seconds of one forward pass of one row on this machine, estimated from two cheap timings: a
    forward of `rows` x `short` tokens (what everything but attention costs per token: about the same at any
    length, once the matrices are that large) and the attention kernel alone (sdpa, causal, [1, H, T, d]) at
    each length, times the number of layers; each timing the faster of two (the kernel's share grows with the
    length: on 2 CPU cores, 6 of 17 s a row at 4,096 tokens, docs/results.md). An estimate: windowed heads (a KV plan) run a masked kernel, slower than the
    causal one timed here, and a busy machine is slower than it was while timing."""
    from analysis.arch.adapters import adapter_for, input_device
    g = geometry or adapter_for(model).geometry(model)
    device = input_device(model)
    dtype = next(model.parameters()).dtype

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(2):
            raise_if_signalled()                                        # Ctrl-C between the timings
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    def kernel(T: int) -> float:
        q = torch.randn(1, g.n_heads, T, g.head_dim, dtype=dtype, device=device)          # [1, H, T, d]
        return timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))

    n = min(short, context_length(model, default=short))
    x = torch.randint(0, model.get_input_embeddings().weight.shape[0], (rows, n), device=device)   # [rows, n]
    handle = model.base_model.register_forward_hook(_keep_positions(torch.arange(rows), torch.full((rows,), n - 1)))  # one logit a row
    try:
        with stop_between_layers(model, None, "The time estimate"):    # Ctrl-C within a layer, not the whole pass
            whole = timed(lambda: model(input_ids=x, use_cache=False))
    finally:
        handle.remove()
    per_token = max(whole - rows * g.n_layers * kernel(n), 0.0) / (rows * n)
    return {int(T): per_token * T + g.n_layers * kernel(int(T)) for T in lengths}


# -- running ---------------------------------------------------------------------------------------------

@contextmanager
def stop_between_layers(model, should_stop: ShouldStop | None, what: str = "The long-context probes") -> Iterator:
    """A cancel check before every decoder layer, so Stop (should_stop) or Ctrl-C (the signal flag, also without
    a should_stop: the CLI's) ends an 8k-token forward within a layer's time, not the row's minutes."""
    from analysis.arch.adapters import adapter_for
    from analysis.arch.hooks import attached
    with attached() as hooks:
        for layer in adapter_for(model).layers(model):
            hooks.before(layer, lambda module, args: check_stop(should_stop, what))
        yield


def measure_long(model, built: dict, *, gates=None, seed: int = 0, progress=None,
                 should_stop: ShouldStop | None = None, weights: dict | None = None) -> dict:
    """(name, length) -> depth_scores of `built` (build_long) on `model` under gates [B, L, H] (None: as it is;
    wrap the call in a KV plan's `applied` for a plan). weights: (name, length) -> share of the time (progress)."""
    from analysis.core.progress import report, scaled
    seed = check_seed(seed, "The long-context probes' seed")           # before the passes, not after them
    keys = list(built)
    w = np.array([float((weights or {}).get(k, built[k][2].n_tokens)) for k in keys])
    edges = np.concatenate([[0.0], np.cumsum(w) / max(w.sum(), 1e-12)])
    out = {}
    with stop_between_layers(model, should_stop):
        for i, key in enumerate(keys):
            spec, probe, items = built[key]
            check_stop(should_stop, "The long-context probes")
            t0 = time.perf_counter()
            part = scaled(progress, edges[i], edges[i + 1])
            named = None if part is None else (lambda f, m, part=part, key=key:
                                               part(f, f"{key[0]} at {key[1]:,} tokens ({m.split(': ')[-1]})"))
            diff, nll = item_values(model, items, gates, progress=named, should_stop=should_stop)
            out[key] = depth_scores(spec, probe, items, diff, nll, seed=seed, seconds=time.perf_counter() - t0)
    report(progress, 1.0, "long-context probes done")
    return out
