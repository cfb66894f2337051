"""Evaluation of a (head-masked) model on real text: the evidence behind every score.

Three metrics, one per `LoadedModel.kind` (dispatch table `EVALUATORS`):
- "causal-lm": perplexity = exp(mean token NLL), and from the same forward passes the next-token
  top-1 accuracy (`Evaluation.top1`: the share of scored tokens whose argmax prediction is the
  actual next token, "accuracy" as the compression literature reports it; `accuracy_ratio` divides
  it by the dense model's), with a sliding window of `window` tokens moved
  by `stride` as in the Hugging Face perplexity guide: every token is scored at most once,
  with up to `window - 1` tokens of context (with stride < window every token after the first
  is scored; with stride = window the first token of each window has no context and is not).
  Logits are computed only at the scored positions (`logits_to_keep`); windows of the same
  shape are batched.
- "masked-lm": pseudo-perplexity (Salazar et al. 2020): each non-special token is masked in
  turn and scored from the rest; the base model runs on the masked copies and the LM head is
  applied only at the masked position (a forward hook slices the base model's output).
- "encoder" (no LM head): embedding fidelity = mean cosine similarity of the mean-pooled
  embedding to the dense model's, per chunk of text (1.0 = unchanged).

Every metric runs under any head mask through `analysis.arch.head_gates.head_mask`; gates [B, L, H]
evaluate B masks in the same batched forward passes (inputs laid out mask-major, as the
masking contract says). Long text is split into windows/chunks that fit the model's context.

Sparsity curves (a score array -> masks -> this metric) are `analysis.score.curves`.

Multi-process (`team`, analysis.core.distributed): each evaluator's forward passes are a fixed list of
jobs (a batch of windows / chunks x a chunk of masks) built from the whole problem; the processes
of a launch split the jobs, gather each job's per-row sums, and add them up in job order: every
batch has the shape it has in one process, so the values are exactly the single-process ones.

Bad input (documented handling): empty or whitespace-only text, non-UTF-8 bytes, text with
fewer than two tokens, gates or masks of the wrong shape -> `InputError` saying what to do.
Text longer than the context is windowed, never truncated to the context; `max_tokens` caps
the amount of text evaluated (the first `max_tokens` tokens).

Device and precision: token ids go to the model's input device (`adapters.input_device`; a
dispatched model's embedding), logits of any dtype are scored in float32 at least (`loss.token_nll`)
and summed per mask in float64 on the CPU, so the float32 CPU path is unchanged.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from analysis.arch.cut import Cut, checked
from analysis.arch.hooks import attached
from analysis.arch.adapters import adapter_for, input_device
from analysis.core.distributed import SOLO, Team
from analysis.core.errors import InputError, check_seed, check_whole_number
from analysis.arch.head_gates import as_gates, gates_from_mask, head_mask
from analysis.measure.loss import token_nll
from analysis.arch.models import mean_pool
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.core.text import MAX_TOKENS_LIMIT, check_max_tokens, clean_user_text, evaluation_text, tokenize

DEFAULT_MAX_TOKENS = 512
DEFAULT_CAUSAL_WINDOW = 512
DEFAULT_MLM_WINDOW = 128


# ---------------------------------------------------------------------------------------------
# Small shared helpers (also used by ablation, roles, redundancy, attribution)
# ---------------------------------------------------------------------------------------------

def default_text() -> str:
    """The built-in evaluation text (held-out Wikipedia paragraphs)."""
    return evaluation_text()


def token_ids(tokenizer, text: str | bytes, *, max_tokens: int | None = None,
              add_special_tokens: bool = True, min_tokens: int = 2) -> torch.Tensor:
    """Tokenize user text -> ids [N] (the first `max_tokens` tokens). InputError if N < min_tokens.

    With special tokens this is `text.tokenize`; without (for re-chunking with specials per
    chunk) the same growing-prefix idea, so a long text is never tokenized whole."""
    text = clean_user_text(text)
    if add_special_tokens:
        ids = tokenize(tokenizer, text, max_tokens)[0]                  # [N]
    else:
        chars = len(text) if max_tokens is None else 8 * max_tokens + 256
        while True:
            ids = tokenizer(text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
            if max_tokens is None or chars >= len(text) or len(ids) >= max_tokens + 32:
                break
            chars *= 2
        ids = torch.as_tensor(ids[:max_tokens], dtype=torch.long)        # [N]
    if ids.numel() < min_tokens:
        raise InputError(f"The text gives {ids.numel()} token(s); this evaluation needs at least "
                         f"{min_tokens}. Use a longer text.")
    return ids


def gate_batch(model, gates=None, pruned=None) -> torch.Tensor | None:
    """Normalize a mask argument to gates [B, L, H] (or None for the dense model).

    gates: float [L, H] / [B, L, H], 1 = keep, 0 = prune (fractions allowed).
    pruned: bool [L, H] / [B, L, H], True = pruned (converted with gates_from_mask).
    InputError for both at once or the wrong shape."""
    if gates is not None and pruned is not None:
        raise InputError("Pass either gates (1 = keep) or pruned (True = pruned), not both.")
    if pruned is not None:
        gates = gates_from_mask(pruned)
    if gates is None:
        return None
    g = as_gates(gates, adapter_for(model).geometry(model))          # [L, H] or [B, L, H]
    return g.unsqueeze(0) if g.dim() == 2 else g                      # [B, L, H]


def context_length(model, default: int = 512) -> int:
    """The model's maximum sequence length (max_position_embeddings or equivalent); `model` is anything with the
    model's `config` (a model, or an analysis.arch.models.LoadedModel, a deferred one too)."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _masked(model, gates: torch.Tensor | None):
    """head_mask for a gate batch, or a no-op context for the dense model."""
    return contextlib.nullcontext(model) if gates is None else head_mask(model, gates)


