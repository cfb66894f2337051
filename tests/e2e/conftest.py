"""Shared fixtures of the real-browser tests: `streamlit run app.py` on a free local port (one per
test session, tests/e2e/serving.py), Debian's Chromium through Playwright, one fresh tab per test, the artifacts folder.

Needs Debian's chromium at /usr/bin/chromium (scripts/setup.sh installs it when root); the tests
are skipped with the reason otherwise. Playwright drives it (`playwright install` cannot download).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.serving import CHROMIUM, ROOT, chromium, served_app

ARTIFACTS = ROOT / "artifacts"
LOAD_TIMEOUT_MS = 180_000  # the first page load may convert the GGUF file (10 s to minutes) and profile it


def needs_chromium():
    return pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at "
                              "/usr/bin/chromium (run scripts/setup.sh as root, or apt-get install chromium)")


@pytest.fixture(scope="session")
def export_root(tmp_path_factory) -> Path:
    """Where the served app exports to (HEADSCOPE_EXPORT_ROOT of the server)."""
    return tmp_path_factory.mktemp("exports")


@pytest.fixture(scope="session")
def server(builtin_cache_dir, tmp_path_factory, export_root):
    """`streamlit run app.py` on 127.0.0.1:<free port>; yields the base URL once it is healthy."""
    log = tmp_path_factory.mktemp("streamlit") / "server.log"
    env = {"HEADSCOPE_CACHE": str(builtin_cache_dir), "HEADSCOPE_EXPORT_ROOT": str(export_root)}
    try:
        with served_app(log, env) as base:
            yield base
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, request):
    """A fresh browser tab; tall (the whole page in one screenshot) unless the test says otherwise."""
    height = getattr(request, "param", 2400)
    context = browser.new_context(viewport={"width": 1500, "height": height})
    pg = context.new_page()
    yield pg
    context.close()
