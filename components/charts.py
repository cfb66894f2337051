"""Figure builders: pure functions from arrays to drawings (no Streamlit, no computation).

Every builder takes results that `analysis/` computed and only draws them:
- `layer_head_heatmap`: any [L, H] (or [L, H_kv]) array, layer on y, head on x;
- `mask_heatmap`: kept/pruned cells ([L, H] bool) with the score on hover; z is 1 for pruned;
- `mask_grid`: the same mask as one HTML block for `st.html` -- kept/pruned cells with the score
  on hover and the pruned count of every layer beside its row. The Prune page's live view draws
  this: `st.plotly_chart` remounts (a full Plotly.newPlot) whenever its figure changes, while an
  HTML block is swapped in place, so a key press on z or the sparsity redraws in a few ms;
- `norm_histogram`: one population's row norms with the mean and mean + z*std lines and the
  outlier rows marked;
- `head_bars`: one value per head of a layer (e.g. the per-head excess);
- `curves`: lines such as perplexity vs sparsity, one per scorer;
- `head_slices`: W_Q, W_K, W_V, W_O drawn to scale with one head's slices (and its KV group's) marked;
- `head_rows`: one head's row norms beside the rest of their populations, with each tau.
"""
from __future__ import annotations

import math
from html import escape

import numpy as np
import plotly.graph_objects as go

from analysis.arch.kvplan import KV_MODES, WINDOW
from analysis.arch.window import Window
from analysis.core.ticks import log_ticks as core_log_ticks

KEPT_COLOR = "#dbe9f6"
PRUNED_COLOR = "#c0392b"
MEAN_COLOR = "#2c3e50"
TAU_COLOR = "#e67e22"
_HEIGHT_PER_LAYER = 18


def layer_height(n_layers: int) -> int:
    return int(min(900, max(260, 90 + _HEIGHT_PER_LAYER * n_layers)))


