"""The self-check of a lossy export: the written file, run right after it is written on this machine's
own kernels, against its float reference on held-back tokens.

A quantized artifact (an INT8 ONNX file, a GGUF file at any type below F32) can be wrong in ways no
test of the writer sees: ONNX Runtime's u8 x s8 integer kernels saturate on x86 CPUs without VNNI
(docs/EXPORT.md, "INT8 on every CPU"), a quantizer can write wrong scales. So each lossy export is
measured before it becomes the export: the file and its float reference (the float32 ONNX file, the
PyTorch model, or the F32 GGUF in llama.cpp) predict the next token on `SELF_CHECK_TOKENS` tokens of the
built-in evaluation split (held back: the quantizers calibrate on the calibration split), and the file
must keep, for a language model,
- perplexity / the reference's perplexity at most the floor's, and
- top-1 agreement with the reference at least the floor's. Both are needed: on a random-weight model
  (the tests' tiny ones) the logits are nearly flat, so a file with every scale 100x too large keeps
  its perplexity on random ids (1.003x measured) while its agreement falls from 0.99 to 0.01;
or, for a model without an LM head, a mean cosine similarity of its output rows to the reference's at
least the floor's.

The floors (`FLOORS`, by the bits of the weights) sit well below what correct files measure on the
built-in SmolLM2 (docs/EXPORT.md, "Self-check") and far above what the broken kernels gave (top-1
0.17, perplexity x167): they catch broken files and kernels, not the normal cost of fewer bits.
"""
from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from analysis.compress.export.folder import ExportError

SELF_CHECK_TOKENS = 512          # held-back tokens (windows of SELF_CHECK_WINDOW): a few seconds on SmolLM2
SELF_CHECK_WINDOW = 256
SELF_CHECK_FILE = "self_check.json"


@dataclass(frozen=True)
class Floor:
    """What a correct file of this precision keeps at the least (language models: agreement,
    perplexity ratio; models without an LM head: cosine fidelity of the outputs)."""
    agreement: float
    perplexity_ratio: float
    fidelity: float

    def text(self, causal: bool) -> str:
        return (f"top-1 agreement >= {self.agreement:.2f}, perplexity <= {self.perplexity_ratio:.2f}x" if causal
                else f"output cosine >= {self.fidelity:.3f}")


# bits of the weights -> floor (docs/EXPORT.md, "Self-check": what correct files measured on SmolLM2)
FLOORS: dict[int, Floor] = {
    16: Floor(agreement=0.95, perplexity_ratio=1.02, fidelity=0.999),
    8: Floor(agreement=0.80, perplexity_ratio=1.10, fidelity=0.98),
    6: Floor(agreement=0.70, perplexity_ratio=1.25, fidelity=0.95),
    4: Floor(agreement=0.55, perplexity_ratio=1.60, fidelity=0.90),
}

# next-token logits [T, V] (float) of one window of token ids [T]
LogitsFn = Callable[[np.ndarray], np.ndarray]


class SelfCheckFailed(ExportError):
    """A lossy export measured below its floor: nothing was written."""


def cpu_features() -> str:
    """The CPU features that decide which integer / vector kernels run here, in one phrase
    (e.g. "x86_64 with AVX-512 and VNNI"), read from /proc/cpuinfo where there is one."""
    machine = platform.machine() or "unknown CPU"
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return machine
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    names = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_vnni", "VNNI"),
                                     ("avx_vnni", "AVX-VNNI"), ("amx_int8", "AMX"), ("asimddp", "NEON dot"))
             if flag in flags]
    return f"{machine} with {', '.join(names)}" if names else machine


@dataclass
class SelfCheck:
    """What the self-check measured and whether the file passed."""
    artifact: str                   # e.g. "INT8 ONNX (dynamic, u8 weights)"
    reference: str                  # e.g. "the float32 ONNX file"
    bits: int
    n_tokens: int
    passed: bool
    floor: dict
    cpu: str
    text: str                       # "held-back tokens" or "random token ids (...)"
    agreement: float | None = None
    perplexity: float | None = None
    reference_perplexity: float | None = None
    reference_accuracy: float | None = None     # the reference's own next-token top-1 accuracy
    accuracy: float | None = None               # the file's own next-token top-1 accuracy
    fidelity: float | None = None
    details: dict = field(default_factory=dict)  # what the file is, e.g. the layers an INT8 file keeps float

    @property
    def perplexity_ratio(self) -> float | None:
        if self.perplexity is None or not self.reference_perplexity:
            return None
        return self.perplexity / self.reference_perplexity

    def measured(self) -> str:
        if self.fidelity is not None:
            return f"output cosine {self.fidelity:.4f}"
        return f"top-1 agreement {self.agreement:.3f}, perplexity {self.perplexity_ratio:.3f}x"

    def line(self) -> str:
        """One line for the CLI, the pages and the reports."""
        floor = Floor(**self.floor).text(self.fidelity is None)
        verdict = "passed" if self.passed else "FAILED"
        return (f"self-check {verdict}: {self.artifact} vs {self.reference}, {self.measured()} on {self.n_tokens} "
                f"{self.text} on this CPU ({self.cpu}); floor {floor}.")

    def as_dict(self) -> dict:
        return {**asdict(self), "perplexity_ratio": self.perplexity_ratio, "line": self.line()}


def floor_for(bits: int) -> Floor:
    """The floor of the nearest precision at or below `bits` (a 5-bit type gets the 4-bit floor)."""
    known = sorted(b for b in FLOORS if b <= bits) or [min(FLOORS)]
    return FLOORS[known[-1]]


