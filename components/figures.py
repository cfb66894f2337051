"""Figures for a projector and a handout: every chart downloadable as SVG and as a high-DPI PNG, titled
with the view it shows, and a "lecture pack" (a zip of the current view's figures with a short index).

- `chart(fig, key, ...)`: draws a plotly figure (as `st.plotly_chart`) with two download buttons under
  it, SVG and PNG (PNG_SCALE x its size). The downloaded figure is re-laid out for a projector
  (`for_projector`: PROJECTOR_FONT px text, a fixed 16:9 size, the title with the model, scorer, z,
  sparsity and policy of the view, `view_line`). The files are rendered when a button is clicked,
  never on a rerun.
- `render(fig, fmt)`: the renderer is Debian's Chromium (the one the browser tests use, installed by
  scripts/setup.sh) driven by Playwright (requirements-dev.txt), running plotly.js from the plotly
  package itself, so it works offline and needs no kaleido. One browser per server process, in a
  thread of its own (Playwright's sync objects belong to the thread that made them); requests queue
  to it. Without Chromium the buttons say why, and the plotly toolbar's own camera button still
  saves a PNG at PNG_SCALE x (`PLOTLY_CONFIG`), in the browser.
- `lecture_pack(figs, index)`: a zip of SVG + PNG per figure and index.md (what each figure shows,
  the view, the link that reopens it).
"""
from __future__ import annotations

import base64
import copy
import io
import queue
import threading
import urllib.parse
import zipfile
from concurrent.futures import Future
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from . import controls, state

PNG_SCALE = 3                    # a 1600 x 900 figure becomes 4800 x 2700 px: sharp on any projector
PROJECTOR_SIZE = (1600, 900)     # 16:9
PROJECTOR_FONT = 22              # px: readable from the back of a room at 1600 px wide
CHROMIUM = Path("/usr/bin/chromium")
RENDER_TIMEOUT_S = 60
# the plotly toolbar's camera button: a PNG at PNG_SCALE x, made in the browser (works without Chromium here)
PLOTLY_CONFIG = {"toImageButtonOptions": {"format": "png", "scale": PNG_SCALE}, "displaylogo": False}


def view_line() -> str:
    """The view in one line: model, scorer (with z where it has one), sparsity, policy."""
    scorer = state.get("scorer")
    z = f", z = {float(state.get('z')):g}" if "z" in controls.offered_params(scorer) else ""
    return (f"{state.get('model')} · {controls.label(scorer)}{z} · sparsity {float(state.get('sparsity')):g} · "
            f"policy {state.get('policy')}")


def for_projector(fig: go.Figure, title: str | None = None, *, view: str | None = None) -> go.Figure:
    """A copy of `fig` laid out for a projector: big text, 16:9, margins that hold the legend and the
    axis titles, and a two-line title: what it shows, then the view (model, scorer, z, sparsity, policy)."""
    out = go.Figure(copy.deepcopy(fig.to_dict()))
    text = title if title is not None else (fig.layout.title.text or "")
    line = view_line() if view is None else view
    out.update_layout(title=dict(text=f"{text}<br><sup>{line}</sup>" if line else text, x=0.02, xanchor="left",
                                 font=dict(size=PROJECTOR_FONT + 6)),
                      font=dict(size=PROJECTOR_FONT), width=PROJECTOR_SIZE[0], height=PROJECTOR_SIZE[1],
                      margin=dict(l=110, r=60, t=130, b=110), paper_bgcolor="white")
    out.update_annotations(font_size=PROJECTOR_FONT)
    return out


# -- rendering: Chromium + plotly.js, one browser in one thread per server process ---------------------

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><script>{js}</script></head>
<body style="margin:0"><div id="fig"></div></body></html>"""
_TO_IMAGE = """async ([spec, fmt, scale]) => {
  const gd = document.getElementById('fig');
  await Plotly.newPlot(gd, spec.data, spec.layout, {staticPlot: true});
  return await Plotly.toImage(gd, {format: fmt, width: spec.layout.width || 1000, height: spec.layout.height || 500,
                                   scale: scale});
}"""


class Renderer:
    """A Chromium page holding plotly.js, in a thread of its own; `render` queues a request to it."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="headscope-figures")
        self._ready: Future = Future()
        self._thread.start()

    def _serve(self) -> None:
        try:
            from plotly.offline import get_plotlyjs
            from playwright.sync_api import sync_playwright
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
                    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync"])
                page = browser.new_page()
                page.set_content(_PAGE.format(js=get_plotlyjs()))
                self._ready.set_result(True)
                while True:
                    spec, fmt, scale, done = self._jobs.get()
                    try:
                        done.set_result(page.evaluate(_TO_IMAGE, [spec, fmt, scale]))
                    except Exception as err:  # noqa: BLE001 - handed to the caller
                        done.set_exception(err)
        except Exception as err:  # noqa: BLE001 - no Chromium / Playwright: every render says why
            if not self._ready.done():
                self._ready.set_exception(err)

    def render(self, fig: go.Figure, fmt: str, scale: float = 1.0) -> bytes:
        self._ready.result(timeout=RENDER_TIMEOUT_S)
        done: Future = Future()
        spec = fig.to_plotly_json()
        import json
        import plotly.utils
        spec = json.loads(json.dumps(spec, cls=plotly.utils.PlotlyJSONEncoder))
        self._jobs.put((spec, fmt, scale, done))
        url = done.result(timeout=RENDER_TIMEOUT_S)
        head, _, data = url.partition(",")
        return base64.b64decode(data) if head.endswith(";base64") else urllib.parse.unquote(data).encode("utf-8")


