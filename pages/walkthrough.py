"""Walkthrough page: one real head from its weight slices to its MP and MP-G scores (live in z), why
MP-G divides by G, why an uneven GQA mask can grow the exported model, and the way from score to
export, each step a link. Numbers come from analysis/ through components/cache; this page wires and draws."""
import numpy as np
import pandas as pd
import streamlit as st

from analysis.measure import evaluation
from analysis.score import masks

from analysis.compress import surgery
from analysis.arch.geometry import HeadGeometry
from components import cache, charts, controls, explain, figures, longctx, shell, state, views
from components.errors import shown_errors

shell.ensure_app()

# the step links look like links (Streamlit draws page links like plain sidebar items)
STEP_LINK_CSS = ('[data-testid="stMainBlockContainer"] [data-testid="stPageLink"] a p'
                 '{color:#1c62b9;text-decoration:underline}')

st.title("Walkthrough")
explain.walk_intro()
lm = cache.model_or_stop()
g = lm.geometry
G = g.group_size
prof = cache.profile_or_stop()

st.header("1. What a head is")
c1, c2 = st.columns(2)
layer = c1.slider("Layer", 0, g.n_layers - 1, key=state.widget_key("walk.layer", value=0))
head = c2.slider("Query head", 0, g.n_heads - 1, key=state.widget_key("walk.head", value=0))
layer, head = min(layer, g.n_layers - 1), min(head, g.n_heads - 1)
group = g.kv_group(head)
figures.chart(charts.head_slices(n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                                   hidden=g.hidden, head=head), "walk.slices")
explain.walk_head(layer=layer, head=head, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                  hidden=g.hidden)

st.header(f"2. Head {head} of layer {layer}, worked")
z = st.slider("Threshold z (tau = mean + z * std)", 0.0, float(state.Z_MAX), step=0.05, key=state.widget_key("z"))
state.set("z", z)
st.caption("Defaults of the Prune page's MP and MP-G: L2 norms, one population per projection and layer, "
           "a_q = a_kv = 1.")
with shown_errors("Working the example"):
    unit = {"q": head, "o": head, "k": group, "v": group}                   # which slice of each projection
    norms = {p: n[layer] for p, n in prof.norms(2).items()}                 # {p: [units, d]}
    taus = {p: float(t[layer]) for p, t in prof.thresholds(z).items()}      # {p: tau}
    excess = {p: float(e[layer, unit[p]].sum()) for p, e in prof.excess(z).items()}
    rows_over = {p: int((norms[p][unit[p]] > taus[p]).sum()) for p in unit}
    own_sums, group_sums = prof.excess_sums(z)                              # [L, H], [L, Hkv]
    scored = {name: cache.cached_call(cache.scores, state.model_key(), name,
                                      cache.params_key(controls.default_params(name, z)),
                                      label=f"Scoring with {controls.label(name)}") for name in ("mp", "mp-g")}
    if any(s is None for s in scored.values()):
        shell.end_run()
    mp, mpg = scored["mp"].scores, scored["mp-g"].scores                   # [L, H] each
    own, e_kv = float(own_sums[layer, head]), float(group_sums[layer, group])
    figures.chart(charts.head_rows(norms, unit, taus, title=f"Layer {layer}: head {head}'s rows (red) among "
                                                             f"their populations at z = {z:g}"), "walk.rows")
    worked = {"Own excess (Q + O)": own, f"KV group {group} excess (K + V)": e_kv, "MP score": mp[layer, head],
              "MP-G score": mpg[layer, head]}
    for col, (name, value) in zip(st.columns(4), worked.items()):
        col.metric(name, explain.num(value), help=f"Full precision: {float(value)!r}")
    explain.walk_score(z=z, layer=layer, head=head, group=group, G=G, taus=taus, excess=excess,
                       rows_over=rows_over, head_dim=g.head_dim, own=own, e_kv=e_kv,
                       mp=mp[layer, head], mpg=mpg[layer, head])

    st.header("3. Why MP-G divides the group part by G")
    members = list(range(group * G, (group + 1) * G))
    explain.walk_mpg(G=G, head=head, group=group, e_kv=e_kv, heads=members,
                     own=own_sums[layer, members].tolist(), mp=mp[layer, members].tolist(),
                     mpg=mpg[layer, members].tolist())

