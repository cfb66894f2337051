"""Profiles page: per-head row norms of Q, K, V, O as layer x head heatmaps; one population's
row-norm distribution with the mean and mean + z*std lines and its outlier rows; per-head excess."""
import numpy as np
import streamlit as st

from analysis.score import scoring
from components import cache, charts, controls, explain, figures, shell, state
from components.errors import shown_errors

shell.ensure_app()

PROJ_TITLES = {"q": "Q (rows of W_Q)", "k": "K (rows of W_K)", "v": "V (rows of W_V)", "o": "O (columns of W_O)"}

st.title("Profiles")
st.caption("Row norms of every attention projection, computed once per model. Moving z only moves "
           "the threshold: the norms are never recomputed.")
lm = cache.model_or_stop()
g = lm.geometry
prof = cache.profile_or_stop()

c1, c2, c3 = st.columns([1, 1, 2])
ord_ = controls.param_widget(scoring.ORD, state.widget_key("profiles.ord", value=scoring.ORD.default), c1)
scope = controls.param_widget(scoring.SCOPE, state.widget_key("profiles.scope", value=scoring.SCOPE.default), c2)
convention = controls.param_widget(scoring.STD, state.widget_key("profiles.std", value=scoring.STD.default), c3)
st.caption(f"Threshold tau = mean + z * std with the {scoring.STD.shown(convention)} std.")
kv_unit = "KV group" if g.group_size > 1 else "head"           # MHA: K/V rows belong to one head each

norms = stats = None
with shown_errors("Computing thresholds"):
    norms = prof.norms(ord_)                                   # {p: [L, units, d]}
    stats = prof.stats(ord_, scope, convention)                # {p: (mean [L], std [L])}

    st.subheader("Mean row norm per head")
    for pair in (("q", "k"), ("v", "o")):                      # a 2 x 2 grid: wide enough for 12+ heads
        for col, p in zip(st.columns(2), pair):
            per_unit = norms[p].mean(axis=-1)                  # [L, units]
            figures.chart(charts.layer_head_heatmap(per_unit, PROJ_TITLES[p], colorbar=f"L{ord_}",
                                                       x_title="head" if p in ("q", "o") else kv_unit,
                                                       group_size=g.group_size if p in ("q", "o") else 1), f"profiles.heat.{p}",
                          where=col)

    explain.gqa(g.n_heads, g.n_kv_heads)


def _row_table(norms: dict, excess: dict) -> str:
    """Every row's norm and excess as CSV (built only when the download is clicked)."""
    return "layer,projection,unit,row,norm,excess\n" + "\n".join(
        f"{l},{p},{u},{j},{norms[p][l, u, j]:.6g},{excess[p][l, u, j]:.6g}"
        for p in ("q", "k", "v", "o") for l, u, j in np.ndindex(*norms[p].shape))


@st.fragment
def one_population(norms: dict, stats: dict) -> None:
    """z, layer and projection -> one population's histogram, per-unit excess and the formula.

    A fragment: moving z (or the layer) reruns only this part; nothing above depends on z."""
    st.subheader("One population")
    with shown_errors("Computing thresholds"):
        c0, c1, c2 = st.columns([2, 2, 1])
        z = c0.slider("Threshold z (tau = mean + z * std)", 0.0, float(state.Z_MAX), step=0.05,
                      key=state.widget_key("z"), help="Moves the orange line in the histogram right below.")
        state.set("z", z)
        layer = c1.slider("Layer", 0, g.n_layers - 1, key=state.widget_key("profiles.layer", value=0))
        layer = min(layer, g.n_layers - 1)
        proj = c2.radio("Projection", ["q", "k", "v", "o"], format_func=str.upper, horizontal=True,
                        key=state.widget_key("profiles.proj", value="q"))
        excess = prof.excess(z, ord=ord_, scope=scope, std=convention)    # {p: [L, units, d]}
        taus = prof.thresholds(z, ord=ord_, scope=scope, std=convention)  # {p: [L]}
        rows = norms[proj][layer]                              # [units, d]
        unit = "head" if proj in ("q", "o") else kv_unit
        labels = [f"{unit} {u}, row {j}" for u in range(rows.shape[0]) for j in range(rows.shape[1])]
        mean, std = float(stats[proj][0][layer]), float(stats[proj][1][layer])
        tau = float(taus[proj][layer])
        n_out = int((rows > tau).sum())
        figures.chart(charts.norm_histogram(rows, mean, tau, z=z, row_labels=labels,
                                              title=f"Layer {layer}, {PROJ_TITLES[proj]}: {n_out} of {rows.size} "
                                                    f"rows above tau"), "profiles.hist")
        head_excess = excess[proj][layer].sum(axis=-1)         # [units]
        figures.chart(charts.head_bars(head_excess, title=f"Excess per {unit} (layer {layer}, {proj.upper()})",
                                         y_title="sum of max(0, n - tau)",
                                         labels=[f"{unit[0].upper()}{u}" for u in range(head_excess.size)]), "profiles.excess")
        n_pop = rows.size if scope == "layer" else norms[proj].size
        explain.mp_formula(z=z, layer=layer, projection=proj, mean=mean, std=std, tau=tau, n_outliers=n_out,
                           n_rows=n_pop if scope == "layer" else rows.size, scope=scope, convention=convention)
        st.download_button("Download row norms (CSV)", lambda: _row_table(norms, excess),
                           file_name=f"row_norms_L{ord_}_z{z:g}.csv", mime="text/csv", key="profiles.csv")


if norms is not None:
    one_population(norms, stats)
