"""Specialized heads from attention patterns on real text (in the spirit of Voita et al. 2019).

For every head, statistics of its attention probabilities A[i, j] (query i, key j), averaged
over the queries of every sequence:
- previous-token: mean A[i, i-1] (queries i >= 1);
- fixed-offset positional: the relative offset k != 1 (k > 0 looks back, k = 0 is the token
  itself, k < 0 looks ahead in encoders) with the largest mean A[i, i-k];
- first-token / sink: mean A[i, 0] over queries i >= 1;
- local vs broad: mean normalized entropy of each query's row (0 = one key, 1 = uniform over
  its context) and mean attention distance sum_j A[i, j] |i - j| relative to what uniform
  attention over the same context would give;
- rare-word: mean attention on the least frequent token of the query's context (frequencies
  from the built-in corpus tokenized; position 0 and the query itself are excluded).
Each gives a strength in [0, 1]; a head gets every tag whose strength passes its threshold,
and its primary role is the strongest tag.

Attention probabilities come from `output_attentions=True` with the eager attention
implementation, switched on for the call and restored in `finally`. `pattern_stats` works on
any attention tensor, so tests can check it on hand-built patterns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from analysis.measure.tokens import as_sequences, text_sequences
from analysis.arch.adapters import input_device
from analysis.arch.attention import eager_attention  # noqa: F401  (re-exported: the switch lives in arch)
from analysis.core.errors import InputError
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.core.text import calibration_articles

ROLES = ("previous-token", "positional", "first-token", "local", "broad", "rare-word")
GENERIC_ROLES = ("local", "broad")
DEFAULT_THRESHOLDS = {
    "previous-token": 0.5,   # mean attention on the previous token
    "positional": 0.5,       # mean attention at the head's best other fixed offset
    "first-token": 0.5,      # mean attention on the first token
    "local": 0.75,           # 1 - (attention distance / uniform attention distance)
    "broad": 0.85,           # mean normalized entropy
    "rare-word": 0.3,        # mean attention on the rarest context token
}
MAX_OFFSET = 4
MIN_CONTEXT = 4              # queries with fewer candidate keys do not count for rare-word


@torch.no_grad()
def attention_forward(model, ids: torch.Tensor):
    """(model output, attention probabilities per layer: [n, H_l, T, T] float32 on the CPU, or None
    for a layer with no heads left) of the model on ids [n, T]. H_l is the layer's own head count
    (a physically pruned model has fewer in some layers)."""
    with eager_attention(model):
        out = model(input_ids=ids.to(input_device(model)), output_attentions=True, use_cache=False)
    attn = getattr(out, "attentions", None)
    if not attn or all(a is None for a in attn):
        raise InputError("This model did not return attention probabilities, so head roles cannot be "
                         "computed for it.")
    return out, [None if a is None else a.float().cpu() for a in attn]


def attention_probabilities(model, ids: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [n, L, H, T, T] of the model on ids [n, T] (float32, on the CPU)."""
    _, attn = attention_forward(model, ids)
    if any(a is None for a in attn) or len({a.shape[1] for a in attn}) > 1:
        raise InputError("This model has a different number of heads per layer (physically pruned); use the "
                         "detectors of analysis.measure.detectors, which place each kept head in its slot.")
    return torch.stack(attn, dim=1)                                    # [n, L, H, T, T]


def token_frequencies(tokenizer, texts=None, *, max_chars: int = 400_000) -> np.ndarray:
    """Token counts [vocab] over the built-in calibration corpus (or `texts`), up to max_chars."""
    if texts is None:
        texts, size = [], 0
        for article in calibration_articles():
            texts.append(article.text)
            size += len(article.text)
            if size >= max_chars:
                break
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    flat = np.fromiter((t for row in ids for t in row), dtype=np.int64)
    return np.bincount(flat, minlength=len(tokenizer)).astype(np.float64)   # [vocab]


@dataclass
class PatternStats:
    """Per-head pattern statistics, each [L, H] (mean over queries and sequences)."""
    previous: np.ndarray
    offsets: np.ndarray          # [K] relative offsets measured
    offset_mass: np.ndarray      # [L, H, K] mean A[i, i - k]
    first: np.ndarray
    entropy: np.ndarray          # normalized, 0..1
    locality: np.ndarray         # 1 - distance / uniform distance (1 = only itself, 0 = uniform)
    rare: np.ndarray             # NaN without frequencies
    causal: bool


def previous_token_mass(attn: torch.Tensor) -> torch.Tensor:
    """The previous-token statistic (the one definition): mean A[i, i-1] over queries i >= 1 of
    attention probabilities attn [n, ..., T, T] -> [...] (e.g. [L, H] or [H])."""
    a = attn.double()
    return a.diagonal(-1, -2, -1).mean((0, -1))                        # [...]


