"""Screenshots of every page at 1280x800 for both built-in models, into artifacts/ (what a user sees
first on each page). Serves the app with tests/e2e/serving.py and drives Debian's Chromium.

    .venv/bin/python -m scripts.screenshots [--out artifacts] [--models smollm2-135m,minilm-l6] [--full]
--full also saves each whole page (<model>_<page>_full.png): what scrolling shows at 1280 px wide (a window
FULL_HEIGHT px tall: the app scrolls inside its own container, so a "full page" screenshot of the browser
would show only the first 800 px).
"""
import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

from tests.e2e.serving import SETTLED, chromium, served_app  # noqa: E402

PAGES = {"model": "", "walkthrough": "walkthrough", "profiles": "profiles", "prune": "prune",
         "compare": "compare", "heads": "heads", "export": "export", "pipeline": "pipeline"}
VIEWPORT = {"width": 1280, "height": 800}
FULL_HEIGHT = 6000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "artifacts"))
    ap.add_argument("--models", default="smollm2-135m,minilm-l6")
    ap.add_argument("--full", action="store_true", help="also a whole-page screenshot of each page")
    ap.add_argument("--cache", default=os.environ.get("HEADSCOPE_CACHE") or
                    str(Path(tempfile.gettempdir()) / f"headscope-test-cache-{os.getuid()}"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkdtemp(prefix="headscope-shots-")) / "server.log"
    with served_app(log, {"HEADSCOPE_CACHE": args.cache}) as base, chromium() as browser:
        sizes = [("", VIEWPORT)] + ([("_full", {"width": VIEWPORT["width"], "height": FULL_HEIGHT})] if args.full else [])
        for model in args.models.split(","):
            for suffix, viewport in sizes:
                context = browser.new_context(viewport=viewport)
                page = context.new_page()
                for name, path in PAGES.items():
                    page.goto(f"{base}/{path}?model={model}")
                    page.get_by_role("heading", level=1).first.wait_for(timeout=180_000)
                    for _ in range(3):                     # settled for a moment (charts drawn)
                        page.wait_for_timeout(700)
                        page.wait_for_selector(SETTLED, timeout=180_000)
                    file = out / f"{model}_{name}{suffix}.png"
                    if suffix:                             # the page's own height, not the whole window
                        height = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]')"
                                               ".scrollHeight") or FULL_HEIGHT
                        page.screenshot(path=str(file), clip={"x": 0, "y": 0, "width": viewport["width"],
                                                               "height": min(height, FULL_HEIGHT)})
                    else:
                        page.screenshot(path=str(file))
                    print(file)
                context.close()


if __name__ == "__main__":
    main()
