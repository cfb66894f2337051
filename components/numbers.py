"""What a mask really removes, drawn the same way on the Prune and Export pages.

Every number comes from `analysis.score.masks.summarize_mask` under the chosen kv_policy -- the layout
surgery will build -- so growth (uneven GQA groups: K/V copied per query head) shows as growth,
with the summary's warnings naming the cause and the policy that avoids it; and from
`analysis.compress.export.stock_check`: whether a stock config can describe the result, and if not the
nearest sparsities that can. And the tables every dense-vs-cut report shares: `cut_verdict` (the long-context
probes' and RULER's verdict, table and downloads), `flagged_table`, `wide_table`, `csv_text`.
"""
from __future__ import annotations

import csv
import io

import streamlit as st

from analysis.compress import export as export_mod
from analysis.score import masks

from . import cache, state

KV_POLICY_HELP = ("How surgery handles a GQA layer whose kept query heads are spread unevenly over its KV "
                  "groups (e.g. 2 + 1 + 0): auto copies K/V per query head in those layers only (bigger); "
                  "expand does it in every layer (one head count everywhere, for a stock export); strict "
                  "refuses such masks. The balanced and groups mask policies never need it.")


KIND_WORDS = {"causal-lm": "a causal language model", "masked-lm": "a masked language model",
              "encoder": "an encoder without a language-model head"}    # LoadedModel.kind -> words


def kind_words(kind: str) -> str:
    """The model kind in a sentence ("this model is an encoder ...")."""
    return KIND_WORDS.get(kind, f"a {kind}")


def kv_policy_choice(where=st) -> str:
    """The kv_policy selectbox (view field `kv_policy`: kept across pages and in the URL)."""
    choice = where.selectbox("KV policy (surgery)", list(masks.KV_POLICIES), key=state.widget_key("kv_policy"),
                             help=KV_POLICY_HELP)
    state.set("kv_policy", choice)
    return choice


def summary_of(lm, plan, head_scores, kv_policy: str, seq_len: int = 512) -> masks.MaskSummary:
    """`summarize_mask` for the loaded model's geometry, biases and weight dtype."""
    g = lm.geometry
    return masks.summarize_mask(plan, head_scores, head_dim=g.head_dim, hidden=g.hidden, seq_len=seq_len,
                                bias=cache.has_qkv_bias(state.model_key()), kv_policy=kv_policy,
                                dtype_bytes=next(lm.model.parameters()).element_size())


def growth_of(summary: masks.MaskSummary, *, kind: str = "causal-lm") -> list[str]:
    """What the surgery of this mask makes BIGGER than the dense model (empty when nothing grows)."""
    kv_after = summary.kv_heads - summary.kv_heads_removed
    grows = {
        f"KV heads {kv_after} > {summary.kv_heads}": kv_after > summary.kv_heads,
        f"attention parameters {-summary.params_removed:+,}": summary.params_removed < 0,
        f"KV cache {summary.kv_cache_ratio:.3g}x dense": kind != "encoder" and summary.kv_cache_ratio > 1,
        f"checkpoint {summary.checkpoint_bytes_change / 2**20:+.2f} MiB": summary.checkpoint_bytes_change > 0,
        f"attention FLOPs {-summary.attention_flops_removed:+.3g}": summary.attention_flops_removed < 0,
    }
    return [what for what, grew in grows.items() if grew]


def show_growth(grown: list[str], where=st) -> None:
    """One red line naming what grows (nothing when `grown` is empty)."""
    if grown:
        where.error("This makes the model BIGGER than the dense one: " + "; ".join(grown) + ". Pick the groups "
                    "or balanced mask policy (they never grow a GQA model).", icon=":material/warning:")


def _delta(change: float, text: str) -> str | None:
    """A metric's delta, None (no arrow) when nothing changes."""
    return None if change == 0 else text


