"""Exports that check themselves (analysis/compress/export/selfcheck.py): every lossy file (INT8 ONNX,
GGUF below F32) is measured on this CPU against its float reference before it becomes the export; a
broken one is refused in one line with nothing left on disk, or replaced by a variant that passes.

The INT8 ONNX file must also be right on CPUs this machine is not: `saturating_matmuls` finds the
integer MatMuls an x86 CPU without VNNI would saturate (u8 x s8 pairs added into int16), the cause of
the garbage INT8 model on AVX2-only CPUs (docs/EXPORT.md, "INT8 on every CPU"); the shipped file has
none, the old variant (full-range s8 weights) is found.
"""
import json

import numpy as np
import pytest
import torch

from analysis.compress.export import FORMATS, export
from analysis.compress.export.gguf import format as gguf_format
from analysis.compress.export import onnx_int8
from analysis.compress.export.selfcheck import (FLOORS, SELF_CHECK_FILE, CheckText, SelfCheckFailed, check_causal,
                                                floor_for)
from tests._tiny import tiny_model
from tests._threads import one_torch_thread  # noqa: F401 (autouse)


def _broken(method):
    """The real quantizer, then every scale of the written file multiplied by 100 (a broken quantizer)."""
    def write(src, dst, block_size, keep_float=()):
        import onnx
        from onnx import numpy_helper
        method(src, dst, block_size, keep_float)
        proto = onnx.load(str(dst))
        for init in proto.graph.initializer:
            if "scale" in init.name:
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 100, init.name))
        onnx.save(proto, str(dst))
    return write


def _ops(path):
    import onnx
    return {n.op_type for n in onnx.load(str(path)).graph.node}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_int8_export_is_self_checked_and_portable(llama, tmp_path):
    import onnx
    result = export("onnx-int8", llama, np.zeros((2, 4), bool), tmp_path, "int8")
    checks = json.loads((result.path / SELF_CHECK_FILE).read_text())
    assert [c["passed"] for c in checks] == [True] and result.checks == checks
    assert any(line.startswith("self-check passed: INT8 ONNX (dynamic)") for line in result.notes)
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= _ops(result.path / "model.onnx")
    assert not (result.path / ".fp32").exists()
    # the written file is right on every x86 CPU: no u8 x s8 pair that could saturate without VNNI
    assert onnx_int8.saturating_matmuls(onnx.load(str(result.path / "model.onnx"))) == []


