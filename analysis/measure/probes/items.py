"""Probe items, one home: a prompt, where the answer is read, the correct next token and its contrast.

A probe (one class each, analysis.measure.probes.registry) writes *drafts* offline from its own
templates and word lists, seeded: a token sequence, the index `at` of the answer token in it, and a
contrast token. `Probe.build(tokenizer, kind)` checks every filler against the tokenizer (a word
that is not one token, with the leading space it has inside a sentence, is left out and counted in
`ProbeItems.rejected`) and lays the drafts out for the model's kind:

- causal LM: one row per distinct sequence, cut after the last position any of its drafts reads;
  the answer at index a is read from the logits at position a - 1 (they predict token a). Drafts
  on one sequence (the copying probe reads every position of a repeated copy) share that row.
  Rows are right-padded: a causal model's logits at position p see tokens 0..p only, so the
  padding after the last read position changes nothing and no attention mask is needed.
- masked LM: one row per draft, the tokenizer's own special tokens around it, the answer token
  replaced by the mask token and read there; padded rows carry an attention mask.

Units: the drafts of one sequence are one unit of the bootstrap (analysis.measure.probes.measure):
their items are not independent, so CIs resample sequences, not items.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from analysis.core.errors import InputError, check_seed
from analysis.measure.probes.registry import BOS_CHOICES, DEFAULT_ITEMS, MAX_ITEMS, MIN_ITEMS  # noqa: F401 (the options)


@dataclass(frozen=True)
class Draft:
    """One item before layout: tokens (answer included), the answer's index, its contrast."""
    tokens: tuple[int, ...]
    at: int                      # index of the answer in tokens (>= 1)
    contrast: int
    condition: str = ""
    reference: bool = False      # read but not scored (a probe's extras use it, e.g. the ICL score)

    @property
    def correct(self) -> int:
        return self.tokens[self.at]


class Vocabulary:
    """The tokenizer, asked about word lists: which fillers are one token, and the ones left out."""

    def __init__(self, tokenizer, kind: str = "causal-lm"):
        self.tokenizer, self.kind = tokenizer, kind
        self.rejected: dict[str, list[str]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def token(self, piece: str) -> int | None:
        """The id of `piece` when the tokenizer makes exactly one token of it, else None."""
        ids = self.encode(piece)
        return ids[0] if len(ids) == 1 else None

    def reject(self, what: str, item: str) -> None:
        self.rejected.setdefault(what, []).append(item)

    def keep(self, what: str, groups, *, space: bool = True) -> list[tuple]:
        """The groups (a word, or a tuple of words that go together: singular / plural, a gender pair)
        whose every word is one token (as " word" when `space`); the others are recorded under `what`."""
        out = []
        for group in groups:
            words = (group,) if isinstance(group, str) else tuple(group)
            if all(self.token((" " if space else "") + w) is not None for w in words):
                out.append(group)
            else:
                self.reject(what, "/".join(words))
        return out

    def complete(self, prompt: str, answer: str, contrast: str, *, condition: str = "", suffix: str = ".") -> Draft | None:
        """The draft "prompt + answer" answered by `answer` (one token) against `contrast`, or None (counted)
        when the answer is not a token of its own right after the prompt. A masked LM's sentence goes on
        with `suffix` after the masked answer (a causal LM never reads past the answer)."""
        suffix = suffix if self.kind == "masked-lm" else ""
        answer_id, contrast_id = self.token(answer), self.token(contrast)
        if answer_id is None or contrast_id is None:
            self.reject("answers that are not one token", f"{answer.strip()}/{contrast.strip()}")
            return None
        head = self.encode(prompt)
        whole = self.encode(prompt + answer + suffix)
        if len(head) < 1 or whole[:len(head) + 1] != head + [answer_id]:
            self.reject("prompts whose answer merges with its neighbours", prompt[-40:] + answer)
            return None
        return Draft(tuple(whole), len(head), contrast_id, condition)


@dataclass(frozen=True)
class ProbeItems:
    """A probe's items laid out for one model kind (module docstring). n = items, S = rows."""
    name: str
    kind: str                        # "causal-lm" | "masked-lm"
    ids: torch.Tensor                # [S, T] rows, right-padded
    lengths: torch.Tensor            # [S] real tokens per row
    row: torch.Tensor                # [n] the row each item reads
    position: torch.Tensor           # [n] where it is read
    correct: torch.Tensor            # [n] token id
    contrast: torch.Tensor           # [n] token id
    unit: torch.Tensor               # [n] bootstrap unit (the sequence it came from)
    reference: torch.Tensor          # [n] bool: read, not scored
    conditions: tuple[str, ...]      # [n] a label per item (e.g. "plural subject, singular attractor")
    rejected: dict = field(default_factory=dict)   # list name -> the fillers the tokenizer split
    notes: tuple[str, ...] = ()

    @property
    def scored(self) -> torch.Tensor:
        return ~self.reference                                           # [n] bool

    @property
    def n_items(self) -> int:
        return int(self.scored.sum())

    @property
    def n_units(self) -> int:
        return int(self.unit[self.scored].unique().numel())

    @property
    def n_tokens(self) -> int:
        return int(self.lengths.sum())

    def rejected_counts(self) -> dict[str, int]:
        return {what: len(items) for what, items in self.rejected.items()}

    def attention_mask(self) -> torch.Tensor:
        """[S, T] 1 on real tokens (masked LMs read it; causal rows need none)."""
        return (torch.arange(self.ids.shape[1])[None] < self.lengths[:, None]).long()


def pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return 0


def _rows(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), T), pad, dtype=torch.long)        # [S, T]
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in sequences], dtype=torch.long)


