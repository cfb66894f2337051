"""The deployment report: what a GGUF file costs and does in llama.cpp, dense next to pruned.

Per file, all measured by llama.cpp (`analysis.compress.export.gguf.llamacpp`): file size, perplexity on the
built-in evaluation split (the same token ids and windows as headscope's evaluator), the KV cache
llama.cpp allocates at 4096 and 8192 tokens (f16 K/V) with flash attention on (exact per-layer sizes)
and off (every layer's V padded to the widest: a cut with uneven layers saves less), and prefill and
decode tokens/s at one context length in the steady state: each pruned file against the dense one in
interleaved rounds after untimed warm-up rounds (`compare`), flash attention on and off, with the
per-round ratios' spread; `verdict` says in words whether, and with which setting, the cut pays. `headscope_perplexity` puts headscope's
own PyTorch number for the same cut next to it when the caller has it (an export folder's mask.json
and the model). Ratios pruned / dense come with the rows (`ratios`). Each row also lists the types its tensors really
have (`tensor_types`: the weight type names the mix llama.cpp's quantizer aims at, not what every tensor
got; the token embedding's own type separately).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from analysis.compress.export.gguf import llamacpp
from analysis.compress.verdict import speed_words, worse_than_input

KV_CONTEXTS = (4096, 8192)
SPEED_CONTEXT = 512
SPEED_CONTEXT_MAX = 32768            # prefill tokens for tokens/s: 4x the largest KV context measured
MIN_TOKENS = 2                       # perplexity needs a token and the one it predicts


def check_options(*, max_tokens=None, speed_context=SPEED_CONTEXT, threads=llamacpp.DEFAULT_THREADS) -> None:
    """The report's numbers, each in its range (InputError naming the range), before anything is read."""
    from analysis.core.errors import check_whole_number
    from analysis.core.text import MAX_TOKENS_LIMIT
    from analysis.core.threads import check_threads
    check_whole_number(max_tokens, "--max-tokens (evaluation tokens)", low=MIN_TOKENS, high=MAX_TOKENS_LIMIT,
                       none_ok=True)
    check_whole_number(speed_context, "--speed-context (prefill tokens for tokens/s)", low=1, high=SPEED_CONTEXT_MAX)
    check_threads(threads, "--threads (llama.cpp threads)")


def check_files(dense, pruned: Sequence, ids: Sequence[int] | None = None) -> list:
    """The checked headers (`gguf_reader.read_gguf`) of the dense file and each pruned one, which must
    come from the same model at the same weight type (layers, hidden size, vocabulary); with `ids`,
    every id must be in each file's vocabulary. InputError naming the file and the difference."""
    from analysis.compress.export.gguf.reader import read_gguf
    from analysis.core.errors import InputError
    headers = [read_gguf(dense)] + [read_gguf(p) for p in pruned]
    base = headers[0]
    facts = {"weight type": lambda h: h.weight_type, "layers": lambda h: h.block_count,
             "hidden size": lambda h: h.embedding_length, "vocabulary": lambda h: h.vocab_size}
    for other in headers[1:]:
        for what, fact in facts.items():
            if fact(other) != fact(base):
                raise InputError(f"The pruned file {other.path.name} ({other.path.parent.name}) has {what} "
                                 f"{fact(other)}, the dense file {base.path.name} {fact(base)}: the report compares "
                                 f"a cut with its own dense model at the same weight type. Export both at one "
                                 f"--gguf-type from the same model.")
    if ids is not None and len(ids):
        top = max(int(i) for i in ids)
        small = next((h for h in headers if top >= h.vocab_size), None)
        if small is not None:
            raise InputError(f"The evaluation ids reach {top}, past the {small.vocab_size}-token vocabulary of "
                             f"{small.path}: --model is not the model the GGUF files were exported from. Give that "
                             f"model.")
    return headers


def gguf_facts(path_or_header) -> dict:
    """Architecture, weight type and per-layer head counts, read from the file's checked header."""
    from analysis.compress.export.gguf.reader import GGUFHeader, read_gguf
    header = path_or_header if isinstance(path_or_header, GGUFHeader) else read_gguf(path_or_header)
    heads, kv = header.head_counts, header.kv_head_counts
    return {"arch": header.arch, "file_type": header.file_type, "heads": int(sum(heads)), "kv_heads": int(sum(kv)),
            "head_counts": heads, "kv_head_counts": kv, **tensor_types(header)}


def tensor_types(header) -> dict:
    """The types the file's tensors really have (a Q4_K_M file of SmolLM2 is mostly Q5_0: llama.cpp's
    quantizer falls back where a row is not a multiple of 256): "tensor_types" one line, largest share
    first ("Q5_0 166 (51.2 MiB), ..."), and "embedding_type", the token embedding's."""
    count: dict[str, list[int]] = {}
    for t in header.tensors.values():
        entry = count.setdefault(t.type_name, [0, 0])
        entry[0] += 1
        entry[1] += int(t.nbytes)
    embedding = header.tensors.get("token_embd.weight")
    line = ", ".join(f"{name} {n} ({size / 2**20:.1f} MiB)"
                     for name, (n, size) in sorted(count.items(), key=lambda kv: -kv[1][1]))
    return {"tensor_types": line, "embedding_type": None if embedding is None else embedding.type_name}


