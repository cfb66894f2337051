"""Text that must fit where it is shown, in a real headless Chromium at 1280x800 (the size the
issue was walked at), on every page for both built-in models: every option of every select box fits
the box's width (the Prune page's Policy box was cut at "(never grow", the sidebar's model box at
"(built-in", the Export format box before them; each option's width is measured in the box's own
font with a canvas, so options not selected now are checked too), and no text is cut with an
ellipsis ("causa..." for the Model page's Kind, the Pipeline's toggles "One-shot (one round, no re...").
"""
from __future__ import annotations

import pytest

from tests.e2e.conftest import LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.serving import SETTLED

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]

PAGES = ("", "walkthrough", "profiles", "prune", "compare", "heads", "export", "pipeline")
MODELS = ("smollm2-135m", "minilm-l6")

# width of `text` in `input`'s font, and the room the input has for it (its width less padding)
_MEASURE = """([input, texts]) => {
  const style = getComputedStyle(input);
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = style.font;
  const room = input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return texts.map(t => [t, ctx.measureText(t).width, room]);
}"""


# visible elements whose text the browser cuts with an ellipsis
_ELLIPSIZED = """() => [...document.querySelectorAll('body *')].filter(e => {
  const style = getComputedStyle(e);
  return style.textOverflow === 'ellipsis' && e.getClientRects().length && e.scrollWidth > e.clientWidth + 1
      && e.textContent.trim() && e.tagName !== 'INPUT';
}).map(e => e.textContent.trim().slice(0, 80))"""


@pytest.fixture(scope="module")
def small(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()


@pytest.mark.parametrize("model", MODELS)
def test_no_text_is_cut_off(server, small, model):
    page = small
    cut = []
    for path in PAGES:
        page.goto(f"{server}/{path}?model={model}")
        page.get_by_role("heading", level=1).first.wait_for(timeout=LOAD_TIMEOUT_MS)
        for _ in range(3):                                   # settled for a moment
            page.wait_for_timeout(500)
            page.wait_for_selector(SETTLED, timeout=LOAD_TIMEOUT_MS)
        cut += [f"/{path}: {text!r} is cut with an ellipsis" for text in page.evaluate(_ELLIPSIZED)]
        widgets = page.get_by_test_id("stSelectbox")
        for i in range(widgets.count()):
            widget = widgets.nth(i)
            box = widget.locator('input[role="combobox"]')
            if not box.is_visible():                         # e.g. inside a closed expander
                continue
            label = box.get_attribute("aria-label")
            widget.scroll_into_view_if_needed()
            page.wait_for_timeout(300)                       # a popover opened while scrolling closes again
            widget.get_by_role("button", name="Open").click()
            options = page.get_by_role("option")
            try:
                options.first.wait_for(timeout=10_000)
            except Exception:  # noqa: BLE001 - reported below with the box it happened on
                cut.append(f"/{path} {label!r}: its options did not open")
                page.keyboard.press("Escape")
                continue
            texts = [t.strip() for t in options.all_inner_texts()]
            page.keyboard.press("Escape")
            options.first.wait_for(state="hidden", timeout=10_000)
            for text, width, room in page.evaluate(_MEASURE, [box.element_handle(), texts]):
                if width > room:
                    cut.append(f"/{path} {label!r}: {text!r} needs {width:.0f} px of {room:.0f}")
    assert not cut, "text cut off at 1280x800:\n" + "\n".join(cut)
