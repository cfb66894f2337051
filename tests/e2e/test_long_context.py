"""The Long context page in a real headless Chromium at 1280x800 on the built-in SmolLM2: opened from the
sidebar, the plan grid edited with the keyboard only (arrows, Enter, type the mode, Enter) changes the KV
memory, the counts and the URL to the library's numbers for that plan; the plan survives switching pages
(the Export page offers it) and a reload. Screenshots: artifacts/e2e_long_context*.png."""
from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest

from analysis.arch.kvplan import MODES
from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.serving import SETTLED

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]
CONTEXT = 4096                      # the page's default for SmolLM2 (it reads 8,192)
ROW_PX, INDEX_PX = 35, 52           # the grid's row height and index column (components/longctx.py)


def _settled(page, timeout_ms: int = 60_000) -> None:
    from playwright.sync_api import expect
    for _ in range(3):
        page.wait_for_timeout(400)
        expect(page.locator(SETTLED)).to_have_count(1, timeout=timeout_ms)


def _metric(page, label: str):
    return page.get_by_test_id("stMetric").filter(has_text=label).first.get_by_test_id("stMetricValue")


def _expected(modes) -> tuple[str, str]:
    """(KV cache, counts) the page must show for modes [30, 3] at the default band and context."""
    from analysis.arch.kvplan import KVPlan
    from components.longctx import size_words
    plan = KVPlan(np.asarray(modes, np.int8), n_heads=9)
    c = plan.counts()
    return size_words(plan.kv_bytes(CONTEXT, head_dim=64)), f"{c['full']} / {c['window']} / {c['prune']}"


def _edit(page, row: int, col: int, mode: str) -> None:
    """Keyboard only, once the grid has focus: move to (row, col) from the top-left data cell, Enter opens
    the cell's choice box, typing the mode filters it, Enter picks it."""
    grid = page.get_by_test_id("stDataFrame").first
    box = grid.bounding_box()
    page.mouse.click(box["x"] + INDEX_PX + 40, box["y"] + ROW_PX + ROW_PX / 2)      # focus: layer 0, KV head 0
    page.wait_for_timeout(400)                             # the grid takes the focus before the arrows
    for _ in range(row):
        page.keyboard.press("ArrowDown")
        page.wait_for_timeout(100)
    for _ in range(col):
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(100)
    page.keyboard.press("Enter")
    _shown(page.get_by_role("option").first)               # the choice box is open (a loaded machine is slow)
    page.keyboard.type(mode)
    _shown(page.get_by_role("option", name=mode, exact=True).first)   # filtered to the mode: Enter picks it
    page.keyboard.press("Enter")


def _shown(locator, timeout_ms: int = 10_000) -> None:
    """Wait for `locator` to be visible; if it never is, go on (the edit's own check then fails or retries)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        locator.wait_for(state="visible", timeout=timeout_ms)
    except PlaywrightTimeout:
        pass


def _edit_until(page, row: int, col: int, mode: str, counts: str, tries: int = 2) -> None:
    """_edit, then wait for the counts metric; on a loaded machine a key press that lands while the grid is
    still mounting (just after a reload) is lost, so the edit is typed once more after the page settles (at
    most `tries` times: an edit the page never takes still fails)."""
    from playwright.sync_api import expect
    for attempt in range(tries):
        _edit(page, row, col, mode)
        try:
            expect(_metric(page, "Full / window / prune")).to_have_text(counts, timeout=30_000)
            return
        except AssertionError:
            if attempt == tries - 1:
                raise
            _settled(page)


def _query(page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlparse(page.url).query).items()}


@pytest.mark.parametrize("page", [800], indirect=True)
def test_keyboard_edits_change_the_kv_memory_and_page_switches_keep_the_plan(server, page):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{server}/?model=smollm2-135m")
    nav = page.get_by_test_id("stSidebarNav")
    nav.get_by_role("link", name="Long context", exact=True).click()
    expect(page.get_by_role("heading", name="Long context", level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    modes = np.zeros((30, 3), np.int8)
    kv, counts = _expected(modes)
    expect(_metric(page, "KV cache at 4,096 tokens")).to_have_text(kv, timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    for row, col, mode in ((1, 0, "window"), (2, 2, "prune")):
        _edit(page, row, col, mode)
        modes[row, col] = MODES.index(mode)
        kv, counts = _expected(modes)
        expect(_metric(page, "KV cache at 4,096 tokens")).to_have_text(kv, timeout=60_000)
        expect(_metric(page, "Full / window / prune")).to_have_text(counts)
        _settled(page)
    link = "fff.wff.ffp." + ".".join(["fff"] * 27)
    assert _query(page)["kv"] == link and _query(page)["plan"] == "edited"
    assert page.get_by_test_id("stException").count() == 0
    page.screenshot(path=str(ARTIFACTS / "e2e_long_context.png"))
    for name in ("Prune", "Export", "Walkthrough", "Long context"):             # the plan stays in the view
        nav.get_by_role("link", name=name, exact=True).click()
        expect(page.get_by_role("heading", name=name, level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
        _settled(page)
        assert _query(page)["kv"] == link, name
        if name == "Export":
            expect(page.get_by_text(re.compile(r"^The KV plan of the Long context page: 88 full, 1 windowed"))
                   ).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "e2e_long_context_export.png"))
    expect(_metric(page, "KV cache at 4,096 tokens")).to_have_text(kv, timeout=60_000)
    expect(_metric(page, "Full / window / prune")).to_have_text(counts)
    page.reload()                                                                 # the URL alone brings it back
    expect(_metric(page, "Full / window / prune")).to_have_text(counts, timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    modes[1, 0] = 0
    kv, counts = _expected(modes)
    _edit_until(page, 1, 0, "full", counts)                                       # and the grid edits on from it
    expect(_metric(page, "KV cache at 4,096 tokens")).to_have_text(kv)
    assert page.get_by_test_id("stException").count() == 0
    page.screenshot(path=str(ARTIFACTS / "e2e_long_context_after.png"))