def _chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass(frozen=True)
class Evaluation:
    """One metric value per mask. `values[b]` belongs to gate row b (one row for a single mask)."""
    metric: str                # "perplexity" | "pseudo-perplexity" | "embedding-fidelity"
    values: np.ndarray         # [B]
    mean_nll: np.ndarray | None  # [B] mean token NLL (nats) for LM metrics, None for fidelity
    n_tokens: int              # tokens scored (LM) or tokens embedded (fidelity)
    higher_is_better: bool
    top1: np.ndarray | None = None  # [B] next-token top-1 accuracy (causal LMs), None otherwise

    @property
    def accuracy(self) -> float | None:
        """Top-1 next-token accuracy of the first mask (causal LMs; None otherwise)."""
        return None if self.top1 is None else float(self.top1[0])

    @property
    def value(self) -> float:
        """The metric of the first (usually only) mask."""
        return float(self.values[0])


# ---------------------------------------------------------------------------------------------
# Causal LM perplexity
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    begin: int     # first token of the window (absolute)
    end: int       # one past the last token
    n_target: int  # the last n_target tokens of the window are scored


def causal_windows(n_tokens: int, window: int, stride: int) -> list[Window]:
    """The HF-guide sliding windows over n_tokens; each token is scored at most once.

    Window w covers tokens [begin, end) and scores its last n_target tokens (those not scored
    by an earlier window; the window's first token has no context inside it)."""
    if window < 2 or stride < 1 or stride > window:
        raise InputError(f"Window {window} / stride {stride} are invalid: need window >= 2 and "
                         "1 <= stride <= window.")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        n_target = end - max(prev_end, begin + 1)  # token `begin` has no prediction inside the window
        if n_target > 0:
            out.append(Window(begin, end, n_target))
        prev_end = end
        if end == n_tokens:
            break
    return out


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class CausalPerplexity:
    """exp(mean NLL) of a causal LM over a token stream with sliding windows; one verb: measure."""
    metric = "perplexity"
    label = "perplexity"
    higher_is_better = False

    def __init__(self, window: int | None = None, stride: int | None = None, batch_size: int = 8):
        self.window, self.stride, self.batch_size = window, stride, max(1, int(batch_size))

    def prepare(self, tokenizer, text, max_tokens: int | None) -> torch.Tensor:
        return token_ids(tokenizer, text, max_tokens=max_tokens)      # [N]

    def plan(self, model, n_tokens: int) -> list[Window]:
        window = self.window or min(context_length(model), DEFAULT_CAUSAL_WINDOW)
        window = min(window, context_length(model))
        stride = self.stride or window
        return causal_windows(n_tokens, window, min(stride, window))

    def nll(self, model, ids: torch.Tensor, gates: torch.Tensor | None = None, *,
            progress: Progress | None = None, should_stop: ShouldStop | None = None,
            team: Team | None = None) -> tuple[np.ndarray, int]:
        """Summed token NLL per mask [B] (float64) and the number of scored tokens.

        ids: [N] token ids; gates: [B, L, H] or None (dense, B = 1)."""
        sums, counts = self.window_nll(model, ids, gates, progress=progress, should_stop=should_stop, team=team)
        return sums.sum(axis=1), int(counts.sum())

    def window_nll(self, model, ids: torch.Tensor, gates: torch.Tensor | None = None, *,
                   progress: Progress = None, should_stop: ShouldStop = None,
                   team: Team | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Summed token NLL per mask and window [B, W] (float64) and scored tokens per window [W]
        (the windows of `plan`, in order): what a bootstrap over windows resamples. `team`: the
        processes that split the jobs (module docstring)."""
        sums, _, counts = self.window_stats(model, ids, gates, progress=progress, should_stop=should_stop, team=team)
        return sums, counts

    @torch.no_grad()
    def window_stats(self, model, ids: torch.Tensor, gates: torch.Tensor | None = None, *,
                     progress: Progress = None, should_stop: ShouldStop = None,
                     team: Team | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`window_nll`'s sums [B, W] and counts [W], and the correct top-1 next-token predictions
        per mask and window [B, W] (argmax of the logits == the next token), from the same passes."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)      # [N]
        if ids.numel() < 2:
            raise InputError("Perplexity needs at least two tokens; use a longer text.")
        windows = self.plan(model, ids.numel())
        device = input_device(model)
        B = 1 if gates is None else gates.shape[0]
        keep_arg = _accepts(model, "logits_to_keep")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, w in enumerate(windows):
            groups.setdefault((w.end - w.begin, w.n_target), []).append(i)
        mask_chunks = _chunks(B, self.batch_size)
        jobs = [(key, idx[r.start:r.stop], mr) for key, idx in groups.items()
                for r in _chunks(len(idx), max(1, self.batch_size // min(B, self.batch_size)))
                for mr in mask_chunks]
        sums = torch.zeros(B, len(windows), dtype=torch.float64)       # [B, W]
        correct = torch.zeros(B, len(windows), dtype=torch.float64)    # [B, W]

        def run(j: int) -> torch.Tensor:
            (length, m), idx, mr = jobs[j]
            check_stop(should_stop, "Perplexity")
            x = torch.stack([ids[windows[i].begin:windows[i].end] for i in idx]).to(device)   # [k, T]
            y = x[:, length - m:]                                       # [k, m] targets
            g = None if gates is None else gates[mr.start:mr.stop]      # [b, L, H]
            b = 1 if g is None else g.shape[0]
            xb = x.repeat(b, 1)                                         # [b*k, T] mask-major
            with _masked(model, g):
                if keep_arg:
                    logits = model(input_ids=xb, use_cache=False, logits_to_keep=m + 1).logits[:, :-1]  # [b*k, m, V]
                else:
                    logits = model(input_ids=xb, use_cache=False).logits[:, length - m - 1:-1]      # [b*k, m, V]
            targets = y.repeat(b, 1)                                    # [b*k, m]
            nll = token_nll(logits, targets).cpu().double()             # [b*k, m] float32 at least, summed in float64
            hits = (logits.argmax(-1) == targets).cpu().double()         # [b*k, m]
            report(progress, (j + 1) / len(jobs), f"perplexity: window batch {j + 1}/{len(jobs)}")
            return torch.stack([nll.reshape(b, len(idx), m).sum(2), hits.reshape(b, len(idx), m).sum(2)])  # [2, b, k]

        blocks = (team or SOLO).map(run, len(jobs), what="perplexity")
        for (_, idx, mr), block in zip(jobs, blocks):
            sums[mr.start:mr.stop, idx] += block[0]                     # [b, k]
            correct[mr.start:mr.stop, idx] += block[1]                  # [b, k]
        return sums.numpy(), correct.numpy(), np.array([w.n_target for w in windows])

    def measure(self, model, ids, gates=None, *, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, team: Team | None = None) -> Evaluation:
        sums, correct, counts = self.window_stats(model, ids, gates, progress=progress, should_stop=should_stop,
                                                  team=team)
        n = int(counts.sum())
        mean = sums.sum(axis=1) / n                                     # [B]
        return Evaluation(self.metric, np.exp(mean), mean, n, self.higher_is_better, top1=correct.sum(axis=1) / n)


# ---------------------------------------------------------------------------------------------
# Masked LM pseudo-perplexity
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskedChunk:
    ids: torch.Tensor        # [T] token ids with special tokens
    positions: torch.Tensor  # [m] positions to mask and score (non-special)


def special_template(tokenizer) -> tuple[list[int], list[int]]:
    """The special ids a tokenizer puts before and after one sequence, e.g. ([CLS], [SEP]).

    Learned from a probe word (tokenizers in transformers 5 no longer expose
    build_inputs_with_special_tokens)."""
    full = list(tokenizer("hello world", verbose=False)["input_ids"])
    bare = list(tokenizer("hello world", add_special_tokens=False, verbose=False)["input_ids"])
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


def special_chunks(tokenizer, ids: torch.Tensor, window: int) -> list[MaskedChunk]:
    """Split ids [N] into chunks of at most `window` tokens including the special tokens."""
    prefix, suffix = special_template(tokenizer)
    size = max(1, window - len(prefix) - len(suffix))
    out = []
    for r in _chunks(ids.numel(), size):
        full = torch.as_tensor(prefix + ids[r.start:r.stop].tolist() + suffix, dtype=torch.long)  # [T]
        out.append(MaskedChunk(full, torch.arange(len(prefix), len(prefix) + len(r))))
    return out


def _slice_output_hook(positions: torch.Tensor):
    """Forward hook for the base model: keep only row r's hidden state at positions[r]."""
    def hook(module, args, output):
        hidden = output[0]                                             # [R, T, D]
        rows = torch.arange(hidden.shape[0], device=hidden.device)     # [R]
        picked = hidden[rows, positions.to(hidden.device)].unsqueeze(1)  # [R, 1, D]
        if isinstance(output, tuple):
            return (picked, *output[1:])
        output[next(iter(output.keys()))] = picked
        return output
    return hook


class PseudoPerplexity:
    """Pseudo-perplexity of a masked LM (Salazar et al.); one verb: measure.

    Logits only at the masked positions: a forward hook on `model.base_model` cuts its output
    to the masked position of each row before the (position-wise) LM head runs."""
    metric = "pseudo-perplexity"
    label = "pseudo-perplexity"
    higher_is_better = False

    def __init__(self, window: int | None = None, batch_size: int = 32, **_):
        self.window, self.batch_size = window, max(1, int(batch_size))

    def prepare(self, tokenizer, text, max_tokens: int | None) -> list[MaskedChunk]:
        if tokenizer.mask_token_id is None:
            raise InputError("This tokenizer has no [MASK] token, so pseudo-perplexity is undefined.")
        ids = token_ids(tokenizer, text, max_tokens=max_tokens, add_special_tokens=False, min_tokens=2)  # [N]
        self.mask_token_id = tokenizer.mask_token_id
        return special_chunks(tokenizer, ids, self.window or DEFAULT_MLM_WINDOW)

    @torch.no_grad()
    def nll(self, model, chunks: Sequence[MaskedChunk], gates: torch.Tensor | None = None, *,
            mask_token_id: int | None = None, progress: Progress | None = None,
            should_stop: ShouldStop | None = None, team: Team | None = None) -> tuple[np.ndarray, int]:
        """Summed pseudo-NLL per mask [B] (float64) and the number of scored tokens."""
        mask_id = mask_token_id if mask_token_id is not None else getattr(self, "mask_token_id", None)
        if mask_id is None:
            raise InputError("Pseudo-perplexity needs the tokenizer's mask token id.")
        base = model.base_model
        if base is model:
            raise InputError("This model has no LM head; use embedding fidelity instead.")
        B = 1 if gates is None else gates.shape[0]
        device = input_device(model)
        jobs = []   # (chunk, positions slice)
        per = max(1, self.batch_size // min(B, self.batch_size))
        for c in chunks:
            for r in _chunks(c.positions.numel(), per):
                for mr in _chunks(B, self.batch_size):
                    jobs.append((c, c.positions[r.start:r.stop], mr))
        total = torch.zeros(B, dtype=torch.float64)                    # [B]

        def run(j: int) -> torch.Tensor:
            c, pos, mr = jobs[j]
            check_stop(should_stop, "Pseudo-perplexity")
            k = pos.numel()
            x = c.ids.repeat(k, 1)                                     # [k, T]
            x[torch.arange(k), pos] = mask_id                          # one masked token per row
            x, y = x.to(device), c.ids[pos].to(device)                 # [k, T], [k]
            g = None if gates is None else gates[mr.start:mr.stop]      # [b, L, H]
            b = 1 if g is None else g.shape[0]
            with attached() as hooks, _masked(model, g):
                hooks.after(base, _slice_output_hook(pos.repeat(b).to(device)))
                logits = model(input_ids=x.repeat(b, 1), attention_mask=torch.ones_like(x).repeat(b, 1)
                               ).logits[:, 0]                          # [b*k, V]
            nll = token_nll(logits, y.repeat(b)).cpu().double()          # [b*k]
            report(progress, (j + 1) / len(jobs), f"pseudo-perplexity: batch {j + 1}/{len(jobs)}")
            return nll.reshape(b, k).sum(1).cpu()                       # [b]

        blocks = (team or SOLO).map(run, len(jobs), what="pseudo-perplexity")
        for (_, _, mr), block in zip(jobs, blocks):
            total[mr.start:mr.stop] += block                            # [b]
        return total.numpy(), int(sum(c.positions.numel() for c in chunks))

    def measure(self, model, chunks, gates=None, *, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, mask_token_id: int | None = None,
                team: Team | None = None) -> Evaluation:
        if not chunks or sum(c.positions.numel() for c in chunks) == 0:
            raise InputError("The text has no tokens to score; use a longer text.")
        total, n = self.nll(model, chunks, gates, mask_token_id=mask_token_id, progress=progress,
                            should_stop=should_stop, team=team)
        mean = total / n                                                # [B]
        return Evaluation(self.metric, np.exp(mean), mean, n, self.higher_is_better)


# ---------------------------------------------------------------------------------------------
# Encoders without an LM head: embedding fidelity
# ---------------------------------------------------------------------------------------------

class EmbeddingFidelity:
    """Mean cosine of the mean-pooled embedding vs the dense model's, per chunk; one verb: measure."""
    metric = "embedding-fidelity"
    label = "embedding fidelity"
    higher_is_better = True

    def __init__(self, window: int | None = None, batch_size: int = 16, **_):
        self.window, self.batch_size = window, max(1, int(batch_size))

    def prepare(self, tokenizer, text, max_tokens: int | None) -> list[torch.Tensor]:
        ids = token_ids(tokenizer, text, max_tokens=max_tokens, add_special_tokens=False, min_tokens=1)  # [N]
        return [c.ids for c in special_chunks(tokenizer, ids, self.window or DEFAULT_MLM_WINDOW)]

    @torch.no_grad()
    def embed(self, model, chunks: Sequence[torch.Tensor], gates: torch.Tensor | None = None, *,
              progress: Progress | None = None, should_stop: ShouldStop | None = None,
              team: Team | None = None) -> torch.Tensor:
        """Mean-pooled embeddings [B, n_chunks, D] (B = 1 for the dense model)."""
        B = 1 if gates is None else gates.shape[0]
        out = [[None] * len(chunks) for _ in range(B)]
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault(c.numel(), []).append(i)
        per = max(1, self.batch_size // min(B, self.batch_size))
        device = input_device(model)
        jobs = [(idx[r.start:r.stop], mr) for idx in groups.values() for r in _chunks(len(idx), per)
                for mr in _chunks(B, self.batch_size)]

        def run(j: int) -> torch.Tensor:
            idx, mr = jobs[j]
            check_stop(should_stop, "Embedding fidelity")
            x = torch.stack([chunks[i] for i in idx]).to(device)      # [k, T]
            g = None if gates is None else gates[mr.start:mr.stop]     # [b, L, H]
            b = 1 if g is None else g.shape[0]
            with _masked(model, g):
                hidden = model(input_ids=x.repeat(b, 1), attention_mask=torch.ones_like(x).repeat(b, 1))[0]  # [b*k, T, D]
            report(progress, (j + 1) / len(jobs), f"embedding fidelity: batch {j + 1}/{len(jobs)}")
            return mean_pool(hidden.float()).reshape(b, len(idx), -1).cpu()  # [b, k, D] pooled in float32

        blocks = (team or SOLO).map(run, len(jobs), what="embedding fidelity")
        for (idx, mr), pooled in zip(jobs, blocks):
            for bi in range(pooled.shape[0]):
                for ki, i in enumerate(idx):
                    out[mr.start + bi][i] = pooled[bi, ki]
        return torch.stack([torch.stack(row) for row in out])         # [B, n_chunks, D]

    def measure(self, model, chunks, gates=None, *, progress: Progress | None = None,
                should_stop: ShouldStop | None = None, team: Team | None = None, **_) -> Evaluation:
        if not chunks:
            raise InputError("The text has no tokens to embed; use a longer text.")
        half = (lambda f, m: report(progress, 0.5 * f, m)) if progress else None
        dense = self.embed(model, chunks, None, progress=half, should_stop=should_stop, team=team)[0]  # [n, D]
        rest = (lambda f, m: report(progress, 0.5 + 0.5 * f, m)) if progress else None
        masked = dense.unsqueeze(0) if gates is None else self.embed(
            model, chunks, gates, progress=rest, should_stop=should_stop, team=team)                  # [B, n, D]
        cos = F.cosine_similarity(masked.double(), dense.double().unsqueeze(0), dim=-1)     # [B, n]
        return Evaluation(self.metric, cos.mean(1).numpy(), None,
                          int(sum(c.numel() for c in chunks)), self.higher_is_better)


# kind -> evaluator class (LoadedModel.kind)
EVALUATORS = {
    "causal-lm": CausalPerplexity,
    "masked-lm": PseudoPerplexity,
    "encoder": EmbeddingFidelity,
}


def metric_of(kind: str) -> tuple[str, bool]:
    """(metric name, higher is better) of a model kind, as its evaluator in EVALUATORS measures it."""
    cls = evaluator_class(kind)
    return cls.metric, cls.higher_is_better


def evaluator_class(kind: str):
    """The evaluator class of a model kind; InputError naming the known kinds otherwise."""
    try:
        return EVALUATORS[kind]
    except KeyError:
        raise InputError(f"No evaluation for model kind {kind!r}; known kinds: {', '.join(EVALUATORS)}.") from None


def evaluator_for(kind: str, **options):
    return evaluator_class(kind)(**options)


def evaluate(loaded, text: str | bytes | None = None, *, gates=None, pruned=None, cut: Cut | None = None,
             max_tokens: int | None = DEFAULT_MAX_TOKENS, window: int | None = None,
             stride: int | None = None, batch_size: int = 8, progress: Progress | None = None,
             should_stop: ShouldStop | None = None, team: Team | None = None) -> Evaluation:
    """Evaluate `loaded` (a LoadedModel) on `text` under a head mask or a cut, with the metric of its kind.

    text: str or UTF-8 bytes; None = the built-in evaluation text. Only the first `max_tokens`
    tokens are used (None = all). gates: float [L, H] or [B, L, H] (1 keep, 0 prune) or
    pruned: bool [L, H] / [B, L, H]; B masks share batched forward passes and give
    `Evaluation.values[b]`. cut: an analysis.arch.cut.Cut instead (a mask, a KV plan, a model of its own;
    not with gates / pruned). window/stride: causal sliding window (default min(context, 512),
    stride = window); for masked LMs and encoders `window` is the chunk length (default 128).
    batch_size: sequences per forward pass. team: the processes of a launch that split the forward
    passes (analysis.core.distributed; None = this process alone). Raises InputError for bad text or masks,
    CancelledError when should_stop() returns True."""
    check_max_tokens(max_tokens)                                       # before a byte of text is tokenized
    window = check_whole_number(window, "window", low=2, high=MAX_TOKENS_LIMIT, none_ok=True)
    stride = check_whole_number(stride, "stride", low=1, high=MAX_TOKENS_LIMIT, none_ok=True)
    batch_size = check_whole_number(batch_size, "batch_size", low=1, high=2**16)
    cut = checked(cut, loaded.geometry)
    if cut is not None and (gates is not None or pruned is not None):
        raise InputError("Give one cut: a cut, or gates / a mask, not both.")
    if cut is not None and cut.kind == "mask":
        pruned, cut = cut.mask, None                                      # masks batch through the gates
    g = gate_batch(loaded.model, gates, pruned)                        # [B, L, H] | None
    ev = evaluator_for(loaded.kind, window=window, stride=stride, batch_size=batch_size)
    inputs = ev.prepare(loaded.tokenizer, default_text() if text is None else text, max_tokens)
    if cut is None:
        return ev.measure(loaded.model, inputs, g, progress=progress, should_stop=should_stop, team=team)
    with cut.running(loaded.model, adapter=loaded.adapter) as model:
        return ev.measure(model, inputs, None, progress=progress, should_stop=should_stop, team=team)


def bootstrap_perplexity(sums: np.ndarray, counts: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Perplexity per row over n bootstrap resamples of the windows (the same resamples for every row).

    sums [B, W] summed NLL per row and window, counts [W] scored tokens (`CausalPerplexity.window_nll`)
    -> [n, B]; a 95 % CI is np.percentile(..., [2.5, 97.5], axis=0)."""
    rng = np.random.default_rng(check_seed(seed, "The bootstrap's seed"))
    picks = rng.integers(0, counts.size, size=(n, counts.size))                # [n, W]
    return np.exp(sums[:, picks].sum(axis=2).T / counts[picks].sum(axis=1)[:, None])   # [n, B]


def accuracy_ratio(pruned: Evaluation, dense: Evaluation) -> float | None:
    """Top-1 accuracy of `pruned` (its first mask) over the dense model's; None without accuracy."""
    if pruned.accuracy is None or not dense.accuracy:
        return None
    return pruned.accuracy / dense.accuracy


def perplexity(loaded, text: str | bytes | None = None, *, gates=None, pruned=None, cut: Cut | None = None,
               max_tokens: int | None = DEFAULT_MAX_TOKENS, window: int | None = None,
               stride: int | None = None, batch_size: int = 8, progress: Progress | None = None,
               should_stop: ShouldStop | None = None) -> float | np.ndarray:
    """Perplexity of `loaded` on `text` under a head mask (STABLE SIGNATURE, used by scoring).

    Causal LMs: sliding-window perplexity; masked LMs: pseudo-perplexity. Encoders without an LM
    head have no perplexity: InputError pointing to `evaluate` (embedding fidelity).
    Arguments as in `evaluate`. Returns a float for one mask ([L, H] or none), an array [B] for
    gates/pruned of shape [B, L, H]."""
    if loaded.kind not in ("causal-lm", "masked-lm"):
        raise InputError(f"A {loaded.kind} model has no LM head, so it has no perplexity; use "
                         "evaluate() for its embedding fidelity to the dense model.")
    single = all(m is None or np.ndim(m) == 2 for m in (gates, pruned))
    ev = evaluate(loaded, text, gates=gates, pruned=pruned, cut=cut, max_tokens=max_tokens, window=window,
                  stride=stride, batch_size=batch_size, progress=progress, should_stop=should_stop)
    return ev.value if single else ev.values
