"""End to end in a real headless Chromium: `streamlit run app.py` on a free local port, opened on the
built-in SmolLM2, the Prune page's sparsity slider moved with the keyboard, the redrawn mask grid and
the pruned count checked, screenshots saved under artifacts/ (gitignored).

Needs Debian's chromium at /usr/bin/chromium (scripts/setup.sh installs it when root); skipped with
the reason otherwise. Playwright drives it (`playwright install` cannot download here).
"""
from __future__ import annotations

import math
import re

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium

N_HEADS = 30 * 9          # SmolLM2-135M: 30 layers x 9 query heads

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]


def _no_exception_on_page(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


@pytest.mark.parametrize("page", [1100], indirect=True)
def test_prune_slider_moves_the_mask(server, page):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/prune?model=smollm2-135m&scorer=mp-g&z=2&sparsity=0.3&policy=global")
    start = math.floor(0.3 * N_HEADS + 1e-9)
    expect(page.locator(".hsm-t", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(1,
                                                                                         timeout=LOAD_TIMEOUT_MS)
    expect(page.locator('[data-testid="stMetricValue"]', has_text=f"{N_HEADS - start} / {N_HEADS}")).to_have_count(1)

    slider = page.locator('[data-testid="stSlider"]', has_text="Sparsity").get_by_role("slider")
    slider.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    moved = math.floor(0.33 * N_HEADS + 1e-9)
    expect(page.locator(".hsm-t", has_text=f"{moved} of {N_HEADS} heads pruned")).to_have_count(1, timeout=60_000)
    expect(page.locator(".hsm-t", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(0)
    # one grid (swapped in place, not a second one beside the old), with exactly the pruned cells red
    expect(page.locator(".hsm")).to_have_count(1)
    expect(page.locator(".hsm-g > .p")).to_have_count(moved)
    expect(page.locator('[data-testid="stMetricValue"]', has_text=f"{N_HEADS - moved} / {N_HEADS}")).to_have_count(1)
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
