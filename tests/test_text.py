"""Built-in Wikipedia text (split, order, attribution), user text cleaning, tokenization."""
import hashlib
import json

import pytest
import torch

from analysis.core import text as T
from analysis.core.errors import HeadscopeError, InputError


def _raw_file():
    return json.loads(T._wiki_file().read_text(encoding="utf-8"))


def test_every_article_is_loaded_once():
    raw = _raw_file()
    articles = T.wiki_articles()
    assert len(articles) == len(raw) > 10_000
    assert {a.title for a in articles} == set(raw)
    some = articles[123]
    assert some.text == raw[some.title]["extract"].strip() and some.text


def test_split_is_disjoint_complete_and_balanced():
    cal = {a.title for a in T.calibration_articles()}
    ev = {a.title for a in T.evaluation_articles()}
    assert cal.isdisjoint(ev)
    assert cal | ev == {a.title for a in T.wiki_articles()}
    assert 0.4 < len(cal) / (len(cal) + len(ev)) < 0.6


def test_split_follows_a_stable_hash_of_the_title():
    # Recompute the documented rule independently: first SHA-256 byte of salt + title, mod 2.
    for article in T.wiki_articles()[:200]:
        first = hashlib.sha256((T.SPLIT_SALT + article.title).encode()).digest()[0]
        expected = ("calibration", "evaluation")[first % 2]
        assert T.split_of(article.title) == expected


def test_order_is_fixed_and_mixes_the_file_order():
    titles = [a.title for a in T.evaluation_articles()]
    digests = [hashlib.sha256((T.SPLIT_SALT + t).encode()).digest() for t in titles]
    assert digests == sorted(digests)
    in_split = set(titles)
    assert titles[:50] != [t for t in _raw_file() if t in in_split][:50]


def test_text_is_the_articles_joined_and_cut_to_max_chars():
    first = T.evaluation_articles()[:3]
    joined = "\n\n".join(a.text for a in first)
    assert T.evaluation_text(len(joined)) == joined
    assert T.evaluation_text(10) == first[0].text[:10]
    assert T.calibration_text(500) == T.calibration_text(None)[:500]
    assert T.calibration_text(500) != T.evaluation_text(500)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_bad_max_chars_is_rejected(bad):
    with pytest.raises(InputError, match="max_chars"):
        T.evaluation_text(bad)


def test_attribution_names_license_and_authors():
    assert "CC BY-SA 4.0" in T.WIKI_ATTRIBUTION
    assert "Wikipedia contributors" in T.WIKI_ATTRIBUTION


@pytest.mark.parametrize("raw, clean", [
    ("  hello world \n", "hello world"),
    ("a\r\nb\rc", "a\nb\nc"),
    ("x\x00y", "xy"),
    ("\ufeffbom".encode("utf-8"), "bom"),
    ("Zürich".encode("utf-8"), "Zürich"),
])
def test_user_text_is_cleaned(raw, clean):
    assert T.clean_user_text(raw) == clean


@pytest.mark.parametrize("bad, hint", [
    ("", "empty"),
    ("  \n\t ", "empty"),
    (b"", "empty"),
    (b"\xff\xfe\x00abc", "UTF-8"),
    ("Zürich".encode("latin-1"), "UTF-8"),
    (None, "Expected text"),
])
def test_bad_user_text_is_rejected_with_a_fix(bad, hint):
    with pytest.raises(InputError, match=hint) as info:
        T.clean_user_text(bad)
    assert isinstance(info.value, HeadscopeError)


class _CharTokenizer:
    """Stand-in tokenizer: one token per non-space character, plus a trailing end token."""

    def __call__(self, text, return_tensors=None, verbose=True):
        ids = [ord(c) for c in text if not c.isspace()] + [0]
        return {"input_ids": torch.tensor([ids])}


def test_tokenize_prefix_equals_whole_text_cut():
    tok = _CharTokenizer()
    text = "ab c " * 3000
    whole = T.tokenize(tok, text)
    assert whole.shape == (1, 9001) and whole.dtype == torch.long
    for n in (1, 7, 500, 8990):
        assert torch.equal(T.tokenize(tok, text, max_tokens=n), whole[:, :n])
    # a text shorter than max_tokens keeps everything, end token included
    assert torch.equal(T.tokenize(tok, "xy", max_tokens=50), torch.tensor([[120, 121, 0]]))


def test_tokenize_grows_the_prefix_when_tokens_are_sparse():
    # mostly whitespace: a prefix of 8 * max_tokens characters yields too few tokens
    tok = _CharTokenizer()
    text = ("a" + " " * 40) * 400
    assert T.tokenize(tok, text, max_tokens=300).shape == (1, 300)


def test_tokenize_with_a_real_tokenizer(smollm2):
    text = T.evaluation_text(20_000)
    whole = smollm2.tokenizer(text, return_tensors="pt")["input_ids"]
    assert torch.equal(T.tokenize(smollm2.tokenizer, text, max_tokens=256), whole[:, :256])


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_tokenize_rejects_bad_max_tokens(bad):
    with pytest.raises(InputError, match="max_tokens"):
        T.tokenize(_CharTokenizer(), "abc", max_tokens=bad)
