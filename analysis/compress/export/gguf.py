"""The "gguf" format: one model.gguf that llama.cpp loads and runs (per-layer head counts included),
written from the physically pruned model by `analysis.compress.gguf_writer` (docs/EXPORT.md, "The
gguf format"). The tokenizer is carried over from the GGUF file a built-in model came from, or
converted from the tokenizer.json of the folder a model was loaded from."""
from __future__ import annotations

from pathlib import Path

from analysis.compress.export.formats import FormatOption, PhysicalFormat, StreamSpec, register_format
from analysis.compress.gguf_writer import (DEFAULT_EMBEDDING_TYPE, DEFAULT_WEIGHT_TYPE, EMBEDDING_TYPES, GGUF_FILE,
                                           WEIGHT_TYPES, source_gguf, write_gguf)

BUILTIN_MARKER = "headscope-builtin.json"       # analysis.arch.models writes it into a converted built-in


def tokenizer_source(model) -> Path | None:
    """Where the export's tokenizer.* keys come from: the built-in's own GGUF file when `model` was
    loaded from a converted built-in (its folder's marker names it); else the model's folder when it
    holds a tokenizer.json (converted by analysis.compress.gguf_tokenizer); else None (token ids only)."""
    from analysis.arch.models import read_marker
    from analysis.compress.gguf_tokenizer import TOKENIZER_JSON
    text = str(getattr(model.config, "_name_or_path", "") or "")
    folder = Path(text)
    marker = read_marker(folder, BUILTIN_MARKER) if text else None     # capped, regular files only
    if marker is None or not isinstance(marker.get("name"), str):
        return folder if text and (folder / TOKENIZER_JSON).is_file() else None
    return source_gguf(marker["name"])


@register_format
class GGUFFormat(PhysicalFormat):
    name = "gguf"
    label = "GGUF (llama.cpp)"
    help = "model.gguf for llama.cpp (and what is built on it), per-layer head counts included"
    options = {"gguf_type": FormatOption(DEFAULT_WEIGHT_TYPE, tuple(WEIGHT_TYPES),
                                         "GGUF weight type (k-quants and q4_0/q4_1 by llama.cpp's quantizer)"),
               "gguf_embedding_type": FormatOption(
                   DEFAULT_EMBEDDING_TYPE, tuple(EMBEDDING_TYPES),
                   "type of the token embedding (and output) tensor that llama.cpp's quantizer is told to use "
                   "(its token_embedding_type / output_tensor_type; auto: its own choice, Q8_0 on SmolLM2); "
                   "the file keeps its weight type's name, the deployment report lists every tensor's type")}
    # streamed (analysis.compress.streamed): the plan from names and shapes, the tensors fed one at a time
    streamed = StreamSpec(names="state_dict", producer=False, config=None, writer="gguf")

    def write_cut(self, smaller, layout, folder, *, original, gguf_type=DEFAULT_WEIGHT_TYPE,
                  gguf_embedding_type=DEFAULT_EMBEDDING_TYPE, **options):
        write_gguf(smaller, layout, Path(folder) / GGUF_FILE, weight_type=gguf_type,
                   embedding_type=gguf_embedding_type,
                   tokenizer_gguf=tokenizer_source(original),
                   name=str(getattr(original.config, "_name_or_path", "") or ""))