@dataclass(frozen=True)
class CheckText:
    """The token windows a self-check runs (each int64 [T]) and what they are, for its line."""
    windows: list
    source: str


def held_back_windows(tokenizer, model, *, n_tokens: int = SELF_CHECK_TOKENS) -> CheckText:
    """Windows (at most SELF_CHECK_WINDOW tokens, at most the model's context) of the first n_tokens
    tokens of the built-in evaluation split; without a tokenizer (or with one whose ids do not fit the
    model's vocabulary, e.g. a tiny test model), seeded random ids."""
    from analysis.measure.evaluation import context_length
    vocab_size = int(model.config.get_text_config().vocab_size)
    window = min(SELF_CHECK_WINDOW, context_length(model, SELF_CHECK_WINDOW))
    ids = _text_ids(tokenizer, vocab_size, n_tokens)
    if ids is not None:
        source = "held-back tokens"
    else:
        ids = np.random.default_rng(0).integers(0, vocab_size, n_tokens, dtype=np.int64)              # [N]
        source = "random token ids (no tokenizer for this model)"
    return CheckText([ids[b:b + window] for b in range(0, len(ids) - 1, window) if len(ids[b:b + window]) >= 2],
                     source)


def _text_ids(tokenizer, vocab_size: int, n_tokens: int) -> np.ndarray | None:
    """The evaluation split's first tokens [N], or None where the tokenizer cannot give them for this
    model (no tokenizer, ids beyond its vocabulary, a tokenizer without a vocabulary of its own)."""
    if tokenizer is None or len(tokenizer) > vocab_size:
        return None
    from analysis.core.errors import InputError
    from analysis.core.text import evaluation_text
    from analysis.measure.evaluation import token_ids
    try:
        ids = token_ids(tokenizer, evaluation_text(), max_tokens=n_tokens).numpy().astype(np.int64)   # [N]
    except InputError:
        return None
    return ids if len(ids) >= 2 and int(ids.max()) < vocab_size else None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)                                         # [T, V]
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))      # [T, V]


def check_causal(reference: LogitsFn, artifact: LogitsFn, text: CheckText, *, bits: int,
                 artifact_name: str, reference_name: str) -> SelfCheck:
    """Next-token agreement and perplexity ratio of `artifact` against `reference` over the windows."""
    same = hits = hits_art = count = 0
    nll_ref = nll_art = 0.0
    for ids in text.windows:
        ref, art = _log_softmax(reference(ids)), _log_softmax(artifact(ids))   # [T, V] each
        targets = ids[1:]                                                       # [T-1]
        rows = np.arange(len(targets))
        pred_ref, pred_art = ref[:-1].argmax(1), art[:-1].argmax(1)             # [T-1]
        same += int((pred_ref == pred_art).sum())
        hits += int((pred_ref == targets).sum())
        hits_art += int((pred_art == targets).sum())
        nll_ref -= float(ref[rows, targets].sum())
        nll_art -= float(art[rows, targets].sum())
        count += len(targets)
    floor = floor_for(bits)
    agreement, accuracy = same / count, hits / count
    ppl_ref, ppl_art = float(np.exp(nll_ref / count)), float(np.exp(nll_art / count))
    ratio = ppl_art / ppl_ref
    passed = bool(np.isfinite(ratio) and ratio <= floor.perplexity_ratio and agreement >= floor.agreement)
    return SelfCheck(artifact=artifact_name, reference=reference_name, bits=bits, n_tokens=count, passed=passed,
                     floor=asdict(floor), cpu=cpu_features(), text=text.source, agreement=agreement, perplexity=ppl_art,
                     reference_perplexity=ppl_ref, reference_accuracy=accuracy, accuracy=hits_art / count)


def check_outputs(reference: LogitsFn, artifact: LogitsFn, text: CheckText, *, bits: int,
                  artifact_name: str, reference_name: str) -> SelfCheck:
    """Models without an LM head: the mean cosine similarity of the artifact's output rows to the
    reference's over the windows."""
    cosines = []
    for ids in text.windows:
        a = reference(ids).astype(np.float64)                                   # [T, D]
        b = artifact(ids).astype(np.float64)                                    # [T, D]
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)           # [T]
        cosines.append((a * b).sum(1) / np.maximum(norms, 1e-30))
    fidelity = float(np.concatenate(cosines).mean())
    floor = floor_for(bits)
    return SelfCheck(artifact=artifact_name, reference=reference_name, bits=bits,
                     n_tokens=int(sum(len(w) for w in text.windows)), passed=bool(fidelity >= floor.fidelity),
                     floor=asdict(floor), cpu=cpu_features(), text=text.source, fidelity=fidelity)


def refuse(check: SelfCheck, hint: str) -> SelfCheckFailed:
    """The one-line error of a failed check (nothing is written: the caller's atomic folder goes)."""
    return SelfCheckFailed(f"{check.line()} Nothing was written; {hint}")


def write_self_checks(folder, checks: Sequence[SelfCheck]) -> None:
    """self_check.json: every check the export ran, in order (the last is the written file's)."""
    import json
    (Path(folder) / SELF_CHECK_FILE).write_text(json.dumps([c.as_dict() for c in checks], indent=1),
                                                encoding="utf-8")


def read_self_checks(folder) -> list[dict]:
    """The checks an export folder's self_check.json records (none for a lossless format)."""
    import json
    from analysis.core.files import read_file_text
    path = Path(folder) / SELF_CHECK_FILE
    if not path.is_file():
        return []
    return json.loads(read_file_text(path, 2**20, what="self_check.json", fix="export the model again"))
