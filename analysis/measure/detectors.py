"""The head taxonomy of the interpretability field: one detector class per role, in one lookup table.

Every detector has one verb, `detect(model, ids, *, gates=None, layout=None, progress=None,
should_stop=None) -> Detection` (analysis.measure.headmaps): an L x H score map in the original
head slots, the threshold above which a head has the role, and extras. `ids` is the user's text
(for the detectors with needs_text); the others build their own input or read weights.

- previous-token (needs text): mean A[i, i-1] over queries i >= 1 on the text, the same statistic
  as the Voita-style role tags (analysis.measure.roles.previous_token_mass: one definition).
- induction (Olsson et al. 2022; TransformerLens' head detector builds the same input): on
  sequences [BOS] r r of N random distinct tokens repeated twice, the mean attention from each
  token of the second copy to the token right after its first occurrence (query BOS?+N+k, key
  BOS?+k+1). Extras: the in-context-learning score of the whole model on the same sequences,
  mean NLL of tokens 1..N-1 of the first copy minus that of the second copy (nats; > 0 when the
  model predicts the repeat better), for causal LMs.
- duplicate-token: attention from a token to its earlier occurrences (the sum over every earlier
  key holding the same token id, averaged over the queries that have one). Measured on the same
  repeated random sequences, where each second-copy token has exactly one earlier occurrence.
- copying (analysis.measure.circuits): OV-circuit eigenvalue share, weights only, decoders only.
- successor (analysis.measure.circuits): the OV circuit maps ordinal tokens (1, Monday, January, ...)
  to their successors (Gould et al. 2023), weights only, decoders only, needs the tokenizer.
- dla (analysis.measure.dla): direct logit attribution on the text, decoders only.
- retrieval, streaming (analysis.measure.longheads): long-context heads, decoders only, registered with
  `long=True`: they read thousands of tokens per pass (minutes on a CPU), so they are not in the default
  set (`default_detectors`) and run only when named (the CLI's --detector, the Heads page's own buttons).

Encoders: previous-token, induction and duplicate-token run on encoders too (the definitions
only read attention probabilities; a bidirectional head may also look ahead, which simply does
not count). copying and dla need an unembedding and refuse encoders with one clear line.
Masks: gates [L, H] run through head_mask; a pruned head scores 0. A physically pruned model is
given with its HeadLayout (`layout`) and its kept heads land in their original slots.

Each detector is one `DetectorSpec` record in the registry `DETECTORS` (name, the title of its map, a
help line, how to read its map, where it applies, whether it needs text, and how to build it),
registered once with `register_detector`; the CLI's `roles --detector`, the app's Heads page and
`detect_heads` read the registry. The records live in analysis.measure.detector_registry (light: the
CLI's parser reads them without torch), re-exported here; each names its detector lazily
("analysis.measure.detectors:PreviousTokenDetector"), imported the first time it is built.
"""
from __future__ import annotations

import torch

from analysis.measure.tokens import as_sequences, text_sequences
from analysis.arch.adapters import adapter_for
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.detector_registry import (DETECTORS, DetectorSpec, default_detectors, detector_spec,  # noqa: F401
                                                register_detector)
from analysis.measure.headmaps import Detection, gates_array, head_slots, masked, place, zero_pruned
from analysis.measure.roles import DEFAULT_THRESHOLDS, attention_forward, previous_token_mass

MIN_REPEAT = 4          # random tokens per copy, at least
# attention patterns are [batch, H, T, T] floats: a longer sequence needs gigabytes per layer
MAX_PATTERN_TOKENS = 4096
MAX_REPEAT = (MAX_PATTERN_TOKENS - 1) // 2          # [BOS] r r fits MAX_PATTERN_TOKENS
MAX_SEQUENCES = 4096    # repeated random sequences


def repeated_random_tokens(vocab_size: int, n_sequences: int, length: int, *, seed: int = 0,
                           bos_id: int | None = None, exclude=()) -> torch.Tensor:
    """ids [n, (1) + 2N]: [BOS] r r, r = `length` distinct random token ids (seeded), per sequence."""
    seed = check_seed(seed)                                             # torch's generator: 0 .. SEED_MAX
    if length < MIN_REPEAT:
        raise InputError(f"The repeated random sequence needs at least {MIN_REPEAT} tokens per copy; got {length}.")
    banned = set(int(t) for t in exclude) | ({int(bos_id)} if bos_id is not None else set())
    allowed = torch.tensor([t for t in range(int(vocab_size)) if t not in banned], dtype=torch.long)
    if allowed.numel() < length:
        raise InputError(f"The vocabulary has {allowed.numel()} usable tokens, fewer than the {length} distinct "
                         f"random tokens asked for; use a shorter repeat length.")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(max(1, int(n_sequences))):
        r = allowed[torch.randperm(allowed.numel(), generator=g)[:length]]     # [N]
        parts = ([torch.tensor([int(bos_id)])] if bos_id is not None else []) + [r, r]
        rows.append(torch.cat(parts))
    return torch.stack(rows)                                           # [n, (1) + 2N]