def measure_gguf(path: str | os.PathLike, ids: Sequence[int], *, window: int = 512,
                 speed_context: int = SPEED_CONTEXT, kv_contexts: Sequence[int] = KV_CONTEXTS,
                 decode_tokens: int = 16, repeats: int = 3, threads: int = llamacpp.DEFAULT_THREADS,
                 speed: bool = True) -> dict:
    """One file's row (its header checked, the options in range, first): facts, llama.cpp's perplexity,
    the KV cache at each of `kv_contexts` with flash attention on and off, and (speed=True) its own
    steady-state tokens/s (after warm-up rounds, flash attention on). `compare` times files in pairs."""
    check_options(speed_context=speed_context, threads=threads)
    path = Path(path)
    facts = gguf_facts(path)
    ppl = llamacpp.perplexity(path, ids, window=window, threads=threads)
    row = {"file": str(path), "bytes": path.stat().st_size, "arch": facts["arch"], "heads": facts["heads"],
           "kv_heads": facts["kv_heads"], "perplexity": ppl.value, "n_tokens": ppl.n_tokens,
           "speed_context": speed_context, "threads": threads,
           "embedding_type": facts["embedding_type"], "tensor_types": facts["tensor_types"]}
    if speed:
        timed = llamacpp.paired_speed({"file": path}, speed_context, decode_tokens=decode_tokens, rounds=repeats,
                                      threads=threads, flash_attn=True)
        row.update(prefill_tok_s=timed.median("prefill", "file"), decode_tok_s=timed.median("decode", "file"))
    for n_ctx in kv_contexts:
        row[f"kv_mib_{n_ctx}"] = llamacpp.kv_cache_mib(path, n_ctx, flash_attn=True).mib
        row[f"kv_mib_{n_ctx}_no_fa"] = llamacpp.kv_cache_mib(path, n_ctx, flash_attn=False).mib
    return row


SPEED_KEYS = ("prefill_tok_s", "decode_tok_s")
FLASH = {"": True, "_no_fa": False}          # row-key suffix -> llama.cpp's flash attention


def ratios(dense: dict, pruned: dict) -> dict:
    """pruned / dense for every number that both rows have (a speed > 1: faster); a paired speed
    (`compare`) gives the median of its per-round ratios, with their spread under "<key>_spread"."""
    keys = ("bytes", "perplexity", *(k for k in dense if k.startswith("kv_mib_")),
            *(k + suffix for k in SPEED_KEYS for suffix in FLASH))
    out = {k: pruned[k] / dense[k] for k in keys if dense.get(k) and k in pruned}
    for key, spread in pruned.get("paired", {}).items():
        out[key] = spread["median"]
        out[key + "_spread"] = spread
    return out


def compare(dense, pruned: Sequence, ids: Sequence[int], *, window: int = 512, speed_context: int = SPEED_CONTEXT,
            decode_tokens: int = 32, rounds: int = 6, threads: int = llamacpp.DEFAULT_THREADS,
            progress=None, should_stop=None) -> tuple[list[dict], list[dict]]:
    """The deployment report of a dense GGUF file and pruned ones: each file's row (`measure_gguf`, no
    speed of its own), then each pruned file timed against the dense one in interleaved rounds after
    warm-up rounds (`llamacpp.paired_speed`), with flash attention on and off. Returns (rows: dense
    first, ratios per pruned file)."""
    from analysis.core.progress import report
    check_options(max_tokens=len(ids), speed_context=speed_context, threads=threads)
    check_files(dense, list(pruned), ids)
    paths = [Path(dense)] + [Path(p) for p in pruned]
    rows = []
    for i, path in enumerate(paths):
        report(progress, i / (3 * len(paths)), f"{path.name}: perplexity and KV cache")
        rows.append({"role": "dense" if i == 0 else "pruned",
                     **measure_gguf(path, ids, window=window, speed_context=speed_context, threads=threads,
                                    speed=False)})
    for i, path in enumerate(paths[1:], start=1):
        paired = {}
        for suffix, flash in FLASH.items():
            report(progress, (len(paths) + 2 * (i - 1) + (not flash)) / (3 * len(paths)),
                   f"{path.name} vs dense: tokens/s, flash attention {'on' if flash else 'off'}")
            timed = llamacpp.paired_speed({"dense": paths[0], "pruned": path}, speed_context,
                                          decode_tokens=decode_tokens, rounds=rounds, threads=threads,
                                          flash_attn=flash, should_stop=should_stop)
            for key, part in zip(SPEED_KEYS, ("prefill", "decode")):
                rows[i][key + suffix] = timed.median(part, "pruned")
                rows[0].setdefault(key + suffix, timed.median(part, "dense"))
                paired[key + suffix] = timed.ratio(part, "pruned", "dense")
        rows[i]["paired"] = paired
    report(progress, 1.0, "report ready")
    return rows, [ratios(rows[0], row) for row in rows[1:]]