def _axes(fig: go.Figure, n_layers: int, n_cols: int, x_title: str = "head",
          max_x_ticks: int | None = None) -> go.Figure:
    """Axis titles and linear ticks: every head up to 32, else every (n // 16)-th; a narrow chart
    passes `max_x_ticks` (at most that many labels), or its labels overlap into '0123456789'."""
    if max_x_ticks is None:
        dtick = 1 if n_cols <= 32 else max(1, n_cols // 16)
    else:
        dtick = 1 if n_cols <= max_x_ticks else math.ceil(n_cols / max_x_ticks)
    fig.update_xaxes(title_text=x_title, tickmode="linear", dtick=dtick)
    fig.update_yaxes(title_text="layer", autorange="reversed", tickmode="linear",
                     dtick=1 if n_layers <= 16 else 2)
    fig.update_layout(height=layer_height(n_layers), margin=dict(l=50, r=20, t=50, b=40))
    return fig


def _group_lines(fig: go.Figure, n_layers: int, n_heads: int, group_size: int) -> None:
    """Dotted vertical lines between KV groups (GQA), so shared K/V heads are visible."""
    if group_size <= 1:
        return
    for x in np.arange(group_size, n_heads, group_size) - 0.5:
        fig.add_shape(type="line", x0=x, x1=x, y0=-0.5, y1=n_layers - 0.5,
                      line=dict(color="#555", width=1, dash="dot"))


def layer_head_heatmap(values: np.ndarray, title: str, *, colorbar: str = "", x_title: str = "head",
                       group_size: int = 1, colorscale: str = "Viridis") -> go.Figure:
    """Heatmap of values [L, C] (C = heads or KV groups)."""
    values = np.asarray(values, dtype=float)
    n_layers, n_cols = values.shape
    fig = go.Figure(go.Heatmap(
        z=values, x=np.arange(n_cols), y=np.arange(n_layers), colorscale=colorscale,
        colorbar=dict(title=colorbar),
        hovertemplate=f"layer %{{y}}, {x_title} %{{x}}<br>{colorbar or 'value'} %{{z:.4g}}<extra></extra>"))
    fig.update_layout(title=title)
    _group_lines(fig, n_layers, n_cols, group_size)
    return _axes(fig, n_layers, n_cols, x_title)


def mask_heatmap(pruned: np.ndarray, scores: np.ndarray, *, title: str | None = None,
                 score_name: str = "score", group_size: int = 1, max_x_ticks: int | None = None) -> go.Figure:
    """Kept/pruned heads: z = 1 where pruned, 0 where kept; hover shows the head's score.
    `max_x_ticks`: most head labels on the x axis (fewer for a narrow chart)."""
    pruned = np.asarray(pruned, dtype=bool)
    n_layers, n_heads = pruned.shape
    n_pruned = int(pruned.sum())
    status = np.where(pruned, "pruned", "kept")
    fig = go.Figure(go.Heatmap(
        z=pruned.astype(np.int8), x=np.arange(n_heads), y=np.arange(n_layers), zmin=0, zmax=1,
        colorscale=[[0.0, KEPT_COLOR], [0.5, KEPT_COLOR], [0.5, PRUNED_COLOR], [1.0, PRUNED_COLOR]],
        showscale=False, xgap=1, ygap=1, customdata=np.asarray(scores, dtype=float), text=status,
        hovertemplate=f"layer %{{y}}, head %{{x}}: %{{text}}<br>{score_name} %{{customdata:.4g}}<extra></extra>"))
    fig.update_layout(title=title or f"{n_pruned} of {pruned.size} heads pruned (red = pruned)")
    _group_lines(fig, n_layers, n_heads, group_size)
    return _axes(fig, n_layers, n_heads, max_x_ticks=max_x_ticks)


_GRID_CSS = (
    ".hsm{font:12px sans-serif}.hsm-t{font-size:15px;margin:0 0 6px}"
    ".hsm-g{display:grid;gap:1px;align-items:center}"
    ".hsm-g>div{height:13px;line-height:13px}"
    f".hsm-g>.k{{background:{KEPT_COLOR}}}.hsm-g>.p{{background:{PRUNED_COLOR}}}"
    ".hsm-g>.s{margin-left:3px}"                      # the first head of a KV group (G > 1)
    ".hsm-g>.k:hover,.hsm-g>.p:hover{outline:2px solid #2c3e50}"
    ".hsm-g>.y,.hsm-g>.x{color:#555;font-size:10px;text-align:right;padding-right:4px}"
    ".hsm-g>.x{text-align:center;padding:0}"
    ".hsm-g>.n{font-size:10px;color:#555;white-space:nowrap;padding-left:6px}"
    f".hsm-g>.n>b{{display:inline-block;height:8px;background:{TAU_COLOR};margin-right:3px}}"
)


def mask_grid(pruned: np.ndarray, scores: np.ndarray, *, title: str | None = None, score_name: str = "score",
              group_size: int = 1) -> str:
    """Kept/pruned heads as an HTML grid (layer rows, head columns; KV groups spaced apart), the
    head's score on hover, and each layer's pruned count with a bar at the end of its row.

    Every cell carries its state and score (class "k" kept / "p" pruned, `data-s` the score as
    Python writes a float), every row its count (`data-n`), so a test reads back what is drawn."""
    pruned = np.asarray(pruned, dtype=bool)                            # [L, H]
    scores = np.asarray(scores, dtype=float)                           # [L, H]
    n_layers, n_heads = pruned.shape
    per_layer = pruned.sum(axis=1)                                     # [L]
    name = escape(score_name)
    title = escape(title or f"{int(pruned.sum())} of {pruned.size} heads pruned")
    group_size = max(1, int(group_size))

    def head_class(h: int, state: str) -> str:
        return f"{state} s" if group_size > 1 and h and h % group_size == 0 else state

    def group(h: int) -> str:
        return f" (KV group {h // group_size})" if group_size > 1 else ""

    cells = ['<div class="h"></div>', f'<div class="h" style="grid-column:span {n_heads};text-align:center">head</div>',
             '<div class="h"></div>']
    cells += ['<div class="x">layer</div>'] + [f'<div class="{head_class(h, "x")}">{h}</div>' for h in range(n_heads)]
    cells.append('<div class="n">pruned</div>')
    for layer in range(n_layers):
        cells.append(f'<div class="y">{layer}</div>')
        for h in range(n_heads):
            state = "p" if pruned[layer, h] else "k"
            word = "pruned" if pruned[layer, h] else "kept"
            score = float(scores[layer, h])
            tip = f"layer {layer}, head {h}{group(h)}: {word}&#10;{name} {score:.4g}"
            cells.append(f'<div class="{head_class(h, state)}" data-s="{score!r}" data-t="{tip}"></div>')
        count = int(per_layer[layer])
        cells.append(f'<div class="n" data-n="{count}"><b style="width:{round(48 * count / n_heads)}px"></b>'
                     f'{count}</div>')
    columns = f"2.5em repeat({n_heads}, minmax(0, 1fr)) 6em"
    return (f'<style>{_GRID_CSS}</style><div class="hsm" data-layers="{n_layers}" data-heads="{n_heads}">'
            f'<div class="hsm-t">{title}</div>'
            f'<div class="hsm-l"><i style="background:{PRUNED_COLOR}"></i>red = pruned &nbsp;'
            f'<i style="background:{KEPT_COLOR}"></i>blue = kept &nbsp; (hover a cell for its score)</div>'
            f'<div class="hsm-g" style="grid-template-columns:{columns}">'
            + "".join(cells) + "</div></div>")


def norm_histogram(norms: np.ndarray, mean: float, tau: float, *, title: str, z: float,
                   row_labels: list[str] | None = None, bins: int = 60) -> go.Figure:
    """Histogram of one population's row norms; vertical lines at the mean and tau = mean + z*std;
    rows above tau (the outliers) drawn as red markers under the bars, labelled on hover."""
    norms = np.asarray(norms, dtype=float).ravel()
    labels = np.asarray(row_labels if row_labels is not None else [f"row {i}" for i in range(norms.size)])
    outliers = norms > tau
    fig = go.Figure(go.Histogram(x=norms, nbinsx=bins, name="rows", marker_color="#7f9cbf",
                                 hovertemplate="norm %{x}<br>%{y} rows<extra></extra>"))
    fig.add_trace(go.Scatter(x=norms[outliers], y=np.zeros(int(outliers.sum())), mode="markers",
                             name=f"outliers ({int(outliers.sum())})", text=labels[outliers],
                             marker=dict(color=PRUNED_COLOR, symbol="triangle-up", size=10),
                             hovertemplate="%{text}<br>norm %{x:.4g}<extra></extra>"))
    # The line labels sit above the plot area (paper y = 1), where no bar can hide them: the
    # tallest bar is usually the one at the mean.
    above = dict(yref="paper", y=1.0, yanchor="bottom", showarrow=False, bgcolor="rgba(255,255,255,0.9)")
    fig.add_vline(x=mean, line=dict(color=MEAN_COLOR, dash="dash"))
    fig.add_vline(x=tau, line=dict(color=TAU_COLOR, width=2))
    fig.add_annotation(x=mean, text=f"mean {mean:.3g}", xanchor="right", font=dict(color=MEAN_COLOR), **above)
    fig.add_annotation(x=tau, text=f"mean + {z:g}·std = {tau:.3g}", xanchor="left", font=dict(color=TAU_COLOR),
                       **above)
    fig.update_layout(title=title, height=360, bargap=0.05, xaxis_title="row norm", yaxis_title="rows",
                      margin=dict(l=50, r=20, t=80, b=40), legend=dict(orientation="h", y=-0.25))
    return fig


def head_bars(values: np.ndarray, *, title: str, y_title: str, labels: list[str] | None = None,
              x_title: str = "head", height: int = 300) -> go.Figure:
    """One bar per head (or group, or layer)."""
    values = np.asarray(values, dtype=float)
    x = labels if labels is not None else [str(i) for i in range(values.size)]
    fig = go.Figure(go.Bar(x=x, y=values, marker_color=TAU_COLOR,
                           hovertemplate="%{x}: %{y:.4g}<extra></extra>"))
    fig.update_layout(title=title, height=height, xaxis_title=x_title, yaxis_title=y_title,
                      margin=dict(l=50, r=20, t=50, b=40))
    return fig


def log_axis(metric: str) -> bool:
    """Whether a metric's axis is logarithmic: perplexities span orders of magnitude when heads go
    (a linear 0-4000 axis flattens the region that matters); fidelity-type metrics do not."""
    return metric.endswith("perplexity")


# one colour per scorer, fixed by its place in the registry (so MP and MP-G never share one)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39")


def curves(series: dict[str, tuple], *, title: str, x_title: str, y_title: str, log_y: bool = False,
           marker_x: float | None = None, colors: dict[str, str] | None = None) -> go.Figure:
    """Lines {name: (x, y)}; optional vertical marker (e.g. the current sparsity or z); `colors`
    {name: colour} (else PALETTE in order)."""
    fig = go.Figure()
    for i, (name, (x, y)) in enumerate(series.items()):
        color = (colors or {}).get(name, PALETTE[i % len(PALETTE)])
        fig.add_trace(go.Scatter(x=np.asarray(x, dtype=float), y=np.asarray(y, dtype=float), name=name,
                                 mode="lines+markers", line=dict(color=color), marker=dict(color=color)))
    if marker_x is not None:
        fig.add_vline(x=marker_x, line=dict(color="#999", dash="dot"))
    fig.update_layout(title=title, height=360, xaxis_title=x_title, yaxis_title=y_title,
                      margin=dict(l=50, r=20, t=50, b=40))
    if log_y:
        log_ticks(fig, [v for _, y in series.values() for v in np.asarray(y, dtype=float).ravel()])
    return fig


def frontier(points: dict, *, title: str) -> go.Figure:
    """File size (MiB) against perplexity with 95 % CIs, one series per label (dense, the cut), each point
    named by its GGUF type, and the Pareto frontier as a grey step line
    (analysis.compress.recover.frontier's points)."""
    from analysis.compress.recover.frontier import measured, pareto
    ok = measured(points)
    fig = go.Figure()
    for i, label in enumerate(sorted({p["label"] for p in ok.values()}, key=lambda s: (s != "dense", s))):
        group = sorted((p for p in ok.values() if p["label"] == label), key=lambda p: p["bytes"])
        y = np.asarray([p["ppl"] for p in group])                                      # [n]
        fig.add_trace(go.Scatter(
            x=[p["bytes"] / 2**20 for p in group], y=y, name=label, mode="lines+markers+text",
            text=[p["type"] for p in group], textposition="top right", line=dict(color=PALETTE[i % len(PALETTE)]),
            error_y=dict(type="data", symmetric=False, array=[p["hi"] - p["ppl"] for p in group],
                         arrayminus=[p["ppl"] - p["lo"] for p in group])))
    front = [ok[k] for k in pareto(ok)]
    fig.add_trace(go.Scatter(x=[p["bytes"] / 2**20 for p in front], y=[p["ppl"] for p in front], name="Pareto frontier",
                             mode="lines", line=dict(color="#999", width=6, shape="hv"), opacity=0.4))
    fig.update_layout(title=title, height=380, xaxis_title="GGUF file (MiB)",
                      yaxis_title="llama.cpp perplexity (95 % CI)", margin=dict(l=50, r=20, t=50, b=40))
    # log axis: a damaged cut (perplexity 200) would flatten the dense points (15-20) into one line
    return log_ticks(fig, [v for p in ok.values() for v in (p["lo"], p["ppl"], p["hi"])])


def log_ticks(fig: go.Figure, values, axis: str = "y") -> go.Figure:
    """THE log-axis rule (analysis.core.ticks: whole numbers written in full, at least two, inside the
    range) on a plotly axis; plotly's default labels bare minor digits ("5, 2, 1000, 5, 2, 100"), and a
    reader takes the top "5" for a perplexity of 5."""
    update = fig.update_yaxes if axis == "y" else fig.update_xaxes
    found = core_log_ticks(np.asarray(list(values), dtype=float).ravel())
    if found is None:
        return update(type="log")
    ticks, (low, high), labels = found
    return update(type="log", tickmode="array", tickvals=ticks, range=[low, high], ticktext=labels,
                  minor=dict(showgrid=False))


def matrix_heatmap(values: np.ndarray, labels: list[str], *, title: str, fmt: str = ".2f",
                   zmin: float | None = None, zmax: float | None = None) -> go.Figure:
    """A square labelled matrix (Jaccard overlaps, rank correlations) with the numbers written in.

    A range that includes negative values (a correlation, -1 .. 1) gets a diverging scale centred
    at 0 (blue negative, white 0, red positive), so -0.10 does not look positive."""
    values = np.asarray(values, dtype=float)
    signed = zmin is not None and zmin < 0
    scale = dict(colorscale="RdBu_r", zmid=0.0) if signed else dict(colorscale="Blues")
    fig = go.Figure(go.Heatmap(z=values, x=labels, y=labels, zmin=zmin, zmax=zmax, **scale,
                               text=[[format(v, fmt) for v in row] for row in values],
                               texttemplate="%{text}", hovertemplate="%{y} vs %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, height=120 + 45 * len(labels), margin=dict(l=80, r=20, t=50, b=60))
    fig.update_yaxes(autorange="reversed")
    return fig


def attention_heatmap(weights: np.ndarray, tokens: list[str], *, title: str) -> go.Figure:
    """One head's attention pattern [T, T] (query rows, key columns) over the sentence's tokens."""
    weights = np.asarray(weights, dtype=float)
    idx = [f"{i}:{t}" for i, t in enumerate(tokens)]
    fig = go.Figure(go.Heatmap(z=weights, x=idx, y=idx, colorscale="Greys", zmin=0,
                               hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, height=min(800, 200 + 18 * len(tokens)), margin=dict(l=80, r=20, t=50, b=80))
    fig.update_yaxes(autorange="reversed", title_text="query token")
    fig.update_xaxes(title_text="key token")
    return fig


CATEGORY_COLORS = ["#eeeeee", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22", "#17becf"]


def category_heatmap(labels: np.ndarray, categories: list[str], strengths: np.ndarray, *, title: str,
                     group_size: int = 1) -> go.Figure:
    """Layer x head map of one category per cell ("" = none); hover shows category and strength."""
    labels = np.asarray(labels, dtype=object)
    n_layers, n_heads = labels.shape
    cats = ["", *categories]
    index = np.vectorize(lambda c: cats.index(c) if c in cats else 0, otypes=[np.int16])(labels)  # [L, H]
    n = len(cats)
    scale = []
    for i in range(n):
        color = CATEGORY_COLORS[i % len(CATEGORY_COLORS)]
        scale += [[i / n, color], [(i + 1) / n, color]]
    fig = go.Figure(go.Heatmap(
        z=index, x=np.arange(n_heads), y=np.arange(n_layers), zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        customdata=np.asarray(strengths, dtype=float), text=np.where(labels == "", "no tag", labels).astype(str),
        xgap=1, ygap=1, hovertemplate="layer %{y}, head %{x}: %{text}<br>strength %{customdata:.3f}<extra></extra>",
        colorbar=dict(tickvals=list(range(n)), ticktext=["none", *categories])))
    fig.update_layout(title=title)
    _group_lines(fig, n_layers, n_heads, group_size)
    return _axes(fig, n_layers, n_heads)


SLICE_COLOR = "#c0392b"       # the head's own slices
LEGEND_MARGIN = 70            # px below a plot for a one-line horizontal legend
GROUP_COLOR = "#f5b7b1"       # the other query heads of its KV group
MATRIX_COLOR = "#eef2f7"


def _slice_rect(fig: go.Figure, x0: float, x1: float, y0: float, y1: float, color: str) -> None:
    fig.add_shape(type="rect", x0=x0, x1=x1, y0=y0, y1=y1, line=dict(width=0), fillcolor=color)


def head_slices(*, n_heads: int, n_kv_heads: int, head_dim: int, hidden: int, head: int) -> go.Figure:
    """W_Q [H*d, D], W_K and W_V [Hkv*d, D], W_O [D, H*d] side by side, to scale ([out, in] as
    nn.Linear stores them). Marked: head h's Q rows h*d..(h+1)*d-1 and O columns in the same range,
    and its KV group g = h // G's K/V rows g*d..(g+1)*d-1; the group's other query heads lighter.
    One hover marker per marked slice names its index range."""
    H, Hkv, d, D = int(n_heads), int(n_kv_heads), int(head_dim), int(hidden)
    G = H // Hkv
    g = head // G
    gap = 0.12 * max(D, H * d)
    # name -> (rows, cols, own slice (axis, start, stop), group slice or None)
    mats = {
        "W_Q": (H * d, D, ("rows", head * d, (head + 1) * d), ("rows", g * G * d, (g + 1) * G * d)),
        "W_K": (Hkv * d, D, ("rows", g * d, (g + 1) * d), None),
        "W_V": (Hkv * d, D, ("rows", g * d, (g + 1) * d), None),
        "W_O": (D, H * d, ("columns", head * d, (head + 1) * d), ("columns", g * G * d, (g + 1) * G * d)),
    }
    fig = go.Figure()
    hover_x, hover_y, hover_text = [], [], []
    x = 0.0
    for name, (rows, cols, own, group) in mats.items():
        fig.add_shape(type="rect", x0=x, x1=x + cols, y0=0, y1=rows, fillcolor=MATRIX_COLOR,
                      line=dict(color="#7f8c8d", width=1))
        for part, color in ((group, GROUP_COLOR), (own, SLICE_COLOR)):
            if part is None or (part is group and G == 1):
                continue
            axis, lo, hi = part
            if axis == "rows":
                _slice_rect(fig, x, x + cols, lo, hi, color)
                cx, cy = x + cols / 2, (lo + hi) / 2
            else:
                _slice_rect(fig, x + lo, x + hi, 0, rows, color)
                cx, cy = x + (lo + hi) / 2, rows / 2
            if part is own:
                hover_x.append(cx)
                hover_y.append(cy)
                who = f"head {head}" if name in ("W_Q", "W_O") else f"KV group {g}"
                hover_text.append(f"{name} {axis} {lo}..{hi - 1} ({who})")
        fig.add_annotation(x=x + cols / 2, y=-0.04 * max(D, H * d), text=f"<b>{name}</b> [{rows} x {cols}]",
                           showarrow=False, yanchor="bottom")
        x += cols + gap
    fig.add_trace(go.Scatter(x=hover_x, y=hover_y, mode="markers", text=hover_text, name="slices",
                             marker=dict(color=SLICE_COLOR, size=6, symbol="diamond"),
                             hovertemplate="%{text}<extra></extra>", showlegend=False))
    top = max(D, H * d, Hkv * d)
    fig.update_xaxes(visible=False, range=[-gap / 4, x - gap * 0.75])
    fig.update_yaxes(visible=False, range=[top * 1.02, -0.12 * top], scaleanchor="x")
    extra = f"; lighter: the other {G - 1} query heads of KV group {g}" if G > 1 else ""
    fig.update_layout(title=f"Query head {head}: its slices of the four projections (red{extra})",
                      height=300, margin=dict(l=10, r=10, t=50, b=10), plot_bgcolor="white")
    return fig


def head_rows(population: dict[str, np.ndarray], picked: dict[str, int], taus: dict[str, float], *,
              title: str) -> go.Figure:
    """Row norms of one layer, one panel per projection, each with its own y axis (V and O norms are
    on other scales than Q and K: on one axis they were flat lines): every row of the population
    population[p] [units, d] in grey, the picked unit's d rows (picked[p]: the head for Q/O, its KV
    group for K/V) in red, and that population's tau as an orange line."""
    from plotly.subplots import make_subplots
    names = list(population)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=[
        f"{p.upper()} ({'head' if p in ('q', 'o') else 'KV group'} {picked[p]}), τ = {taus[p]:.3g}" for p in names])
    for i, p in enumerate(names, start=1):
        rows = np.asarray(population[p], dtype=float)                      # [units, d]
        units, d = rows.shape
        spread = np.linspace(-0.3, 0.3, rows.size).reshape(units, d)       # [units, d] fixed jitter
        mine = np.zeros((units, d), dtype=bool)                            # [units, d]
        mine[picked[p]] = True
        text = [f"{p.upper()} {'head' if p in ('q', 'o') else 'KV group'} {picked[p]}, row {j}" for j in range(d)]
        first = i == 1
        fig.add_trace(go.Scatter(x=spread[~mine], y=rows[~mine], mode="markers", name="other rows of the population",
                                 marker=dict(color="#b0bec5", size=4), showlegend=first, legendgroup="rest",
                                 hovertemplate="norm %{y:.4g}<extra></extra>"), row=1, col=i)
        fig.add_trace(go.Scatter(x=spread[mine], y=rows[mine], mode="markers", name="this head's rows", text=text,
                                 marker=dict(color=SLICE_COLOR, size=7), showlegend=first, legendgroup="own",
                                 hovertemplate="%{text}<br>norm %{y:.4g}<extra></extra>"), row=1, col=i)
        fig.add_trace(go.Scatter(x=[-0.4, 0.4], y=[taus[p], taus[p]], mode="lines", name="tau = mean + z·std",
                                 line=dict(color=TAU_COLOR, width=3), showlegend=first, legendgroup="tau",
                                 hovertemplate="tau %{y:.4g}<extra></extra>"), row=1, col=i)
        fig.update_xaxes(showticklabels=False, range=[-0.5, 0.5], row=1, col=i)
    fig.update_yaxes(title_text="row norm", row=1, col=1)
    # the legend below the panels inside the bottom margin: at y=-0.1 with a 40 px margin a downloaded
    # image cut its last entry ("tau = mean + z*st", issue 33)
    fig.update_layout(title=title, height=420, margin=dict(l=50, r=20, t=80, b=LEGEND_MARGIN),
                      legend=dict(orientation="h", x=0, y=0, yref="container", yanchor="bottom"))
    return fig


def kv_copies(kept: tuple[int, ...], group_size: int, *, expanded: bool) -> str:
    """One GQA layer before and after surgery as an HTML picture: per KV group its G query heads
    (kept blue, pruned grey) above its K/V head; after surgery, when K/V must be copied per query
    head (`expanded`), every kept query head gets its own K/V copy (orange)."""
    cell = ('<span style="display:inline-block;width:22px;height:16px;margin:1px;border-radius:2px;'
            'background:{};font:9px sans-serif;color:#fff;text-align:center;line-height:16px">{}</span>')
    before, after = [], []
    for g, n in enumerate(kept):
        queries = "".join(cell.format("#1f77b4" if h < n else "#cfd8dc", "Q") for h in range(group_size))
        kv = cell.format("#2ca02c" if n else "#cfd8dc", "KV")
        before.append(f'<div style="display:inline-block;margin:0 8px;text-align:center">{queries}<br>{kv}'
                      f'<br><small>group {g}</small></div>')
        if expanded:
            copies = "".join(f'<span style="display:inline-block;text-align:center">{cell.format("#1f77b4", "Q")}'
                             f'<br>{cell.format("#ff7f0e", "KV")}</span>' for _ in range(n))
        else:
            copies = ("".join(cell.format("#1f77b4", "Q") for _ in range(n)) + "<br>" + cell.format("#2ca02c", "KV")
                      if n else "")
        after.append(f'<div style="display:inline-block;margin:0 8px;text-align:center;min-width:30px">{copies}</div>')
    note = ("each kept query head gets its own copy of its group's K/V (orange)" if expanded else
            "the kept groups keep their shared K/V")
    return ('<div style="font:12px sans-serif;margin:4px 0 10px">'
            f'<div><b>kept {" + ".join(map(str, kept))}</b>: the mask</div><div>{"".join(before)}</div>'
            f'<div style="margin-top:4px">after surgery: {note}</div><div>{"".join(after)}</div></div>')


def kv_copies_figure(kept: tuple[int, ...], group_size: int, *, expanded: bool, title: str = "") -> go.Figure:
    """`kv_copies` as a figure (for a download or a projector): per KV group its G query heads (kept blue,
    pruned grey) above its K/V head; below, after surgery, the kept query heads with their K/V (one copy
    per query head, orange, when `expanded`). Big boxes with their letters, so it reads from afar."""
    fig = go.Figure()
    box, gap = 1.0, 0.6

    def cell(x: float, y: float, color: str, text: str) -> None:
        fig.add_shape(type="rect", x0=x, x1=x + box * 0.9, y0=y, y1=y + box * 0.9, fillcolor=color,
                      line=dict(width=0))
        fig.add_annotation(x=x + box * 0.45, y=y + box * 0.45, text=text, showarrow=False, font=dict(color="white"))

    x = 0.0
    for g, n in enumerate(kept):
        left = x
        for h in range(group_size):
            cell(x + h * box, 3.0, "#1f77b4" if h < n else "#cfd8dc", "Q")
        cell(left + (group_size - 1) * box / 2, 2.0, "#2ca02c" if n else "#cfd8dc", "KV")
        fig.add_annotation(x=left + group_size * box / 2 - 0.05, y=1.75, text=f"group {g}", showarrow=False)
        if expanded:
            for h in range(n):
                cell(left + h * box, 0.6, "#1f77b4", "Q")
                cell(left + h * box, -0.4, "#ff7f0e", "KV")
        elif n:
            for h in range(n):
                cell(left + h * box, 0.6, "#1f77b4", "Q")
            cell(left + (n - 1) * box / 2, -0.4, "#2ca02c", "KV")
        x += group_size * box + gap
    note = ("after surgery: each kept query head gets its own copy of its group's K/V (orange)" if expanded else
            "after surgery: the kept groups keep their shared K/V")
    fig.add_annotation(x=0, y=1.35, xanchor="left", text=note, showarrow=False)
    fig.add_annotation(x=0, y=4.2, xanchor="left", text=f"the mask: heads kept per KV group {' + '.join(map(str, kept))}",
                       showarrow=False)
    fig.update_xaxes(visible=False, range=[-0.3, x])
    fig.update_yaxes(visible=False, range=[-0.7, 4.6], scaleanchor="x")
    fig.update_layout(title=title or f"Kept {' + '.join(map(str, kept))}: before and after surgery", height=320,
                      margin=dict(l=10, r=10, t=50, b=10), plot_bgcolor="white")
    return fig


def score_vs_effect(scores: np.ndarray, effect: np.ndarray, *, x_title: str, y_title: str, title: str,
                    group_size: int = 1) -> go.Figure:
    """One point per head: a scorer's score (x) against the measured effect of removing it (y), e.g.
    MP-G against the single-head ablation's loss increase; hover names the head."""
    scores, effect = np.asarray(scores, dtype=float), np.asarray(effect, dtype=float)       # [L, H] each
    L, H = scores.shape
    names = np.array([[f"L{l}H{h}" + (f" (KV group {h // group_size})" if group_size > 1 else "") for h in range(H)]
                      for l in range(L)])
    fig = go.Figure(go.Scatter(x=scores.ravel(), y=effect.ravel(), mode="markers", text=names.ravel(),
                               marker=dict(color=np.repeat(np.arange(L), H), colorscale="Viridis", size=7,
                                           colorbar=dict(title="layer")),
                               hovertemplate="%{text}<br>score %{x:.4g}<br>effect %{y:.4g}<extra></extra>"))
    fig.add_hline(y=0, line=dict(color="#999", dash="dot"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, height=420,
                      margin=dict(l=60, r=20, t=60, b=50))
    return fig


# -- long context: the KV plan and where a head's attention goes ------------------------------------------
KV_MODE_COLORS = {"full": "#2e86c1", "window": "#f39c12", "prune": PRUNED_COLOR}   # blue, orange, red


def kv_agreement_heatmap(agreement, *, group_size: int, names: tuple[str, str]) -> go.Figure:
    """[L, Hkv] which of two KV plans keeps each KV head full (analysis.compress.export.duo.Agreement: both, the
    first only, the second only, neither) in four colours, layer on y, KV head on x."""
    kinds = (("both", "full in both", KV_MODE_COLORS["full"]), ("only_first", f"full in {names[0]} only", "#8e44ad"),
             ("only_second", f"full in {names[1]} only", "#16a085"), ("neither", "windowed in both",
                                                                       KV_MODE_COLORS["window"]))
    codes = np.zeros(agreement.both.shape, dtype=np.int8)                 # [L, Hkv]
    for i, (field, _, _) in enumerate(kinds):
        codes[getattr(agreement, field)] = i
    L, Hkv = codes.shape
    G = max(1, int(group_size))
    text = [[kinds[c][1] + (f"<br>query heads {j * G}-{j * G + G - 1}" if G > 1 else "") for j, c in enumerate(row)]
            for row in codes.tolist()]
    n, scale = len(kinds), []
    for i, (_, _, color) in enumerate(kinds):
        scale += [[i / n, color], [(i + 1) / n, color]]
    fig = go.Figure(go.Heatmap(z=codes, x=np.arange(Hkv), y=np.arange(L), zmin=-0.5, zmax=n - 0.5, colorscale=scale,
                               xgap=2, ygap=1, text=text, showscale=False,
                               hovertemplate="layer %{y}, KV head %{x}: %{text}<extra></extra>"))
    for _, name, color in kinds:                                          # the key, as legend entries
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                                 marker=dict(symbol="square", size=12, color=color)))
    fig.update_layout(title=f"{names[0].capitalize()} beside {names[1]}", plot_bgcolor="white",
                      legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", xanchor="left"))
    _axes(fig, L, Hkv, x_title="KV head")
    return fig.update_layout(margin=dict(l=50, r=20, t=80, b=40))


def kv_plan_heatmap(modes: np.ndarray, *, group_size: int, window: Window, title: str) -> go.Figure:
    """A KV plan's modes [L, Hkv] (analysis.arch.kvplan.KV_MODES' codes) in their colours, layer on y, KV head
    on x; hover names the query heads of each KV head and what it keeps."""
    modes = np.asarray(modes, dtype=np.int8)
    L, Hkv = modes.shape
    G = max(1, int(group_size))
    keeps = [window.describe() if m.code == WINDOW else m.keeps for m in KV_MODES]
    text = [[f"{KV_MODES[c].name}: keeps {keeps[c]}" + (f"<br>query heads {j * G}-{j * G + G - 1}" if G > 1 else "")
             for j, c in enumerate(row)] for row in modes.tolist()]
    scale = []
    n = len(KV_MODES)
    for m in KV_MODES:
        scale += [[m.code / n, KV_MODE_COLORS[m.name]], [(m.code + 1) / n, KV_MODE_COLORS[m.name]]]
    fig = go.Figure(go.Heatmap(
        z=modes, x=np.arange(Hkv), y=np.arange(L), zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=2, ygap=1,
        text=text, hovertemplate="layer %{y}, KV head %{x}: %{text}<extra></extra>", showscale=False))
    for name, color in KV_MODE_COLORS.items():                      # the key, as legend entries
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                                 marker=dict(symbol="square", size=12, color=color)))
    fig.update_layout(title=title, legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", xanchor="left"),
                      plot_bgcolor="white")
    _axes(fig, L, Hkv, x_title="KV head")
    return fig.update_layout(margin=dict(l=50, r=20, t=80, b=40))


def attention_over_keys(mass: np.ndarray, *, title: str, regions: dict[str, tuple[int, int]],
                        tokens: list[str] | None = None) -> go.Figure:
    """One head's attention mass [T] over the key positions (log y: the sinks' mass dwarfs the rest), with
    the named key ranges {name: (start, stop)} shaded and labelled (sinks, needle, recent window); `tokens`
    [T] name each key on hover."""
    mass = np.asarray(mass, dtype=float)
    T = mass.size
    names = [repr(t)[1:-1] for t in tokens] if tokens is not None and len(tokens) == T else [""] * T
    fig = go.Figure(go.Scatter(x=np.arange(T), y=np.maximum(mass, 1e-6), mode="lines", name="attention",
                               line=dict(color=MEAN_COLOR, width=1), text=names,
                               hovertemplate="key %{x} '%{text}': %{y:.3g}<extra></extra>"))
    colors = {"sinks": KV_MODE_COLORS["full"], "recent window": KV_MODE_COLORS["window"], "needle": "#27ae60"}
    for i, (name, (start, stop)) in enumerate(regions.items()):
        color = colors.get(name, PALETTE[i % len(PALETTE)])
        fig.add_vrect(x0=start - 0.5, x1=stop - 0.5, fillcolor=color, opacity=0.25, line_width=0,
                      annotation_text=name, annotation_position="top left" if i % 2 else "top right",
                      annotation_font_color=color)
    fig.update_layout(title=title, height=340, xaxis_title="key position (token)", showlegend=False,
                      yaxis_title="attention (mean of the last queries)", margin=dict(l=60, r=20, t=60, b=45))
    return log_ticks(fig, [max(float(mass.max()), 1e-6), 1e-6])


def task_length_heatmap(tasks: list[str], lengths: list[int], scores: np.ndarray, passes: np.ndarray, *,
                        title: str) -> go.Figure:
    """Dense's score per task (rows) and length (columns) [n_tasks, n_lengths], 0..1, the numbers written in;
    cells in the test set (`passes` [n_tasks, n_lengths] bool) starred; NaN: not measured (blank)."""
    scores = np.asarray(scores, dtype=float)                                           # [n_tasks, n_lengths]
    text = [["" if np.isnan(v) else f"{v:.2f}" + (" *" if ok else "") for v, ok in zip(row, prow)]
            for row, prow in zip(scores, passes)]
    fig = go.Figure(go.Heatmap(z=scores, x=[f"{n:,}" for n in lengths], y=tasks, zmin=0.0, zmax=1.0,
                               colorscale="RdYlGn", text=text, texttemplate="%{text}", colorbar=dict(title="score"),
                               hovertemplate="%{y} at %{x} tokens: %{z:.2f}<extra></extra>"))
    fig.update_layout(title=title, height=140 + 32 * len(tasks), margin=dict(l=140, r=20, t=50, b=50),
                      xaxis_title="tokens", xaxis_type="category")
    fig.update_yaxes(autorange="reversed")
    return fig


def kv_frontier(lines: dict, dense: tuple[float, float, float], *, title: str, mark: float | None = None) -> go.Figure:
    """Score against the KV cache held (x, fraction of dense), one line per method: lines[name] = [(kv, score,
    low, high)]; dense (score, low, high) as the ceiling with its band; `mark`: the KV the view's plan holds."""
    fig = go.Figure()
    fig.add_hrect(y0=dense[1], y1=dense[2], fillcolor="#999", opacity=0.2, line_width=0)
    fig.add_hline(y=dense[0], line=dict(color="black", width=1), annotation_text="dense",
                  annotation_position="bottom left")
    for i, (name, pts) in enumerate(sorted(lines.items())):
        pts = sorted(pts)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=name, mode="lines+markers",
                                 line=dict(color=PALETTE[i % len(PALETTE)]),
                                 error_y=dict(type="data", symmetric=False, array=[p[3] - p[1] for p in pts],
                                              arrayminus=[p[1] - p[2] for p in pts])))
    if mark is not None:
        fig.add_vline(x=mark, line=dict(color="#555", dash="dot"), annotation_text="this plan")
    fig.update_layout(title=title, height=360, xaxis_title="KV cache held / dense", yaxis_title="test-set score (95 % CI)",
                      xaxis_range=[0.0, 1.05], yaxis_range=[-0.05, 1.05], margin=dict(l=50, r=20, t=50, b=40))
    return fig
