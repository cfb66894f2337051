"""Helpers for the capability-probe tests: a tiny Llama with one planted head that carries a probe-shaped
task, the probe that asks it, and a tokenizer that splits chosen words (to see rejected fillers counted).

The planted model (`planted_model`): 2 layers x 4 heads (2 KV heads, d = 8, hidden 32), every weight
small and random except one head. That head attends uniformly (its query rows are zero, so every
score is 0 whatever the rotary embedding), its KV group reads an 8-dimensional subspace S of the
embeddings (where the content tokens live; fillers are outside it), its O columns write S back
(x 20), and the unembedding reads S: the model's logit for a content token grows with that token's
presence in the context, through that head alone. `PlantedProbe`: a context of fillers holding one
content token; answer = that token, contrast = a content token that is not there.
"""
from __future__ import annotations

import torch

from analysis.measure.probes.items import Draft, Probe
from analysis.measure.probes.registry import ProbeSpec

from ._tiny import tiny_model

CONTENT = tuple(range(40, 48))      # content token ids; the fillers are drawn from 50..89
HEAD_DIM = 8


def planted_model(layer: int = 1, head: int = 2, dtype: torch.dtype = torch.float64):
    m = tiny_model("llama", seed=3, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    V, D, G = m.config.vocab_size, m.config.hidden_size, 2
    basis = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=dtype))[0]
    S, rest = basis[:, :HEAD_DIM], basis[:, HEAD_DIM:]                   # [D, 8] content subspace, [D, 24]
    d = HEAD_DIM
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g, dtype=dtype)) if p.dim() > 1 else p.fill_(1.0)
        emb = (rest @ torch.randn(rest.shape[1], V, generator=g, dtype=dtype)).T.clone()   # [V, D] fillers outside S
        emb[list(CONTENT)] = 3.0 * S.T                                   # content token i = 3 * S[:, i]
        m.model.embed_tokens.weight.copy_(emb)
        m.lm_head.weight.copy_(0.05 * emb)
        m.lm_head.weight[list(CONTENT)] = S.T                            # a content token's logit reads S
        attn = m.model.layers[layer].self_attn
        group = head // G
        attn.q_proj.weight[head * d:(head + 1) * d] = 0.0                # zero query: uniform attention
        attn.v_proj.weight[group * d:(group + 1) * d] = S.T              # its KV group reads S
        attn.o_proj.weight[:, head * d:(head + 1) * d] = 20.0 * S        # the head writes S back
    return m.eval()


class PlantedProbe(Probe):
    """Which content token was in the context? Answer: the one that was; contrast: one that was not."""

    def drafts(self, vocab, kind):
        rng = self.rng()
        out = []
        for _ in range(self.n_items):
            a, b = rng.sample(CONTENT, 2)
            fill = [rng.randrange(50, 90) for _ in range(9)]
            fill.insert(rng.randrange(0, 8), a)
            out.append(Draft(tuple(fill + [a]), len(fill), b, "planted"))
        return out


PLANTED = ProbeSpec("planted", "Planted copy", "which content token was in the context", "tests/_probekit.py",
                    PlantedProbe, kinds=("causal-lm",))


class SplittingTokenizer:
    """A real tokenizer, except that the listed words (with their leading space) come out as two tokens."""

    def __init__(self, inner, words):
        self.inner, self.words = inner, tuple(words)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def __call__(self, text, **kwargs):
        for w in self.words:
            text = text.replace(" " + w, " " + w[:2] + " " + w[2:])
        return self.inner(text, **kwargs)
