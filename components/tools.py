"""Tools the app can open without: llama.cpp (llama-cpp-python), which `scripts/run_app.sh` builds in the
background (`scripts/setup.sh --app`: ~10-15 minutes on 2 cores), so the app opens in minutes.

`llama_missing()` is "" once llama_cpp imports, else one line saying why the features that need it wait
(a GGUF file below F32: its self-check runs it in llama.cpp, and llama.cpp's quantizer makes the
k-quants; the deployment report) and how far the background build is (the last "[ NN%]" of its log,
the minutes since it started), or that it failed (the log's path), or how to install it.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

VENV = Path(sys.prefix)
LLAMA_LOG, LLAMA_PID, LLAMA_RC = (VENV / name for name in ("llama-build.log", "llama-build.pid", "llama-build.rc"))
NEEDS_LLAMA = ("a GGUF file below F32 (its self-check runs the file in llama.cpp; llama.cpp's quantizer makes the "
               "k-quants) and the deployment report")
_PERCENT = re.compile(rb"\[\s*(\d+)%\]")


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def _build_percent() -> int | None:
    """The last "[ NN%]" cmake printed in the background build's log (its tail only)."""
    try:
        with open(LLAMA_LOG, "rb") as f:
            f.seek(max(0, LLAMA_LOG.stat().st_size - 65536))
            found = _PERCENT.findall(f.read())
    except OSError:
        return None
    return int(found[-1]) if found else None


def llama_missing() -> str:
    """'' when llama.cpp can be used here, else why not and what is happening about it (one line)."""
    importlib.invalidate_caches()                  # a background build may have finished since the last look
    if importlib.util.find_spec("llama_cpp") is not None:
        return ""
    if LLAMA_PID.exists() and _alive(LLAMA_PID):
        minutes = (time.time() - LLAMA_PID.stat().st_mtime) / 60
        percent = _build_percent()
        done = f", compiling: {percent}%" if percent is not None else ", preparing the build"
        return (f"llama.cpp is being built in the background (started {minutes:.0f} min ago{done}; about 10-15 "
                f"minutes on 2 cores in all): {NEEDS_LLAMA} wait until it is there. Everything else works now.")
    if LLAMA_RC.exists() and LLAMA_RC.read_text().strip() not in ("", "0"):
        return (f"The background build of llama.cpp failed (see {LLAMA_LOG}); {NEEDS_LLAMA} need it. Run "
                "`bash scripts/setup.sh` to build it in the foreground and see why.")
    return (f"llama.cpp (llama-cpp-python) is not installed here; {NEEDS_LLAMA} need it. Run `bash scripts/setup.sh` "
            "(it builds it, ~10-15 minutes on 2 cores).")


def gguf_needs_llama(fmt: str, options: dict) -> bool:
    """Whether writing `fmt` with `options` runs llama.cpp (a GGUF file below F32)."""
    if fmt != "gguf":
        return False
    from analysis.compress.export.gguf.format import is_lossy
    return is_lossy(options.get("gguf_type", "f16"))
