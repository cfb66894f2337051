"""The Walkthrough page in a real headless Chromium on the built-in SmolLM2: the z slider moved with the
keyboard changes the worked head's live numbers to analysis' values at the new z (and the URL's z);
a screenshot lands in artifacts/e2e_walkthrough.png."""
from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]
START_Z, STEPS, STEP = 0.5, 3, 0.05          # the slider's step is 0.05


def _expected(smollm2, z: float) -> dict[str, str]:
    """The worked numbers of layer 0, head 0 at z, from analysis, formatted as the page prints them."""
    from analysis.measure import profiles
    from analysis.score import scoring
    from components.explain import num
    prof = profiles.profile_model(smollm2.model, adapter=smollm2.adapter)
    own, group = prof.excess_sums(z)
    return {"Own excess (Q + O)": num(own[0, 0]), "KV group 0 excess (K + V)": num(group[0, 0]),
            "MP score": num(scoring.get_scorer("mp", z=z).score(prof).scores[0, 0]),
            "MP-G score": num(scoring.get_scorer("mp-g", z=z).score(prof).scores[0, 0])}


def _metric(page, label: str):
    return page.get_by_test_id("stMetric").filter(has_text=label).first.get_by_test_id("stMetricValue")


@pytest.mark.parametrize("page", [4200], indirect=True)   # tall: every section in the screenshot
def test_z_keys_change_the_live_numbers(server, page, smollm2):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    moved_z = round(START_Z + STEPS * STEP, 2)
    before, after = _expected(smollm2, START_Z), _expected(smollm2, moved_z)
    assert before["MP score"] != after["MP score"], "pick a start z where the three key presses change MP"
    page.goto(f"{server}/walkthrough?model=smollm2-135m&z={START_Z:g}")
    for label, value in before.items():
        expect(_metric(page, label)).to_have_text(value, timeout=LOAD_TIMEOUT_MS)
    slider = page.get_by_test_id("stSlider").filter(has_text="Threshold z").get_by_role("slider")
    slider.focus()
    for _ in range(STEPS):
        page.keyboard.press("ArrowRight")
    for label, value in after.items():
        expect(_metric(page, label)).to_have_text(value, timeout=60_000)
    expect(page).to_have_url(re.compile(rf"z={moved_z:g}(&|$)"))
    expect(page.get_by_text(f"at z = {moved_z:g}").first).to_be_visible()
    assert page.get_by_test_id("stException").count() == 0
    page.wait_for_timeout(1000)                     # let the charts redraw before the screenshot
    page.screenshot(path=str(ARTIFACTS / "e2e_walkthrough.png"), full_page=True)
