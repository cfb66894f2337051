"""The "gguf" format: one model.gguf that llama.cpp loads and runs (per-layer head counts included),
written from the physically pruned model by `analysis.compress.export.gguf.writer` (docs/EXPORT.md, "The
gguf format"). The tokenizer is carried over from the GGUF file a built-in model came from, or
converted from the tokenizer.json of the folder a model was loaded from. A file of a lossy type (below
F32) is run by llama.cpp right after it is written and measured against the PyTorch model on held-back
tokens (`selfcheck`); below its floor the export is refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.arch.adapters import input_device
from analysis.compress.export.formats import PhysicalFormat, StreamSpec
from analysis.compress.export.selfcheck import (CheckText, LogitsFn, SelfCheck, check_causal, held_back_windows,
                                                refuse, write_self_checks)
from analysis.compress.export.gguf.writer import (DEFAULT_EMBEDDING_TYPE, DEFAULT_WEIGHT_TYPE, EMBEDDING_TYPES, GGUF_FILE,
                                           WEIGHT_TYPES, check_weight_type, source_gguf, write_gguf)

BUILTIN_MARKER = "headscope-builtin.json"       # analysis.arch.models writes it into a converted built-in


def tokenizer_source(model) -> Path | None:
    """Where the export's tokenizer.* keys come from: the built-in's own GGUF file when `model` was
    loaded from a converted built-in (its folder's marker names it); else the model's folder when it
    holds a tokenizer.json (converted by analysis.compress.export.gguf.tokenizer); else None (token ids only)."""
    from analysis.arch.models import read_marker
    from analysis.compress.export.gguf.tokenizer import TOKENIZER_JSON
    text = str(getattr(model.config, "_name_or_path", "") or "")
    folder = Path(text)
    marker = read_marker(folder, BUILTIN_MARKER) if text else None     # capped, regular files only
    if marker is None or not isinstance(marker.get("name"), str):
        return folder if text and (folder / TOKENIZER_JSON).is_file() else None
    return source_gguf(marker["name"])


class GGUFFormat(PhysicalFormat):
    name = "gguf"   # label, help, rank, options: its declaration (export/format_registry.py)
    # measured (scripts/gguf_window_check.py): llama.cpp loads a llama / deci file with
    # {arch}.attention.sliding_window (and a per-layer pattern) and computes bit-identical logits: those graphs
    # build no sliding-window cache; llama.cpp's window (is_masked_swa) has no sink tokens either
    kv_windows = ("llama.cpp runs every layer of model.gguf with full attention: the llama and deci graphs "
                  "headscope writes ignore a sliding window (measured), and llama.cpp's window keeps no sink "
                  "tokens; the file holds the plan's cut, kv_plan.json records its windows")
    # streamed (analysis.compress.export.streamed): the plan from names and shapes, the tensors fed one at a time
    streamed = StreamSpec(names="state_dict", producer=False, config=None, writer="gguf")

    def write_cut(self, smaller, layout, folder, *, original, tokenizer=None, gguf_type=DEFAULT_WEIGHT_TYPE,
                  gguf_embedding_type=DEFAULT_EMBEDDING_TYPE, **options):
        path = Path(folder) / GGUF_FILE
        write_gguf(smaller, layout, path, weight_type=gguf_type, embedding_type=gguf_embedding_type,
                   tokenizer_gguf=tokenizer_source(original),
                   name=str(getattr(original.config, "_name_or_path", "") or ""))
        if is_lossy(gguf_type):
            check = self_check_gguf(path, gguf_type, held_back_windows(tokenizer, smaller), torch_logits(smaller),
                                    "the PyTorch model in float32")
            write_self_checks(folder, [check])


def is_lossy(weight_type: str) -> bool:
    """Whether a GGUF file of this weight type rounds the weights (everything below F32)."""
    return WEIGHT_TYPES[check_weight_type(weight_type)][2] < 32


def torch_logits(model) -> LogitsFn:
    """One window of ids [T] -> `model`'s next-token logits [T, V] in float32 (the float reference)."""
    import torch

    def run(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.from_numpy(ids).long()[None].to(input_device(model))           # [1, T]
            return model(input_ids=x).logits[0].float().cpu().numpy()                  # [T, V]
    return run


def llamacpp_logits(path: Path, n_ctx: int) -> LogitsFn:
    """One window of ids [T <= n_ctx] -> llama.cpp's logits [T, V] of the GGUF file, with the f16 KV
    cache a deployment runs with."""
    from analysis.compress.export.gguf import llamacpp
    with llamacpp.llama_log():                 # its load notes stay off the console
        llm = llamacpp.load(path, n_ctx=n_ctx, kv_type="f16")
    return lambda ids: llamacpp.logits(llm, ids)


def self_check_gguf(path: Path, weight_type: str, text: CheckText, reference: LogitsFn,
                    reference_name: str) -> SelfCheck:
    """The GGUF file run by llama.cpp on this CPU against the float reference (`selfcheck`); a failure
    refuses the export."""
    n_ctx = max(len(w) for w in text.windows)
    check = check_causal(reference, llamacpp_logits(path, n_ctx), text, bits=WEIGHT_TYPES[weight_type][2],
                         artifact_name=f"GGUF {weight_type} in llama.cpp", reference_name=reference_name)
    if not check.passed:
        bits = WEIGHT_TYPES[weight_type][2]
        wider = [t for t in ("q8_0", "f16") if 16 >= WEIGHT_TYPES[t][2] > bits]
        raise refuse(check, (f"try a type with more bits ({' or '.join(wider)}), " if wider else "")
                     + "recover the cut first if it is one (a heavily cut model can be too fragile for rounding: "
                       f"its float logits move with any noise), or report the CPU ({check.cpu}).")
    return check
