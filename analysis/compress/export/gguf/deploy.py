"""The deployment report: what a GGUF file costs and does in llama.cpp, dense next to pruned.

Per file, all measured by llama.cpp (`analysis.compress.export.gguf.llamacpp`): file size, perplexity on the
built-in evaluation split (the same token ids and windows as headscope's evaluator), prefill and
decode tokens/s at one context length, and the KV cache llama.cpp allocates at 4096 and 8192
tokens (f16 K/V, flash attention on: exact per-layer sizes). `headscope_perplexity` puts headscope's
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
                 decode_tokens: int = 16, repeats: int = 3, threads: int = llamacpp.DEFAULT_THREADS) -> dict:
    """One row of the report for one GGUF file (its header checked, the options in range, first)."""
    check_options(speed_context=speed_context, threads=threads)
    path = Path(path)
    facts = gguf_facts(path)
    ppl = llamacpp.perplexity(path, ids, window=window, threads=threads)
    speed = llamacpp.speed(path, speed_context, decode_tokens=decode_tokens, repeats=repeats, threads=threads)
    row = {"file": str(path), "bytes": path.stat().st_size, "arch": facts["arch"], "heads": facts["heads"],
           "kv_heads": facts["kv_heads"], "perplexity": ppl.value, "n_tokens": ppl.n_tokens,
           "speed_context": speed_context, "prefill_tok_s": speed.prefill_tokens_per_s,
           "decode_tok_s": speed.decode_tokens_per_s, "threads": threads,
           "embedding_type": facts["embedding_type"], "tensor_types": facts["tensor_types"]}
    for n_ctx in kv_contexts:
        row[f"kv_mib_{n_ctx}"] = llamacpp.kv_cache_mib(path, n_ctx).mib
    return row


def ratios(dense: dict, pruned: dict) -> dict:
    """pruned / dense for every number that both rows have."""
    keys = ("bytes", "perplexity", "prefill_tok_s", "decode_tok_s",
            *(k for k in dense if k.startswith("kv_mib_")))
    return {k: pruned[k] / dense[k] for k in keys if dense.get(k) and k in pruned}


def deployment_rows(loaded, pruned, export_result, weight_type: str, *, max_tokens: int = 512,
                    threads: int = llamacpp.DEFAULT_THREADS) -> list[dict]:
    """The Export page's report for a written gguf export: the dense model written at the same weight
    type (a temporary file) and the export's file, both measured by llama.cpp, each with headscope's own
    perplexity (the dense model; the masked model, which the cut computes) next to llama.cpp's."""
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
    rows = []
    with tempfile.TemporaryDirectory(prefix="headscope-dense-gguf-") as tmp:
        dense_file = Path(tmp) / GGUF_FILE
        write_gguf(model, dense_layout, dense_file, weight_type=weight_type, tokenizer_gguf=tokenizer_source(model))
        check_files(dense_file, [Path(export_result.path) / GGUF_FILE], ids)
        for role, path, mask in (("dense", dense_file, None), ("pruned", Path(export_result.path) / GGUF_FILE, pruned)):
            row = {"role": role, **measure_gguf(path, ids, threads=threads)}
            row["headscope_perplexity"] = float(evaluate(loaded, pruned=mask, max_tokens=max_tokens).value)
            row["file"] = Path(row["file"]).name if role == "dense" else row["file"]
            rows.append(row)
    rows[1]["size_ratio"] = rows[1]["bytes"] / rows[0]["bytes"]
    return rows
