"""Journeys through the app in a real headless Chromium, the way people use it: the sidebar to switch
pages, the keyboard on sliders, the Stop button on long work.

- Every ordered pair of pages keeps the view (model, scorer, its parameters, z, sparsity, policy,
  kv_policy, the Long context page's context, window and KV plan) and every other control set on a page
  (Export's format and typed root, Heads' token count, the Pipeline's recovery steps): one walk over all
  72 ordered pairs of the nine pages (an Euler circuit of the complete directed graph), checking the URL
  and every control that shows one of them on each arrival, then a reload (the URL alone brings back the
  view). AppTest cannot see this: it keeps widget keys a real browser drops on a page switch.
- Stop on a long job leaves a usable page that says "Stopped".
"""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.serving import SETTLED

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]

# page -> (sidebar title, url path, the view sliders it shows: label text -> view field)
PAGES = {
    "model": ("Model", "", {}),
    "walkthrough": ("Walkthrough", "walkthrough", {"Threshold z": "z"}),
    "profiles": ("Profiles", "profiles", {"Threshold z": "z"}),
    "prune": ("Prune", "prune", {"Threshold z": "z", "Sparsity": "sparsity"}),
    "long_context": ("Long context", "long_context", {}),
    "compare": ("Compare", "compare", {"Threshold z": "z", "Sparsity": "sparsity"}),
    "heads": ("Heads", "heads", {}),
    "export": ("Export", "export", {}),
    "pipeline": ("Pipeline", "pipeline", {}),
}
VIEW = {"model": "smollm2-135m", "scorer": "mp-g", "z": "2.35", "sparsity": "0.4",   # none a default but
        "policy": "balanced", "kv_policy": "expand", "a_kv": "0.5", "ord": "1",        # the model's scorer
        "context": "2048", "recent": "128", "plan": "edited",                         # the Long context page's
        "kv": ".".join(["wfp" if layer % 7 == 3 else "fff" for layer in range(30)])}  # band and KV plan


def _box(page, testid: str, label: str):
    return page.get_by_test_id("stMainBlockContainer").get_by_test_id(testid).filter(has_text=label).first


def _opened(page, label: str):
    """The page, with its expander `label` opened (widgets in a closed expander are not drawn)."""
    expander = page.get_by_test_id("stExpander").filter(has_text=label).first
    if not expander.get_by_test_id("stExpanderDetails").is_visible():
        expander.locator("summary").click()
        expander.get_by_test_id("stExpanderDetails").wait_for(state="visible")
    return page


def _selected(page, label: str) -> str:
    return _box(page, "stSelectbox", label).get_by_role("combobox").input_value()


def _number(page, label: str) -> str:
    return _box(page, "stNumberInput", label).locator("input").input_value()


# page -> (what, read the control, expected) for the controls the page shows; the URL fields come
# from the link, the others are set through the page (`_set_session_controls`) before the walk
def _controls(root: str) -> dict:
    return {
        "prune": [("policy", lambda p: _selected(p, "Policy"), re.compile(r"^balanced \(GQA\)")),
                  ("kv_policy", lambda p: _selected(_opened(p, "Scorer parameters"), "KV policy"),
                   re.compile(r"^expand$")),
                  ("a_kv", lambda p: _number(_opened(p, "Scorer parameters"), "a_kv"), "0.50"),
                  ("Norm L1", lambda p: _box(_opened(p, "Scorer parameters"), "stRadio", "Norm")
                   .get_by_role("radio", name="L1").is_checked(), True)],
        "compare": [("policy", lambda p: _selected(p, "Policy"), re.compile(r"^balanced \(GQA\)"))],
        "export": [("format", lambda p: _selected(p, "Format"), re.compile(r"^ONNX")),
                   ("root", lambda p: p.get_by_role("textbox", name="Export root").input_value(), root),
                   ("kv_policy", lambda p: _selected(p, "KV policy"), re.compile(r"^expand$"))],
        "heads": [("tokens", lambda p: _number(p, "Tokens to use"), "80")],
        "long_context": [("context", lambda p: _number(p, "Context length"), "2048"),
                         ("recent", lambda p: _number(p, "Window (recent tokens)"), "128"),
                         ("counts", lambda p: p.get_by_test_id("stMetric").filter(has_text="Full / window / prune")
                          .first.get_by_test_id("stMetricValue").inner_text(), "82 / 4 / 4")],
        "pipeline": [("recovery steps", lambda p: _number(p, "Recovery steps per round"), "30")],
    }


