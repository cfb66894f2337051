"""A deferred load (analysis.arch.models.load_deferred: config, tokenizer, no model built, no weights read)
names the same model as load_model: the same stored results' fingerprint, geometry, kind and placement, and
`materialize` gives weights bit-identical to load_model's (tied embeddings, the rotary buffers); the commands that
find every result stored (kv-plan --rows probes, longctx --kv-plan) then read no weights at all, and load them on
a miss."""
import json

import numpy as np
import pytest
import torch

from tests._apptools import long_tiny, results_store  # noqa: F401 (fixtures)
from tests._input_checks import run_captured
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

LENGTH = 320
WINDOW = ("--sinks", 2, "--recent", 16)


def _same_tensors(a, b) -> None:
    """Every parameter and buffer of `a` equals `b`'s bit for bit (names, dtypes, shapes, values)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and sa[name].shape == sb[name].shape, name
        assert torch.equal(sa[name], sb[name]), name
    for (na, ba), (nb, bb) in zip(a.named_buffers(), b.named_buffers()):   # inv_freq is not in the state dict
        assert na == nb and torch.equal(ba, bb), na


def test_deferred_builtin_is_the_loaded_one(smollm2, builtin_cache_dir):
    from analysis.arch.models import load_deferred, materialize
    from analysis.arch.stored import model_fingerprint
    lazy = load_deferred("smollm2-135m", cache_dir=builtin_cache_dir)
    assert lazy.model is None and lazy.config.model_type == "llama"
    assert model_fingerprint(lazy) == model_fingerprint(smollm2)
    assert (lazy.geometry, lazy.kind, lazy.source, lazy.source_dtype, lazy.dtype, lazy.device) == (
        smollm2.geometry, smollm2.kind, smollm2.source, smollm2.source_dtype, smollm2.dtype, smollm2.device)
    assert lazy.placement.describe() == smollm2.placement.describe()
    assert lazy.tokenizer("a pass key").input_ids == smollm2.tokenizer("a pass key").input_ids
    real = materialize(lazy)
    assert real is not smollm2 and real.deferred is None and materialize(real) is real
    _same_tensors(real.model, smollm2.model)
    assert real.model.lm_head.weight is real.model.model.embed_tokens.weight      # still tied
    assert lazy.model is None and lazy.deferred is not None                       # the deferred one unchanged


def test_deferred_tiny_model_materializes_as_loaded(long_tiny):
    from analysis.arch.models import is_weights_only, load_deferred, load_model, materialize
    from analysis.arch.stored import model_fingerprint
    lazy, loaded = load_deferred(str(long_tiny)), load_model(str(long_tiny))
    assert model_fingerprint(lazy) == model_fingerprint(loaded) and not is_weights_only(lazy)
    again = load_deferred(str(long_tiny))                       # the built model's facts read back, not rebuilt
    assert model_fingerprint(again) == model_fingerprint(loaded) and again.attention == "sdpa"
    _same_tensors(materialize(lazy).model, loaded.model)


def _json(capsys, *argv) -> dict:
    code, out, err = run_captured(capsys, *argv, "--quiet")
    assert code == 0, err
    return json.loads(out)


def _no_weights(monkeypatch):
    """load_model raises: a command that reads its weights fails."""
    import analysis.arch.models as models

    def refused(*args, **kwargs):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(models, "load_model", refused)


def test_stored_commands_read_no_weights(long_tiny, results_store, capsys, tmp_path, monkeypatch):
    plan = tmp_path / "kv_plan.json"
    kv = ("kv-plan", "--model", long_tiny, "--rows", "probes", "--lengths", LENGTH, *WINDOW, "--window-share", 0.5,
          "--prune-share", 0.25, "--prune-tokens", 64, "--out", plan)
    lc = ("longctx", "--model", long_tiny, "--lengths", LENGTH, "--items", 2, "--probe", "passkey", "--kv-plan", plan)
    first = _json(capsys, *kv)                                      # misses: measured (the weights loaded on the miss)
    assert first["stored"] == {"scan": "miss", "importance": "miss"}
    written = plan.read_text()
    lc_first = _json(capsys, *lc)
    assert lc_first["stored"] == {"dense": "miss", "cut": "miss"}    # kv-plan scored calibration rows, not these
    with monkeypatch.context() as m:
        _no_weights(m)
        again = _json(capsys, *kv)
        lc_again = _json(capsys, *lc)
    assert again["stored"] == {"scan": "hit", "importance": "hit"} and plan.read_text() == written
    assert again["plan"] == first["plan"] and again["kv_bytes"] == first["kv_bytes"]
    assert lc_again["stored"] == {"dense": "hit", "cut": "hit"}
    assert lc_again["report"]["cells"] == lc_first["report"]["cells"]
    drop = lambda scores: {k: v for k, v in scores.items() if k != "seconds"}     # noqa: E731 (the time taken)
    np.testing.assert_equal(drop(again["scores"]), drop(first["scores"]))
