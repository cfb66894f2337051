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
    """The script's run has ended. Called only after waiting for what the action changes (a heading, a metric's
    text, a cell's value), so the run that action started has begun: no fixed sleep."""
    from playwright.sync_api import expect
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


def _cell(page, row: int, col: int):
    """The grid's cell of layer `row`, KV head `col` in glide-data-grid's accessible table behind the canvas
    (its column 0 is the layer index); the grid's current cell is the focused one."""
    return page.get_by_test_id("stDataFrame").first.get_by_test_id(f"glide-cell-{col + 1}-{row}")


def _until_focused(page, act, cell, came_from=None, tries: int = 2) -> None:
    """`act()` (a click or a key), then wait for `cell` to take the focus. A press the browser drops (a loaded
    machine, the grid still mounting) leaves the focus where it was (`came_from`, or no grid cell for the
    click): then, and only then, it is done once more; anywhere else is a failure."""
    from playwright.sync_api import expect
    for attempt in range(tries):
        act()
        try:
            expect(cell).to_be_focused(timeout=15_000)
            return
        except AssertionError:
            stayed = (came_from.evaluate("e => e === document.activeElement") if came_from is not None else
                      page.evaluate("() => !(document.activeElement?.id || '').startsWith('glide-cell-')"))
            if attempt == tries - 1 or not stayed:
                raise


def _edit(page, row: int, col: int, mode: str) -> None:
    """Keyboard only, once the grid has focus: move to (row, col) from the top-left data cell, Enter opens
    the cell's choice box, typing the mode filters it, Enter picks it. Each step waits for what it changes
    (the focused cell, the count of options, the cell's value), never for a time."""
    from playwright.sync_api import expect
    grid = page.get_by_test_id("stDataFrame").first
    box = grid.bounding_box()
    _until_focused(page, lambda: page.mouse.click(box["x"] + INDEX_PX + 40, box["y"] + ROW_PX + ROW_PX / 2),
                   _cell(page, 0, 0))                                             # focus: layer 0, KV head 0
    at = (0, 0)
    for key, step in [("ArrowDown", (1, 0))] * row + [("ArrowRight", (0, 1))] * col:
        to = (at[0] + step[0], at[1] + step[1])
        _until_focused(page, lambda: page.keyboard.press(key), _cell(page, *to), _cell(page, *at))
        at = to
    options = page.get_by_role("option")
    page.keyboard.press("Enter")
    expect(options).to_have_count(len(MODES), timeout=15_000)                     # the choice box is open
    page.keyboard.type(mode)
    expect(options).to_have_count(1)                                              # filtered to the mode
    expect(options.first).to_have_text(mode)
    page.keyboard.press("Enter")
    expect(_cell(page, row, col)).to_have_text(mode)                              # picked


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
    _settled(page, LOAD_TIMEOUT_MS)     # the first visit of a server times its long passes (components/longscan.py)
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
    _edit(page, 1, 0, "full")                                                     # and the grid edits on from it
    expect(_metric(page, "Full / window / prune")).to_have_text(counts, timeout=60_000)
    expect(_metric(page, "KV cache at 4,096 tokens")).to_have_text(kv)
    assert page.get_by_test_id("stException").count() == 0
    page.screenshot(path=str(ARTIFACTS / "e2e_long_context_after.png"))
