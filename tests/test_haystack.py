"""Long-context haystacks (analysis/measure/haystack.py): seeded, the length asked for, the needle where asked."""
import pytest
import torch

from analysis.core.errors import InputError
from analysis.measure.haystack import haystack, place, sentence_ends


def test_haystack_is_seeded_and_exact(smollm2):
    tok = smollm2.tokenizer
    a, b, c = haystack(tok, 600, seed=1), haystack(tok, 600, seed=1), haystack(tok, 600, seed=2)
    assert a.shape == (600,) and torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(InputError):
        haystack(tok, 0)


def test_needle_goes_after_a_sentence_end_near_its_depth(smollm2):
    tok = smollm2.tokenizer
    h = haystack(tok, 800, seed=0)
    ends = sentence_ends(tok, h)
    needle = torch.tensor(tok(" The pass key is 4821.", add_special_tokens=False)["input_ids"])
    for depth in (0.0, 0.3, 0.9, 1.0):
        p = place(h, needle, depth, ends=ends)
        assert torch.equal(p.ids[p.start:p.end], needle) and p.ids.numel() == 800 + needle.numel()
        assert torch.equal(torch.cat([p.ids[:p.start], p.ids[p.end:]]), h)
        if 0 < depth < 1:
            assert (p.start - 1) in ends.tolist()
            gaps = (ends + 1 - round(depth * 800)).abs()
            assert abs(p.start - round(depth * 800)) == int(gaps.min())
    with pytest.raises(InputError, match="depth"):
        place(h, needle, 1.5)
