"""components/tools.py: while llama.cpp builds in the background (scripts/setup.sh --app), the features
that need it say why they wait and how far the build is; the Export page's GGUF export below F32 and
the deployment report wait for it, everything else works."""
import os
import sys

import pytest

from tests._apptools import fresh_caches, new_app, no_exception, out_root, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


@pytest.fixture
def no_llama(monkeypatch, tmp_path):
    """llama_cpp not importable, and the build files in a folder of this test."""
    import importlib.util

    from components import tools
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    for attr, name in (("LLAMA_LOG", "llama-build.log"), ("LLAMA_PID", "llama-build.pid"), ("LLAMA_RC", "llama-build.rc")):
        monkeypatch.setattr(tools, attr, tmp_path / name)
    return tools


def test_a_running_build_says_how_far_it_is(no_llama):
    no_llama.LLAMA_PID.write_text(str(os.getpid()))
    no_llama.LLAMA_LOG.write_bytes(b"[ 10%] Building C object\n[ 42%] Building CXX object ggml.cpp.o\n")
    words = no_llama.llama_missing()
    assert "being built in the background" in words and "compiling: 42%" in words
    assert "deployment report" in words and "Everything else works now" in words


def test_a_failed_or_absent_build_says_what_to_run(no_llama):
    no_llama.LLAMA_RC.write_text("1\n")
    assert "failed" in no_llama.llama_missing() and str(no_llama.LLAMA_LOG) in no_llama.llama_missing()
    no_llama.LLAMA_RC.unlink()
    assert "not installed" in no_llama.llama_missing() and "scripts/setup.sh" in no_llama.llama_missing()


def test_llama_is_found_when_installed():
    from components import tools
    pytest.importorskip("llama_cpp")
    assert tools.llama_missing() == ""


def test_gguf_below_f32_waits_for_llama_and_other_formats_do_not(no_llama, tiny_dir, out_root):
    from components import tools
    assert tools.gguf_needs_llama("gguf", {"gguf_type": "q4_k_m"}) and tools.gguf_needs_llama("gguf", {})
    assert not tools.gguf_needs_llama("gguf", {"gguf_type": "f32"}) and not tools.gguf_needs_llama("pruned", {})
    at = new_app(tiny_dir, page="export", policy="global")
    at.selectbox(key="hs.w.export.format").set_value("gguf").run()
    no_exception(at)
    assert any("not installed" in i.value for i in at.info) and at.button(key="export.run").disabled
    at.selectbox(key="hs.w.export.format").set_value("pruned").run()
    assert not at.button(key="export.run").disabled
