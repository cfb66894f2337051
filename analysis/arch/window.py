"""The window of a windowed KV head, one value: the `sinks` first tokens and the `recent` latest ones.

A windowed KV head (a streaming head: StreamingLLM's attention sinks, Xiao et al. 2023; DuoAttention's
streaming heads, Xiao et al. 2024) lets query i read key j when

    j <= i  and  (j < sinks  or  i - j < recent)

(the query's own token counts among the `recent`). So a window of sinks + recent >= the context reads every
earlier token (it equals full attention), and recent = 0 would read nothing (refused: recent >= 1).

Its cache is a ring (analysis.arch.kvcache): sink token p < sinks in slot p, token p >= sinks in slot
sinks + (p - sinks) % recent, so a new token overwrites the one that just left every later query's band and
the ring never holds more than `size` = sinks + recent tokens.

A query at position p reads min(p + 1, sinks + recent) keys: `read_keys` counts the (query, key) pairs of the last
`tokens` queries of a context, the one count of attention work every FLOP figure uses (a full head is the same
count without a cap: causal attention, each query reading every earlier key and itself).

`Window` holds the two numbers with their checks and every formula above; it works on plain ints, numpy
arrays and torch tensors alike (operators only), and imports neither torch nor numpy (the CLI's parser and
the app's inputs read its defaults).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from analysis.core.errors import InputError, check_whole_number

DEFAULT_SINKS = 4                    # first tokens a windowed KV head keeps (attention sinks)
DEFAULT_RECENT = 256                 # latest tokens it keeps, the query's own included
MAX_WINDOW = 2**31 - 1               # tokens; a bigger window is a typo (it would equal full attention anyway)


@dataclass(frozen=True)
class Window:
    """sinks first tokens + recent latest tokens (checked: whole numbers, sinks >= 0, recent >= 1)."""
    sinks: int = DEFAULT_SINKS
    recent: int = DEFAULT_RECENT

    def __post_init__(self):
        if isinstance(self.recent, numbers.Integral) and not isinstance(self.recent, bool) and self.recent < 1:
            raise InputError(f"A window of {self.recent} recent tokens reads nothing (not even the token itself); "
                             f"use at least 1, or prune the head instead.")
        object.__setattr__(self, "sinks", check_whole_number(self.sinks, "The number of sink tokens", low=0,
                                                             high=MAX_WINDOW))
        object.__setattr__(self, "recent", check_whole_number(self.recent, "The window (recent tokens)", low=1,
                                                              high=MAX_WINDOW))

    @property
    def size(self) -> int:
        """Tokens a windowed head holds at most: sinks + recent."""
        return self.sinks + self.recent

    def covers(self, context: int) -> bool:
        """Whether the window reads every earlier token at `context` tokens (then it equals full attention)."""
        return self.size >= context

    def kept(self, context):
        """Tokens a windowed head holds after `context` tokens: min(context, sinks + recent) (int or array)."""
        return context - (context > self.size) * (context - self.size)

    def reads(self, q_positions, k_positions):
        """[q, S] bool: the query at q_positions[i] reads the key at k_positions[j] (q [q] and k [S] numpy arrays
        or torch tensors of positions)."""
        qp, kp = q_positions[:, None], k_positions[None, :]                        # [q, 1], [1, S]
        return (kp <= qp) & ((kp < self.sinks) | (qp - kp < self.recent))        # [q, S]

    def read_keys(self, tokens: int, context: int) -> int:
        """(query, key) pairs a windowed head computes for the last `tokens` queries of `context` tokens."""
        return read_keys(tokens, context, self.size)

    def slot(self, position):
        """The ring slot of a kept position (an int, or an integer array / tensor of positions)."""
        past = position - self.sinks
        return position - (past >= 0) * (past - past % self.recent)

    def describe(self) -> str:
        return f"{self.sinks} sink + {self.recent} recent tokens"

    def as_dict(self) -> dict:
        return dict(sinks=self.sinks, recent=self.recent)


def read_keys(tokens: int, context: int, cap: int | None = None) -> int:
    """(query, key) pairs of the last `tokens` queries of a context of `context` tokens, each query reading every
    earlier key and itself (causal), at most `cap` of them (None: no cap): the sum over positions
    p = context - tokens .. context - 1 of min(p + 1, cap). A prefill of S tokens: read_keys(S, S) = S (S + 1) / 2;
    a decode step at context C: read_keys(1, C) = C."""
    cap = context if cap is None else cap
    first, last = context - tokens + 1, context                          # keys read by the first / last query
    top = min(last, cap)
    growing = (first + top) * (top - first + 1) // 2 if top >= first else 0
    return growing + max(0, last - max(first, cap + 1) + 1) * cap


def window_of(value) -> Window:
    """A Window from a Window, a (sinks, recent) pair or a {"sinks", "recent"} mapping (InputError otherwise)."""
    if isinstance(value, Window):
        return value
    if isinstance(value, dict):
        return Window(value.get("sinks", DEFAULT_SINKS), value.get("recent", DEFAULT_RECENT))
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Window(*value)
    raise InputError(f"A window is (sinks, recent); got {value!r}.")
