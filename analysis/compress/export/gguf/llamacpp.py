"""Running a GGUF file in llama.cpp (through llama-cpp-python): logits, perplexity, speed, KV cache.

The measurements of the deployment report and of the GGUF tests come from llama.cpp itself:
- `logits(path, ids)`: llama.cpp's logits [N, V] for token ids (all positions, one sequence);
- `perplexity(path, ids, window, stride)`: the sliding windows of headscope's evaluator
  (`analysis.measure.evaluation.causal_windows`) over the same token ids, NLL summed in float64;
- `speed(path, context)`: prefill tokens/s over `context` tokens, then decode tokens/s one token at
  a time after it (medians of repeats, fixed thread count);
- `paired_speed(paths, context)`: the same for several files in interleaved rounds after untimed
  warm-up rounds (llama.cpp builds its graphs per shape on first use: steady state is what a
  deployment sees), with per-round ratios; `paired_decode_at(paths, context)`: decode speed after a
  long prefill, interleaved the same way;
- `kv_cache_mib(path, n_ctx, flash_attn)`: the KV-cache size llama.cpp allocates for a context, as its
  loader reports it ("llama_kv_cache: size = ... MiB"; K and V in f16). Without flash attention
  llama.cpp pads the V cache of every layer to the widest layer ("padding V cache to ..."), so a cut
  with uneven layers saves its full KV memory only with flash attention on.
llama_cpp is imported lazily, only through `llama_cpp_module` (the k-quant writer too), which closes the two /dev/null
files it leaves open at exit.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from analysis.core.errors import InputError, ModelLoadError, check_seed, first_line

DEFAULT_THREADS = 2
_GGML_TYPES = {"f32": 0, "f16": 1}          # ggml_type ids of the KV cache's element type
_KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB .*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")


@functools.cache
def llama_cpp_module():
    """llama_cpp, imported once (headscope's one import of it), its /dev/null files closed at exit."""
    try:
        import llama_cpp
    except ImportError as err:                # pragma: no cover - the dependency is required
        raise ModelLoadError("llama-cpp-python is not installed; run `bash scripts/setup.sh` "
                             "(or `pip install llama-cpp-python==0.3.36`).") from err
    atexit.register(_close_devnull)
    return llama_cpp


# llama-cpp-python opens /dev/null twice when it is imported (llama_cpp._utils: where its suppress_stdout_stderr
# sends llama.cpp's console output) and never closes the files: at exit Python reported each as "ResourceWarning:
# unclosed file <... name='/dev/null'>" on stderr (under -W default), after the CLI's one error line
_DEVNULL_FILES = ("outnull_file", "errnull_file")


def _close_devnull() -> None:
    """Close llama_cpp's /dev/null files at exit (atexit: before the interpreter's teardown; what still runs of
    llama_cpp after it, its objects' __del__, never uses them: only a Llama being loaded does)."""
    from llama_cpp import _utils
    for name in _DEVNULL_FILES:
        handle = getattr(_utils, name, None)
        if handle is not None:
            handle.close()


# llama.cpp's log callback is process-wide: the line lists of the llama_log blocks now open, outermost
# first. A block's callback adds each line to every open list, so a block nested in another (the
# loader's inside a KV-cache measurement) keeps the lines from the outer one, and its end hands the
# log back to the enclosing block's callback.
_LOG_BLOCKS: list[tuple[list[str], object]] = []


@contextlib.contextmanager
def llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines (and keep them off the console) while the block runs."""
    llama_cpp = llama_cpp_module()
    lines: list[str] = []
    targets = [outer for outer, _ in _LOG_BLOCKS] + [lines]

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        line = text.decode("utf-8", "replace")
        for target in targets:
            target.append(line)

    block = (lines, collect)
    _LOG_BLOCKS.append(block)
    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        _LOG_BLOCKS.remove(block)
        from llama_cpp._logger import llama_log_callback as default
        llama_cpp.llama_log_set(_LOG_BLOCKS[-1][1] if _LOG_BLOCKS else default, ctypes.c_void_p(0))


def _failed(path, err: BaseException, lines: list[str]) -> ModelLoadError:
    """One line for a llama.cpp failure: its own first error line where it logged one (the specific one:
    "check_tensor_dims: tensor ... has wrong shape", before the general "failed to load model")."""
    said = next((line for word in ("error", "fail") for line in lines if word in line.lower()), "")
    said = " ".join(said.split())
    detail = first_line(err) + (f"; llama.cpp: {said[:200]}" if said else "")
    return ModelLoadError(f"llama.cpp could not run {Path(str(path)).name} ({detail}). Export the GGUF file again "
                          f"(`python -m analysis export --export-format gguf`) or use the headscope version it was "
                          f"written with.")


@contextlib.contextmanager
def llama_errors(path) -> Iterator[list[str]]:
    """llama.cpp's failures in the block (a ValueError from its loader, a RuntimeError such as
    "llama_decode returned -1") as one ModelLoadError; its log lines are kept off the console."""
    with llama_log() as lines:
        try:
            yield lines
        except (ValueError, RuntimeError) as err:
            raise _failed(path, err, lines) from None


def load(path: str | os.PathLike, *, n_ctx: int = 512, logits_all: bool = True, threads: int = DEFAULT_THREADS,
         flash_attn: bool = False, n_batch: int | None = None, kv_type: str = "f16"):
    """llama_cpp.Llama over the GGUF file on the CPU. kv_type: the KV cache's element type, "f16"
    (llama.cpp's default: what a deployment uses) or "f32" (for exactness checks: an f16 cache rounds
    K and V to 11 bits, ~1e-3 of the logits). The file's header is checked first
    (`analysis.compress.export.gguf.reader.read_gguf`): llama.cpp never sees a file it would crash on."""
    from analysis.compress.export.gguf.reader import read_gguf
    from analysis.core.threads import check_threads
    llama_cpp = llama_cpp_module()
    path = Path(path)
    threads = check_threads(threads, "llama.cpp threads")
    read_gguf(path)
    with llama_errors(path):
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch or min(n_ctx, 512),
                               n_ubatch=n_batch or min(n_ctx, 512), logits_all=logits_all, n_threads=threads,
                               n_threads_batch=threads, flash_attn=flash_attn, verbose=False,
                               type_k=_GGML_TYPES[kv_type], type_v=_GGML_TYPES[kv_type])


def check_ids(llm, ids: Sequence[int]) -> list[int]:
    """`ids` as ints, each a token id of `llm`'s vocabulary (InputError otherwise: llama.cpp's decode
    would fail with -1)."""
    ids = [int(i) for i in ids]
    vocab = llm.n_vocab()
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise InputError(f"Token id {bad} is outside the {vocab}-token vocabulary of {Path(llm.model_path).name}: "
                         f"the ids come from another model's tokenizer. Give the model the GGUF files were "
                         f"exported from (--model).")
    return ids


def logits(path_or_llm, ids: Sequence[int], *, kv_type: str = "f32") -> np.ndarray:
    """llama.cpp's logits [N, V] (float32) for the token ids, one fresh sequence (a path is loaded with
    a float32 KV cache: the exact computation; pass a loaded Llama to choose otherwise)."""
    ids = [int(i) for i in ids]
    llm = load(path_or_llm, n_ctx=max(len(ids), 8), kv_type=kv_type) if isinstance(path_or_llm, (str, os.PathLike)) else path_or_llm
    ids = check_ids(llm, ids)
    with llama_errors(llm.model_path):
        llm.reset()
        llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)           # [N, V]


def _nll(logits_rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits_rows.astype(np.float64)                                  # [n, V]
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))                  # [n]
    return lse - x[np.arange(len(targets)), targets]                    # [n]


@dataclass(frozen=True)
class Perplexity:
    value: float
    mean_nll: float
    n_tokens: int


def window_nll(path: str | os.PathLike, ids: Sequence[int], *, window: int = 512, stride: int | None = None,
               threads: int = DEFAULT_THREADS, kv_type: str = "f16") -> tuple[np.ndarray, np.ndarray]:
    """Summed NLL [W] and scored tokens [W] per window of the ids in llama.cpp, the windows exactly as
    headscope's evaluator scores them (`causal_windows`: each token at most once, up to window - 1
    tokens of context); the input of `perplexity` and of a bootstrap CI over windows."""
    from analysis.measure.evaluation import causal_windows
    ids = np.asarray([int(i) for i in ids], dtype=np.int64)             # [N]
    windows = causal_windows(len(ids), window, stride or window)
    llm = load(path, n_ctx=max(w.end - w.begin for w in windows), threads=threads, kv_type=kv_type)
    sums, counts = np.zeros(len(windows)), np.zeros(len(windows))
    for i, w in enumerate(windows):
        rows = logits(llm, ids[w.begin:w.end])                          # [w, V]
        scored = rows[-w.n_target - 1:-1]                               # predictions of the last n_target tokens
        sums[i], counts[i] = float(_nll(scored, ids[w.end - w.n_target:w.end]).sum()), w.n_target
    return sums, counts


def perplexity(path: str | os.PathLike, ids: Sequence[int], *, window: int = 512, stride: int | None = None,
               threads: int = DEFAULT_THREADS) -> Perplexity:
    """exp(mean NLL) of the ids in llama.cpp (`window_nll`: scored as headscope's evaluator scores them)."""
    sums, counts = window_nll(path, ids, window=window, stride=stride, threads=threads)
    mean = float(sums.sum() / counts.sum())
    return Perplexity(float(np.exp(mean)), mean, int(counts.sum()))


@dataclass(frozen=True)
class Speed:
    context: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    threads: int


def _timed_round(llm, path, prompt: list[int], steps: list[int]) -> tuple[float, float]:
    """One timed round from an empty cache: (seconds to prefill `prompt`, seconds to decode `steps` one
    token at a time after it)."""
    with llama_errors(path):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for token in steps:
            llm.eval([token])
        return t1 - t0, time.perf_counter() - t1


def speed(path: str | os.PathLike, context: int, *, decode_tokens: int = 16, repeats: int = 3,
          threads: int = DEFAULT_THREADS, seed: int = 0, warmup: bool = True) -> Speed:
    """Prefill of `context` random token ids, then `decode_tokens` single-token steps after them;
    medians of `repeats` runs (after one warm-up run unless warmup=False). Tokens/s of each."""
    seed = check_seed(seed, "The random ids' seed")
    llm = load(path, n_ctx=context + decode_tokens + 8, logits_all=False, threads=threads,
               n_batch=min(context, 512))
    rng = np.random.default_rng(seed)
    vocab = llm.n_vocab()
    low = min(4, vocab - 1)                      # ids 0-3 are often special tokens
    prompt = rng.integers(low, vocab, size=context).tolist()
    steps = rng.integers(low, vocab, size=decode_tokens).tolist()
    prefill, decode = [], []
    skip = 1 if warmup else 0
    for run in range(repeats + skip):
        seconds = _timed_round(llm, path, prompt, steps)
        if run >= skip:                          # run 0 is the warm-up
            prefill.append(context / seconds[0])
            decode.append(decode_tokens / seconds[1])
    return Speed(context, statistics.median(prefill), statistics.median(decode), threads)


WARMUP_ROUNDS = 2        # untimed rounds of every file first: llama.cpp allocates its compute buffers and
                         # builds its graphs on first use per shape (a cut's first decode calls ran ~25x slower)


@dataclass
class PairedSpeed:
    """Tokens/s of several files measured in interleaved rounds (each round runs every file once, the
    order rotating), after WARMUP_ROUNDS untimed rounds: the steady state, and per-round ratios whose
    spread says how far a ratio can be trusted on a shared CPU."""
    context: int
    decode_tokens: int
    threads: int
    flash_attn: bool
    prefill: dict[str, list[float]]      # name -> prefill tokens/s per round
    decode: dict[str, list[float]]       # name -> decode tokens/s per round (after the prefill)

    def median(self, part: str, name: str) -> float:
        return float(statistics.median(getattr(self, part)[name]))

    def ratio(self, part: str, name: str, base: str) -> dict:
        """{"min", "median", "max", "rounds"} of the per-round speed of `name` / speed of `base` (> 1: faster)."""
        values = [a / b for a, b in zip(getattr(self, part)[name], getattr(self, part)[base])]
        return {"min": min(values), "median": float(statistics.median(values)), "max": max(values),
                "rounds": len(values)}


def paired_speed(paths: dict, context: int, *, decode_tokens: int = 32, rounds: int = 6,
                 warmup: int = WARMUP_ROUNDS, threads: int = DEFAULT_THREADS, flash_attn: bool = False,
                 seed: int = 0, should_stop=None) -> PairedSpeed:
    """Prefill of `context` random token ids, then `decode_tokens` single steps, for each file of
    `paths` (name -> GGUF file) in turn, `rounds` timed rounds after `warmup` untimed ones. All files
    stay loaded, so every round times the same llama.cpp state of each."""
    from analysis.core.progress import check_stop
    seed = check_seed(seed, "The random ids' seed")
    llms = {name: load(path, n_ctx=context + decode_tokens + 8, logits_all=False, threads=threads,
                       n_batch=min(context, 512), flash_attn=flash_attn) for name, path in paths.items()}
    rng = np.random.default_rng(seed)
    vocab = min(llm.n_vocab() for llm in llms.values())
    low = min(4, vocab - 1)                      # ids 0-3 are often special tokens
    prompt = rng.integers(low, vocab, size=context).tolist()
    steps = rng.integers(low, vocab, size=decode_tokens).tolist()
    names = list(llms)
    prefill: dict[str, list[float]] = {n: [] for n in names}
    decode: dict[str, list[float]] = {n: [] for n in names}
    for run in range(warmup + rounds):
        order = names[run % len(names):] + names[:run % len(names)]      # rotate who goes first
        for name in order:
            check_stop(should_stop, "The llama.cpp speed measurement")
            seconds = _timed_round(llms[name], paths[name], prompt, steps)
            if run >= warmup:
                prefill[name].append(context / seconds[0])
                decode[name].append(decode_tokens / seconds[1])
    return PairedSpeed(context, decode_tokens, threads, flash_attn, prefill, decode)


def paired_decode_at(paths: dict, context: int, *, tokens_per_round: int = 16, rounds: int = 6,
                     warmup: int = WARMUP_ROUNDS, threads: int = DEFAULT_THREADS, flash_attn: bool = True,
                     seed: int = 0, should_stop=None) -> PairedSpeed:
    """Decode speed at a long context: each file prefills `context` random ids once (untimed), then the
    files decode `tokens_per_round` tokens each in turn, `rounds` timed rounds after `warmup` ones
    (the context grows by the decoded tokens, a small share of it)."""
    from analysis.core.progress import check_stop
    seed = check_seed(seed, "The random ids' seed")
    total = context + (warmup + rounds) * tokens_per_round + 8
    llms = {name: load(path, n_ctx=total, logits_all=False, threads=threads, n_batch=512, flash_attn=flash_attn)
            for name, path in paths.items()}
    rng = np.random.default_rng(seed)
    vocab = min(llm.n_vocab() for llm in llms.values())
    low = min(4, vocab - 1)
    prompt = rng.integers(low, vocab, size=context).tolist()
    steps = rng.integers(low, vocab, size=(warmup + rounds) * tokens_per_round).tolist()
    names = list(llms)
    prefill: dict[str, list[float]] = {n: [] for n in names}
    decode: dict[str, list[float]] = {n: [] for n in names}
    for name, llm in llms.items():
        check_stop(should_stop, "The llama.cpp long-context measurement")
        with llama_errors(paths[name]):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            prefill[name].append(context / (time.perf_counter() - t0))
    for run in range(warmup + rounds):
        chunk = steps[run * tokens_per_round:(run + 1) * tokens_per_round]
        for name in names[run % len(names):] + names[:run % len(names)]:
            check_stop(should_stop, "The llama.cpp long-context measurement")
            with llama_errors(paths[name]):
                t0 = time.perf_counter()
                for token in chunk:
                    llms[name].eval([token])
                seconds = time.perf_counter() - t0
            if run >= warmup:
                decode[name].append(tokens_per_round / seconds)
    return PairedSpeed(context, tokens_per_round, threads, flash_attn, prefill, decode)


@dataclass(frozen=True)
class KVCache:
    n_ctx: int
    mib: float          # K + V, as llama.cpp reports it
    k_mib: float
    v_mib: float
    cache_type: str     # "f16"
    flash_attn: bool


def kv_cache_mib(path: str | os.PathLike, n_ctx: int, *, flash_attn: bool = True) -> KVCache:
    """The KV cache llama.cpp allocates for an n_ctx context (its own log line)."""
    with llama_log() as lines:
        llm = load(path, n_ctx=n_ctx, logits_all=False, flash_attn=flash_attn, n_batch=512)
        del llm
    for line in lines:
        match = _KV_LINE.search(line)
        if match:
            total, k_type, k, v_type, v = match.groups()
            return KVCache(n_ctx, float(total), float(k), float(v), k_type, flash_attn)
    raise ModelLoadError("llama.cpp did not report its KV cache size; check the llama-cpp-python version "
                         "(0.3.36 is pinned in requirements.txt).")
