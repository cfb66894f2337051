"""The code paths of other CPUs, reproduced on this one (docs/ARCHITECTURE.md, "Testing on other CPUs").

- torch, MKL and oneDNN take environment variables that force their AVX2 kernels
  (scripts/as_avx2.sh): the exactness tests whose bounds depend on float32 parts inside a float64
  model run again in a subprocess under them.
- ONNX Runtime reads CPUID itself, so its AVX2-only kernels are reached by running the process under
  qemu-user with an AVX2-only CPU model (Haswell: no AVX-512, no VNNI). There, the u8 x s8 integer
  kernel saturates (the cause of the garbage INT8 model on AMD EPYC Zen 3), and the INT8 file headscope
  writes (u8 weights) passes the same floor as its self-check. Skipped, with the reason, where
  qemu-user is missing (scripts/test.sh installs it).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.compress.export import export
from analysis.compress.export.selfcheck import CheckText, check_causal
from tests._tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
QEMU = shutil.which("qemu-x86_64")
needs_qemu = pytest.mark.skipif(QEMU is None or os.uname().machine != "x86_64",
                                reason="qemu-user (qemu-x86_64) is not installed; scripts/test.sh installs it")


def _emulated(*args, timeout=900) -> subprocess.CompletedProcess:
    """Run `python args...` under qemu-user as an AVX2-only x86 CPU (scripts/as_avx2.sh --emulate)."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "as_avx2.sh"), "--emulate", sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_float64_exactness_holds_on_torchs_avx2_kernels():
    """The cached-decode equalities, run again with torch / MKL / oneDNN on AVX2 (where the cached decode
    of a float64 model differs from its full forward by up to 1e-7, 0 on AVX-512: tests/_tolerance.py).
    The whole suite under the same variables is the recipe's (docs/ARCHITECTURE.md)."""
    tests = ["tests/test_surgery.py::test_generate_with_kv_cache_matches_masked"]
    env = {**os.environ, **AVX2_ENV}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


MATMUL_INTEGER = r"""
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
A = np.full((2, 64), 250, np.uint8)                           # activations near the top of u8
for name, B in (("s8", np.full((64, 4), 127, np.int8)), ("u8", np.full((64, 4), 255, np.uint8))):
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["A", "B"], ["Y"])], "g",
                              [helper.make_tensor_value_info("A", TensorProto.UINT8, [2, 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.INT32, [2, 4])],
                              initializer=[numpy_helper.from_array(B, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"A": A})[0]
    exact = A.astype(np.int64) @ B.astype(np.int64)
    print(name, int(np.abs(y - exact).max()))
"""


@needs_qemu
def test_onnx_runtime_u8_s8_kernel_saturates_on_avx2_and_u8_u8_does_not():
    """250 x 127 + 250 x 127 = 63,500 per pair: the AVX2 kernel clamps each pair to 32,767 (an error of
    64 x 30,733 / 2 per output); the u8 x u8 kernel adds in int32 and is exact."""
    run = _emulated("-c", MATMUL_INTEGER)
    assert run.returncode == 0, run.stderr[-2000:]
    errors = dict(line.split() for line in run.stdout.split("\n") if line.strip())
    assert int(errors["s8"]) > 0, run.stdout
    assert int(errors["u8"]) == 0, run.stdout


@needs_qemu
def test_the_int8_file_headscope_writes_is_right_on_an_avx2_only_cpu(tmp_path):
    """The onnx-int8 export of a tiny model, written here, run by ONNX Runtime under an AVX2-only CPU
    model next to its float32 file: it keeps the self-check's floor there too."""
    model = tiny_model("llama")
    pruned = np.zeros((2, 4), bool)
    fp32 = export("onnx", model, pruned, tmp_path, "fp32").path / "model.onnx"
    int8 = export("onnx-int8", model, pruned, tmp_path, "int8")
    floor = int8.checks[-1]["floor"]
    ids = np.random.default_rng(0).integers(0, 128, (2, 48), dtype=np.int64)            # [2, 48]
    np.save(tmp_path / "ids.npy", ids)
    outputs = {}
    for name, path in (("fp32", fp32), ("int8", int8.path / "model.onnx")):
        run = _emulated(str(ROOT / "tests" / "_ort_logits.py"), str(path), str(tmp_path / "ids.npy"),
                        str(tmp_path / f"{name}.npy"))
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[name] = np.load(tmp_path / f"{name}.npy")                             # [2, 48, V]
    rows = {name: iter(out) for name, out in outputs.items()}
    check = check_causal(lambda ids: next(rows["fp32"]), lambda ids: next(rows["int8"]),
                         CheckText(list(ids), "random ids"), bits=8, artifact_name="INT8 ONNX (emulated AVX2)",
                         reference_name="float32 ONNX (emulated AVX2)")
    assert check.agreement >= floor["agreement"] and check.perplexity_ratio <= floor["perplexity_ratio"], check