def lay_out(name: str, drafts: list[Draft], tokenizer, kind: str, *, prefix=(), suffix=(),
            rejected=None, notes=()) -> ProbeItems:
    """Drafts -> ProbeItems for `kind` (module docstring). prefix / suffix: special ids around each
    sequence (causal: the BOS a probe chose; masked: the tokenizer's own [CLS] ... [SEP])."""
    prefix, suffix = list(prefix), list(suffix)
    units: dict[tuple, int] = {}
    rows, row_of, position, extra = [], [], [], []
    if kind == "causal-lm":
        reach: dict[tuple, int] = {}
        for d in drafts:
            reach[d.tokens] = max(reach.get(d.tokens, 0), d.at)
        for tokens, last in reach.items():
            units[tokens] = len(rows)
            rows.append(prefix + list(tokens[:last]))
        row_of = [units[d.tokens] for d in drafts]
        position = [len(prefix) + d.at - 1 for d in drafts]
    elif kind == "masked-lm":
        mask_id = getattr(tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise InputError(f"The {name} probe's masked-LM version needs the tokenizer's mask token; this "
                             f"tokenizer has none.")
        for d in drafts:
            units.setdefault(d.tokens, len(units))
            seq = list(d.tokens)
            seq[d.at] = mask_id
            row_of.append(len(rows))
            position.append(len(prefix) + d.at)
            rows.append(prefix + seq + suffix)
    else:
        raise InputError(f"Probes read a language model's predictions; a {kind} model has none.")
    ids, lengths = _rows(rows, pad_id(tokenizer))
    t = lambda values: torch.tensor(values, dtype=torch.long)           # noqa: E731
    return ProbeItems(name, kind, ids, lengths, t(row_of), t(position), t([d.correct for d in drafts]),
                      t([d.contrast for d in drafts]), t([units[d.tokens] for d in drafts]),
                      torch.tensor([d.reference for d in drafts], dtype=torch.bool),
                      tuple(d.condition for d in drafts), dict(rejected or {}), tuple(notes))


def special_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The special ids the tokenizer puts before and after one sequence (e.g. [CLS] / [SEP]; none for SmolLM2)."""
    from analysis.measure.evaluation import special_template
    return special_template(tokenizer)


class Probe:
    """Base of every probe: `build` turns the subclass's `drafts` into items for a tokenizer and kind.

    n_items: scored items wanted (the probe builds that many when its lists allow); seed: which ones
    (the same seed, tokenizer and kind give the same items); bos: what a causal row starts with:
    "auto" = what the tokenizer itself adds to one sequence, "none", "bos" / "eos" = that special
    token (docs/DEFINITIONS.md says what SmolLM2 does with each)."""
    name = ""          # set from the probe's record (registry.ProbeSpec.make)
    label = ""

    def __init__(self, n_items: int = DEFAULT_ITEMS, seed: int = 0, bos: str = "auto"):
        if isinstance(n_items, bool) or not isinstance(n_items, int) or not MIN_ITEMS <= n_items <= MAX_ITEMS:
            raise InputError(f"A probe needs {MIN_ITEMS} to {MAX_ITEMS} items; got {n_items!r}.")
        if bos not in BOS_CHOICES:
            raise InputError(f"bos must be one of {', '.join(BOS_CHOICES)}; got {bos!r}.")
        self.n_items, self.seed, self.bos = n_items, check_seed(seed, "The probes' seed"), bos

    def rng(self) -> random.Random:
        """The probe's own seeded generator (string seeds hash the same on every machine and Python)."""
        return random.Random(f"headscope-probe:{self.name}:{self.seed}")

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        raise NotImplementedError

    def collect(self, make: Callable[[int, random.Random], Draft | None]) -> list[Draft]:
        """Up to n_items distinct drafts from make(i, rng) (i = drafts so far, for rotating conditions);
        None (a filler combination the tokenizer refused, counted by `Vocabulary`) or a repeat is drawn again,
        at most 4 x n_items draws in all."""
        rng, out, seen = self.rng(), [], set()
        for _ in range(4 * self.n_items):
            if len(out) >= self.n_items:
                break
            d = make(len(out), rng)
            if d is not None and (d.tokens, d.at) not in seen:
                seen.add((d.tokens, d.at))
                out.append(d)
        return out

    def notes(self, items: ProbeItems) -> tuple[str, ...]:
        return ()

    def extras(self, items: ProbeItems, diff, nll) -> dict:
        """Whole-probe numbers beyond accuracy and logit difference, per mask (e.g. the ICL score)."""
        return {}

    def build(self, tokenizer, kind: str) -> ProbeItems:
        """The probe's items for `tokenizer` and model `kind`; InputError when too few can be built."""
        if tokenizer is None:
            raise InputError(f"The {self.label} probe builds its prompts with the model's tokenizer; this model "
                             f"has none (export it with its tokenizer).")
        vocab = Vocabulary(tokenizer, kind)
        drafts = self.drafts(vocab, kind)
        scored = sum(not d.reference for d in drafts)
        if scored < MIN_ITEMS:
            lost = "; ".join(f"{len(v)} {what} ({', '.join(v[:4])}{', ...' if len(v) > 4 else ''})"
                             for what, v in vocab.rejected.items())
            raise InputError(f"The {self.label} probe could build only {scored} item(s) with this tokenizer (it "
                             f"needs at least {MIN_ITEMS})" + (f"; left out: {lost}." if lost else "."))
        before, after = special_ids(tokenizer) if kind == "masked-lm" else (self.bos_ids(tokenizer), [])
        items = lay_out(self.name, drafts, tokenizer, kind, prefix=before, suffix=after, rejected=vocab.rejected)
        return replace(items, notes=self.notes(items))

    def bos_ids(self, tokenizer) -> list[int]:
        if self.bos == "auto":
            return special_ids(tokenizer)[0]
        if self.bos == "none":
            return []
        value = getattr(tokenizer, f"{self.bos}_token_id", None)
        if value is None:
            raise InputError(f"The tokenizer has no {self.bos} token; use bos='auto' or 'none'.")
        return [int(value)]