@st.cache_resource(show_spinner=False)
def renderer() -> Renderer:
    """The server's one figure renderer (started on the first download)."""
    return Renderer()


def available() -> str:
    """'' when figures can be rendered here, else why not (one line)."""
    if not CHROMIUM.exists():
        return (f"Rendering figures needs Debian's chromium at {CHROMIUM} (scripts/setup.sh installs it as root); "
                "the chart's camera button still saves a PNG.")
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "Rendering figures needs the playwright package (requirements-dev.txt)."
    return ""


def render(fig: go.Figure, fmt: str) -> bytes:
    """`fig` as SVG or PNG (PNG_SCALE x), through the server's Chromium."""
    return renderer().render(fig, fmt, PNG_SCALE if fmt == "png" else 1)


def safe_name(text: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
    return "_".join(filter(None, keep.split("_")))[:80] or "figure"


def downloads(fig, name: str, *, key: str, where=st, title: str | None = None, label: str = "",
              inline: bool = False) -> None:
    """Two buttons, SVG and PNG, that render `fig` (a figure, or a function that builds one: nothing is
    built before a click) for a projector when clicked; `inline`: into `where` itself (a row already)."""
    why = available()
    row = where if inline else where.container(horizontal=True)

    def projected(fmt: str) -> bytes:
        return render(for_projector(fig() if callable(fig) else fig, title), fmt)

    for fmt, mime in (("svg", "image/svg+xml"), ("png", "image/png")):
        row.download_button(f"{label}{fmt.upper()}", (lambda f=fmt: projected(f)) if not why else b"",
                            file_name=f"{safe_name(name)}.{fmt}", mime=mime, key=f"{key}.{fmt}",
                            disabled=bool(why), help=why or f"This figure as {fmt.upper()} for a projector "
                            f"({'vector' if fmt == 'svg' else f'{PNG_SCALE}x pixels'}), titled with the view.",
                            icon=":material/download:", on_click="ignore")


def pack_button(parts: dict, *, key: str, name: str, where=st) -> None:
    """The "Lecture pack (zip)" button: `parts` is read when it is clicked (name -> (build a figure, what it
    shows)), so a section drawn after the button can still add its figures to it."""
    why = available()
    link = "?" + "&".join(f"{k}={v}" for k, v in st.query_params.to_dict().items())
    view = view_line()

    def build() -> bytes:
        return lecture_pack({n: (make(), what) for n, (make, what) in parts.items()}, view=view, link=link)

    where.download_button("Lecture pack (zip)", build if not why else b"", file_name=f"{safe_name(name)}.zip",
                          mime="application/zip", key=key, disabled=bool(why), on_click="ignore",
                          icon=":material/folder_zip:",
                          help=why or "Every figure of this view as SVG and PNG, titled for a projector, with "
                                      "index.md: what each shows, the view and the link that reopens it.")


def chart(fig: go.Figure, key: str, *, where=st, name: str | None = None, title: str | None = None) -> None:
    """A plotly chart with its SVG / PNG downloads under it (see `downloads`)."""
    where.plotly_chart(fig, width="stretch", key=key, config=PLOTLY_CONFIG)
    downloads(fig, name or key, key=f"dl.{key}", where=where, title=title)


def lecture_pack(figs: dict[str, tuple[go.Figure, str]], *, view: str, link: str) -> bytes:
    """A zip: for each figure name -> (figure, what it shows), its SVG and PNG; and index.md."""
    buffer = io.BytesIO()
    lines = ["# Lecture pack", "", f"View: {view}", "", f"Reopen it: {link}", "",
             "| file | what it shows |", "|---|---|"]
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for i, (name, (fig, what)) in enumerate(figs.items(), start=1):
            stem = f"{i:02d}_{safe_name(name)}"
            projected = for_projector(fig, view=view)
            for fmt in ("svg", "png"):
                z.writestr(f"{stem}.{fmt}", render(projected, fmt))
            lines.append(f"| {stem}.svg / .png | {what} |")
        z.writestr("index.md", "\n".join(lines) + "\n")
    return buffer.getvalue()
