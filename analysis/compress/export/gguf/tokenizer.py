"""GGUF tokenizer metadata from a Hugging Face tokenizer folder (tokenizer.json, BPE).

A model that does not come from a GGUF file (a local HF folder) has its tokenizer in tokenizer.json;
llama.cpp needs it as `tokenizer.*` keys (GGUF spec; llama.cpp's convert_hf_to_gguf.py writes the
same keys, this is headscope's own code):
- `tokenizer.ggml.model` "gpt2" (byte-level BPE) and `tokenizer.ggml.pre`, the name of llama.cpp's
  pre-tokenizer (its split regexes). convert_hf_to_gguf.py finds that name from a hash of a test
  tokenization; here it comes from the structure of tokenizer.json's `pre_tokenizer` itself
  (`PRE_TOKENIZERS`: the split a llama.cpp name implements, written out), so a pre-tokenizer that is
  not in the table is reported rather than guessed;
- `tokens` (by id, the model's vocabulary plus the added tokens; rows of the embedding beyond them
  are "[PAD<i>]", type UNUSED), `token_type` (added special tokens CONTROL, other added tokens
  USER_DEFINED, the rest NORMAL), `merges` ("left right");
- the special ids from tokenizer_config.json (bos / eos / unk / pad token strings -> ids),
  `add_bos_token` / `add_eos_token` from the post-processor's template (a special token before /
  after the sequence), `add_space_prefix` from ByteLevel's add_prefix_space, and the chat template
  (tokenizer_config.json's, or chat_template.jinja).
`hf_tokenizer_metadata(folder, vocab_size)` returns None (the caller then writes token ids only)
with the reason in `unsupported_reason` when the tokenizer is not one of these.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from analysis.core.files import read_file_text

TOKENIZER_JSON = "tokenizer.json"
MAX_TOKENIZER_BYTES = 64 * 2**20

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Split regexes of byte-level BPE pre-tokenizers, as tokenizer.json writes them
_GPT2_SPLIT = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
_LLAMA3_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

# The structure of a pre_tokenizer (`_signature`) -> llama.cpp's pre-tokenizer that splits the same way:
# "gpt-2": ByteLevel's own (GPT-2) regex; "smollm": digits one by one, then GPT-2's regex (SmolLM /
# SmolLM2 on the hub); "llama-bpe": Llama-3's regex (numbers in runs of up to 3); "qwen2": the same with
# single digits.
PRE_TOKENIZERS: dict[tuple, str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3_SPLIT, "Isolated", False), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT, "Isolated", False), ("ByteLevel", False)): "qwen2",
}


class Unsupported(ValueError):
    """The tokenizer is not one this module converts (the message says why)."""


def _signature(pre: dict | None) -> tuple:
    """A hashable summary of a pre_tokenizer: per step its type and the settings that change the split."""
    if pre is None:
        raise Unsupported("it has no pre-tokenizer")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise Unsupported("its ByteLevel pre-tokenizer adds a prefix space")
            out.append((kind, bool(step.get("use_regex", True))))
        elif kind == "Digits":
            out.append((kind, bool(step.get("individual_digits"))))
        elif kind == "Split":
            pattern = step.get("pattern", {})
            out.append((kind, pattern.get("Regex", pattern.get("String")), step.get("behavior"),
                        bool(step.get("invert"))))
        else:
            raise Unsupported(f"its pre-tokenizer has a {kind!r} step")
    return tuple(out)


def pre_tokenizer_name(tokenizer: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a parsed tokenizer.json (Unsupported if none fits)."""
    signature = _signature(tokenizer.get("pre_tokenizer"))
    if signature not in PRE_TOKENIZERS:
        raise Unsupported(f"its pre-tokenizer {[s[0] for s in signature]} is not one headscope maps to "
                          f"llama.cpp's ({', '.join(sorted(set(PRE_TOKENIZERS.values())))})")
    return PRE_TOKENIZERS[signature]


def _special_flags(template: list) -> tuple[bool, bool]:
    """(a special token before the sequence, one after it) in a TemplateProcessing template."""
    kinds = ["SpecialToken" in piece for piece in template]
    return bool(kinds and kinds[0]), bool(kinds and kinds[-1])


def _token_string(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


_FIX = "export without the tokenizer (token ids only) or fix the tokenizer folder"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(read_file_text(path, MAX_TOKENIZER_BYTES, what=path.name, fix=_FIX))
    except json.JSONDecodeError as err:
        raise Unsupported(f"its {path.name} is not valid JSON ({err.msg})") from None


def unsupported_reason(folder: str | os.PathLike) -> str | None:
    """Why `folder`'s tokenizer is not converted (None: it is)."""
    try:
        convert(Path(folder), None)
    except Unsupported as err:
        return str(err)
    return None


def hf_tokenizer_metadata(folder: str | os.PathLike, vocab_size: int) -> list[tuple] | None:
    """The `tokenizer.*` keys (key, value, GGUF type, array element type) for the tokenizer in `folder`,
    or None when it is not a byte-level BPE tokenizer this module converts (`unsupported_reason`)."""
    try:
        return convert(Path(folder), vocab_size)
    except Unsupported:
        return None


def convert(folder: Path, vocab_size: int | None) -> list[tuple]:
    """As `hf_tokenizer_metadata`, raising Unsupported; vocab_size None: check only."""
    path = folder / TOKENIZER_JSON
    if not path.is_file():
        raise Unsupported(f"there is no {TOKENIZER_JSON} in {folder}")
    tokenizer = _read_json(path)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise Unsupported(f"its model is {model.get('type')!r}{' with byte fallback' if model.get('byte_fallback') else ''}, "
                          "not byte-level BPE")
    if tokenizer.get("normalizer") is not None:
        raise Unsupported("it has a normalizer")
    pre = pre_tokenizer_name(tokenizer)
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: NORMAL for i in by_id}
    for added in tokenizer.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = CONTROL if added.get("special") else USER_DEFINED
    n = max(by_id) + 1
    if vocab_size is None:
        return []
    if n > vocab_size:
        raise Unsupported(f"it has {n} tokens but the model only {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, UNUSED) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {t: i for i, t in enumerate(tokens)}
    meta = [("tokenizer.ggml.model", b"gpt2", "STRING", None), ("tokenizer.ggml.pre", pre.encode(), "STRING", None),
            ("tokenizer.ggml.tokens", [t.encode("utf-8") for t in tokens], "ARRAY", "STRING"),
            ("tokenizer.ggml.token_type", token_types, "ARRAY", "INT32"),
            ("tokenizer.ggml.merges", [m.encode("utf-8") for m in merges], "ARRAY", "STRING")]
    for role in ("bos", "eos", "unk", "pad"):
        token = _token_string(config.get(f"{role}_token"))
        if token in ids:
            name = "unknown" if role == "unk" else "padding" if role == "pad" else role
            meta.append((f"tokenizer.ggml.{name}_token_id", ids[token], "UINT32", None))
    post = tokenizer.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing":
        add_bos, add_eos = _special_flags(post.get("single", []))
    else:
        add_bos, add_eos = bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
    meta += [("tokenizer.ggml.add_bos_token", add_bos, "BOOL", None),
             ("tokenizer.ggml.add_eos_token", add_eos, "BOOL", None),
             ("tokenizer.ggml.add_space_prefix", False, "BOOL", None)]
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = read_file_text(folder / "chat_template.jinja", MAX_TOKENIZER_BYTES, what="chat_template.jinja",
                                  fix=_FIX)
    if isinstance(template, str):
        meta.append(("tokenizer.chat_template", template.encode("utf-8"), "STRING", None))
    return meta
