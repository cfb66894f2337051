"""Resuming a distillation from an edited or damaged checkpoint (issue 36, a sibling of the streamed and
metadata classes): a checkpoint whose settings fingerprint matches but whose contents were edited (a key
removed, a step that is no whole number, a tensor of another shape, a damaged RNG state) is one InputError
naming the file and the fix, never a KeyError / TypeError / RuntimeError from inside the restore. Tiny
Llama student, 2 steps: a second per case.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from analysis.compress.recover import distill as D
from analysis.compress.recover.distill import DistillConfig, distill
from analysis.compress.surgery import prune_heads
from analysis.core.errors import InputError
from tests._tiny import tiny_input_ids, tiny_model

IDS = tiny_input_ids(4, 16)                                  # [4, 16]
CFG = DistillConfig(steps=2, lr=1e-2, batch_size=2, seq_len=16, checkpoint_every=1)


def _pair():
    teacher = tiny_model("llama")
    pruned = np.zeros((2, 4), dtype=bool)                     # [L, H]
    pruned[0, 1] = True
    return teacher, prune_heads(teacher, pruned)[0]


def _edit(state: dict, how: str) -> dict:
    if how == "no-params":
        del state["params"]
    elif how == "step-text":
        state["step"] = "two"
    elif how == "step-negative":
        state["step"] = -3
    elif how == "tensor-shape":
        name = next(iter(state["params"]))
        state["params"][name] = torch.zeros(3, 3)
    elif how == "rng":
        state["rng"] = torch.zeros(5, dtype=torch.uint8)
    elif how == "optimizer":
        state["optimizer"] = {"state": 1}
    return state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The checkpoint a finished 2-step run leaves (written once; each case edits a copy)."""
    folder = tmp_path_factory.mktemp("resume")
    distill(*_pair(), IDS, CFG, checkpoint_dir=folder)
    return folder / D.CHECKPOINT_FILE


@pytest.mark.parametrize("how", ["no-params", "step-text", "step-negative", "tensor-shape", "rng", "optimizer"])
def test_an_edited_checkpoint_is_one_line(how, checkpoint, tmp_path):
    state = torch.load(checkpoint, weights_only=True)
    torch.save(_edit(state, how), tmp_path / D.CHECKPOINT_FILE)
    with pytest.raises(InputError, match=r"checkpoint .* is damaged or was edited .* delete it to start over"):
        distill(*_pair(), IDS, CFG, checkpoint_dir=tmp_path, resume=True)


def test_an_intact_checkpoint_still_resumes(checkpoint, tmp_path):
    shutil.copy(checkpoint, tmp_path / D.CHECKPOINT_FILE)
    resumed = distill(*_pair(), IDS, CFG, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 2
