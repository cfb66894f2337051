"""Teaching text, folded away by default: what each page shows and why (docs/DEFINITIONS.md).

Each function renders one `st.expander` (collapsed). Numbers passed in are results computed by
`analysis/` (means, stds, thresholds); this module only formats them into the formulas.
"""
from __future__ import annotations

import streamlit as st

LABEL = "How to read this"


def _fold(title: str, body: str) -> None:
    with st.expander(f"{LABEL}: {title}", expanded=False):
        st.markdown(body)


def structured_pruning() -> None:
    _fold("structured vs unstructured pruning", """
**Unstructured** pruning zeroes individual weights anywhere in a matrix. It can remove many
weights with little damage, but the matrices keep their shape, so the model is only faster on
hardware and kernels that exploit sparsity.

**Structured** pruning removes whole units - here, whole **attention heads**. A pruned head's
query rows, its output-projection columns and (when every query head sharing them is gone) its
key/value rows disappear, so the attention layers become genuinely smaller and faster on any
hardware. The cost: a head is a coarse unit, so choosing *which* heads to remove matters.

headscope ranks every head of every layer on one global list (least important first) and
prunes the first ⌊sparsity × L × H⌋ of them.
""")


def model_geometry(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    G = n_heads // n_kv_heads
    kind = "multi-head (MHA)" if G == 1 else ("multi-query (MQA)" if n_kv_heads == 1 else "grouped-query (GQA)")
    _fold("the head geometry", f"""
Each of the **L = {n_layers}** layers has **H = {n_heads}** query heads of width **d = {head_dim}**
and **H_kv = {n_kv_heads}** key/value heads, so **G = H / H_kv = {G}** query heads share each K/V head:
this is **{kind}** attention. Head h uses rows h·d … (h+1)·d−1 of W_Q and the same *columns* of
W_O; KV group g = h // G uses rows g·d … (g+1)·d−1 of W_K and W_V.
""")


def mp_formula(*, z: float, layer: int, projection: str, mean: float, std: float, tau: float,
               n_outliers: int, n_rows: int, scope: str = "layer") -> None:
    population = f"the {n_rows} rows of {projection.upper()} in layer {layer}" if scope == "layer" else \
        f"the {n_rows} rows of {projection.upper()} across all layers"
    what = "columns of W_O" if projection == "o" else f"rows of W_{projection.upper()}"
    _fold("the Magnitude Profile (MP) score", f"""
For every row i of W_Q, W_K, W_V (and every *column* of W_O) take its norm nᵢ = ‖W[i,:]‖₂.
Within a population - here {population} - the threshold is

  **τ = mean(n) + z · std(n) = {mean:.4g} + {z:g} × {std:.4g} = {tau:.4g}**

and a row's **excess** is eᵢ = max(0, nᵢ − τ). Right now **{n_outliers} of {n_rows}** {what}
lie above τ; all the others ("the bulk") have excess 0.

The MP score of query head h adds up the excess of everything it owns:

  **S(h) = Σ over h's rows (e^Q + e^O) + Σ over its KV group's rows (e^K + e^V)**

A head with S = 0 has no outlier row at this z. Heads are ranked globally by ascending S;
heads in the bulk (S = 0) go first, ordered by their plain magnitude, then by (layer, head).
Lower z → lower τ → more outliers and fewer zero-score heads; higher z → more ties.
""")


def mp_score(*, z: float, n_zero: int | None, n_heads: int) -> None:
    zero = "" if n_zero is None else (f" At z = {z:g}, **{n_zero} of {n_heads}** heads have S = 0: among "
                                      "them the tie-break (plain magnitude, then layer and head) decides.")
    _fold("the MP score and the ranking", f"""
Each row norm n is compared with its population's threshold **τ = mean(n) + {z:g} · std(n)**;
the excess is e = max(0, n − τ). A head's MP score sums the excess of its Q rows and O columns
and of its KV group's K and V rows (MP-G divides the group part by G).

All L × H heads are ranked together by ascending score, and the first ⌊sparsity × L × H⌋ are
pruned; when every query head of a KV group is pruned, the group's K/V rows go too.{zero}
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
    _fold("why grouped-query attention needs MP-G", f"""
{note}

**MP-G** gives each query head its share of the group instead:

  **S(h) = a_q · Σ_h (e^Q + e^O) + a_kv · E_kv(g(h)) / G**,  E_kv(g) = Σ over group g's rows (e^K + e^V)

with a_q = a_kv = 1 by default. For multi-head attention (G = 1) MP-G equals MP exactly.
""")


def scorers() -> None:
    _fold("the scorers", """
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
    _fold("checking a mask", """
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
    _fold("comparing scorers", """
At one sparsity every scorer prunes the same number of heads; they differ in *which* ones.
- **Jaccard overlap** of two masks = |pruned by both| / |pruned by either| (1 = identical choice).
- **Spearman rank correlation** of two score arrays over all L × H heads (1 = same order).
- **Perplexity vs sparsity** curves show which choice hurts the model least as more heads go.
""")


def heads_page() -> None:
    _fold("ablation, roles and redundancy", """
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
    _fold("exporting", """
- The **mask JSON** records which heads are pruned, with the scorer, its parameters and the
  sparsity, so the choice can be reproduced.
- The **pruned model** is built on a copy: each layer's projections are physically shrunk to the
  kept heads (per-layer head counts), and it gives the same outputs as the masked model.
  Removing heads shrinks the attention parameters and FLOPs; the MLPs are untouched.
""")
