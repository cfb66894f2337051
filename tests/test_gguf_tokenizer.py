"""HF tokenizer.json -> GGUF tokenizer keys (analysis/compress/export/gguf/tokenizer.py), checked in llama.cpp.

Oracles:
- the SmolLM2 HF folder (the built-in converted to a plain checkpoint) converts to the same tokens,
  token types, merges, special ids and chat template as the built-in GGUF file's own keys, byte for
  byte; its tokenizer.json's pre-tokenizer is plain ByteLevel, so the name is llama.cpp's "gpt-2";
- llama.cpp's own tokenizer, reading only the converted keys (a vocabulary-only GGUF file), gives the
  HF tokenizer's ids on the 1,000 built-in paragraphs; the same with the pre-tokenizer rewritten as
  Llama-3's and Qwen2's split (the HF `tokenizers` library runs the rewritten tokenizer.json, llama.cpp
  runs "llama-bpe" / "qwen2"): each table entry is proven by running both sides;
- a tokenizer the module does not convert (Metaspace pre-tokenizer) says why, and the export then
  writes token ids only ("none"), as before;
- the gguf export of a model loaded from an HF folder carries the converted keys.
"""
import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from analysis.compress.export.gguf import tokenizer as gguf_tokenizer
from analysis.compress.export.gguf.writer import source_gguf, tokenizer_metadata

VOCAB = 49152


@pytest.fixture(scope="module")
def smol_folder(smollm2) -> Path:
    folder = Path(smollm2.model.config._name_or_path)
    assert (folder / "tokenizer.json").is_file()
    return folder


@pytest.fixture(scope="module")
def paragraphs():
    from analysis.core.text import wiki_articles
    texts = [a.text for a in wiki_articles()[:1000]]
    assert len(texts) == 1000
    return texts


def _keys(meta) -> dict:
    return {key: (value, vtype, sub) for key, value, vtype, sub in meta}


def _vocab_file(path: Path, meta) -> Path:
    """A GGUF file with the llama architecture's name and the tokenizer keys only: llama.cpp loads its
    vocabulary (vocab_only) without any tensor."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value, vtype, sub in meta:
        writer.add_key_value(key, value, gguf.GGUFValueType[vtype],
                             sub_type=None if sub is None else gguf.GGUFValueType[sub])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def _differ(folder: Path, tmp_path: Path, texts) -> list[int]:
    """Indices of the paragraphs that llama.cpp (the converted keys) tokenizes differently from HF's
    `tokenizers` running the folder's tokenizer.json."""
    import llama_cpp
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    meta = gguf_tokenizer.hf_tokenizer_metadata(folder, VOCAB)
    vocab = llama_cpp.Llama(model_path=str(_vocab_file(tmp_path / "vocab.gguf", meta)), vocab_only=True,
                            verbose=False)
    return [i for i, text in enumerate(texts)
            if vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False) != hf.encode(text).ids]


def test_smollm2_converts_to_the_builtin_gguf_keys(smol_folder):
    mine = _keys(gguf_tokenizer.hf_tokenizer_metadata(smol_folder, VOCAB))
    theirs = _keys(tokenizer_metadata(source_gguf("smollm2-135m"), VOCAB))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"):
        assert mine[key][0] == theirs[key][0], key
    assert mine["tokenizer.ggml.pre"][0] == b"gpt-2"      # the folder's tokenizer.json: plain ByteLevel


def test_llama_cpp_tokenizes_like_hf_with_the_converted_keys(smol_folder, paragraphs, tmp_path):
    differ = _differ(smol_folder, tmp_path, paragraphs)
    assert differ == [], f"{len(differ)} of 1000 paragraphs tokenize differently, e.g. #{differ[:3]}"


def _rewritten(smol_folder: Path, target: Path, pre_tokenizer: dict) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_folder / name, target / name)
    data = json.loads((target / "tokenizer.json").read_text())
    data["pre_tokenizer"] = pre_tokenizer
    (target / "tokenizer.json").write_text(json.dumps(data))
    return target


@pytest.mark.parametrize("name,split", [("llama-bpe", gguf_tokenizer._LLAMA3_SPLIT),
                                        ("qwen2", gguf_tokenizer._QWEN2_SPLIT)])
def test_split_pre_tokenizers_run_as_in_hf(smol_folder, paragraphs, tmp_path, name, split):
    """Llama-3 / Qwen2 style tokenizer.json (a Split regex, then ByteLevel without its own regex) on
    SmolLM2's vocabulary and merges: llama.cpp's named pre-tokenizer splits as HF's does."""
    pre = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    folder = _rewritten(smol_folder, tmp_path / name, pre)
    assert gguf_tokenizer.pre_tokenizer_name(json.loads((folder / "tokenizer.json").read_text())) == name
    differ = _differ(folder, tmp_path, paragraphs)
    assert differ == [], f"{name}: {len(differ)} of 1000 paragraphs tokenize differently, e.g. #{differ[:3]}"


def test_an_unconverted_tokenizer_says_why_and_the_export_keeps_ids_only(smol_folder, tmp_path):
    pre = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False}
    folder = _rewritten(smol_folder, tmp_path / "metaspace", pre)
    assert "'Metaspace' step" in gguf_tokenizer.unsupported_reason(folder)
    assert gguf_tokenizer.hf_tokenizer_metadata(folder, VOCAB) is None
    assert tokenizer_metadata(folder, VOCAB) == [("tokenizer.ggml.model", "none", "STRING", None)]
    data = json.loads((smol_folder / "tokenizer.json").read_text())
    unigram = copy.deepcopy(data)
    unigram["model"] = {"type": "Unigram", "vocab": []}
    (folder / "tokenizer.json").write_text(json.dumps(unigram))
    assert "'Unigram'" in gguf_tokenizer.unsupported_reason(folder)


def test_gguf_export_of_an_hf_folder_carries_the_converted_tokenizer(smollm2, smol_folder, tmp_path):
    """tokenizer_source: a model loaded from a folder with tokenizer.json (not the built-in marker) gets
    its tokenizer converted; the written file's keys are the converted ones."""
    from gguf import GGUFReader
    from analysis.arch.adapters import adapter_for
    from analysis.compress.export.gguf.format import tokenizer_source
    from analysis.compress.export.gguf.writer import write_gguf
    from analysis.compress.surgery import prune_heads
    from tests._tiny import tiny_model
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_folder / name, folder / name)
    model = tiny_model("llama", vocab_size=VOCAB)
    model.config._name_or_path = str(folder)
    assert tokenizer_source(model) == folder
    g = adapter_for(model).geometry(model)
    smaller, layout = prune_heads(model, np.zeros((g.n_layers, g.n_heads), bool))
    written = write_gguf(smaller, layout, tmp_path / "model.gguf", weight_type="f16",
                         tokenizer_gguf=tokenizer_source(model))
    fields = GGUFReader(str(written.path)).fields
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"].contents()) == VOCAB
    assert tokenizer_source(smollm2.model) == source_gguf("smollm2-135m")    # the built-in: its own file
