"""The app walked as a newcomer walks it (issue 20), in a real headless Chromium at 1280x800 where it
matters: Stop ends the computation, so the next run starts at once; the header has no Stop or
Deploy of its own; the Prune page's mask is in view beside the sliders, the default policy never
grows the model and the paper's global ranking shows its growth in red; an encoder has no KV-cache
tile; no page asks an outside host for anything; exported files get the umask's modes.
"""
from __future__ import annotations

import os
import re
import time
from urllib.parse import urlparse

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.test_journeys import PAGES, _arrive, _choose, _settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]

N_HEADS = 30 * 9          # SmolLM2-135M: 30 layers x 9 query heads
NEXT_RUN_BOUND_S = 15.0   # goal ~2 s on a quiet machine; generous for a loaded one, still fails when the
                          # stopped computation keeps the model until its layer ends (tens of seconds)


@pytest.fixture
def small_page(browser):
    """A tab at 1280x800, the size the issue was walked at."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()


def _main(page):
    return page.get_by_test_id("stMainBlockContainer")


def _start_ablation(server, page):
    from playwright.sync_api import expect
    page.goto(f"{server}/heads?model=smollm2-135m")
    run = page.get_by_role("button", name="Run the ablation sweep")
    expect(run).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    run.click()
    stop = _main(page).get_by_role("button", name="Stop")
    expect(stop).to_be_visible(timeout=60_000)
    return stop


def test_stop_ends_the_computation_and_the_next_run_starts_at_once(server, page):
    from playwright.sync_api import expect
    main = _main(page)
    stop = _start_ablation(server, page)
    # the bar moves inside the first layer (which replays all 30 layers per batch of ablations)
    expect(main.get_by_test_id("stProgress").filter(has_text=re.compile(r"layer 1/30, \d+% of its ablations"))
           ).to_have_count(1, timeout=120_000)
    stop.click()
    expect(main.get_by_test_id("stAlert").filter(has_text="Stopped: Ablating heads")).to_be_visible(timeout=60_000)
    _settled(page)
    roles = main.get_by_role("button", name="Tag head roles from their attention patterns")
    t0 = time.monotonic()
    roles.click()
    started, waited = None, False
    while time.monotonic() - t0 < 120:
        bars = [t for t in main.get_by_test_id("stProgress").all_inner_texts() if "Tagging heads" in t]
        waited = waited or any("waiting for another computation" in t for t in bars)
        busy = any(t.startswith("Tagging heads:") and "waiting" not in t for t in bars)
        if busy or page.get_by_text("Primary role of each head").count():
            started = time.monotonic() - t0
            break
        page.wait_for_timeout(100)
    print(f"\nnext run started {started} s after the press (waited on the model's lock: {waited})")
    assert started is not None, "the role tagging never started"
    assert started < NEXT_RUN_BOUND_S, f"the next run waited {started:.1f} s for the stopped computation"
    expect(page.get_by_text("Primary role of each head")).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
    assert page.get_by_test_id("stException").count() == 0


def test_the_header_has_no_stop_or_deploy_of_its_own(server, page):
    from playwright.sync_api import expect
    stop = _start_ablation(server, page)
    page.wait_for_timeout(1500)                          # the header's "Running... Stop" shows after ~0.5 s
    assert page.get_by_test_id("stStatusWidget").count() == 0, "the header shows its own Stop"
    assert page.get_by_role("button", name="Deploy").count() == 0
    assert page.get_by_test_id("stAppDeployButton").count() == 0
    stop.click()
    expect(_main(page).get_by_test_id("stAlert").filter(has_text="Stopped")).to_be_visible(timeout=60_000)


def test_prune_mask_in_view_beside_the_sliders_and_growth_in_red(server, small_page):
    from playwright.sync_api import expect
    page = small_page
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/prune?model=smollm2-135m")
    start = int(0.3 * N_HEADS + 1e-9)                      # groups of 3 heads: 27 whole KV groups
    expect(page.locator(".hsm-t", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(1,
                                                                                         timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    assert "policy=groups" in page.url                     # the default on a GQA model: whole KV groups
    bigger = page.get_by_test_id("stAlertContentError").filter(has_text="BIGGER")
    assert bigger.count() == 0, bigger.first.inner_text()
    slider = page.get_by_test_id("stSlider").filter(has_text="Sparsity").get_by_role("slider")
    slider.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    expect(page).to_have_url(re.compile(r"sparsity=0\.33"), timeout=60_000)
    expect(page.locator(".hsm-t", has_text=f"{start} of {N_HEADS} heads pruned")).to_have_count(0, timeout=60_000)
    expect(page.locator(".hsm-t", has_text=f"of {N_HEADS} heads pruned")).to_have_count(1)
    box = page.locator(".hsm").bounding_box()
    print(f"\nmask grid at y {box['y']:.0f} .. {box['y'] + box['height']:.0f} of an 800 px viewport")
    assert box["y"] >= 0 and box["y"] + box["height"] <= 800, box
    page.screenshot(path=str(ARTIFACTS / "e2e_prune_1280x800.png"))
    # the paper's setting, one choice away: on this GQA model it grows the KV cache, said in red
    _choose(page, "Policy", "global:")
    expect(bigger).to_have_count(1, timeout=60_000)
    expect(bigger).to_contain_text("KV heads")
    assert "policy=global" in page.url
    page.screenshot(path=str(ARTIFACTS / "e2e_prune_global_growth.png"))


def test_an_encoder_has_no_kv_cache_tile(server, small_page):
    from playwright.sync_api import expect
    page = small_page
    page.goto(f"{server}/prune?model=minilm-l6&sparsity=0.25")
    expect(page.locator(".hsm-t", has_text="heads pruned")).to_have_count(1, timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    labels = page.get_by_test_id("stMetricLabel").all_inner_texts()
    assert any("Query heads" in t for t in labels), labels
    assert not any("KV cache" in t for t in labels), labels
    assert "policy=global" in page.url                     # MHA: the paper's global ranking


def test_no_page_asks_an_outside_host(server, page):
    outside: list[str] = []

    def note(request) -> None:
        url = urlparse(request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname not in ("127.0.0.1", "localhost"):
            outside.append(request.url)

    from playwright.sync_api import expect
    page.on("request", note)
    for name, (title, path, _) in PAGES.items():
        page.goto(f"{server}/{path}?model=smollm2-135m")
        expect(page.get_by_role("heading", name=title, level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
        _settled(page, LOAD_TIMEOUT_MS)                 # every request of the page's run has been made
    assert not outside, f"requests to outside hosts: {sorted(set(outside))}"


def test_exported_files_get_the_modes_of_the_umask(server, page, export_root):
    from playwright.sync_api import expect
    page.goto(f"{server}/export?model=smollm2-135m&scorer=mp-g&z=2&sparsity=0.1")
    _arrive(page, "export")
    _choose(page, "Format", "pruned checkpoint")
    name_box = page.get_by_role("textbox", name="Folder name (follows the settings until you edit it)")
    name_box.fill("modes-check")
    name_box.press("Enter")
    _settled(page)
    page.get_by_role("button", name="Export", exact=True).click()
    expect(page.get_by_test_id("stAlertContentSuccess")).to_contain_text("Wrote the pruned checkpoint",
                                                                          timeout=LOAD_TIMEOUT_MS)
    umask = os.umask(0)
    os.umask(umask)                                        # the server inherited this process's umask
    files = [p for p in (export_root / "modes-check").rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files), files
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_an_unknown_scorer_in_the_link_falls_back_to_the_models_default(server, page):
    from playwright.sync_api import expect
    page.goto(f"{server}/prune?model=smollm2-135m&scorer=nope")
    _arrive(page, "prune")
    box = _main(page).get_by_test_id("stSelectbox").filter(has_text="Scorer").first.get_by_role("combobox")
    expect(box).to_have_value("MP-G (GQA-aware MP)", timeout=60_000)      # SmolLM2 is GQA: MP-G, not MP
    expect(_main(page).get_by_test_id("stAlert").filter(has_text="scorer='nope' was ignored")).to_have_count(1)
    assert "scorer=mp-g" in page.url


def test_pipeline_page_explains_itself_distills_by_default_and_locks_run_while_running(server, page):
    from playwright.sync_api import expect
    page.goto(f"{server}/pipeline?model=smollm2-135m&z=2.5")
    _arrive(page, "pipeline")
    main = _main(page)
    expect(main.get_by_test_id("stExpander").filter(has_text="How to read this")).to_have_count(1)
    recovery = main.get_by_test_id("stNumberInput").filter(has_text="Recovery steps per round").locator("input")
    assert int(recovery.input_value()) > 0                 # a default run distills
    # every control has its help, and the page says it starts from the Prune view (z = 2.5 from the link)
    for testid in ("stSlider", "stNumberInput", "stSelectbox", "stCheckbox"):
        for box in main.get_by_test_id(testid).all():
            assert box.get_by_test_id("stTooltipIcon").count() == 1, f"no help on {box.inner_text()[:60]!r}"
    expect(main.get_by_text(re.compile(r"Starts from the Prune page's view: .*z = 2\.5"))).to_have_count(1)
    expect(main.get_by_test_id("stMetric").filter(has_text="Estimated time")).to_have_count(1)
    run = main.get_by_role("button", name="Run the pipeline")
    expect(run).to_be_enabled()
    run.click()
    stop = main.get_by_role("button", name="Stop")
    expect(stop).to_be_visible(timeout=60_000)
    expect(run).to_be_disabled()                           # no second run while this one runs
    stop.click()
    expect(main.get_by_test_id("stAlert").filter(has_text="Stopped")).to_be_visible(timeout=120_000)
    _settled(page)
    expect(run).to_be_enabled()
    assert page.get_by_test_id("stException").count() == 0