def show_summary(summary: masks.MaskSummary, *, flops_len: int, zero_label: str | None = None,
                 kind: str = "causal-lm", where=st) -> None:
    """Metrics of what surgery makes of the mask, all as after / before with the change below (red =
    the model grows, green = it shrinks); a layer left without heads said first, a red line for growth,
    other notes folded below."""
    show_empty_layers(summary, where)
    row = where.container(horizontal=True)       # one block for the row (columns would be one per metric)
    kept = summary.n_heads - summary.n_pruned
    row.metric("Query heads after / before", f"{kept} / {summary.n_heads}",
               _delta(summary.n_pruned, f"{-summary.n_pruned:+,} pruned"), delta_color="inverse")
    kv_after = summary.kv_heads - summary.kv_heads_removed
    row.metric("KV heads after / before", f"{kv_after} / {summary.kv_heads}",
               _delta(summary.kv_heads_removed, f"{-summary.kv_heads_removed:+,}"), delta_color="inverse")
    change = -summary.params_removed
    row.metric("Attention params change", f"{change:+,}",
               _delta(change, f"{100 * change / summary.attention_params:+.1f}% of attention"), delta_color="inverse")
    if kind != "encoder":                            # an encoder keeps no KV cache
        ratio = summary.kv_cache_ratio
        row.metric("KV cache per token", f"{summary.kv_cache_bytes_per_token_after:,} B",
                   _delta(ratio - 1, f"{100 * (ratio - 1):+.0f}% vs dense ({ratio:.3g}x)"), delta_color="inverse")
    flops_change = -summary.attention_flops_removed
    row.metric(f"Attention FLOPs at {flops_len} tokens", f"{summary.attention_flops_after / 1e9:,.3g} G",
               _delta(flops_change, f"{-100 * summary.flops_removed_fraction:+.1f}%"), delta_color="inverse",
               help="The Q, K, V and O projections and the attention scores of one sequence, 2 FLOPs per "
                    "multiply-add; the scores causal: each token reads the tokens up to itself, n (n + 1) / 2 "
                    "pairs per head (docs/DEFINITIONS.md, \"FLOPs\").")
    if zero_label:
        row.metric(zero_label, summary.zero_score_heads,
                   help="Heads in the bulk (no outlier row). The tie-break (plain magnitude, then layer/head) "
                        "decides which of them go first.")
    show_growth(growth_of(summary, kind=kind), where)
    where.caption(f"Counted from the layout surgery builds with kv_policy '{summary.kv_policy}': checkpoint size "
                  f"change {summary.checkpoint_bytes_change / 2**20:+.2f} MiB (weights).")


def show_empty_layers(summary: masks.MaskSummary, where=st) -> None:
    """A layer that loses every head, said in the open where the numbers are (issue 33: the default view
    pruned all of layer 4 with the only note folded away)."""
    empty = list(getattr(summary.surgery, "empty_layers", None) or [])
    if empty:
        layers = ", ".join(map(str, empty))
        where.warning(f"This mask prunes every head of layer{'s' if len(empty) > 1 else ''} {layers}: "
                      f"{'their' if len(empty) > 1 else 'its'} attention then outputs only O's bias. The "
                      "min-per-layer policy keeps some heads in every layer.", icon=":material/warning:")


def show_notes(summary: masks.MaskSummary, where=st) -> None:
    """The summary's other warnings (rounding, expanded K/V and why), folded (`show_empty_layers` says the
    emptied layers in the open)."""
    empty = list(getattr(summary.surgery, "empty_layers", None) or [])
    rest = [line for line in summary.warnings if not (empty and line.startswith(f"Layers {empty}"))]
    if rest:
        with where.expander(f"Notes on this mask ({len(rest)})", expanded=False, icon=":material/warning:"):
            for line in rest:
                st.warning(line)


def stock_of(lm, pruned, kv_policy: str, sparsity: float) -> export_mod.StockCheck | str:
    """Whether a stock config describes the pruned model (and the nearest sparsities that can); the
    reason as text for a family without surgery."""
    try:
        return export_mod.stock_check(lm.model.config, pruned, kv_policy=kv_policy, sparsity=sparsity,
                                      stock=cache.stock_sparsities(state.model_key()))
    except Exception as err:  # noqa: BLE001 - a family without surgery: say so, do not fail the page
        return str(err)


def show_stock(check: export_mod.StockCheck | str) -> None:
    """Draw `stock_of`'s answer: a caption when a stock config fits, a note with the nearest ones if not."""
    if isinstance(check, str):
        st.caption(f"Stock config: {check}")
        return
    (st.caption if check.ok else st.info)("Stock config: " + check.message())


WORSE_STYLE = "background-color: #fadbd8; color: #922b21"     # a row worse than its input (red)


def flagged_table(rows: list[dict], *, flag: str, where=st) -> None:
    """A table whose rows with a non-empty `flag` column are red (issue 33: a broken or slower stage is
    never drawn as a normal row). A static table: every column is shown whole at 1280x800, long text
    wraps in its cell (a data grid cut the widest columns off at the right)."""
    import pandas as pd
    frame = pd.DataFrame(rows)
    styled = frame.style.apply(lambda row: [WORSE_STYLE if row.get(flag) else ""] * len(row), axis=1).hide(axis="index")
    where.table(styled)


