"""Issue 33's defects in a real headless Chromium, the way the new user met them:

1. Prune: a result shown under the mask is that mask's. Check a mask's perplexity and sweep z at sparsity
   0.3, then move sparsity 0.30 -> 0.20 and z 2 -> 2.25 with the keyboard: the old check and sweep go
   (a note says which view they were of) and the sweep button names the new sparsity. Before the fix
   only the sliders' fragment reran and the old 81-head check stayed under the new 54-head mask.
2. Export: a relative export root is refused before anything is written, naming where it would land
   (before: `relative/dir` wrote 516 MiB into the server's own folder).
3. Export: /proc as the export root gives the true reason (before: "a folder on the path does not exist").
"""
from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.serving import ROOT, SETTLED

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]

N_HEADS = 30 * 9          # SmolLM2-135M: 30 layers x 9 query heads
VIEW = "model=smollm2-135m&scorer=mp-g&z=2&sparsity=0.3&policy=global"


def _settled(page) -> None:
    from playwright.sync_api import expect
    for _ in range(3):
        page.wait_for_timeout(400)
        expect(page.locator(SETTLED)).to_have_count(1, timeout=LOAD_TIMEOUT_MS)


def _number(page, label: str, value: int) -> None:
    box = page.get_by_test_id("stNumberInput").filter(has_text=label).first.locator("input")
    box.fill(str(value))
    box.press("Enter")
    _settled(page)


def _press(page, slider_label: str, key: str, times: int) -> None:
    slider = page.get_by_test_id("stSlider").filter(has_text=slider_label).first.get_by_role("slider")
    slider.focus()
    for _ in range(times):
        page.keyboard.press(key)
        page.wait_for_timeout(150)
    _settled(page)


def test_prune_results_follow_the_mask(server, page):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/prune?{VIEW}")
    start = math.floor(0.3 * N_HEADS + 1e-9)                                           # 81
    expect(page.locator(".hsm-t", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(1,
                                                                                         timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    _number(page, "Tokens to use", 16)
    page.get_by_role("button", name="Check perplexity against the dense model").click()
    checked = page.get_by_text(f"Checked: {start} pruned heads", exact=False)
    expect(checked).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
    _number(page, "Tokens per split", 16)
    page.get_by_role("button", name="Sweep z at sparsity 0.3").click()
    sweep_title = page.locator(".gtitle", has_text="vs z at sparsity 0.3")
    expect(sweep_title).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
    _settled(page)

    _press(page, "Sparsity", "ArrowLeft", 10)                                          # 0.30 -> 0.20
    _press(page, "Threshold z", "ArrowRight", 5)                                       # 2 -> 2.25
    moved = math.floor(0.2 * N_HEADS + 1e-9)                                           # 54
    expect(page.locator(".hsm-t", has_text=f"{moved} of {N_HEADS} heads pruned")).to_have_count(1, timeout=60_000)
    expect(page.get_by_text("Heads with score 0 at z = 2.25")).to_have_count(1)
    # nothing of the 81-head view is left under the 54-head mask: each says it is stale, and of which view
    expect(checked).to_have_count(0, timeout=30_000)
    expect(page.get_by_text(f"The settings changed since the last check ({start} pruned heads")).to_have_count(1)
    expect(sweep_title).to_have_count(0)
    expect(page.get_by_text("The settings changed since the last sweep")).to_have_count(1)
    expect(page.get_by_role("button", name="Sweep z at sparsity 0.2", exact=True)).to_have_count(1)
    expect(page.get_by_role("button", name="Sweep z at sparsity 0.3", exact=True)).to_have_count(0)
    assert page.locator('[data-testid="stException"]').count() == 0
    page.screenshot(path=str(ARTIFACTS / "e2e_issue33_prune_stale.png"), full_page=True)


def _export_page(server, page):
    from playwright.sync_api import expect
    page.goto(f"{server}/export?{VIEW}")
    expect(page.get_by_role("button", name="Export", exact=True)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    return page.get_by_role("textbox", name="Export root")


def test_a_relative_export_root_is_refused_before_writing(server, page):
    from playwright.sync_api import expect
    root = _export_page(server, page)
    root.fill("relative/e2e-issue33")
    root.press("Enter")
    _settled(page)
    landing = ROOT / "relative" / "e2e-issue33"
    # said before anything is written: where it would land, and that an absolute path is needed
    error = page.get_by_test_id("stAlert").filter(has_text="relative path")
    expect(error).to_have_count(1, timeout=30_000)
    expect(error).to_contain_text(str(landing))
    expect(page.get_by_role("button", name="Export", exact=True)).to_be_disabled()
    assert not (ROOT / "relative").exists()
    page.screenshot(path=str(ARTIFACTS / "e2e_issue33_relative_root.png"), full_page=True)


def test_proc_as_export_root_gives_the_true_reason(server, page):
    from playwright.sync_api import expect
    root = _export_page(server, page)
    root.fill("/proc")
    root.press("Enter")
    _settled(page)
    button = page.get_by_role("button", name="Export", exact=True)
    if button.is_enabled():                 # the check may come only when writing: press it to see the reason
        button.click()
        _settled(page)
    error = page.get_by_test_id("stAlert").filter(has_text="/proc")
    expect(error.first).to_be_visible(timeout=120_000)
    expect(error.first).to_contain_text("takes no new folders")
    expect(error.first).not_to_contain_text("does not exist")