def _mean_over(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Mean of values [n, L, H, T] over the queries where mask [n?, T] is true -> [L, H]."""
    m = mask.to(values.dtype).expand_as(values)                        # [n, L, H, T]
    return (values * m).sum((0, 3)) / m.sum((0, 3)).clamp_min(1.0)     # [L, H]


def pattern_stats(attn: torch.Tensor, ids: torch.Tensor | None = None,
                  frequencies: np.ndarray | None = None) -> PatternStats:
    """Statistics of attention probabilities attn [n, L, H, T, T] for tokens ids [n, T]."""
    a = attn.double()                                                  # [n, L, H, T, T]
    n, L, H, T, _ = a.shape
    if T < 2:
        raise InputError("Head roles need sequences of at least two tokens; use a longer text.")
    causal = bool(a.triu(1).abs().max() < 1e-6)
    pos = torch.arange(T)
    q = torch.ones(1, T, dtype=torch.bool)
    q[:, 0] = False                                                    # queries i >= 1
    previous = previous_token_mass(a)                                  # [L, H]
    first = _mean_over(q, a[..., :, 0])                                # [L, H]
    offsets = np.arange(0 if causal else -MAX_OFFSET, MAX_OFFSET + 1)
    mass = []
    for k in offsets:
        diag = a.diagonal(-int(k), -2, -1)                             # [n, L, H, T - |k|]
        mass.append(diag.mean((0, 3)) if diag.shape[-1] else a.new_zeros(L, H))
    offset_mass = torch.stack(mass, -1)                                # [L, H, K]
    context = (pos[None, :] <= pos[:, None]) if causal else torch.ones(T, T, dtype=torch.bool)  # [T, T]
    width = context.sum(1).double()                                    # [T] keys per query
    plogp = torch.where(a > 0, a * a.clamp_min(1e-300).log(), a.new_zeros(()))
    ent = -plogp.sum(-1) / width.log().clamp_min(1e-12)                # [n, L, H, T]
    multi = (width >= 2)[None, :]                                      # [1, T]
    entropy = _mean_over(multi, ent)
    dist = (pos[:, None] - pos[None, :]).abs().double()                # [T, T]
    uniform = (dist * context).sum(1) / width                          # [T]
    locality = _mean_over(multi, 1.0 - (a * dist).sum(-1) / uniform.clamp_min(1e-12))
    rare = np.full((L, H), np.nan)
    if frequencies is not None and ids is not None:
        rare = _rare_mass(a, ids, np.asarray(frequencies, dtype=np.float64), context).numpy()
    return PatternStats(previous.numpy(), offsets, offset_mass.numpy(), first.numpy(), entropy.numpy(),
                        locality.numpy(), rare, causal)


def _rare_mass(a: torch.Tensor, ids: torch.Tensor, freq: np.ndarray, context: torch.Tensor) -> torch.Tensor:
    """Mean attention on the rarest context token (excluding position 0 and the query) -> [L, H]."""
    n, L, H, T, _ = a.shape
    f = torch.as_tensor(freq)[ids.clamp(0, len(freq) - 1)]             # [n, T] corpus counts
    allowed = context.clone()
    allowed[:, 0] = False
    allowed.fill_diagonal_(False)                                      # [T, T] candidate keys
    cost = torch.where(allowed[None], f[:, None, :], torch.full((), float("inf"), dtype=f.dtype))  # [n, T, T]
    target = cost.argmin(-1)                                           # [n, T] rarest key per query
    valid = (allowed.sum(1) >= MIN_CONTEXT)[None, :].expand(n, T)      # [n, T]
    picked = a.gather(-1, target[:, None, None, :, None].expand(n, L, H, T, 1))[..., 0]  # [n, L, H, T]
    return _mean_valid(valid, picked)


def _mean_valid(valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values [n, L, H, T] averaged over (n, T) where valid [n, T] -> [L, H]."""
    m = valid[:, None, None, :].to(values.dtype)                       # [n, 1, 1, T]
    return (values * m).sum((0, 3)) / m.sum((0, 3)).clamp_min(1.0)


@dataclass(frozen=True)
class HeadTag:
    layer: int
    head: int
    role: str         # one of ROLES
    strength: float   # 0..1
    detail: str = ""  # e.g. "offset +2"


@dataclass
class HeadRoles:
    """Role strengths [L, H] per role, the tags that pass the thresholds, primary role per head."""
    strengths: dict[str, np.ndarray]      # role -> [L, H]
    best_offset: np.ndarray               # [L, H] offset of the positional strength
    stats: PatternStats
    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))

    def tags(self) -> list[HeadTag]:
        out = []
        for role in ROLES:
            s = self.strengths[role]
            for l, h in zip(*np.nonzero(np.nan_to_num(s, nan=-1.0) >= self.thresholds[role])):
                detail = f"offset {int(self.best_offset[l, h]):+d}" if role == "positional" else ""
                out.append(HeadTag(int(l), int(h), role, float(s[l, h]), detail))
        return sorted(out, key=lambda t: (t.layer, t.head, -t.strength))

    def primary(self) -> tuple[np.ndarray, np.ndarray]:
        """(role [L, H] as str, "" where untagged; strength [L, H]) of each head's main tag: the
        strongest specific tag (previous-token, positional, first-token, rare-word), else the
        stronger of local/broad (a previous-token head is local too, but that says less)."""
        L, H = self.best_offset.shape
        role = np.full((L, H), "", dtype=object)
        strength = np.zeros((L, H))
        rank = np.full((L, H), -1.0)
        for t in self.tags():
            key = (0.0 if t.role in GENERIC_ROLES else 1.0) * 10 + t.strength
            if key > rank[t.layer, t.head]:
                rank[t.layer, t.head] = key
                role[t.layer, t.head], strength[t.layer, t.head] = t.role, t.strength
        return role, strength

    def table(self, ablation_delta: np.ndarray | None = None) -> list[dict]:
        """One row per tag, with the head's single-head ablation effect beside it when given."""
        return [dict(layer=t.layer, head=t.head, role=t.role, strength=round(t.strength, 4), detail=t.detail,
                     ablation_delta=None if ablation_delta is None else float(ablation_delta[t.layer, t.head]))
                for t in self.tags()]


