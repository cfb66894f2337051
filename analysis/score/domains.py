"""Domains: which heads matter more for one kind of text than for another, and whether a cut scored on
one domain keeps it while the other degrades.

- Text sets: a set has a scoring part and a held-out evaluation part. Built-in: "wikipedia" (the
  calibration / evaluation splits of analysis.core.text, CC BY-SA 4.0) and "python" (the interpreter's
  standard-library files, analysis.core.pysource, PSF License: even-numbered files score, odd ones
  evaluate); or the user's own text (`user_text_set`: one text cut in two at the paragraph nearest its
  middle; empty, binary, undecodable, too short or too large text is refused in one line).
  Language-specific heads are the same comparison with a text in one language as A and one in
  another as B (upload both; nothing else changes).
- Per-head importance on a set = the single-head ablation sweep's loss increase on its scoring part
  (analysis.measure.ablation.head_ablation; causal LMs: the fast sweep) with a 95 % bootstrap CI over
  its sequences (the sweep's per-sequence changes). The difference B - A per head has a CI from
  resampling both sets (independently: their sequences differ); a head whose CI excludes 0 is
  domain-specific at that level.
- Cuts: the heads ranked by their importance on A (the ablation oracle's scores,
  analysis.score.scoring.AblationOracle), masked at `sparsity` under the model's default policy; the
  same for B; each cut and the dense model evaluated on the held-out parts of A and of B (perplexity
  with a bootstrap CI over windows, and its ratio to dense).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from analysis.core.errors import InputError, check_seed, derived_seed
from analysis.core.progress import Progress, ShouldStop, scaled
from analysis.core.text import WIKI_ATTRIBUTION, calibration_text, clean_user_text, evaluation_text

USER_TEXT_MAX_BYTES = 8 * 2**20      # an uploaded text set: at most 8 MiB (a few hundred tokens are used)
BINARY_SHARE = 0.01                  # control characters (other than tab / newline) above this share: binary
DEFAULT_SCORE_TOKENS = 256
DEFAULT_SEQ_LEN = 32
DEFAULT_EVAL_TOKENS = 512
EVAL_WINDOW = 64
N_BOOT = 1000


@dataclass(frozen=True)
class TextSet:
    name: str
    score_text: str           # where head importance is measured
    eval_text: str            # held out: where cuts are evaluated
    attribution: str = ""


def builtin_text_set(which: str) -> TextSet:
    """"wikipedia" or "python" (module docstring)."""
    if which == "wikipedia":
        return TextSet("Wikipedia", calibration_text(200_000), evaluation_text(200_000), WIKI_ATTRIBUTION)
    if which == "python":
        from analysis.core.pysource import PYTHON_ATTRIBUTION, stdlib_sources
        files = [text for _, text in stdlib_sources()]
        return TextSet("Python source", "\n\n".join(files[0::2]), "\n\n".join(files[1::2]), PYTHON_ATTRIBUTION)
    raise InputError(f"Unknown built-in text set {which!r}; use 'wikipedia' or 'python', or upload a text.")


BUILTIN_SETS = ("wikipedia", "python")


def user_text_set(name: str, raw: str | bytes, *, max_bytes: int | None = None) -> TextSet:
    """The user's text as a set: refused in one line when empty, binary, not UTF-8 or above `max_bytes`
    (default USER_TEXT_MAX_BYTES); cut in two (scoring / held-out) at the paragraph boundary nearest its middle."""
    max_bytes = USER_TEXT_MAX_BYTES if max_bytes is None else max_bytes
    data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise InputError(f"The text for {name} is {len(data) / 2**20:.1f} MiB; the domain comparison takes at most "
                         f"{max_bytes / 2**20:.0f} MiB (it uses a few thousand tokens). Upload an excerpt.")
    if b"\x00" in data:
        raise InputError(f"The file for {name} holds NUL bytes: it looks like a binary file, not text. Upload a "
                         f"UTF-8 .txt file.")
    text = clean_user_text(data)
    control = sum(1 for ch in text if ord(ch) < 32 and ch not in "\n\t")
    if control > BINARY_SHARE * len(text):
        raise InputError(f"The text for {name} is {100 * control / len(text):.0f}% control characters: it looks like "
                         f"a binary file, not text. Upload a UTF-8 .txt file.")
    middle = len(text) // 2
    cuts = [i for i in (text.rfind("\n\n", 0, middle), text.find("\n\n", middle)) if i > 0]
    cut = min(cuts, key=lambda i: abs(i - middle)) if cuts else middle
    return TextSet(name, text[:cut].strip(), text[cut:].strip(), "")


def _boot_mean(unit_delta: np.ndarray, weight: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Resampled metric changes [n_boot, L, R] from per-unit changes [L, R, U] and unit weights [U]."""
    return np.moveaxis(unit_delta[..., picks].sum(-1) / weight[picks].sum(-1), -1, 0)


