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
- **passkey-once**: the same with the key stated once (" The pass key is 48213. Remember it."), on the same
  keys, contrasts and text (passkey's random stream), so the two variants compare on the same material.
- **needle**: two facts, "The special magic number for <city> is <number>." at the depth and the same
  sentence for another city with another number half a context away (depth + 0.5, wrapped), then the
  question about the first city. Items are the number's digits; the contrast of each is the
  distractor's digit in the same slot (every slot differs), which is also in the context: copying a
  number from the context is not enough, the model must copy the one that belongs to the city asked.
- **long-copying**: `span` random token ids (as the copying probe's repeated_random_tokens) at the
  depth, text, then the same ids again at the end; items are the second copy's positions 1 .. span-1
  (the next token of the first copy, against another token of the sequence): induction at distance.

**The generated answer** of the digit-answer probes (passkey, passkey-once, needle), as the field judges them:
each row's prompt is the row up to the answer (it ends with the question: `Answers`), decoded greedily (the
model's own argmax, analysis.measure.decode) for the answer's tokens + GENERATE_EXTRA more; the row is right
(`generated` 1) when the decoded continuation's first number (`first_number`: the first run of ASCII digits) is
the key. `answer_values` reads a batch of rows of one length from one prefill of their prompts into one cache
(a cut's own, e.g. a KV plan's compact cache): a copy of it reads the answer's tokens (the teacher-forced items:
the same logits as one pass over the whole row), the cache itself decodes.

Units: one sequence (one key, one haystack) is one bootstrap unit: the same key and the same text are read
at every depth (only the needle moves), so depths are compared on the same material, and a sequence's rows
are resampled together. Conditions are
"depth 0.5" etc.; `depth_scores` gives accuracy, logit difference, exact match and the generated answers'
exact match with bootstrap CIs per depth and over all depths (the same resamples); `measure_long` returns them
with each row's generated answer as `LongScores`.

The probes are declared with `long=True` (analysis.measure.probes.registry): never in the default set
of the short probes, run when asked for by name (at their default length through `headscope probes`,
at chosen lengths through `headscope longctx` / analysis.score.longcontext).

Cost: a row is one forward pass of `length` tokens, whose attention grows with the square of the length
(a row of 8,192 tokens cost 2.5x a row of 4,096 on 2 CPU cores); a digit-answer row adds, per batch of rows, one
call for the teacher-forced answer tokens and one decode call per generated token after the first
(`decode_calls`: the answer's tokens + GENERATE_EXTRA a batch). `long_work` counts the rows and decode calls
per length, `row_seconds` and `step_seconds` estimate one row's and one decode call's seconds at each length on
this machine from cheap timings.
"""
from __future__ import annotations

import copy
import random
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np
import torch

from analysis.core.clock import Clock
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import ShouldStop, check_stop, raise_if_signalled
from analysis.measure.evaluation import context_length
from analysis.measure.haystack import haystack, place, sentence_ends
from analysis.measure.probes.items import Draft, Probe, ProbeItems, Vocabulary
from analysis.measure.probes.measure import (BATCH_TOKENS, bootstrap, item_values, keep_positions, read_values,
                                            score_items)
from analysis.measure.long_options import (DEFAULT_DEPTHS, MAX_PROBE_SEQUENCES, MIN_PROBE_SEQUENCES,  # noqa: F401
                                           PROBE_LENGTH, PROBE_SEQUENCES)
from analysis.measure.longheads import check_depths, check_lengths
from analysis.measure.probes.registry import long_chosen
from analysis.measure.splits import TEST, check_split, salted

DEFAULT_LENGTH, DEFAULT_SEQUENCES = PROBE_LENGTH, PROBE_SEQUENCES     # declared in long_options (light)
MIN_SEQUENCES, MAX_SEQUENCES = MIN_PROBE_SEQUENCES, MAX_PROBE_SEQUENCES
KEY_DIGITS = 5
COPY_SPAN = 16                   # tokens of the long-copying probe's random sequence
MIN_HAYSTACK = 32                # tokens of real text a row must hold at least
DISTRACTOR_SHIFT = 0.5           # the needle probe's second fact sits this far (wrapped) from the first
ALL = "all"                      # the depth_scores key over every depth
GENERATE_EXTRA = 2               # tokens decoded beyond the answer's own (a digit written after the key is caught)

PASSKEY_INSTRUCTION = ("A pass key is hidden somewhere in the text below, among a lot of text that has nothing "
                       "to do with it. Find the pass key and remember it: you will be asked for it at the end.\n\n")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_ONCE_NEEDLE = " The pass key is {key}. Remember it."          # passkey-once: the key stated once
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
    `tail`, contrast id) in order. A digit answer also says where in `tail` the answer starts (`answer_at`: the
    question ends there) and the number it is (`answer`), for the generated answer; -1 / "": none."""
    head: tuple[int, ...]
    needles: tuple[tuple[tuple[int, ...], float], ...]
    tail: tuple[int, ...]
    reads: tuple[tuple[int, int], ...]
    answer_at: int = -1
    answer: str = ""


@dataclass(frozen=True)
class Answers:
    """What a digit-answer probe's rows ask the model to write (the generated answer): row r's prompt is
    `ids[r, :prompt[r]]` (the row up to the answer: it ends with the question), its answer the number `key[r]`."""
    prompt: torch.Tensor             # [S] tokens of each row's prompt
    key: tuple[str, ...]             # [S] the number each row asks for

    def steps(self, items: ProbeItems) -> torch.Tensor:
        """[S] tokens greedy decoding writes per row: the answer's own tokens (its whitespace and digits), then
        GENERATE_EXTRA more."""
        return items.lengths - self.prompt + 1 + GENERATE_EXTRA


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
                 tuple(question + tail), tuple((len(question) + i, tail_c[i]) for i in at), len(question), number)


def first_number(text: str) -> str | None:
    """The first run of ASCII digits in `text` (the generated answer's rule: "48213." -> "48213", "4 8213" -> "4",
    "482135" -> "482135"), None when it has none."""
    found = re.search(r"[0-9]+", text)
    return None if found is None else found.group(0)


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
    sized so each row is exactly `length` tokens. n_items = sequences per depth (each a bootstrap unit).
    After `build`, a digit-answer probe's `answers` says what each row asks the model to write (None: a probe
    without one)."""
    abstract = True                  # a base, not a probe: no registry record names it (tests/test_cli_fast.py)
    digit_answers = True             # items are a number's digits: exact match and the generated answer reported
    answers: Answers | None = None

    def __init__(self, n_items: int = DEFAULT_SEQUENCES, seed: int = 0, bos: str = "auto",
                 length: int = DEFAULT_LENGTH, depths=DEFAULT_DEPTHS, split: str = TEST):
        super().__init__(MIN_SEQUENCES * 4, seed, bos)                    # checks seed and bos; n_items is ours
        self.n_items = check_whole_number(n_items, "The number of sequences per depth", low=MIN_SEQUENCES,
                                          high=MAX_SEQUENCES)
        self.length = check_whole_number(length, "The context length (tokens)", low=1)
        self.depths = check_depths(depths)
        self.split = check_split(split)       # test: a verdict's rows; calibration: a score's (analysis.measure.splits)

    def stream_key(self) -> str:
        """The seed string of the probe's random stream (keys, contrasts) for the test split."""
        return f"headscope-probe:{self.name}:{self.seed}"

    def rng(self) -> random.Random:
        """The probe's random stream: as it always was for test rows, drawn apart (salted) for calibration rows."""
        return random.Random(salted(self.split, self.stream_key()))

    def split_seed(self) -> int:
        """An integer seed of the split (the test split's is the probe's own seed)."""
        return self.seed if self.split == TEST else random.Random(salted(self.split, self.stream_key())).getrandbits(31)

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
        self._row_answer = []                                        # (prompt tokens, number) of each row, same order
        self.needle_spans = []                       # per row: (start, end) of the asked needle in the row's ids
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
            filler = haystack(vocab.tokenizer, n, seed=self.haystack_seed(made), split=self.split)   # [n]
            ends = sentence_ends(vocab.tokenizer, filler)
            for depth in self.depths:
                needles = [(ids, depth if not s else (depth + s) % 1.0) for ids, s in p.needles]
                body, starts = insert(filler, needles, ends)
                tokens = tuple(p.head) + tuple(body.tolist()) + tuple(p.tail)
                start = len(p.head) + body.numel()
                if tokens not in seen:                                # depths that land on one spot share a row
                    seen.add(tokens)
                    self._row_sequence.append(made)
                    self._row_answer.append((len(bos) + start + p.answer_at, p.answer))
                    first = len(bos) + len(p.head) + starts[0]
                    self.needle_spans.append((first, first + len(p.needles[0][0])))
                out += [Draft(tokens, start + at, contrast, depth_label(depth)) for at, contrast in p.reads]
            made += 1
        return out

    def build(self, tokenizer, kind: str) -> ProbeItems:
        """The items with one bootstrap unit per sequence (its rows at every depth share the key and the text,
        so they are resampled together), not per row."""
        items = super().build(tokenizer, kind)
        sequence = torch.tensor(self._row_sequence, dtype=torch.long)      # [S] row -> sequence
        items = replace(items, unit=sequence[items.row])
        self.answers = None if not self.digit_answers else Answers(
            torch.tensor([n for n, _ in self._row_answer], dtype=torch.long), tuple(k for _, k in self._row_answer))
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
    """The pass key hidden in text (stated twice in its needle): its digits read one by one."""
    needle = PASSKEY_NEEDLE

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        key = random_key(rng)
        return digit_parts(vocab, PASSKEY_INSTRUCTION, [(self.needle.format(key=key), 0.0)], PASSKEY_QUESTION,
                           key, other_digits(key, rng), "keys whose digits are not one token each")