def roles_from_stats(stats: PatternStats, thresholds: dict | None = None) -> HeadRoles:
    """Strength per role from pattern statistics (positional excludes offset 1 = previous-token)."""
    other = stats.offsets != 1
    om = stats.offset_mass[..., other]                                 # [L, H, K-1]
    best = om.argmax(-1)                                               # [L, H]
    strengths = {
        "previous-token": stats.previous,
        "positional": np.take_along_axis(om, best[..., None], -1)[..., 0],
        "first-token": stats.first,
        "local": np.clip(stats.locality, 0.0, 1.0),
        "broad": stats.entropy,
        "rare-word": stats.rare,
    }
    return HeadRoles(strengths, stats.offsets[other][best], stats, {**DEFAULT_THRESHOLDS, **(thresholds or {})})


class RoleTagger:
    """Tags heads by their attention patterns on real text; one verb: tag."""

    def __init__(self, seq_len: int = 128, batch_size: int = 4, thresholds: dict | None = None):
        self.seq_len, self.batch_size, self.thresholds = seq_len, max(1, batch_size), thresholds

    def tag(self, model, ids: torch.Tensor, frequencies: np.ndarray | None = None, *,
            progress: Progress | None = None, should_stop: ShouldStop | None = None) -> HeadRoles:
        """Roles of every head from ids [n, T] (equal-length sequences)."""
        x = as_sequences(ids, "Head roles")                            # [n, T]
        parts = []
        for s in range(0, x.shape[0], self.batch_size):
            check_stop(should_stop, "Head roles")
            parts.append(attention_probabilities(model, x[s:s + self.batch_size]))  # [b, L, H, T, T]
            report(progress, min(s + self.batch_size, x.shape[0]) / x.shape[0], "head roles: attention patterns")
        stats = pattern_stats(torch.cat(parts), x, frequencies)
        return roles_from_stats(stats, self.thresholds)


def head_roles(loaded, text: str | bytes | None = None, *, max_tokens: int = 512, seq_len: int = 128,
               frequencies: np.ndarray | None = None, thresholds: dict | None = None,
               progress: Progress | None = None, should_stop: ShouldStop | None = None) -> HeadRoles:
    """Roles of `loaded`'s heads on `text` (None = built-in evaluation text).

    frequencies: token counts [vocab] for rare-word (None = count the built-in calibration
    corpus with the model's tokenizer; callers should cache `token_frequencies`)."""
    ids = text_sequences(loaded.tokenizer, text, max_tokens=max_tokens, seq_len=seq_len)  # [n, T]
    freq = token_frequencies(loaded.tokenizer) if frequencies is None else frequencies
    return RoleTagger(seq_len, thresholds=thresholds).tag(loaded.model, ids, freq, progress=progress,
                                                          should_stop=should_stop)
