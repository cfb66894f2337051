"""In-context copying: sequences of random tokens repeated twice; the model should continue the
second copy from the first. One home of the in-context-learning (ICL) score as a capability.

Each sequence is r r, r = `length` distinct random token ids (seeded; the tokenizer's special tokens
left out), after the row's BOS choice. An item is a position of the second copy: the token r[k]
there should be followed by r[k+1] (k = 0 .. length-2), against a contrast r[j] taken from the same
sequence (so a model that only raises the logits of tokens it has seen scores 0, and copying the
right one scores > 0). The same positions of the first copy are read as reference items (not
scored): the ICL score = mean NLL of the next token over the first copy minus over the second copy
(nats; the same definition as the induction detector's `icl_score`, analysis.measure.detectors, on
these sequences). Masked LMs: one token of the second copy is masked in place (the model sees both
copies); the ICL score is a causal-LM number and is left out there.
"""
from __future__ import annotations

import numpy as np

from analysis.measure.detectors import repeated_random_tokens
from analysis.measure.probes.items import Draft, Probe, ProbeItems, Vocabulary


def icl_score(nll_first: np.ndarray, nll_second: np.ndarray) -> np.ndarray:
    """Mean NLL over the first copy minus over the second, per mask: [B, n1], [B, n2] -> [B] (nats)."""
    return nll_first.mean(axis=-1) - nll_second.mean(axis=-1)


class CopyingProbe(Probe):
    """Continue a repeated random sequence (induction); items = second-copy positions."""

    def __init__(self, n_items: int = 60, seed: int = 0, bos: str = "auto", length: int = 16):
        super().__init__(n_items, seed, bos)
        self.length = int(length)

    def drafts(self, vocab: Vocabulary, kind: str) -> list[Draft]:
        rng = self.rng()
        N = self.length
        n_sequences = -(-self.n_items // (N - 1))
        tokenizer = vocab.tokenizer
        exclude = tuple(getattr(tokenizer, "all_special_ids", ()) or ())
        seqs = repeated_random_tokens(len(tokenizer), n_sequences, N, seed=self.seed, exclude=exclude)  # [s, 2N]
        out = []
        for seq in seqs.tolist():
            tokens = tuple(seq)
            copies = ((N, False),) if kind == "masked-lm" else ((N, False), (0, True))
            for start, reference in copies:
                for k in range(N - 1):
                    j = (k + 1 + rng.randrange(1, N)) % N               # another token of the sequence
                    out.append(Draft(tokens, start + k + 1, tokens[j], "first copy" if reference else "second copy",
                                     reference))
        return out                                                       # whole sequences: >= n_items scored

    def extras(self, items: ProbeItems, diff, nll) -> dict:
        if items.kind != "causal-lm" or not bool(items.reference.any()):
            return {}
        ref = items.reference.numpy()
        return {"icl_score": icl_score(nll[:, ref], nll[:, ~ref])}