st.header("4. Why an uneven mask can make a GQA model bigger")


def pattern_mask(kept: tuple[int, ...]) -> np.ndarray:
    """One layer's pruned mask [1, H] that keeps the first kept[g] query heads of each KV group g."""
    pruned = np.ones((1, g.n_heads), dtype=bool)                            # [1, H]
    for grp, count in enumerate(kept):
        pruned[0, grp * G: grp * G + count] = False
    return pruned


if explain.walk_uneven(G=G, n_kv_heads=g.n_kv_heads):
    with shown_errors("Counting the layouts"):
        one_layer = HeadGeometry(1, g.n_heads, g.n_kv_heads, g.head_dim, g.hidden)
        costs = masks.attention_costs(g.head_dim, g.hidden, seq_len=1, bias=cache.has_qkv_bias(state.model_key()))
        uneven = [min(2, G), 1] + [0] * (g.n_kv_heads - 2)
        whole = [G] * (sum(uneven) // G) + [0] * (g.n_kv_heads - sum(uneven) // G)
        patterns = {tuple([G] * g.n_kv_heads): "dense", tuple(uneven): "uneven"}      # kept per group -> what
        if sum(uneven) % G == 0:
            patterns.setdefault(tuple(whole), "as many heads, whole groups")
        patterns.setdefault(tuple([G] * (g.n_kv_heads - 1) + [1]), "all but one head of the last group pruned")
        dense_params = g.n_heads * costs["head_params"] + g.n_kv_heads * costs["group_params"]
        rows = []
        for kept, what in patterns.items():
            layout = surgery.HeadLayout.from_mask(pattern_mask(kept), one_layer, lm.adapter.model_type)
            n_q, n_kv = layout.layer_counts(0)
            params = n_q * costs["head_params"] + n_kv * costs["group_params"]
            rows.append({"pattern": " + ".join(map(str, kept)), "what": what,
                         "query heads": n_q, "KV heads after surgery": n_kv,
                         "K/V copied per query head": "yes" if layout.kv_expanded(0) else "no",
                         "attention params": params, "vs dense": f"{params - dense_params:+,}"})
        for kept in patterns:
            if kept != tuple([G] * g.n_kv_heads):
                layout = surgery.HeadLayout.from_mask(pattern_mask(kept), one_layer, lm.adapter.model_type)
                st.html(charts.kv_copies(kept, G, expanded=layout.kv_expanded(0)))
                figures.downloads(charts.kv_copies_figure(kept, G, expanded=layout.kv_expanded(0)),
                                  f"gqa_kept_{'_'.join(map(str, kept))}", key=f"walk.kv.{'_'.join(map(str, kept))}",
                                  title=f"One GQA layer (G = {G}), kept {' + '.join(map(str, kept))} per KV group: "
                                        "before and after surgery")
        st.table(pd.DataFrame(rows).set_index("pattern").rename_axis("heads kept per KV group"))
        explain.walk_uneven_counts(rows)
        st.caption(f"Per query head: Q rows + O columns = {costs['head_params']:,} parameters; per KV head: K + V "
                   f"rows = {costs['group_params']:,}. A mask that prunes the same number of heads from every KV group of a "
                   "layer, or whole groups, never needs copies.")

st.header("5. From score to export, step by step")
view = views.view_mask(lm)
if view is not None:
    head_scores, plan, _, _ = view
    verdict = "pruned" if plan.pruned[layer, head] else "kept"
    st.markdown(f"With the current view ({controls.label(state.get('scorer'))}, z = {z:g}, sparsity = "
                f"{float(state.get('sparsity')):g}) the mask prunes **{plan.n_pruned} of {g.n_total_heads}** heads; "
                f"head {head} of layer {layer} is **{verdict}**.")
metric = evaluation.evaluator_class(lm.kind).label          # perplexity, or fidelity for an encoder
st.html(f"<style>{STEP_LINK_CSS}</style>")
for i, (target, title, what) in enumerate(explain.WALK_STEPS, start=1):
    st.page_link(f"pages/{target}.py", label=f"Step {i}. {title}: {what.format(metric=metric)}",
                 icon=":material/arrow_forward:", query_params={**st.query_params.to_dict(), "page": target})

longctx.walkthrough_section(lm)        # 6: sinks, windows and retrieval heads with a real head