def test_saturation_check_finds_the_old_full_range_s8_variant(llama, tmp_path):
    """The variant that was garbage on AVX2-only CPUs (per-channel s8 weights, full range) is found;
    u8 weights and 7-bit s8 weights (reduce_range) are not."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    fp32 = export("onnx", llama, np.zeros((2, 4), bool), tmp_path, "fp32").path / "model.onnx"
    nodes, _ = onnx_int8.weight_matmuls(onnx.load(str(fp32)))
    found = {}
    for name, kwargs in {"s8": dict(weight_type=QuantType.QInt8),
                         "s8-7bit": dict(weight_type=QuantType.QInt8, reduce_range=True),
                         "u8": dict(weight_type=QuantType.QUInt8)}.items():
        with onnx_int8.quiet_logs():
            quantize_dynamic(str(fp32), str(tmp_path / f"{name}.onnx"), nodes_to_quantize=nodes, per_channel=True,
                             **kwargs)
        found[name] = onnx_int8.saturating_matmuls(onnx.load(str(tmp_path / f"{name}.onnx")))
    assert len(found["s8"]) == len(nodes) and found["s8-7bit"] == [] and found["u8"] == []


def test_a_broken_int8_quantizer_is_refused_and_nothing_is_left(llama, tmp_path, monkeypatch):
    for method in ("dynamic", "weight-only"):
        monkeypatch.setitem(onnx_int8.ONNX_METHODS, method, _broken(onnx_int8.ONNX_METHODS[method]))
    with pytest.raises(SelfCheckFailed) as err:
        export("onnx-int8", llama, np.zeros((2, 4), bool), tmp_path, "int8")
    message = str(err.value)
    assert "\n" not in message and message.startswith("self-check FAILED: INT8 ONNX (weight-only)")
    assert "Nothing was written" in message
    assert list(tmp_path.iterdir()) == []                 # no export, no temporary folder


def test_a_broken_integer_route_falls_back_to_weight_only_and_says_so(llama, tmp_path, monkeypatch):
    monkeypatch.setitem(onnx_int8.ONNX_METHODS, "dynamic", _broken(onnx_int8.ONNX_METHODS["dynamic"]))
    result = export("onnx-int8", llama, np.zeros((2, 4), bool), tmp_path, "int8")
    assert [(c["artifact"], c["passed"]) for c in result.checks] == [("INT8 ONNX (dynamic)", False),
                                                                    ("INT8 ONNX (weight-only)", True)]
    assert result.notes[0].startswith("self-check FAILED") and result.notes[1].startswith("self-check passed")
    assert "MatMulNBits" in _ops(result.path / "model.onnx")


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0"])
def test_gguf_of_a_quantized_type_is_self_checked(llama, tmp_path, gguf_type):
    result = export("gguf", llama, np.zeros((2, 4), bool), tmp_path, gguf_type, gguf_type=gguf_type)
    assert [c["passed"] for c in result.checks] == [True]
    assert result.checks[0]["floor"] == dict(vars(floor_for(8 if gguf_type == "q8_0" else 4)))


def test_f32_gguf_is_lossless_and_not_checked(llama, tmp_path):
    result = export("gguf", llama, np.zeros((2, 4), bool), tmp_path, "f32", gguf_type="f32")
    assert result.checks == [] and not (result.path / SELF_CHECK_FILE).exists()


def test_a_broken_gguf_quantization_is_refused_and_nothing_is_left(llama, tmp_path, monkeypatch):
    """A writer whose weights come out 100x too large (the scales of a broken quantizer)."""
    real = gguf_format.write_gguf

    def broken(model, layout, path, **kwargs):
        import copy
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                if p.dim() == 2:
                    p.mul_(100)
        return real(twin, layout, path, **kwargs)

    monkeypatch.setattr(gguf_format, "write_gguf", broken)
    with pytest.raises(SelfCheckFailed) as err:
        export("gguf", llama, np.zeros((2, 4), bool), tmp_path, "q8", gguf_type="q8_0")
    assert "\n" not in str(err.value) and str(err.value).startswith("self-check FAILED: GGUF q8_0")
    assert list(tmp_path.iterdir()) == []


def _text(*windows):
    return CheckText([np.asarray(w, dtype=np.int64) for w in windows], "test windows")


def test_check_causal_needs_both_agreement_and_perplexity():
    """A reference that predicts every next token of a chain: an artifact that predicts another token
    everywhere fails on agreement; one that agrees but is 3x less sure of every answer fails on
    perplexity; the reference itself passes (agreement 1, ratio 1)."""
    vocab, ids = 16, np.arange(12) % 16                                 # the chain t -> t + 1
    good = np.full((12, vocab), -5.0)
    good[np.arange(12), (ids + 1) % vocab] = 5.0                         # [T, V]
    cases = {"wrong": np.roll(good, 1, axis=1), "unsure": good / 3, "same": good}
    checks = {name: check_causal(lambda x: good[: len(x)], lambda x, a=art: a[: len(x)], _text(ids), bits=8,
                                 artifact_name=name, reference_name="r") for name, art in cases.items()}
    assert checks["wrong"].agreement == 0 and not checks["wrong"].passed
    assert checks["unsure"].agreement == 1 and checks["unsure"].perplexity_ratio > 1.1 and not checks["unsure"].passed
    assert checks["same"].passed and checks["same"].perplexity_ratio == pytest.approx(1.0)
    assert checks["same"].reference_accuracy == pytest.approx(1.0)


def test_floors_tighten_with_more_bits_and_every_lossy_format_names_its_bits():
    bits = sorted(FLOORS)
    assert all(FLOORS[a].agreement < FLOORS[b].agreement and FLOORS[a].perplexity_ratio > FLOORS[b].perplexity_ratio
               for a, b in zip(bits, bits[1:]))
    assert floor_for(5) == FLOORS[4] and floor_for(6) == FLOORS[6]
    assert "onnx-int8" in FORMATS


# (SmolLM2's INT8 export, self-checked on its own held-back tokens: tests/test_quantize.py, beside the other
# SmolLM2 INT8 test, the two sharing one float32 trace.)


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_k_m"])
def test_streamed_gguf_is_self_checked_against_its_f32_in_llama_cpp(tmp_path, gguf_type):
    """export --checkpoint builds no model: the quantized file is measured against an F32 GGUF of the
    same cut (a temporary, gone afterwards) in llama.cpp."""
    from analysis.compress.export.streamed import export_checkpoint
    from tests.test_streamed_export import _checkpoint
    _, ckpt = _checkpoint(tmp_path, "llama")
    result = export_checkpoint("gguf", ckpt, np.zeros((2, 4), bool), tmp_path / "out", gguf_type=gguf_type)
    assert [(c["reference"], c["passed"]) for c in result.checks] == [("the F32 GGUF in llama.cpp", True)]
    assert sorted(p.name for p in result.path.iterdir() if "tmp" in p.name) == []
