"""The cold first load (issue 20 item 7) in a real headless Chromium at 1280x800, with an empty model
cache: the bar moves during the one-time GGUF conversion of SmolLM2 (per tensor; before, it sat at one
value for the whole 'building the model' step), the page's Stop ends the conversion and leaves no
cache or temporary folder behind, and 'Load it again' converts it and the page works.
"""
from __future__ import annotations

import re
import time

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.serving import served_app
from tests.e2e.test_journeys import _arrive

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]

TENSOR = re.compile(r"dequantizing GGUF tensor (\d+)/(\d+)")


@pytest.fixture
def cold_server(tmp_path):
    """The app served with an empty HEADSCOPE_CACHE (so the first load converts)."""
    cache = tmp_path / "cache"
    try:
        with served_app(tmp_path / "server.log", {"HEADSCOPE_CACHE": str(cache)}) as base:
            yield base, cache
    except RuntimeError as err:
        pytest.fail(str(err))


def _bars(page) -> list[tuple[float, str]]:
    """(value, text) of each progress bar on the page now."""
    out = []
    for bar in page.get_by_test_id("stProgress").all():
        try:
            value = bar.get_by_role("progressbar").get_attribute("aria-valuenow", timeout=500)
            out.append((float(value or "nan"), bar.inner_text(timeout=500)))
        except Exception:  # noqa: BLE001 - the bar went away between the two reads
            pass
    return out


def test_cold_load_moves_the_bar_and_stop_leaves_no_cache(cold_server, browser):
    from playwright.sync_api import expect
    base, cache = cold_server
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    try:
        page.goto(f"{base}/?model=smollm2-135m")
        tensors: dict[int, float] = {}          # tensor number -> bar value when it was shown
        deadline = time.monotonic() + LOAD_TIMEOUT_MS / 1000
        while len(tensors) < 5 and time.monotonic() < deadline:
            for value, text in _bars(page):
                match = TENSOR.search(text)
                if match and "Loading smollm2-135m" in text:
                    tensors.setdefault(int(match.group(1)), value)
            page.wait_for_timeout(50)
        ARTIFACTS.mkdir(exist_ok=True)                  # an untracked e2e_* shot, like the other e2e tests:
        page.screenshot(path=str(ARTIFACTS / "e2e_cold_load_converting.png"))   # a test run leaves the tree clean
        assert len(tensors) >= 5, f"the bar showed {len(tensors)} tensors of the conversion: {tensors}"
        steps = [tensors[k] for k in sorted(tensors)]
        # the bar's value is a whole percent, so neighbouring tensors may share one
        assert steps == sorted(steps) and steps[0] < steps[-1], f"the bar did not move with the tensors: {tensors}"
        page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop").click()
        expect(page.get_by_text(re.compile("Loading smollm2-135m was cancelled"))).to_be_visible(timeout=60_000)
        again = page.get_by_role("button", name="Load it again")
        expect(again).to_be_visible()
        models = cache / "models"
        for _ in range(50):                     # the stopped thread removes its temporary folder
            if not models.exists() or not any(models.iterdir()):
                break
            time.sleep(0.2)
        assert not models.exists() or not list(models.iterdir()), list(models.iterdir())
        again.click()
        _arrive(page, "model")
        assert (models / "smollm2-135m" / "headscope-builtin.json").is_file()
        assert page.get_by_test_id("stException").count() == 0
    finally:
        context.close()
