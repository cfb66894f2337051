"""Serving the app for real-browser tests and benchmarks: `streamlit run app.py` on a free local
port (health-checked), and Debian's Chromium through Playwright. Plain context managers, so the
pytest fixtures (tests/e2e/conftest.py) and bench/bench_browser.py share one implementation."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HEALTH_TIMEOUT_S = 90
# The app root while no script runs (Streamlit's own test attribute; the header's "Running..." widget
# is hidden by .streamlit/config.toml, so tests wait on this instead)
SETTLED = '[data-testid="stApp"][data-test-script-state="notRunning"]'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served(str):
    """The base URL of a served app (a str), with the server's process id (`pid`: its CPU time is read
    from /proc by the benchmarks)."""
    pid: int


@contextmanager
def served_app(log: Path, env: dict[str, str] | None = None):
    """Yields the base URL of `streamlit run app.py` once /_stcore/health answers ok (a `Served`: with .pid).

    RuntimeError (with the log's tail) when it does not become healthy in HEALTH_TIMEOUT_S."""
    port = free_port()
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.address", "127.0.0.1",
           "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT)
    base = Served(f"http://127.0.0.1:{port}")
    base.pid = proc.pid
    try:
        deadline = time.time() + HEALTH_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{base}/_stcore/health", timeout=2) as reply:
                    if reply.read().decode().strip() == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"streamlit did not become healthy; log:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def chromium():
    """Yields a Playwright Browser of Debian's Chromium (closed afterwards)."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