class PasskeyOnceProbe(PasskeyProbe):
    """The pass key stated once (" The pass key is 48213. Remember it."): the same keys, contrasts and text as
    `passkey` at the same seed (its random stream), so the two variants are compared on the same material."""
    needle = PASSKEY_ONCE_NEEDLE

    def stream_key(self) -> str:
        return f"headscope-probe:passkey:{self.seed}"


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
                 length: int = DEFAULT_LENGTH, depths=DEFAULT_DEPTHS, span: int = COPY_SPAN, split: str = TEST):
        super().__init__(n_items, seed, bos, length, depths, split)
        self.span = check_whole_number(span, "The copied sequence's length (tokens)", low=4, high=512)
        self._sequences = None

    def parts(self, vocab: Vocabulary, i: int, rng) -> Parts | None:
        from analysis.measure.detectors import repeated_random_tokens
        if self._sequences is None:
            exclude = tuple(getattr(vocab.tokenizer, "all_special_ids", ()) or ())
            self._sequences = repeated_random_tokens(len(vocab.tokenizer), self.n_items, self.span,
                                                     seed=self.split_seed(),
                                                     exclude=exclude)[:, :self.span].tolist()    # [n, span]
        r = tuple(self._sequences[i])
        N = len(r)
        reads = tuple((k, r[(k + rng.randrange(1, N)) % N]) for k in range(1, N))
        return Parts((), ((r, 0.0),), r, reads)