def verdict(ratio: dict) -> list[str]:
    """In words, for one pruned file against dense: the KV memory llama.cpp really allocates with flash
    attention on and off, the steady-state speed-ups (each as faster or slower, with the per-round
    spread), and which setting makes the cut pay, or that none does."""
    lines = []
    kv = sorted(k for k in ratio if k.startswith("kv_mib_") and not k.endswith("_no_fa"))
    if kv:
        key = kv[-1]
        on, off = ratio[key], ratio.get(key + "_no_fa")
        lines.append(f"KV cache ({key.split('_')[2]} tokens): {on:.2f}x dense with flash attention"
                     + ("" if off is None else f", {off:.2f}x without (llama.cpp pads the V cache of every layer "
                                               f"to the widest one without it)") + ".")
    pays = []
    for suffix, flash in FLASH.items():
        parts = []
        for key, what in zip(SPEED_KEYS, ("prefill", "decode")):
            spread = ratio.get(key + suffix + "_spread")
            if spread is None:
                continue
            parts.append(f"{what} {speed_words(spread['median'])} (per round {spread['min']:.2f}-{spread['max']:.2f}x, "
                         f"{spread['rounds']} rounds)")
        if parts:
            lines.append(f"Flash attention {'on' if flash else 'off'}: " + "; ".join(parts) + ".")
            if all(ratio.get(k + suffix, 0) >= 1.0 for k in SPEED_KEYS):
                pays.append("on" if flash else "off")
    if pays:
        lines.append(f"The cut pays in llama.cpp here with flash attention {' or '.join(pays)} (both prefill and "
                     f"decode at least as fast as dense" + (", the KV memory saved in full" if "on" in pays else "")
                     + ").")
    elif any(k.endswith("_spread") for k in ratio):
        lines.append("The cut does not pay in llama.cpp here: it is slower than dense in prefill or decode with "
                     "flash attention on and off (it still saves file and KV bytes).")
    return lines


def deployment_report(loaded, pruned, export_result, weight_type: str, *, max_tokens: int = 512,
                      threads: int = llamacpp.DEFAULT_THREADS, progress=None, should_stop=None) -> dict:
    """The Export page's report for a written gguf export: the dense model written at the same weight
    type (a temporary file) and the export's file, measured by llama.cpp (`compare`: steady-state speed
    in interleaved rounds, flash attention on and off, the KV cache it allocates), each with
    headscope's own perplexity (the dense model; the masked model, which the cut computes) next to
    llama.cpp's. {"rows": [dense, pruned], "ratios": pruned / dense, "verdict": sentences}."""
    import tempfile

    import numpy as np

    from analysis.compress.export.gguf.format import tokenizer_source
    from analysis.compress.export.gguf.writer import GGUF_FILE, write_gguf
    from analysis.compress.surgery import HeadLayout
    from analysis.measure.evaluation import default_text, evaluate, token_ids

    check_options(max_tokens=max_tokens, threads=threads)
    model, g = loaded.model, loaded.geometry
    ids = token_ids(loaded.tokenizer, default_text(), max_tokens=max_tokens).tolist()
    dense_layout = HeadLayout.from_mask(np.zeros((g.n_layers, g.n_heads), bool), g, loaded.adapter.model_type)
    with tempfile.TemporaryDirectory(prefix="headscope-dense-gguf-") as tmp:
        dense_file = Path(tmp) / GGUF_FILE
        write_gguf(model, dense_layout, dense_file, weight_type=weight_type, tokenizer_gguf=tokenizer_source(model))
        rows, (ratio,) = compare(dense_file, [Path(export_result.path) / GGUF_FILE], ids, threads=threads,
                                 progress=progress, should_stop=should_stop)
    for row, mask in zip(rows, (None, pruned)):
        row["headscope_perplexity"] = float(evaluate(loaded, pruned=mask, max_tokens=max_tokens).value)
        row.pop("paired", None)
    rows[0]["file"] = Path(rows[0]["file"]).name
    rows[1]["size_ratio"] = rows[1]["bytes"] / rows[0]["bytes"]
    rows[0]["worse_than_dense"], rows[1]["worse_than_dense"] = "", "; ".join(worse_than_dense(rows[0], rows[1]))
    return {"rows": rows, "ratios": ratio, "verdict": verdict(ratio)}


def worse_than_dense(dense: dict, pruned: dict) -> list[str]:
    """What the pruned file does worse than the dense one in llama.cpp (steady-state tokens/s with flash
    attention on, as time per token; the file; the KV cache it allocates), as `verdict.worse_than_input`
    flags: a 1.30 vs 5.81 tok/s decode never goes without a word."""
    def per_token(row, key):
        return 1 / row[key] if row.get(key) else None

    return worse_than_input(
        times={what: (per_token(dense, key), per_token(pruned, key)) for what, key in zip(("prefill", "decode"), SPEED_KEYS)},
        sizes={"file": (dense.get("bytes"), pruned.get("bytes")),
               **{f"KV cache at {k[len('kv_mib_'):]} tokens": (dense.get(k), pruned.get(k))
                  for k in dense if k.startswith("kv_mib_") and not k.endswith("_no_fa")}})