def wide_table(rows: list[dict], where=st) -> None:
    """A small table shown whole at 1280x800 (no index; headers and long cells wrap)."""
    import pandas as pd
    where.table(pd.DataFrame(rows).style.hide(axis="index"))


# the deployment report's numbers, one row each: (label, key, format)
DEPLOY_ROWS = (("file size (MiB)", "bytes", lambda v: f"{v / 2**20:,.4g}"),     # 258.3, or 0.1953 for a tiny one
               ("perplexity (llama.cpp)", "perplexity", lambda v: f"{v:.3f}"),
               ("perplexity (headscope, PyTorch)", "headscope_perplexity", lambda v: f"{v:.3f}"),
               ("prefill tokens/s", "prefill_tok_s", lambda v: f"{v:,.1f}"),
               ("decode tokens/s", "decode_tok_s", lambda v: f"{v:,.2f}"),
               ("prefill tokens/s, no flash attention", "prefill_tok_s_no_fa", lambda v: f"{v:,.1f}"),
               ("decode tokens/s, no flash attention", "decode_tok_s_no_fa", lambda v: f"{v:,.2f}"))


def _kv_label(key: str) -> str:
    """kv_mib_4096 -> "KV cache at 4096 tokens (MiB)"; kv_mib_4096_no_fa -> "..., no flash attention"."""
    tokens = key[len("kv_mib_"):].removesuffix("_no_fa")
    return f"KV cache at {tokens} tokens (MiB)" + (", no flash attention" if key.endswith("_no_fa") else "")


def deployment_table(dense: dict, pruned: dict) -> list[dict]:
    """The deployment report as rows of numbers (dense, pruned, pruned vs dense in words, worse): narrow
    enough for 1280x800, where the file-per-row table was cut off at the right (issue 33). Steady-state
    speeds and the KV cache llama.cpp allocates, with flash attention on and off
    (analysis.compress.export.gguf.deploy)."""
    from analysis.compress.verdict import is_slower, speed_words
    rows = []
    kv = [(_kv_label(k), k, lambda v: f"{v:,.1f}") for k in dense if k.startswith("kv_mib_")]
    for label, key, fmt in (*DEPLOY_ROWS, *kv):
        a, b = dense.get(key), pruned.get(key)
        if a is None or b is None:
            continue
        if "_tok_s" in key:                            # a rate: the pruned file's speed-up in words
            change, worse = speed_words(b / a), is_slower(b / a)
        else:                                          # a size grows, or a quality that is expected to change
            change, worse = f"{b / a:.3g}x", b > a and (key == "bytes" or key.startswith("kv_mib_"))
        rows.append({"measure": label, "dense": fmt(a), "pruned": fmt(b), "pruned vs dense": change,
                     "worse": "worse" if worse else ""})
    rows.append({"measure": "heads / KV heads", "dense": f"{dense['heads']} / {dense['kv_heads']}",
                 "pruned": f"{pruned['heads']} / {pruned['kv_heads']}", "pruned vs dense": "", "worse": ""})
    rows.append({"measure": "tensor types", "dense": dense.get("tensor_types", ""),
                 "pruned": pruned.get("tensor_types", ""), "pruned vs dense": "", "worse": ""})
    return rows


def csv_text(rows: list[dict]) -> str:
    """Rows (dicts) as CSV text, the columns in the order they first appear: a report's download."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(k for r in rows for k in r)), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def cut_verdict(rows: list[dict], *, cut: bool, warnings: list[str], lost: str, kept: str, notes: str = "",
                title: str, file: str, key: str, csv: str, as_json: str) -> None:
    """A long-context report of dense and (cut) a plan: the verdict (LOSES `lost`, naming `warnings`, or `kept`),
    its table (lost rows red), `notes`, and CSV / JSON downloads named `title` / `file`, keyed `key`.csv / .json."""
    if cut and warnings:
        st.error(f"This plan LOSES {lost}: " + "; ".join(warnings) + ". Keep more KV heads full (the retrieval "
                 "heads first), or widen the window.", icon=":material/warning:")
    elif cut:
        st.success(kept, icon=":material/check_circle:")
    if cut:
        flagged_table(rows, flag="")
    else:
        wide_table(rows)
    if notes:
        st.caption(notes)
    d1, d2 = st.columns(2)
    d1.download_button(f"{title} (CSV)", csv, file_name=f"{file}.csv", mime="text/csv", key=f"{key}.csv",
                       icon=":material/download:")
    d2.download_button(f"{title} (JSON)", as_json, file_name=f"{file}.json", mime="application/json",
                       key=f"{key}.json", icon=":material/download:")