# -- building at chosen lengths ---------------------------------------------------------------------------

def build_long(names, tokenizer, kind: str, lengths, *, depths=DEFAULT_DEPTHS, n_items: int = DEFAULT_SEQUENCES,
               seed: int = 0, bos: str = "auto", limit: int | None = None, split: str = TEST,
               should_stop: ShouldStop | None = None, **options) -> dict[tuple[str, int], tuple]:
    """(name, length) -> (spec, probe, items) for every long probe in `names` (None: all) at every length:
    rows of exactly `length` tokens, `n_items` sequences per depth. limit: the model's context length.
    split: test rows (what a verdict reads; the default) or calibration rows (what a score reads: other keys, the
    other half of the built-in text; analysis.measure.splits).
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
            probe = spec.make(n_items=n_items, seed=seed, bos=bos, length=length, depths=depths, split=split,
                              **options)
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


def row_units(items: ProbeItems) -> np.ndarray:
    """[S] the bootstrap unit (sequence) of each row (every item of a row has its row's unit)."""
    units = np.zeros(items.ids.shape[0], dtype=np.int64)
    units[items.row.numpy()] = items.unit.numpy()
    return units


def label_rows(items: ProbeItems) -> dict:
    """depth label (and ALL) -> the rows [R] (sorted) its scored items read (a row two depths share is in both)."""
    s = items.scored.numpy()
    rows, conds = items.row.numpy()[s], np.array(items.conditions)[s]
    out = {ALL: np.unique(rows)}
    for label in dict.fromkeys(conds.tolist()):
        out[label] = np.unique(rows[conds == label])
    return out


def with_generated(score, generated: np.ndarray, rows: np.ndarray, units: np.ndarray, *, seed: int = 0):
    """`score` (a ProbeScore of one mask) with the generated answers' exact match of `rows` in its extras: the mean
    of generated [S] over those rows and its percentile bootstrap CI over their units (the same units and seed as
    the score's own intervals: the same resamples)."""
    mean, ci = bootstrap(generated[rows][None], units[rows], seed=seed)   # [1], [1, 2]
    return replace(score, extras={**score.extras, "generated": mean, "generated_low": ci[:, 0],
                                  "generated_high": ci[:, 1]})


def depth_scores(spec, probe, items: ProbeItems, diff: np.ndarray, nll: np.ndarray, *, seed: int = 0,
                 seconds: float = 0.0, generated: np.ndarray | None = None) -> dict:
    """depth label (and ALL) -> ProbeScore of those items (accuracy, logit difference, exact match, CIs [B]; with
    generated [S] per row (one mask): the generated answers' exact match and its CI in the extras)."""
    conds = np.array(items.conditions)
    out = {ALL: score_items(spec, probe, items, diff, nll, seed=seed, seconds=seconds)}
    for label in dict.fromkeys(items.conditions):
        keep = conds == label
        out[label] = score_items(spec, probe, subset(items, keep), diff[:, keep], nll[:, keep], seed=seed)
    if generated is not None:
        units, rows = row_units(items), label_rows(items)
        out = {label: with_generated(score, generated, rows[label], units, seed=seed) for label, score in out.items()}
    return out


@dataclass(frozen=True)
class LongScores:
    """One long probe at one length on one model: each depth's scores, and each row's generated answer."""
    depths: dict                              # depth label (and ALL) -> ProbeScore (depth_scores)
    generated: np.ndarray | None = None       # [S] 1.0 where the row's generated answer is its key (None: none)
    written: tuple[str, ...] | None = None    # [S] each row's decoded continuation
    rows: dict = field(default_factory=dict)  # depth label (and ALL) -> the rows [R] of that cell (label_rows)


def long_scores(spec, probe, items: ProbeItems, diff: np.ndarray, nll: np.ndarray, *, seed: int = 0,
                seconds: float = 0.0, written=None) -> LongScores:
    """LongScores of one probe at one length from its item values (diff, nll [1, n]) and, for a digit-answer probe,
    each row's decoded continuation `written` [S] (None: not generated): what measure_long makes of its passes."""
    answers = getattr(probe, "answers", None)
    generated = None if written is None or answers is None else generated_right(written, answers)
    scores = depth_scores(spec, probe, items, diff, nll, seed=seed, seconds=seconds, generated=generated)
    return LongScores(scores, generated, None if written is None else tuple(written), label_rows(items))


# -- the generated answer ----------------------------------------------------------------------------------

def answer_batches(items: ProbeItems, answers: Answers, batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """The rows of a digit-answer probe in batches: rows of one prompt length and one row length together (no
    padding), at most `batch_tokens` tokens a batch (one row at least)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r, (p, n) in enumerate(zip(answers.prompt.tolist(), items.lengths.tolist())):
        groups.setdefault((p, n), []).append(r)
    out = []
    for (_, n), rows in groups.items():
        per = max(1, batch_tokens // max(1, n))
        out += [rows[k:k + per] for k in range(0, len(rows), per)]
    return out


def decode_calls(items: ProbeItems, answers: Answers | None, batch_tokens: int = BATCH_TOKENS) -> int:
    """The forward calls a digit-answer probe's rows take beyond their prefills: per batch, one for the teacher-forced
    answer tokens and one per generated token after the first (`Answers.steps`). 0 for a probe without answers."""
    if answers is None:
        return 0
    steps = answers.steps(items)
    return int(sum(int(steps[rows].max()) for rows in answer_batches(items, answers, batch_tokens)))


@torch.no_grad()
def answer_values(model, items: ProbeItems, answers: Answers, *, tokenizer=None, new_cache=None,
                  batch_tokens: int = BATCH_TOKENS, progress=None,
                  should_stop: ShouldStop | None = None) -> tuple[np.ndarray, np.ndarray, tuple[str, ...] | None]:
    """A digit-answer probe's rows read once each: (diff [1, n], nll [1, n], each row's decoded continuation [S]
    or None without a tokenizer).

    Per batch (`answer_batches`): the prompts (the rows up to the answer) are prefilled into one fresh cache
    (`new_cache()`: a cut's own, e.g. a KV plan's compact cache; None: the model's DynamicCache); a copy of it
    reads the answer's tokens (teacher forcing: the same logits as one pass over the whole row), and the cache
    itself decodes greedily (analysis.measure.decode) the answer's tokens + GENERATE_EXTRA more, which the
    tokenizer writes out. Call it inside the cut's `running()`."""
    from analysis.arch.adapters import input_device
    from analysis.core.progress import report
    from analysis.measure.decode import decode, prefill
    n = items.correct.numel()
    by_row: dict[int, list[int]] = {}
    for i, r in enumerate(items.row.tolist()):
        by_row.setdefault(r, []).append(i)
    steps = answers.steps(items)
    diff, nll = np.zeros((1, n)), np.zeros((1, n))
    written = [""] * items.ids.shape[0]
    device = input_device(model)
    batches = answer_batches(items, answers, batch_tokens)
    for j, rows in enumerate(batches):
        check_stop(should_stop, "The long-context probes")
        P, T = int(answers.prompt[rows[0]]), int(items.lengths[rows[0]])
        x = items.ids[rows, :T]                                           # [b, T]
        last, cache = prefill(model, x[:, :P], cache=None if new_cache is None else new_cache())   # [b, V]
        logits = last[:, None]                                            # [b, 1, V] position P - 1
        if T > P:
            forced = copy.deepcopy(cache) if tokenizer is not None else cache
            rest = model(input_ids=x[:, P:].to(device), past_key_values=forced, use_cache=True).logits   # [b, T-P, V]
            logits = torch.cat([logits, rest.to(logits.device)], 1)      # [b, T-P+1, V] positions P-1 .. T-1
            del forced, rest
        ri, ii = (torch.tensor(v) for v in zip(*[(k, i) for k, r in enumerate(rows) for i in by_row.get(r, [])]))
        picked = logits[ri.to(logits.device), (items.position[ii] - (P - 1)).to(logits.device)]   # [m, V]
        d, l = read_values(picked[None], items.correct[ii], items.contrast[ii])                   # [1, m]
        diff[:, ii.numpy()], nll[:, ii.numpy()] = d, l
        if tokenizer is not None:
            run = decode(model, last, cache, int(steps[rows].max()), keep_logits=False)   # tokens [b, steps]
            for r, tokens in zip(rows, run.tokens.tolist()):
                written[r] = tokenizer.decode(tokens)
        del cache, logits
        report(progress, (j + 1) / len(batches), f"{items.name}: batch {j + 1}/{len(batches)}")
    return diff, nll, (tuple(written) if tokenizer is not None else None)


def generated_right(written, answers: Answers) -> np.ndarray:
    """[S] 1.0 where the continuation's first number (`first_number`) is the row's key, else 0.0."""
    return np.array([first_number(w) == k for w, k in zip(written, answers.key)], dtype=np.float64)


# -- cost: rows, tokens, seconds ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LongWork:
    """What a run reads: rows per length (one prefill each), the decode calls of the generated answers per length
    (`decode_calls`), and how many passes (dense, cut) go over them."""
    rows: dict                     # length -> rows
    passes: int = 1
    steps: dict = field(default_factory=dict)     # length -> decode calls (one token a row each)

    @property
    def tokens(self) -> dict:
        """length -> tokens read (all passes): the work the app's pace is learned per."""
        return {n: n * r * self.passes for n, r in self.rows.items()}

    @property
    def total_tokens(self) -> int:
        return int(sum(self.tokens.values()))

    def seconds(self, per_row: dict, per_step: dict | None = None) -> float:
        """The whole run's seconds from one row's seconds at each length (`row_seconds`) and one decode call's
        (`step_seconds`; None: decode calls not counted)."""
        rows = sum(per_row[n] * r for n, r in self.rows.items())
        steps = sum(per_step[n] * c for n, c in self.steps.items()) if per_step is not None else 0.0
        return float((rows + steps) * self.passes)


def item_work(probe, items: ProbeItems) -> tuple[int, int]:
    """(rows, decode calls) one pass over a long probe's items takes."""
    return int(items.ids.shape[0]), decode_calls(items, getattr(probe, "answers", None))


def long_work(built: dict, passes: int = 1) -> LongWork:
    rows: dict[int, int] = {}
    steps: dict[int, int] = {}
    for (_, length), (_, probe, items) in built.items():
        r, c = item_work(probe, items)
        rows[length] = rows.get(length, 0) + r
        steps[length] = steps.get(length, 0) + c
    return LongWork(dict(sorted(rows.items())), passes, {n: c for n, c in sorted(steps.items()) if c})


def _best_of_two(fn, device) -> float:
    """The faster of two timed calls of fn (wall seconds, read after the device finished: analysis.core.clock)."""
    clock, best = Clock(device), float("inf")
    for _ in range(2):
        raise_if_signalled()                                            # Ctrl-C between the timings
        start = clock.now()
        fn()
        best = min(best, clock.since(start)[0])
    return best


def _kernel_seconds(g, dtype, device, keys: int, queries: int | None = None, rows: int = 1) -> float:
    """One sdpa call's seconds: `queries` rows (None: `keys`, causal) against `keys` keys, rows x H heads."""
    q = torch.randn(rows, g.n_heads, keys if queries is None else queries, g.head_dim, dtype=dtype,
                    device=device)                                         # [rows, H, q, d]
    k = torch.randn(rows, g.n_heads, keys, g.head_dim, dtype=dtype, device=device)   # [rows, H, T, d]
    return _best_of_two(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=queries is None),
                        device)


@torch.no_grad()
def row_seconds(model, lengths, *, short: int = 256, rows: int = 8, geometry=None,
                precision: str = "float32") -> dict[int, float]:
    """length -> seconds of one forward pass of one row on this machine, estimated from two cheap timings: a
    forward of `rows` x `short` tokens (what everything but attention costs per token: about the same at any
    length, once the matrices are that large) and the attention kernel alone (sdpa, causal, [1, H, T, d]) at
    each length, times the number of layers; each timing the faster of two (the kernel's share grows with the
    length: on 2 CPU cores, 6 of 17 s a row at 4,096 tokens, docs/results.md). An estimate: windowed heads (a KV plan) run a masked kernel, slower than the
    causal one timed here, and a busy machine is slower than it was while timing. precision: the forward timed in
    the passes' precision (analysis.arch.attention.precision_block; the attention kernel stays float32 there)."""
    from analysis.arch.adapters import adapter_for, input_device
    g = geometry or adapter_for(model).geometry(model)
    device = input_device(model)
    dtype = next(model.parameters()).dtype
    n = min(short, context_length(model, default=short))
    x = torch.randint(0, model.get_input_embeddings().weight.shape[0], (rows, n), device=device)   # [rows, n]
    handle = model.base_model.register_forward_hook(keep_positions(torch.arange(rows), torch.full((rows,), n - 1)))  # one logit a row
    try:
        from analysis.arch.attention import precision_block
        with stop_between_layers(model, None, "The time estimate"), precision_block(model, precision):
            whole = _best_of_two(lambda: model(input_ids=x, use_cache=False), device)   # Ctrl-C within a layer
    finally:
        handle.remove()
    per_token = max(whole - rows * g.n_layers * _kernel_seconds(g, dtype, device, n), 0.0) / (rows * n)
    return {int(T): per_token * T + g.n_layers * _kernel_seconds(g, dtype, device, int(T)) for T in lengths}


@torch.no_grad()
def step_seconds(model, lengths, *, batch_tokens: int = BATCH_TOKENS, short: int = 8,
                 geometry=None) -> dict[int, float]:
    """length -> seconds of one decode call of a generated-answer batch at that length (`answer_batches`: the rows
    of one batch, one token each, against `length` cached keys), from two cheap timings: a decode call after a
    `short`-token prompt (everything but attention over the long context: at these sizes mostly the call's fixed
    cost) and the attention kernel of one query per row over `length` keys, times the number of layers; each the
    faster of two. An estimate, as `row_seconds`."""
    from analysis.arch.adapters import adapter_for, input_device
    from analysis.measure.decode import prefill
    g = geometry or adapter_for(model).geometry(model)
    device = input_device(model)
    dtype = next(model.parameters()).dtype
    vocab = model.get_input_embeddings().weight.shape[0]
    base: dict[int, float] = {}
    out = {}
    for T in lengths:
        b = max(1, batch_tokens // max(1, int(T)))                       # the rows answer_batches puts together
        if b not in base:
            _, cache = prefill(model, torch.randint(0, vocab, (b, short), device=device))           # [b, short]
            token = torch.randint(0, vocab, (b, 1), device=device)                                  # [b, 1]
            base[b] = _best_of_two(lambda: model(input_ids=token, past_key_values=cache, use_cache=True,
                                                 logits_to_keep=1), device)
        out[int(T)] = base[b] + g.n_layers * _kernel_seconds(g, dtype, device, int(T), queries=1, rows=b)
    return out


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


def measure_long(model, built: dict, *, tokenizer=None, new_cache=None, seed: int = 0, progress=None,
                 should_stop: ShouldStop | None = None, weights: dict | None = None,
                 values: dict | None = None) -> dict:
    """(name, length) -> LongScores of `built` (build_long) on `model` as it is: call it inside a cut's
    `running()` for a cut, with `new_cache=cut.new_cache` (None: the model's own cache). A digit-answer probe's
    rows are read by `answer_values` (teacher forcing and, given the model's `tokenizer`, the generated answer,
    from one prefill), the others by one pass each (`item_values`). weights: (name, length) -> share of the time
    (progress). values: a dict that gets (name, length) -> (diff [1, n], nll [1, n], seconds, written), what the
    scores were made from (`long_scores` makes them again: analysis.measure.longpass stores them)."""
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
            answers = getattr(probe, "answers", None)
            written = None
            if answers is None:
                diff, nll = item_values(model, items, progress=named, should_stop=should_stop)
            else:
                diff, nll, written = answer_values(model, items, answers, tokenizer=tokenizer, new_cache=new_cache,
                                                   progress=named, should_stop=should_stop)
            seconds = time.perf_counter() - t0
            out[key] = long_scores(spec, probe, items, diff, nll, seed=seed, seconds=seconds, written=written)
            if values is not None:
                values[key] = (diff, nll, seconds, written)
    report(progress, 1.0, "long-context probes done")
    return out
