"""Nothing after the one error line, issue 47 item 4 class 4: after an error or a Ctrl-C in a GGUF export or the
pipeline, stderr is the error line alone, also with Python's warnings on (-W default).

Before the fix: `ResourceWarning: unclosed file <... name='/dev/null'>` at exit (llama-cpp-python opens /dev/null
twice when imported and never closes it; analysis.compress.export.gguf.llamacpp.llama_cpp_module now closes them
at exit), and the gguf writer's own INFO lines ("gguf: This GGUF file is for Little Endian only") once the
pipeline's weight-only INT8 had imported ONNX Runtime's MatMulNBits quantizer, whose import calls
logging.basicConfig(level=INFO) (analysis.compress.export.onnx_int8.quiet_logs now leaves the root logger as it
was). Each case is a real process: both appear only as the process ends or across the whole run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *argv, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -W default -c code argv...` from the repository, offline; stdout and stderr as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-W", "default", "-c", code, *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_llama_cpp_leaves_no_unclosed_file_at_exit():
    done = _python("import sys\nfrom analysis.compress.export.gguf.llamacpp import llama_cpp_module\n"
                   "llama_cpp_module()\nsys.exit(2)")
    assert done.returncode == 2 and done.stderr == "", done.stderr


# The CLI with Ctrl-C as llama.cpp has just loaded the written GGUF file for its self-check (the signal sent by
# the process itself at that moment, so the case is the same on every run), after the pipeline's weight-only
# INT8 quantizer was imported as the pipeline imports it: the gguf writer's INFO lines (before the self-check)
# and the unclosed /dev/null files (at exit) would both follow the error line.
CTRL_C_IN_GGUF_EXPORT = """
import os, signal, sys
from analysis.compress.export.onnx_int8 import quiet_logs
with quiet_logs():
    import onnxruntime.quantization.matmul_nbits_quantizer
from analysis.compress.export.gguf import llamacpp
real_load = llamacpp.load
def load_then_ctrl_c(*args, **kwargs):
    llm = real_load(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    return llm
llamacpp.load = load_then_ctrl_c
from analysis.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_in_a_gguf_export_is_one_line(tmp_path):
    from tests._apptools import tiny_model_dir
    model = tiny_model_dir(tmp_path / "tiny", num_hidden_layers=2)
    out = tmp_path / "exports"
    out.mkdir()
    done = _python(CTRL_C_IN_GGUF_EXPORT, "export", "--quiet", "--model", model, "--scorer", "magnitude",
                   "--sparsity", "0.25", "--export-format", "gguf", "--gguf-type", "q8_0", "--out-dir", out,
                   "--name", "cut")
    assert done.returncode == 130, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: interrupted"), done.stderr
    assert list(out.iterdir()) == []
