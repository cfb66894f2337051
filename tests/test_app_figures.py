"""Figures for a teacher (components/figures.py, issue 33): every chart downloads as SVG and as a high-DPI
PNG, re-laid out for a projector with the view in its title (rendered offline by Debian's Chromium with the
plotly package's own plotly.js); the lecture pack zips the view's figures with an index; the sentence
under the curves is computed from them; the Walkthrough's legend stays inside its figure."""
import io
import re
import zipfile

import numpy as np
import pytest

from tests._apptools import fresh_caches, new_app, no_exception, tiny_dir  # noqa: F401

VIEW = "smollm2-135m · MP-G, z = 2 · sparsity 0.3 · policy groups"


def needs_renderer():
    from components import figures
    why = figures.available()
    return pytest.mark.skipif(bool(why), reason=why or "ok")


def _curves():
    from components import charts
    return charts.curves({"MP-G": ([0, 0.2, 0.4], [17.0, 40.0, 7128.0]), "Random (floor)": ([0, 0.2, 0.4], [17.0, 45.0, 120.0])},
                         title="perplexity vs sparsity", x_title="sparsity", y_title="perplexity", log_y=True)


def test_the_projector_copy_is_big_16_9_and_titled_with_the_view():
    from components import figures
    fig = figures.for_projector(_curves(), view=VIEW)
    assert (fig.layout.width, fig.layout.height) == figures.PROJECTOR_SIZE
    assert fig.layout.font.size == figures.PROJECTOR_FONT
    assert "perplexity vs sparsity" in fig.layout.title.text and VIEW in fig.layout.title.text
    assert _curves().layout.width is None                  # the page's figure is not changed


@needs_renderer()
@pytest.mark.slow
def test_svg_and_png_render_offline_with_the_title():
    from components import figures
    fig = figures.for_projector(_curves(), view=VIEW)
    svg = figures.render(fig, "svg").decode()
    assert svg.lstrip().startswith("<svg") and "perplexity vs sparsity" in svg and "MP-G, z = 2" in svg
    png = figures.render(fig, "png")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == tuple(figures.PNG_SCALE * s for s in figures.PROJECTOR_SIZE)


@needs_renderer()
@pytest.mark.slow
def test_the_walkthrough_legend_is_inside_the_downloaded_figure():
    """Issue 33: the downloaded Walkthrough figure cut its legend ("tau = mean + z*st")."""
    from components import charts, figures
    rng = np.random.default_rng(0)
    population = {p: rng.random((3, 8)) for p in "qkvo"}
    fig = charts.head_rows(population, {p: 0 for p in "qkvo"}, {p: 0.8 for p in "qkvo"}, title="rows")
    for out in (fig, figures.for_projector(fig, view=VIEW)):
        svg = figures.render(out, "svg").decode()
        height = float(re.search(r'<svg[^>]*height="([\d.]+)"', svg).group(1))
        legend_y = float(re.search(r'class="legend"[^>]*transform="translate\([\d.]+, ?([\d.]+)\)"', svg).group(1))
        assert "tau = mean + z·std" in svg
        assert legend_y + 20 <= height, (legend_y, height)    # the one-line legend ends inside the image


@needs_renderer()
@pytest.mark.slow
def test_the_lecture_pack_holds_every_figure_and_an_index():
    from components import charts, figures
    mask = np.zeros((4, 6), bool)
    mask[1, :3] = True
    parts = {"mask": (charts.mask_heatmap(mask, np.arange(24.0).reshape(4, 6)), "the mask"),
             "curves": (_curves(), "perplexity vs sparsity")}
    data = figures.lecture_pack(parts, view=VIEW, link="?model=smollm2-135m&sparsity=0.3")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = sorted(z.namelist())
        index = z.read("index.md").decode()
    assert names == ["01_mask.png", "01_mask.svg", "02_curves.png", "02_curves.svg", "index.md"]
    assert VIEW in index and "?model=smollm2-135m&sparsity=0.3" in index and "| 02_curves.svg / .png | perplexity vs sparsity |" in index


def test_the_sentence_under_the_curves_is_computed_from_them():
    from components import explain
    c = {"MP-G": ([0, 0.2, 0.4], [17.0, 40.0, 7128.0]), "Random (floor)": ([0, 0.2, 0.4], [17.0, 45.0, 120.0])}
    text = explain.curves_sentence(c, metric="perplexity", higher_is_better=False, floor="Random (floor)")
    assert text == ("At sparsity 0.4 the best is Random (floor) (perplexity 120), the worst MP-G (7,128); MP-G is "
                    "worse than Random (floor) from sparsity 0.4 on (7,128 vs 120).")
    c["MP-G"] = ([0, 0.2, 0.4], [17.0, 30.0, 60.0])
    text = explain.curves_sentence(c, metric="perplexity", higher_is_better=False, floor="Random (floor)")
    assert text == "At sparsity 0.4 the best is MP-G (perplexity 60), the worst Random (floor) (120)."


@pytest.mark.usefixtures("fresh_caches")
def test_prune_offers_the_mask_and_the_lecture_pack(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global", sparsity="0.25")
    no_exception(at)
    keys = {b.key for b in at.get("download_button")}
    assert {"prune.dl.grid.svg", "prune.dl.grid.png", "prune.dl.pack"} <= keys, keys