@dataclass(frozen=True)
class Importance:
    """Per-head loss increase on one text set: mean [L, H], CI [L, H, 2] (None without per-sequence data)."""
    name: str
    mean: np.ndarray
    ci: np.ndarray | None
    boot: np.ndarray | None           # [n_boot, L, H] resampled means (for differences)
    n_tokens: int
    metric: str


def importance(loaded, text: str, name: str, *, max_tokens: int = DEFAULT_SCORE_TOKENS,
               seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, progress: Progress | None = None,
               should_stop: ShouldStop | None = None, team=None) -> Importance:
    from analysis.measure.ablation import head_ablation
    seed = check_seed(seed, "The domains' seed")                       # before the sweep, not after it
    res = head_ablation(loaded, text, max_tokens=max_tokens, seq_len=seq_len, groups=False, progress=progress,
                        should_stop=should_stop, team=team)
    if res.unit_delta is None:
        return Importance(name, res.head_delta, None, None, res.n_tokens, res.metric)
    U = res.unit_weight.size
    picks = np.random.default_rng(seed).integers(0, U, size=(N_BOOT, U))    # [n_boot, U]
    boot = _boot_mean(res.unit_delta, res.unit_weight, picks)           # [n_boot, L, H]
    return Importance(name, res.head_delta, np.moveaxis(np.percentile(boot, [2.5, 97.5], axis=0), 0, -1), boot,
                      res.n_tokens, res.metric)


@dataclass
class DomainReport:
    a: Importance
    b: Importance
    difference: np.ndarray                   # [L, H] importance on B - on A
    difference_ci: np.ndarray | None         # [L, H, 2]
    cuts: list = field(default_factory=list)   # one dict per evaluated model (dense, cut on A, cut on B)
    attributions: tuple = ()
    seconds: float = 0.0

    def specific(self) -> dict[str, list[tuple[int, int, float]]]:
        """Heads whose difference CI excludes 0: {"more for B": [...], "more for A": [...]} (largest first)."""
        if self.difference_ci is None:
            return {}
        out = {}
        for label, sel, sign in ((f"more for {self.b.name}", self.difference_ci[..., 0] > 0, 1),
                                 (f"more for {self.a.name}", self.difference_ci[..., 1] < 0, -1)):
            heads = [(int(l), int(h), float(self.difference[l, h])) for l, h in zip(*np.nonzero(sel))]
            out[label] = sorted(heads, key=lambda t: -sign * t[2])
        return out

    def answer(self) -> str:
        """One sentence per cut: how far from dense it stays on each set."""
        dense = self.cuts[0]
        lines = []
        for c in self.cuts[1:]:
            lines.append(f"cut scored on {c['scored_on']} ({c['n_pruned']} heads, {c['sparsity']:.0%}, {c['policy']}): "
                         f"{self.a.name} {c['ratio_a']:.3f}x dense, {self.b.name} {c['ratio_b']:.3f}x dense")
        return f"dense {self.a.name} {dense['ppl_a']:.2f}, {self.b.name} {dense['ppl_b']:.2f}; " + "; ".join(lines)

    def as_dict(self) -> dict:
        return dict(a=dict(name=self.a.name, importance=self.a.mean, ci=self.a.ci, n_tokens=self.a.n_tokens),
                    b=dict(name=self.b.name, importance=self.b.mean, ci=self.b.ci, n_tokens=self.b.n_tokens),
                    metric=self.a.metric, difference=self.difference, difference_ci=self.difference_ci,
                    specific=self.specific(), cuts=self.cuts, attributions=list(self.attributions),
                    seconds=self.seconds)


def _evaluate(loaded, text: str, masks: np.ndarray, max_tokens: int, seed: int, should_stop) -> tuple:
    """(value [B], CI [B, 2]) of each mask's metric on `text` (perplexity CIs for causal LMs)."""
    from analysis.measure.evaluation import CausalPerplexity, bootstrap_perplexity, evaluate, gate_batch, token_ids
    if loaded.kind != "causal-lm":
        ev = evaluate(loaded, text, pruned=masks, max_tokens=max_tokens, should_stop=should_stop)
        return ev.values, np.full((masks.shape[0], 2), np.nan)
    ids = token_ids(loaded.tokenizer, text, max_tokens=max_tokens)
    ev = CausalPerplexity(window=EVAL_WINDOW)
    sums, counts = ev.window_nll(loaded.model, ids, gate_batch(loaded.model, pruned=masks), should_stop=should_stop)
    boot = bootstrap_perplexity(sums, counts, N_BOOT, seed)              # [n_boot, B]
    return np.exp(sums.sum(1) / counts.sum()), np.percentile(boot, [2.5, 97.5], axis=0).T


