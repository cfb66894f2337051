"""Successor sequences: "Monday, Tuesday, Wednesday," -> " Thursday". Ordered lists written for
headscope (weekdays, months, number words, ordinal words, capital letters); a prompt is three or four
consecutive members (weekdays and months wrap around), the answer the next member, the contrast
another member of the same list that is neither shown nor the answer (so knowing the category is not
enough: the order is). A list is used only when every member is one token with its leading space
(the others are left out and counted); lists rotate, so the items are balanced over them. After the
successor heads of Gould et al. 2023 (analysis.measure.circuits reads the same idea from weights).
"""
from __future__ import annotations

from analysis.measure.probes.items import Draft, Probe, Vocabulary

SEQUENCES = {
    "weekdays": (("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), True),
    "months": (("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
                "November", "December"), True),
    "numbers": (("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve"), False),
    "ordinals": (("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"),
                 False),
    "letters": (tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), False),
}


class SuccessorProbe(Probe):
    """Continue an ordered list; items rotate over the lists the tokenizer keeps."""

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        rng = self.rng()
        kept = {name: members for name, (members, _) in SEQUENCES.items()
                if vocab.keep(f"{name} lists", [members])}
        pools = {}
        for name, members in kept.items():
            cyclic = SEQUENCES[name][1]
            n = len(members)
            starts = [(s, k) for k in (3, 4) for s in range(n if cyclic else n - k)]
            rng.shuffle(starts)
            pools[name] = starts
        out, cursor = [], 0
        while len(out) < self.n_items and any(cursor < len(p) for p in pools.values()):
            for name, starts in pools.items():
                if len(out) >= self.n_items or cursor >= len(starts):
                    continue
                members = kept[name]
                start, k = starts[cursor]
                shown = [members[(start + i) % len(members)] for i in range(k)]
                answer = members[(start + k) % len(members)]
                others = [m for m in members if m not in shown and m != answer]
                if not others:
                    continue
                d = vocab.complete(", ".join(shown) + ",", " " + answer, " " + rng.choice(others), suffix=",",
                                   condition=name)
                if d is not None:
                    out.append(d)
            cursor += 1
        return out
