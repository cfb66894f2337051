"""Code: closing brackets and quotes in real Python source, from the interpreter's own standard-library
files (analysis.core.pysource; PSF License Version 2).

Python's own `tokenize` module finds, in each file, the brackets ( [ { whose closer comes within a
few lines, and the plain one-line string literals. An item's prompt runs from the first non-blank
character of the opener's line up to the closer (at most `max_chars` characters and `max_tokens`
tokens); the answer is the
token the model's tokenizer starts at the closer in that context (it may carry what follows, e.g.
"):"), the contrast the token it starts there when the closer is swapped for a wrong one
() <-> ], } -> ), ' <-> "). An item whose closer is not the start of a token in either text is left
out and counted. Closers rotate over ), ], }, and quotes (balanced as far as the files allow), and the
files and positions are picked by the seed. Masked LMs: the closer's token is masked in the line.
"""
from __future__ import annotations

import io
import tokenize as pytokenize
from functools import lru_cache

from analysis.core.pysource import PYTHON_ATTRIBUTION, stdlib_sources
from analysis.measure.probes.items import Draft, Probe, ProbeItems, Vocabulary

OPENERS = {"(": ")", "[": "]", "{": "}"}
WRONG = {")": "]", "]": ")", "}": ")", "'": '"', '"': "'"}
KINDS = (")", "]", "}", "quote")
MAX_LINES = 3                    # a closer at most this many lines below its opener


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            starts.append(i + 1)
    return starts


def closers(text: str, max_chars: int) -> list[tuple[str, int, int]]:
    """(kind, context start, closer offset) of every usable closer of a Python source text."""
    starts = _line_starts(text)
    offset = lambda pos: starts[pos[0] - 1] + pos[1]                     # noqa: E731  (row, col) -> offset
    out, stack = [], []
    try:
        for tok in pytokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == pytokenize.OP and tok.string in OPENERS:
                stack.append(tok.start)
            elif tok.type == pytokenize.OP and tok.string in OPENERS.values() and stack:
                open_at = stack.pop()
                end = offset(tok.start)
                begin = starts[open_at[0] - 1]
                begin += len(text[begin:end]) - len(text[begin:end].lstrip())
                if tok.start[0] - open_at[0] < MAX_LINES and end - offset(open_at) > 2 and end - begin <= max_chars:
                    out.append((tok.string, begin, end))
            elif tok.type == pytokenize.STRING and tok.start[0] == tok.end[0]:
                s = tok.string
                if len(s) >= 4 and s[0] in "'\"" and s[-1] == s[0] and not s.startswith(s[0] * 3):
                    end = offset(tok.end) - 1
                    begin = starts[tok.start[0] - 1]
                    begin += len(text[begin:end]) - len(text[begin:end].lstrip())
                    if end - begin <= max_chars:
                        out.append(("quote", begin, end))
    except (pytokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


@lru_cache(maxsize=4)
def all_closers(max_chars: int) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """kind -> (file, context start, closer offset) over every built-in source file (read once)."""
    pools: dict[str, list] = {k: [] for k in KINDS}
    for name, text in stdlib_sources():
        for c in closers(text, max_chars):
            pools[c[0] if c[0] in OPENERS.values() else "quote"].append((name, c[1], c[2]))
    return {k: tuple(v) for k, v in pools.items()}


class CodeProbe(Probe):
    """Close the bracket or quote that is open, in real Python source; items rotate over the closers."""

    def __init__(self, n_items: int = 48, seed: int = 0, bos: str = "auto", max_chars: int = 120,
                 max_tokens: int = 48):
        super().__init__(n_items, seed, bos)
        self.max_chars, self.max_tokens = int(max_chars), int(max_tokens)

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        rng = self.rng()
        pools = {k: list(v) for k, v in all_closers(self.max_chars).items()}
        for k in KINDS:
            rng.shuffle(pools[k])
        texts = dict(stdlib_sources())
        out, cursor = [], {k: 0 for k in KINDS}
        while len(out) < self.n_items and any(cursor[k] < len(pools[k]) for k in KINDS):
            for k in KINDS:
                if len(out) >= self.n_items or cursor[k] >= len(pools[k]):
                    continue
                name, begin, end = pools[k][cursor[k]]
                cursor[k] += 1
                d = self._draft(vocab, texts[name], begin, end, k)
                if d is not None:
                    out.append(d)
        return out

    def _draft(self, vocab: Vocabulary, text: str, begin: int, end: int, kind: str) -> Draft | None:
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        prefix, closer, rest = text[begin:end], text[end], text[end + 1:line_end]
        head = vocab.encode(prefix)
        if len(head) > self.max_tokens:
            vocab.reject(f"prompts longer than {self.max_tokens} tokens", prefix[:30] + "...")
            return None
        right, wrong = vocab.encode(prefix + closer + rest), vocab.encode(prefix + WRONG[closer] + rest)
        n = len(head)
        if not head or right[:n] != head or wrong[:n] != head or len(right) <= n or len(wrong) <= n \
                or right[n] == wrong[n]:
            vocab.reject("closers that are not the start of a token", prefix[-30:] + closer)
            return None
        return Draft(tuple(right), n, wrong[n], f"closing {closer if kind != 'quote' else 'quote'}")

    def notes(self, items: ProbeItems) -> tuple[str, ...]:
        return (PYTHON_ATTRIBUTION,)
