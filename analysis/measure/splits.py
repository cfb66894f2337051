"""Calibration rows apart from test rows: what a score or a plan search may read, and what a verdict reads.

The field keeps the data a method was tuned on apart from the data it is judged on (DESIGN 2b-bis). Every
long-context row set here (RULER's rows, the needle items, the haystacks under them) is made for one split:

- **test** (the default, the rows every verdict reads): the haystacks from the *evaluation* half of the built-in
  text (analysis.core.text splits the articles by a hash of their titles), the generators seeded as they always
  were, so a stored dense side of the test rows stays what it was;
- **calibration** (what scores and searches read): the haystacks from the *calibration* half, the generators
  seeded under another salt, so their keys, values and needles are drawn apart from the test rows'.

`disjoint` is the check that holds the two apart on the rows themselves, token for token: no prompt of one split
equals a prompt of the other, and no row of one asks for the very answers a row of the other asks for (within
a task, where answers could meet). A plan chosen on calibration rows and judged on test rows names both
(`RowsUsed`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from analysis.core.errors import InputError

TEST = "test"
CALIBRATION = "calibration"
SPLITS = (TEST, CALIBRATION)
SCORE_SPLIT = CALIBRATION        # the rows every head score reads (retrieval, streaming, retrieval-aware, importance)
TEXT_HALF = {TEST: "evaluation", CALIBRATION: "calibration"}      # analysis.core.text's halves
SEED_SALT = {TEST: "", CALIBRATION: "calibration:"}              # prefixed to a generator's seed string


def check_split(split: str) -> str:
    """`split` when it is one of SPLITS; InputError (one line) otherwise."""
    if split not in SPLITS:
        raise InputError(f"Rows are made for one split, {' or '.join(SPLITS)}; got {split!r}.")
    return split


def salted(split: str, key: str) -> str:
    """The seed string `key` of a row generator, drawn apart for the calibration split (unchanged for test)."""
    return SEED_SALT[check_split(split)] + key


def text_half(split: str) -> str:
    """The built-in text's half a split's haystacks come from ("evaluation" for test, "calibration")."""
    return TEXT_HALF[check_split(split)]


@dataclass(frozen=True)
class RowsUsed:
    """Which rows a plan was chosen on and which it is judged on: each a short description (split, tasks,
    lengths, rows, seed) and the sha256 of the rows themselves."""
    chosen_on: dict
    judged_on: dict | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        def one(d):
            return (f"{d.get('split', '?')} rows ({d.get('what', '')}, {d.get('rows', '?')} rows, sha256 "
                    f"{str(d.get('digest', ''))[:12]})")
        out = f"chosen on {one(self.chosen_on)}"
        return out + (f"; judged on {one(self.judged_on)}" if self.judged_on else "")


def disjoint(a: dict, b: dict, what: str = "rows") -> None:
    """InputError (one line) when two row sets meet. a, b: task -> list of (prompt token ids, answers) per row,
    prompt ids a tuple of ints, answers a tuple of strings. They meet when some prompt is in both (token for
    token), or when a row of one asks for exactly the answers a row of the other asks for in the same task."""
    prompts_a = {ids: task for task, rows in a.items() for ids, _ in rows}
    shared = [prompts_a[ids] for task, rows in b.items() for ids, _ in rows if ids in prompts_a]
    if shared:
        raise InputError(f"The calibration {what} overlap the test {what}: {len(shared)} prompt(s) in both "
                         f"({', '.join(sorted(set(shared)))}); make them with another seed or split.")
    for task in sorted(set(a) & set(b)):
        answers = {tuple(ans) for _, ans in a[task]}
        met = [ans for _, ans in b[task] if tuple(ans) in answers]
        if met:
            raise InputError(f"The calibration {what} overlap the test {what}: {len(met)} row(s) of {task} ask for "
                             f"the same answer ({', '.join(met[0])[:60]}); make them with another seed.")


__all__ = ["TEST", "CALIBRATION", "SPLITS", "check_split", "salted", "text_half", "RowsUsed", "disjoint"]
