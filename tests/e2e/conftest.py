"""Shared fixtures of the real-browser tests: `streamlit run app.py` on a free local port (module
scope), Debian's Chromium through Playwright, one fresh tab per test, the artifacts folder.

Needs Debian's chromium at /usr/bin/chromium (scripts/setup.sh installs it when root); the tests
are skipped with the reason otherwise. Playwright drives it (`playwright install` cannot download).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOAD_TIMEOUT_MS = 180_000  # the first page load may convert the GGUF file (about 20 s) and profile it


def needs_chromium():
    return pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                              "/usr/bin/chromium (run scripts/setup.sh as root, or apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def export_root(tmp_path_factory) -> Path:
    """Where the served app exports to (HEADSCOPE_EXPORT_ROOT of the server)."""
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="session")
def server(builtin_cache_dir, tmp_path_factory, export_root):
    """`streamlit run app.py` on 127.0.0.1:<free port>; yields the base URL once /_stcore/health is ok."""
    port = _free_port()
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {**os.environ, "HEADSCOPE_CACHE": str(builtin_cache_dir), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HEADSCOPE_EXPORT_ROOT": str(export_root)}
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
           "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as reply:
                    if reply.read().decode().strip() == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"streamlit did not become healthy; log:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    """A fresh browser tab; tall (the whole page in one screenshot) unless the test says otherwise."""
    height = getattr(request, "param", 2400)
    context = browser.new_context(viewport={"width": 1500, "height": height})
    pg = context.new_page()
    yield pg
    context.close()
