"""End to end in a real headless Chromium: `streamlit run app.py` on a free local port, opened on the
built-in SmolLM2, the Prune page's sparsity slider moved with the keyboard, the redrawn heatmap and
the pruned count checked, screenshots saved under artifacts/ (gitignored).

Needs Debian's chromium at /usr/bin/chromium (scripts/setup.sh installs it when root); skipped with
the reason otherwise. Playwright drives it (`playwright install` cannot download here).
"""
from __future__ import annotations

import math
import os
import re
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
N_HEADS = 30 * 9          # SmolLM2-135M: 30 layers x 9 query heads
LOAD_TIMEOUT_MS = 180_000  # the first page load may convert the GGUF file (about 20 s) and profile it

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                                 "/usr/bin/chromium (run scripts/setup.sh as root, or apt-get install chromium)")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(builtin_cache_dir, tmp_path_factory):
    """`streamlit run app.py` on 127.0.0.1:<free port>; yields the base URL once /_stcore/health is ok."""
    port = _free_port()
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {**os.environ, "HEADSCOPE_CACHE": str(builtin_cache_dir), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HEADSCOPE_EXPORT_ROOT": str(tmp_path_factory.mktemp("exports"))}
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


@pytest.fixture(scope="module")
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


def _no_exception_on_page(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


@pytest.mark.parametrize("page", [1100], indirect=True)
def test_prune_slider_moves_the_mask(server, page):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/prune?model=smollm2-135m&scorer=mp-g&z=2&sparsity=0.3")
    start = math.floor(0.3 * N_HEADS + 1e-9)
    expect(page.locator(".gtitle", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(1,
                                                                                          timeout=LOAD_TIMEOUT_MS)
    expect(page.locator('[data-testid="stMetricValue"]', has_text=f"{start} / {N_HEADS}")).to_have_count(1)

    slider = page.locator('[data-testid="stSlider"]', has_text="Sparsity").get_by_role("slider")
    slider.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    moved = math.floor(0.33 * N_HEADS + 1e-9)
    expect(page.locator(".gtitle", has_text=f"{moved} of {N_HEADS} heads pruned")).to_have_count(1, timeout=60_000)
    expect(page.locator(".gtitle", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(0)
    expect(page.locator('[data-testid="stMetricValue"]', has_text=f"{moved} / {N_HEADS}")).to_have_count(1)
    expect(page).to_have_url(re.compile(r"sparsity=0\.33"))
    _no_exception_on_page(page)
    page.screenshot(path=str(ARTIFACTS / "e2e_prune.png"), full_page=True)


@pytest.mark.parametrize("name,ready", [("model", "Parameters"), ("profiles", "rows above tau"),
                                        ("compare", "Jaccard"), ("heads", "Layer 0, head 0 (KV group 0)"),
                                        ("export", "Download mask.json")])
def test_every_page_renders(server, page, name, ready):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    path = "" if name == "model" else name          # the default page lives at the root URL
    page.goto(f"{server}/{path}?model=smollm2-135m&sparsity=0.3")
    expect(page.get_by_text(ready).first).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    page.wait_for_timeout(1000)  # let the remaining charts draw before the screenshot
    _no_exception_on_page(page)
    assert page.get_by_text("Page not found").count() == 0
    page.screenshot(path=str(ARTIFACTS / f"e2e_{name}.png"), full_page=True)
