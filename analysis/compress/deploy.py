"""The deployment report: what a GGUF file costs and does in llama.cpp, dense next to pruned.

Per file, all measured by llama.cpp (`analysis.compress.llamacpp`): file size, perplexity on the
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

from analysis.compress import llamacpp

KV_CONTEXTS = (4096, 8192)
SPEED_CONTEXT = 512


def gguf_facts(path: str | os.PathLike) -> dict:
    """Architecture, weight type and per-layer head counts, read from the file's metadata."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()

    def value(key, default=None):
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else field.contents()

    layers = int(value("block_count"))
    heads = value("attention.head_count")
    kv = value("attention.head_count_kv", heads)
    heads = heads if isinstance(heads, list) else [heads] * layers
    kv = kv if isinstance(kv, list) else [kv] * layers
    ftype = reader.fields.get("general.file_type")
    return {"arch": arch, "file_type": None if ftype is None else int(ftype.contents()),
            "heads": int(sum(heads)), "kv_heads": int(sum(kv)), "head_counts": heads, "kv_head_counts": kv,
            **tensor_types(reader)}


def tensor_types(reader) -> dict:
    """The types the file's tensors really have (a Q4_K_M file of SmolLM2 is mostly Q5_0: llama.cpp's
    quantizer falls back where a row is not a multiple of 256): "tensor_types" one line, largest share
    first ("Q5_0 166 (51.2 MiB), ..."), and "embedding_type", the token embedding's."""
    count: dict[str, list[int]] = {}
    for t in reader.tensors:
        entry = count.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
    embedding = next((t.tensor_type.name for t in reader.tensors if t.name == "token_embd.weight"), None)
    line = ", ".join(f"{name} {n} ({size / 2**20:.1f} MiB)"
                     for name, (n, size) in sorted(count.items(), key=lambda kv: -kv[1][1]))
    return {"tensor_types": line, "embedding_type": embedding}


def measure_gguf(path: str | os.PathLike, ids: Sequence[int], *, window: int = 512,
                 speed_context: int = SPEED_CONTEXT, kv_contexts: Sequence[int] = KV_CONTEXTS,
                 decode_tokens: int = 16, repeats: int = 3, threads: int = llamacpp.DEFAULT_THREADS) -> dict:
    """One row of the report for one GGUF file."""
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
                    threads: int = llamacpp.DEFAULT_THREADS, progress=None, should_stop=None) -> list[dict]:
    """The Export page's report for a written gguf export: the dense model written at the same weight
    type (a temporary file) and the export's file, both measured by llama.cpp, each with headscope's own
    perplexity (the dense model; the masked model, which the cut computes) next to llama.cpp's. The
    pruned row's "worse_than_dense" lists what is slower or bigger than dense (analysis.compress.verdict).
    progress(fraction, message) after each step; should_stop is checked between steps."""
    import tempfile

    import numpy as np

    from analysis.compress.export.gguf import tokenizer_source
    from analysis.compress.gguf_writer import GGUF_FILE, write_gguf
    from analysis.compress.surgery import HeadLayout
    from analysis.measure.evaluation import default_text, evaluate, token_ids

    from analysis.core.progress import tick
    model, g = loaded.model, loaded.geometry
    ids = token_ids(loaded.tokenizer, default_text(), max_tokens=max_tokens).tolist()
    dense_layout = HeadLayout.from_mask(np.zeros((g.n_layers, g.n_heads), bool), g, loaded.adapter.model_type)
    rows = []
    with tempfile.TemporaryDirectory(prefix="headscope-dense-gguf-") as tmp:
        dense_file = Path(tmp) / GGUF_FILE
        tick(progress, should_stop, 0.0, f"writing the dense model's GGUF ({weight_type})")
        write_gguf(model, dense_layout, dense_file, weight_type=weight_type, tokenizer_gguf=tokenizer_source(model))
        for i, (role, path, mask) in enumerate((("dense", dense_file, None),
                                                ("pruned", Path(export_result.path) / GGUF_FILE, pruned))):
            tick(progress, should_stop, 0.1 + 0.45 * i, f"{role} file: perplexity, speed and KV cache in llama.cpp")
            row = {"role": role, **measure_gguf(path, ids, threads=threads)}
            tick(progress, should_stop, 0.45 + 0.45 * i, f"{role} model: headscope's own perplexity")
            row["headscope_perplexity"] = float(evaluate(loaded, pruned=mask, max_tokens=max_tokens).value)
            row["file"] = Path(row["file"]).name if role == "dense" else row["file"]
            rows.append(row)
    rows[1]["size_ratio"] = rows[1]["bytes"] / rows[0]["bytes"]
    rows[0]["worse_than_dense"], rows[1]["worse_than_dense"] = "", "; ".join(worse_than_dense(rows[0], rows[1]))
    tick(progress, should_stop, 1.0, "measured")
    return rows


def worse_than_dense(dense: dict, pruned: dict) -> list[str]:
    """What the pruned file does worse than the dense one in llama.cpp: slower prefill or decode (tokens/s
    as time per token), a bigger file or KV cache (issue 33: 1.30 vs 5.81 tok/s decode went without a word)."""
    from analysis.compress.verdict import worse_than_input

    def per_token(row, key):
        return 1 / row[key] if row.get(key) else None

    return worse_than_input(
        times={what: (per_token(dense, key), per_token(pruned, key))
               for what, key in (("prefill", "prefill_tok_s"), ("decode", "decode_tok_s"))},
        sizes={"file": (dense.get("bytes"), pruned.get("bytes")),
               **{f"KV cache at {k[len('kv_mib_'):]} tokens": (dense.get(k), pruned.get(k))
                  for k in dense if k.startswith("kv_mib_")}})
