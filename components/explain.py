"""Teaching text, folded away by default: what each page shows and why (docs/DEFINITIONS.md).

Each function renders one `st.expander` (collapsed), except the `walk_*` functions: the
Walkthrough page's own text, shown open. Numbers passed in are results computed by `analysis/`
(means, stds, thresholds, excesses, scores, layout counts); this module only formats them.
"""
from __future__ import annotations

import numpy as np
import streamlit as st

LABEL = "How to read this"


def fold(title: str, body: str) -> None:
    """A closed expander "<LABEL>: title" holding the markdown `body` (every page's how-to-read box)."""
    with st.expander(f"{LABEL}: {title}", expanded=False):
        st.markdown(body)


def structured_pruning(policy: str | None = None) -> None:
    """The fold on structured pruning; its last paragraph says what the view's mask `policy` does
    (the registry's help line: on GQA models the default is whole KV groups, not one global list)."""
    from analysis.score import masks
    if policy in masks.POLICIES:
        rule = (f"The current mask policy is **{masks.POLICIES[policy].label}**: {masks.POLICIES[policy].help} "
                "Within what the policy allows, the lowest-scored heads go first, ⌊sparsity × L × H⌋ of them "
                "(the policy's own step where it prunes whole groups). Change the policy on the Prune page.")
    else:
        rule = ("Which heads go is set by the mask policy on the Prune page: the lowest-scored heads anywhere "
                "(global), the same count per layer or per KV group, or whole KV groups (the default on GQA models).")
    fold("structured vs unstructured pruning", """
**Unstructured** pruning zeroes individual weights anywhere in a matrix. It can remove many
weights with little damage, but the matrices keep their shape, so the model is only faster on
hardware and kernels that exploit sparsity.

**Structured** pruning removes whole units - here, whole **attention heads**. A pruned head's
query rows, its output-projection columns and (when every query head sharing them is gone) its
key/value rows disappear, so the attention layers become genuinely smaller and faster on any
hardware. The cost: a head is a coarse unit, so choosing *which* heads to remove matters.

""" + rule + "\n")