def euler_circuit(nodes: list[str]) -> list[str]:
    """A closed walk using every ordered pair (a, b), a != b, exactly once (Hierholzer)."""
    out = {a: [b for b in nodes if b != a] for a in nodes}
    stack, walk = [nodes[0]], []
    while stack:
        top = stack[-1]
        if out[top]:
            stack.append(out[top].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


def test_euler_circuit_covers_every_ordered_pair():
    walk = euler_circuit(list(PAGES))
    pairs = list(zip(walk, walk[1:]))
    assert len(pairs) == len(set(pairs)) == len(PAGES) * (len(PAGES) - 1)


def _settled(page, timeout_ms: int = 60_000) -> None:
    """Wait until the script has finished its run (the app root says 'notRunning' for a moment)."""
    from playwright.sync_api import expect
    for _ in range(3):
        page.wait_for_timeout(400)
        expect(page.locator(SETTLED)).to_have_count(1, timeout=timeout_ms)


def _query(page) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlparse(page.url).query).items()}


def _arrive(page, name: str) -> None:
    from playwright.sync_api import expect
    title, _, sliders = PAGES[name]
    expect(page.get_by_role("heading", name=title, level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    for label in sliders:
        expect(page.get_by_test_id("stSlider").filter(has_text=label).first).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)


def _check_view(page, came_from: str, name: str, controls: dict | None = None) -> None:
    where = f"{came_from} -> {name}"
    query = _query(page)
    for field, value in VIEW.items():
        assert query.get(field) == value, f"{where}: URL has {field}={query.get(field)!r}, expected {value!r}"
    assert query.get("page") == name, f"{where}: URL page={query.get('page')!r}"
    for label, field in PAGES[name][2].items():
        slider = page.get_by_test_id("stSlider").filter(has_text=label).first.get_by_role("slider")
        shown = float(slider.input_value())
        assert shown == pytest.approx(float(VIEW[field])), f"{where}: the {label} slider shows {shown}"
    for what, read, expected in (controls or {}).get(name, []):
        shown = read(page)
        ok = expected.search(shown) if isinstance(expected, re.Pattern) else shown == expected
        assert ok, f"{where}: {what} shows {shown!r}, expected {getattr(expected, 'pattern', expected)!r}"
    assert page.get_by_test_id("stException").count() == 0, where


OPEN_TRIES = 3                # a rerun that lands between the click and the list redraws the box, closed


def _choose(page, label: str, option: str) -> None:
    """Pick `option` in the select box `label`: open it, wait for the option to be listed (open it again, once the
    script has settled, when a rerun closed the list first), click it, wait for the run it starts."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    wanted = page.get_by_role("option", name=option).first
    for attempt in range(OPEN_TRIES):
        _box(page, "stSelectbox", label).click()
        try:
            wanted.wait_for(state="visible", timeout=10_000)
            break
        except PlaywrightTimeout:
            if attempt + 1 == OPEN_TRIES:
                raise
            _settled(page)
    wanted.click()
    _settled(page)


def _type(page, box, text: str) -> None:
    box.fill(text)
    box.press("Enter")
    _settled(page)


def _set_session_controls(page, server: str, root: str) -> None:
    """Set the controls that live in the session only (not in the URL), through the pages."""
    from playwright.sync_api import expect
    nav = page.get_by_test_id("stSidebarNav")
    nav.get_by_role("link", name="Export", exact=True).click()
    _arrive(page, "export")
    _choose(page, "Format", "ONNX (ONNX Runtime)")
    _type(page, page.get_by_role("textbox", name="Export root"), root)
    expect(page.get_by_text(f"Writes {root}/")).to_have_count(1, timeout=60_000)
    nav.get_by_role("link", name="Heads", exact=True).click()
    _arrive(page, "heads")
    _type(page, _box(page, "stNumberInput", "Tokens to use").locator("input"), "80")
    nav.get_by_role("link", name="Pipeline", exact=True).click()
    _arrive(page, "pipeline")
    _type(page, _box(page, "stNumberInput", "Recovery steps per round").locator("input"), "30")


IN_URL = {"policy", "kv_policy", "a_kv", "Norm L1", "context", "recent", "counts"}   # view fields (kept by a reload)


def test_every_ordered_pair_of_pages_keeps_every_control(server, page, export_root):
    root = str(export_root / "typed-root")
    controls = _controls(root)
    walk = euler_circuit(list(PAGES))
    start = walk[0]
    query = "&".join(f"{k}={v}" for k, v in VIEW.items())
    page.goto(f"{server}/{PAGES[start][1]}?{query}")
    _arrive(page, start)
    _set_session_controls(page, server, root)
    nav = page.get_by_test_id("stSidebarNav")
    nav.get_by_role("link", name=PAGES[start][0], exact=True).click()
    _arrive(page, start)
    _check_view(page, "link", start, controls)
    for came_from, name in zip(walk, walk[1:]):
        nav.get_by_role("link", name=PAGES[name][0], exact=True).click()
        _arrive(page, name)
        _check_view(page, came_from, name, controls)
    page.reload()                                       # the URL alone reproduces the view
    _arrive(page, walk[-1])
    in_url = {n: [c for c in checks if c[0] in IN_URL] for n, checks in controls.items()}
    _check_view(page, "reload", walk[-1], in_url)
    nav.get_by_role("link", name="Prune", exact=True).click()
    _arrive(page, "prune")
    _check_view(page, "reload -> prune", "prune", in_url)


def test_stop_leaves_a_usable_page_that_says_stopped(server, page):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/heads?model=smollm2-135m")
    run = page.get_by_role("button", name="Run the ablation sweep")
    expect(run).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    run.click()
    main = page.get_by_test_id("stMainBlockContainer")
    stop = main.get_by_role("button", name="Stop")
    expect(stop).to_be_visible(timeout=60_000)
    expect(main.get_by_test_id("stProgress")).to_have_count(1)
    page.wait_for_timeout(1500)                         # let the sweep get going
    stop.click()
    expect(main.get_by_test_id("stAlert").filter(has_text="Stopped: Ablating heads")).to_be_visible(timeout=60_000)
    _settled(page)
    expect(main.get_by_role("button", name="Stop")).to_have_count(0)
    expect(main.get_by_test_id("stProgress")).to_have_count(0)
    expect(run).to_be_enabled()
    expect(page.get_by_role("heading", name="Attention pattern of one head")).to_be_visible()
    assert page.get_by_test_id("stException").count() == 0
    page.screenshot(path=str(ARTIFACTS / "e2e_heads_stopped.png"), full_page=True)
    run.click()                                         # the next press runs (not cancelled at once)
    expect(main.get_by_role("button", name="Stop")).to_be_visible(timeout=60_000)
    main.get_by_role("button", name="Stop").click()
    expect(main.get_by_test_id("stAlert").filter(has_text="Stopped: Ablating heads")).to_be_visible(timeout=60_000)


def _no_error_on_page(page, where: str) -> None:
    for testid in ("stException", "stAlertContentError"):
        found = page.get_by_test_id(testid)
        assert found.count() == 0, f"{where}: {found.first.inner_text()[:300]}"


@pytest.mark.parametrize("name", list(PAGES))
def test_minilm_journey_has_no_error_on_any_page(server, page, name):
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/{PAGES[name][1]}?model=minilm-l6&sparsity=0.25")
    _arrive(page, name)
    page.wait_for_timeout(500)
    _no_error_on_page(page, f"minilm {name}")
    page.screenshot(path=str(ARTIFACTS / f"e2e_minilm_{name}.png"), full_page=True)


def test_export_journey(server, page, export_root):
    """Format chosen -> the default name follows it -> Export -> the folder is under the root the page
    shows -> mask.json downloads and describes the shown view."""
    import json
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/export?model=smollm2-135m&scorer=mp-g&z=2&sparsity=0.1")
    _arrive(page, "export")
    root_box = page.get_by_role("textbox", name="Export root: every export becomes a folder in here")
    expect(root_box).to_have_value(str(export_root), timeout=30_000)   # waits for the widget's first value
    name_box = page.get_by_role("textbox", name="Folder name (follows the settings until you edit it)")
    expect(name_box).to_have_value(re.compile(r"-zeroed$"), timeout=30_000)
    page.get_by_test_id("stSelectbox").filter(has_text="Format").click()
    page.get_by_role("option", name="pruned checkpoint").click()
    _settled(page)
    expect(name_box).to_have_value("smollm2-135m-mp-g-s0.1-groups-pruned", timeout=30_000)
    page.get_by_role("button", name="Export", exact=True).click()
    expect(page.get_by_test_id("stAlertContentSuccess")).to_contain_text("Wrote the pruned checkpoint",
                                                                          timeout=LOAD_TIMEOUT_MS)
    folder = export_root / "smollm2-135m-mp-g-s0.1-groups-pruned"
    assert (folder / "head_layout.json").is_file() and (folder / "mask.json").is_file()
    assert folder.stat().st_mode & 0o077 != 0                  # not mkdtemp's private 0700
    with page.expect_download() as info:
        page.get_by_role("button", name="Download mask.json").click()
    record = json.loads(Path(info.value.path()).read_text())
    assert (record["scorer"], record["sparsity"]) == ("mp-g", 0.1)
    assert record["kept"] == json.loads((folder / "mask.json").read_text())["kept"]
    _no_error_on_page(page, "export")
    page.screenshot(path=str(ARTIFACTS / "e2e_export_journey.png"), full_page=True)