def compare_domains(loaded, a: TextSet, b: TextSet, *, sparsity: float = 0.25, policy: str | None = None,
                    max_tokens: int = DEFAULT_SCORE_TOKENS, seq_len: int = DEFAULT_SEQ_LEN,
                    eval_tokens: int = DEFAULT_EVAL_TOKENS, seed: int = 0, progress: Progress | None = None,
                    should_stop: ShouldStop | None = None, team=None) -> DomainReport:
    """Importance on A and on B, their difference with CIs, and the cuts scored on each evaluated on both."""
    from analysis.score.masks import check_sparsity
    check_sparsity(sparsity)
    seed = check_seed(seed, "The domains' seed")
    if a.name == b.name:
        b = TextSet(f"{b.name} (B)", b.score_text, b.eval_text, b.attribution)
    t0 = time.perf_counter()
    imp_a = importance(loaded, a.score_text, a.name, max_tokens=max_tokens, seq_len=seq_len, seed=seed,
                       progress=scaled(progress, 0.0, 0.45), should_stop=should_stop, team=team)
    imp_b = importance(loaded, b.score_text, b.name, max_tokens=max_tokens, seq_len=seq_len,
                       seed=derived_seed(seed, 1),
                       progress=scaled(progress, 0.45, 0.9), should_stop=should_stop, team=team)
    diff = imp_b.mean - imp_a.mean
    diff_ci = None
    if imp_a.boot is not None and imp_b.boot is not None:
        diff_ci = np.moveaxis(np.percentile(imp_b.boot - imp_a.boot, [2.5, 97.5], axis=0), 0, -1)   # [L, H, 2]
    if progress is not None:
        progress(0.9, "evaluating the cuts on both held-out texts")
    cuts = domain_cuts(loaded, a, b, {imp_a.name: imp_a.mean, imp_b.name: imp_b.mean}, sparsities=(sparsity,),
                       policy=policy, eval_tokens=eval_tokens, seed=seed, should_stop=should_stop)
    return DomainReport(imp_a, imp_b, diff, diff_ci, cuts, tuple(x for x in (a.attribution, b.attribution) if x),
                        time.perf_counter() - t0)


def domain_cuts(loaded, a: TextSet, b: TextSet, importances: dict, *, sparsities=(0.25,), policy: str | None = None,
                eval_tokens: int = DEFAULT_EVAL_TOKENS, seed: int = 0, should_stop: ShouldStop | None = None) -> list:
    """Dense, then for each sparsity the cut scored on each importance map (set name -> [L, H] loss increase,
    the ablation oracle's scores), all evaluated on the held-out parts of A and B (one batched pass each)."""
    from analysis.score.masks import default_policy, plan_mask
    from analysis.score.scoring import get_scorer
    seed = check_seed(seed, "The domains' seed")
    G = loaded.geometry.group_size
    policy = policy or default_policy(G)
    labels, masks = [("dense", 0.0)], [np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), dtype=bool)]
    for sparsity in sparsities:
        for name, imp in importances.items():
            plan = plan_mask(get_scorer("ablation", loss_increase=imp).score(loaded), sparsity, group_size=G,
                             policy=policy)
            labels.append((name, float(sparsity)))
            masks.append(np.asarray(plan.pruned))
    masks = np.stack(masks)                                              # [1 + S * 2, L, H]
    ppl_a, ci_a = _evaluate(loaded, a.eval_text, masks, eval_tokens, seed, should_stop)
    ppl_b, ci_b = _evaluate(loaded, b.eval_text, masks, eval_tokens, seed, should_stop)
    return [dict(scored_on=on, sparsity=sp, policy=policy, n_pruned=int(masks[i].sum()),
                 ppl_a=float(ppl_a[i]), ppl_a_ci=ci_a[i].tolist(), ratio_a=float(ppl_a[i] / ppl_a[0]),
                 ppl_b=float(ppl_b[i]), ppl_b_ci=ci_b[i].tolist(), ratio_b=float(ppl_b[i] / ppl_b[0]))
            for i, (on, sp) in enumerate(labels)]