def model_geometry(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    G = n_heads // n_kv_heads
    kind = "multi-head (MHA)" if G == 1 else ("multi-query (MQA)" if n_kv_heads == 1 else "grouped-query (GQA)")
    fold("the head geometry", f"""
Each of the **L = {n_layers}** layers has **H = {n_heads}** query heads of width **d = {head_dim}**
and **H_kv = {n_kv_heads}** key/value heads, so **G = H / H_kv = {G}** query heads share each K/V head:
this is **{kind}** attention. Head h uses rows h·d … (h+1)·d−1 of W_Q and the same *columns* of
W_O; KV group g = h // G uses rows g·d … (g+1)·d−1 of W_K and W_V.
""")


def mp_formula(*, z: float, layer: int, projection: str, mean: float, std: float, tau: float,
               n_outliers: int, n_rows: int, scope: str = "layer", convention: str = "population") -> None:
    population = f"the {n_rows} rows of {projection.upper()} in layer {layer}" if scope == "layer" else \
        f"the {n_rows} rows of {projection.upper()} across all layers"
    what = "columns of W_O" if projection == "o" else f"rows of W_{projection.upper()}"
    fold("the Magnitude Profile (MP) score", f"""
For every row i of W_Q, W_K, W_V (and every *column* of W_O) take its norm nᵢ = ‖W[i,:]‖₂.
Within a population - here {population} - the threshold is

  **τ = mean(n) + z · std(n) = {mean:.4g} + {z:g} × {std:.4g} = {tau:.4g}**

with the {"sample std (divide by n − 1, PyTorch's Tensor.std)" if convention == "sample" else
          "population std (divide by n, headscope's default)"}, and a row's **excess** is eᵢ = max(0, nᵢ − τ). Right now **{n_outliers} of {n_rows}** {what}
lie above τ; all the others ("the bulk") have excess 0.

The MP score of query head h adds up the excess of everything it owns:

  **S(h) = Σ over h's rows (e^Q + e^O) + Σ over its KV group's rows (e^K + e^V)**

A head with S = 0 has no outlier row at this z. Heads are ranked globally by ascending S;
heads in the bulk (S = 0) go first, ordered by their plain magnitude, then by (layer, head).
Lower z → lower τ → more outliers and fewer zero-score heads; higher z → more ties.
""")


def mp_score(*, z: float | None, n_zero: int | None, n_heads: int, policy: str | None = None) -> None:
    """The MP score fold; `z` None: written with the symbol z (a page whose z moves without a full rerun)."""
    policy_words = f" (here {policy})" if policy else ""
    z_text = "z" if z is None else f"{z:g}"
    zero = "" if n_zero is None or z is None else (
        f" At z = {z:g}, **{n_zero} of {n_heads}** heads have S = 0: among them the tie-break (plain magnitude, "
        "then layer and head) decides.")
    fold("the MP score and the ranking", f"""
Each row norm n is compared with its population's threshold **τ = mean(n) + {z_text} · std(n)**;
the excess is e = max(0, n − τ). A head's MP score sums the excess of its Q rows and O columns
and of its KV group's K and V rows (MP-G divides the group part by G).

All L × H heads are ranked together by ascending score; the mask policy{policy_words} then prunes
the lowest-ranked heads it allows, ⌊sparsity × L × H⌋ of them (global: the first of the list); when
every query head of a KV group is pruned, the group's K/V rows go too.{zero}
""")


def gqa(n_heads: int, n_kv_heads: int) -> None:
    G = n_heads // n_kv_heads
    if G == 1:
        note = ("This model is multi-head (G = 1): every head has its own K/V rows, so MP-G "
                "gives exactly the same scores as MP.")
    else:
        note = (f"In this model G = {G}: one K/V head serves {G} query heads. Plain MP adds the "
                f"group's full K/V excess to *each* of those {G} heads, counting it {G} times, so one "
                f"outlier K/V row makes the whole group look important, while pruning one of its query "
                f"heads does not remove any K/V rows (they go only when all {G} are pruned).")
    fold("why grouped-query attention needs MP-G", f"""
{note}

**MP-G** gives each query head its share of the group instead:

  **S(h) = a_q · Σ_h (e^Q + e^O) + a_kv · E_kv(g(h)) / G**,  E_kv(g) = Σ over group g's rows (e^K + e^V)

with a_q = a_kv = 1 by default. For multi-head attention (G = 1) MP-G equals MP exactly.
""")


def scorers() -> None:
    fold("the scorers", """
- **MP / MP-G**: outlier excess of the weight rows (no data needed).
- **Magnitude**: plain sum of the head's row norms (no threshold).
- **Random**: a seeded permutation - the floor any scorer must beat.
- **Wanda-Head / SparseGPT-Head**: weights times input activations / OBS saliency, from calibration text.
- **Gradient-Head, head-gate importance**: how much the loss reacts to the head (needs an LM head).
- **Hybrid**: min-max-normalized Magnitude + MP + Wanda.
- **Integrated gates (Captum)**: integrated gradients of the loss over each head's gate, from 0 to 1.
- **Ablation oracle**: the real loss increase when the head alone is removed (one forward per head; slow).

All of them share the same ranking and masking code; only the score differs.
""")


def evaluation() -> None:
    fold("checking a mask", """
A mask is checked by running text through the model with the pruned heads switched off (a gate
of 0 on each head's slice of the output projection's input - the same function as zeroing its
weights; the shared cached model is never changed).
- Causal LMs: **perplexity** = exp(mean token negative log-likelihood), sliding window with a stride.
- Masked LMs: **pseudo-perplexity** (each token masked in turn).
- Encoders without an LM head: **fidelity**, the mean cosine similarity of the pooled embedding to the dense model's.

Lower perplexity is better; higher fidelity is better (1 = the dense model's embeddings). Compare
against the dense model's value shown next to it.
""")


def comparison() -> None:
    fold("comparing scorers", """
At one sparsity every scorer prunes the same number of heads; they differ in *which* ones.
- **Jaccard overlap** of two masks = |pruned by both| / |pruned by either| (1 = identical choice).
- **Spearman rank correlation** of two score arrays over all L × H heads (1 = same order).
- **Perplexity vs sparsity** curves show which choice hurts the model least as more heads go.
""")


def heads_page() -> None:
    fold("ablation, roles and redundancy", """
- **Single-head ablation**: the loss increase when that head alone is switched off - the ground
  truth the cheap scorers try to predict. For GQA models, removing a whole KV group is shown too.
- **Role tags** come from each head's attention pattern on real text: *previous-token* (attends to
  the token before), *positional* (a fixed other offset), *first-token* (a "sink" on position 0),
  *local* / *broad* (short attention distance / high entropy), *rare-word* (attends to the rarest
  token in context). A head gets every tag whose strength passes its threshold.
- **Redundant heads**: cosine similarity of two heads' contributions to the residual stream (or of
  their attention patterns minus uniform attention). Near-duplicate groups are heads linked by a
  similarity above the threshold; a head is *redundant* when it has such a twin and removing it
  alone changes the loss very little.
The attention pattern shows, for each query token (row), how much weight the head puts on each
key token (column); causal models attend only to earlier tokens, so the upper triangle is empty.
""")


def export() -> None:
    fold("exporting", """
- The **mask JSON** records which heads are pruned, with the scorer, its parameters and the
  sparsity, so the choice can be reproduced.
- The **pruned model** is built on a copy: each layer's projections are physically shrunk to the
  kept heads (per-layer head counts), and it gives the same outputs as the masked model.
  Removing heads shrinks the attention parameters and FLOPs; the MLPs are untouched.
""")


def pipeline() -> None:
    fold("the pipeline", """
- **What runs**: rounds of *score -> prune a step -> recover*. Each round rescores the heads on the
  current weights (the scorer, z and policy of the Prune page), prunes the next fraction of heads,
  then distills the pruned copy from the dense model for the recovery steps (the dense model is the
  teacher; pruned heads stay zero). It stops at the target sparsity, or when a round ends above the
  perplexity budget (that round is discarded). One-shot = one round, no recovery.
- **The loss curve** is the distillation loss (KL divergence to the dense model's next-token
  distribution, times T^2) per recovery step: it should fall within each round and jump when a
  round prunes more heads.
- **The report** has one row per measured model (dense, each round's result, INT8): parameters,
  file size, attention FLOPs, latency and the metric, with ratios to the dense model. A ratio above
  1 on a size row means that stage is BIGGER than the dense model (shown in red).
- **Time**: every recovery step runs the teacher and the student on batch x sequence length tokens;
  on a CPU a 135M model takes seconds per step, so steps x rounds sets the time (estimate above the
  Run button; the bar shows the measured rate once it runs).
""")


# -- the Walkthrough page (visible text, not folded) -------------------------------------------

def num(x: float) -> str:
    """A worked number as the walkthrough prints it (6 significant digits)."""
    return f"{float(x):.6g}"


def walk_intro() -> None:
    st.markdown("""
This page follows **one real attention head** of the loaded model from its weights to its score,
and from scores to a smaller exported model. Every number is computed from the model's weights
by the same code the other pages use; move z and the numbers follow.
""")


def walk_head(*, layer: int, head: int, n_heads: int, n_kv_heads: int, head_dim: int, hidden: int) -> None:
    G = n_heads // n_kv_heads
    g = head // G
    d = head_dim
    if G == 1:
        kv = (f"Every query head has its own key/value head (multi-head attention, G = 1): head {head} "
              f"also owns rows {head * d}…{(head + 1) * d - 1} of W_K and W_V.")
    else:
        kv = (f"Here G = H / H_kv = {n_heads} / {n_kv_heads} = **{G}** query heads share one key/value "
              f"head (grouped-query attention): head {head} belongs to **KV group {g} = {head} // {G}**, "
              f"whose rows {g * d}…{(g + 1) * d - 1} of W_K and W_V it shares with heads "
              f"{g * G}…{(g + 1) * G - 1}.")
    st.markdown(f"""
An attention layer has four projections, stored as `[out, in]` matrices. A **head** is a slice of
them, d = {d} wide: query head **{head}** of layer {layer} reads the residual stream (D = {hidden})
through **rows {head * d}…{(head + 1) * d - 1} of W_Q**, and writes its result back through the same
**columns of W_O**. {kv}

Pruning the head removes exactly those slices: its Q rows and O columns always, its K/V rows
only when no query head of its group is left.
""")


def walk_score(*, z: float, layer: int, head: int, group: int, G: int, taus: dict, excess: dict,
               rows_over: dict, head_dim: int, own: float, e_kv: float, mp: float, mpg: float) -> None:
    """taus, excess (the slice's summed excess), rows_over (its rows above tau): per projection."""
    lines = "\n".join(
        f"| {p.upper()} | {who} | {num(taus[p])} | {rows_over[p]} of {head_dim} | {num(excess[p])} |"
        for p, who in (("q", f"head {head}"), ("o", f"head {head}"), ("k", f"group {group}"),
                       ("v", f"group {group}")))
    st.markdown(f"""
Each row norm nᵢ is compared with the threshold of its population (the same projection's rows in
layer {layer}): **τ = mean(n) + z · std(n)** with z = **{z:g}**. Only the part above τ counts:
eᵢ = max(0, nᵢ − τ).

| projection | slice | τ | rows above τ | summed excess |
| --- | --- | --- | --- | --- |
{lines}

Own part (Q + O) = **{num(own)}**; KV group part E_kv (K + V) = **{num(e_kv)}**.

- **MP**: S = own + E_kv = {num(own)} + {num(e_kv)} = **{num(mp)}**
- **MP-G**: S = own + E_kv / G = {num(own)} + {num(e_kv)} / {G} = **{num(mpg)}**

A score of 0 means the head has no row above τ: it is "in the bulk", and the tie-break (its plain
magnitude) decides where it goes among the other zero-score heads.

**Why an outlier row should mean an important head.** Training pushes most rows of a projection
to similar norms; a row far above the rest is a direction the model amplifies strongly, so the
head that owns it writes (or reads) something the model relies on: the paper's hypothesis is
that such heads are the specialized ones, and heads whose rows are all typical are the redundant
ones. The score measures how far the head's rows stick out.

**A low score is pruned first.** All heads are ranked by score, lowest first, and the mask at
sparsity s prunes s · (all heads) of them, lowest first, as the mask policy allows (the global policy
takes the first of the whole ranking; on GQA models the default, groups, prunes whole KV groups, ranked
by their heads' scores): heads in the bulk (score 0) go first, outlier heads last.
""")


def walk_mpg(*, G: int, head: int, group: int, e_kv: float, heads: list, own: list, mp: list, mpg: list) -> None:
    """heads: the query heads of `group`; own, mp, mpg: their numbers (same order)."""
    if G == 1:
        st.markdown(f"""
This model is **multi-head (G = 1)**: each head has its own K/V rows, so dividing by G changes
nothing and **MP-G equals MP exactly** (here {num(mp[0])} = {num(mpg[0])}). The difference matters
only for grouped-query models such as SmolLM2.
""")
        return
    rows = "\n".join(f"| {h}{' (this one)' if h == head else ''} | {num(o)} | {num(a)} | {num(b)} |"
                      for h, o, a, b in zip(heads, own, mp, mpg))
    st.markdown(f"""
KV group {group}'s K and V rows (excess E_kv = {num(e_kv)}) are shared by {G} query heads. Plain MP
adds all of E_kv to *each* of them, so together they count it {G} times ({G} × {num(e_kv)} =
{num(G * e_kv)}), and one outlier K/V row makes all {G} heads look important. Yet pruning one of
them removes no K/V row at all: the rows go only when all {G} are pruned. MP-G gives each head its
share, E_kv / G = {num(e_kv / G)}, so the group's K/V excess is counted once in total.

| query head | own (Q + O) | MP | MP-G |
| --- | --- | --- | --- |
{rows}
""")


def walk_uneven(*, G: int, n_kv_heads: int) -> bool:
    """Text before the worked count; returns False when the model has no uneven masks (MHA, MQA)."""
    if G == 1:
        st.markdown("""
This model is multi-head (G = 1): every head takes its own K/V rows with it, so a mask never
leaves a KV head half used and surgery never copies anything. On a grouped-query model
(SmolLM2, for one) this section works through the count.
""")
        return False
    if n_kv_heads == 1:
        st.markdown(f"""
This model is multi-query (one K/V head for all {G} query heads): K and V stay as long as any
head is left, and no mask can split the heads unevenly over groups.
""")
        return False
    st.markdown(f"""
Hugging Face's grouped attention (`repeat_kv`) needs **the same number of query heads in every KV
group** of a layer. A mask that keeps, say, 2 + 1 + 0 heads of three groups cannot be written
that way, so surgery gives **each kept query head its own copy** of its group's K/V rows (G' = 1).
The group that lost all its heads does lose its K/V, but the copies can cost more than that saves.
Counted by the surgery planner for one layer of this model (d = head_dim, D = hidden; O's bias is
shared and kept):
""")
    return True


def walk_uneven_counts(rows: list[dict]) -> None:
    """One sentence per layout that copies K/V, from the rows of the worked count table (the first
    row is the dense layer): what it keeps and how its parameters compare with the dense layer."""
    dense = rows[0]
    lines = [f"- **{r['pattern']}** keeps {r['query heads']} query heads but **{r['KV heads after surgery']} KV "
             f"heads** (copies) against {dense['KV heads after surgery']} in the dense layer: "
             + (f"**{r['attention params'] - dense['attention params']:+,} parameters, bigger than the dense "
                f"layer**." if r["attention params"] > dense["attention params"] else
                f"{r['attention params'] - dense['attention params']:+,} parameters.")
             for r in rows[1:] if r["K/V copied per query head"] == "yes"]
    st.markdown("\n".join(lines))


WALK_STEPS = (
    ("profiles", "Profiles", "See every row norm and τ: the raw material of the score."),
    ("prune", "Prune", "Pick the scorer, z and sparsity: the heads are ranked and the mask is drawn live."),
    ("prune", "Prune: Check this mask", "Measure the masked model's {metric} against the dense one's."),
    ("compare", "Compare", "Set the scorers side by side: overlap of their masks, perplexity vs sparsity."),
    ("heads", "Heads", "Check the scores against reality: the loss change when each head alone is removed."),
    ("export", "Export", "Write the mask, a zeroed model or a physically smaller one."),
)


def curves_sentence(curves: dict[str, tuple], *, metric: str, higher_is_better: bool, floor: str | None = None) -> str:
    """One sentence that says what metric-vs-sparsity curves show, computed from their numbers: which
    scorer is best at the largest sparsity they share, and from which sparsity on a scorer is worse than
    the `floor` curve (Random) -- e.g. "on SmolLM2 MP-G is worse than random from sparsity 0.4: 7,128 vs 120"."""
    def better(a: float, b: float) -> bool:
        return a > b if higher_is_better else a < b

    def fmt(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    named = {n: (np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for n, (x, y) in curves.items()}
    shared = set.intersection(*(set(np.round(x, 6)) for x, _ in named.values())) if named else set()
    if not shared:
        return ""
    top = max(shared)
    at_top = {n: float(y[np.round(x, 6) == top][0]) for n, (x, y) in named.items()}
    best = max(at_top, key=lambda n: at_top[n] if higher_is_better else -at_top[n])
    words = [f"At sparsity {top:g} the best is {best} ({metric} {fmt(at_top[best])})"]
    others = [n for n in at_top if n != best]
    if others:
        worst = min(others, key=lambda n: at_top[n] if higher_is_better else -at_top[n])
        words[0] += f", the worst {worst} ({fmt(at_top[worst])})"
    if floor in named:
        fx, fy = named[floor]
        for n, (x, y) in named.items():
            if n == floor:
                continue
            lost = [s for s in sorted(shared) if s > 0 and better(float(fy[np.round(fx, 6) == s][0]),
                                                                    float(y[np.round(x, 6) == s][0]))]
            if lost:
                s = lost[0]
                words.append(f"{n} is worse than {floor} from sparsity {s:g} on ({fmt(float(y[np.round(x, 6) == s][0]))} "
                             f"vs {fmt(float(fy[np.round(fx, 6) == s][0]))})"
                             + ("" if all(q in lost for q in sorted(shared) if q >= s) else ", though not at every larger one"))
    return "; ".join(words) + "."