def duplicate_mass(attn: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Attention on earlier occurrences of the query's own token: attn [n, H, T, T], ids [n, T] -> [H]
    (mean over the queries that have an earlier occurrence; 0 when none has)."""
    n, H, T, _ = attn.shape
    same = ids[:, :, None] == ids[:, None, :]                          # [n, T, T]
    earlier = same & torch.ones(T, T, dtype=torch.bool).tril(-1)       # [n, T, T] key j < query i
    mass = (attn.double() * earlier[:, None].double()).sum(-1)         # [n, H, T]
    has = earlier.any(-1)                                              # [n, T]
    count = has.sum()
    if not int(count):
        return torch.zeros(H, dtype=torch.float64)
    return (mass * has[:, None].double()).sum((0, 2)) / count          # [H]


def _second_copy(length: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(queries, induction keys) of a [BOS?] r r sequence: query offset+N+k -> key offset+k+1."""
    k = torch.arange(length)
    return offset + length + k, offset + k + 1


class _RepeatedTokens:
    """Shared by the detectors that read attention on repeated random tokens."""

    def __init__(self, length: int = 50, n_sequences: int = 8, batch_size: int = 4, seed: int = 0,
                 bos_id: int | None = None, exclude=()):
        self.length = check_whole_number(length, "The repeat length", low=MIN_REPEAT, high=MAX_REPEAT)
        self.n_sequences = check_whole_number(n_sequences, "The number of repeated sequences", high=MAX_SEQUENCES)
        self.batch_size = check_whole_number(batch_size, "The batch size", high=MAX_SEQUENCES)
        self.seed, self.bos_id, self.exclude = check_seed(seed), bos_id, tuple(exclude)

    @classmethod
    def for_tokenizer(cls, tokenizer, options: dict) -> "_RepeatedTokens":
        """The detector's builder (its record's `build`): the shared options it takes, with the tokenizer's
        BOS (or CLS) starting each sequence and its special ids left out of the random tokens, unless the
        options say otherwise."""
        options = dict(options)
        if tokenizer is not None:
            bos = getattr(tokenizer, "bos_token_id", None)
            options.setdefault("bos_id", bos if bos is not None else getattr(tokenizer, "cls_token_id", None))
            options.setdefault("exclude", tuple(getattr(tokenizer, "all_special_ids", ()) or ()))
        keys = ("length", "n_sequences", "batch_size", "seed", "bos_id", "exclude")
        return cls(**{k: v for k, v in options.items() if k in keys})

    def inputs(self, model) -> torch.Tensor:
        """The repeated random sequences [n, (1) + 2N] this detector reads (seeded: the same every call)."""
        vocab = model.get_input_embeddings().weight.shape[0]
        return repeated_random_tokens(vocab, self.n_sequences, self.length, seed=self.seed, bos_id=self.bos_id,
                                      exclude=self.exclude)

    def _run(self, model, layer_score, *, gates, layout, progress, should_stop, what):
        """layer_score(attn [n, H_l, T, T], ids) -> [H_l] summed over sequences; out: (mean [L, H], logits list)."""
        adapter = adapter_for(model)
        geo = adapter.geometry(model)
        slots = head_slots(model, layout, adapter)
        g = gates_array(model, gates)
        ids = self.inputs(model)                                       # [n, T]
        sums = [None] * geo.n_layers
        nll = []
        for s in range(0, ids.shape[0], self.batch_size):
            check_stop(should_stop, what)
            x = ids[s:s + self.batch_size]
            with masked(model, g):
                out, attn = attention_forward(model, x)
            for l, a in enumerate(attn):
                if a is not None:
                    v = layer_score(a, x) * x.shape[0]
                    sums[l] = v if sums[l] is None else sums[l] + v
            logits = getattr(out, "logits", None)
            if logits is not None:
                lp = torch.log_softmax(logits.float().cpu()[:, :-1], -1)       # [b, T-1, V]
                nll.append(-lp.gather(-1, x[:, 1:, None])[..., 0])             # [b, T-1] NLL of token t+1
            report(progress, min(s + self.batch_size, ids.shape[0]) / ids.shape[0], what.lower())
        per_layer = [None if v is None else (v / ids.shape[0]).numpy() for v in sums]
        return zero_pruned(place(per_layer, slots, geo.n_heads), g), (torch.cat(nll) if nll else None)


class InductionDetector(_RepeatedTokens):
    """Attention from the second copy of a repeated random sequence to the token after the first
    occurrence; one verb: detect."""
    name = "induction"
    threshold = 0.4
    unit = "attention"

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        offset = 0 if self.bos_id is None else 1
        queries, keys = _second_copy(self.length, offset)

        def score(a, x):
            return a[:, :, queries, keys].double().mean((0, 2))        # [H_l]

        scores, nll = self._run(model, score, gates=gates, layout=layout, progress=progress,
                                should_stop=should_stop, what="Induction scores")
        extras = dict(length=self.length, n_sequences=self.n_sequences, seed=self.seed)
        if nll is not None and model_is_causal(model):
            N = self.length
            first = nll[:, offset:offset + N - 1].mean()               # predicting tokens 1..N-1 of copy 1
            second = nll[:, offset + N:offset + 2 * N - 1].mean()      # predicting tokens 1..N-1 of copy 2
            extras.update(loss_first_copy=float(first), loss_second_copy=float(second),
                          icl_score=float(first - second))
        return Detection(self.name, scores, self.threshold, self.unit, extras)


class DuplicateTokenDetector(_RepeatedTokens):
    """Attention from a token to its earlier occurrences (on repeated random tokens); one verb: detect."""
    name = "duplicate-token"
    threshold = 0.4
    unit = "attention"

    def detect(self, model, ids=None, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        scores, _ = self._run(model, duplicate_mass, gates=gates, layout=layout, progress=progress,
                              should_stop=should_stop, what="Duplicate-token scores")
        return Detection(self.name, scores, self.threshold, self.unit,
                         dict(length=self.length, n_sequences=self.n_sequences, seed=self.seed))


class PreviousTokenDetector:
    """Mean attention on the previous token over the text (roles.previous_token_mass); one verb: detect."""
    name = "previous-token"
    threshold = DEFAULT_THRESHOLDS["previous-token"]
    unit = "attention"

    def __init__(self, batch_size: int = 4, **_):
        self.batch_size = max(1, batch_size)

    def detect(self, model, ids, *, gates=None, layout=None, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> Detection:
        x = as_sequences(ids, "The previous-token detector")            # [n, T]
        adapter = adapter_for(model)
        geo = adapter.geometry(model)
        slots = head_slots(model, layout, adapter)
        g = gates_array(model, gates)
        sums = [None] * geo.n_layers
        for s in range(0, x.shape[0], self.batch_size):
            check_stop(should_stop, "Previous-token scores")
            b = x[s:s + self.batch_size]
            with masked(model, g):
                _, attn = attention_forward(model, b)
            for l, a in enumerate(attn):
                if a is not None:
                    v = previous_token_mass(a) * b.shape[0]            # [H_l]
                    sums[l] = v if sums[l] is None else sums[l] + v
            report(progress, min(s + self.batch_size, x.shape[0]) / x.shape[0], "previous-token scores")
        per_layer = [None if v is None else (v / x.shape[0]).numpy() for v in sums]
        return Detection(self.name, zero_pruned(place(per_layer, slots, geo.n_heads), g), self.threshold,
                         self.unit)


def model_is_causal(model) -> bool:
    from analysis.arch.models import model_kind
    return model_kind(model.config) == "causal-lm"


def get_detector(name: str, tokenizer=None, **options):
    """A detector by name, built by its record (repeated-token detectors get the tokenizer's BOS and
    special ids); options another detector takes are ignored."""
    return detector_spec(name).builder(tokenizer, options)


def detect_heads(loaded, names=None, text: str | bytes | None = None, *, max_tokens: int = 256,
                 seq_len: int = 128, gates=None, layout=None, options: dict | None = None,
                 progress: Progress | None = None, should_stop: ShouldStop | None = None) -> dict[str, Detection]:
    """Run the named detectors (default: all) on `loaded` (a LoadedModel-like with model/tokenizer).

    text: for the detectors that need one (None = the built-in evaluation text). names=None runs the quick
    ones (`default_detectors`); the long-context ones (retrieval, streaming) run when named."""
    from analysis.core.progress import scaled
    from analysis.core.text import check_max_tokens
    names = default_detectors() if names is None else list(names)
    specs = [detector_spec(name) for name in names]
    check_max_tokens(max_tokens, "max_tokens")
    check_whole_number(seq_len, "The sequence length (seq_len)", low=2, high=MAX_PATTERN_TOKENS)
    ids = None
    if any(spec.needs_text for spec in specs):
        ids = text_sequences(loaded.tokenizer, text, max_tokens=max_tokens, seq_len=seq_len)  # [n, T]
    out = {}
    for i, name in enumerate(names):
        det = get_detector(name, loaded.tokenizer, **(options or {}))
        out[name] = det.detect(loaded.model, ids, gates=gates, layout=layout, should_stop=should_stop,
                               progress=scaled(progress, i / len(names), (i + 1) / len(names)))
    return out


__all__ = ["DETECTORS", "DetectorSpec", "register_detector", "default_detectors", "Detection", "detect_heads", "get_detector", "repeated_random_tokens", "duplicate_mass"]
