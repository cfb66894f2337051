"""The compression frontier: file size against llama.cpp perplexity, the dense model quantized vs the cut
(pruned + recovered) model quantized, and which points no other point beats (issue 35).

A point = one GGUF file written by the gguf export (so a lossy one is self-checked: a refused file is a
point that does not exist, kept with the refusal's line), run by llama.cpp on held-out ids: its
perplexity with a 95 % bootstrap CI over windows (the same resamples for every point, so the CIs
compare), its size in bytes. The Pareto frontier holds the points that no other point beats in both
size and perplexity; the verdict says, for each cut point, whether it is on the frontier and how it
compares with the best dense file at or below its size.

    points = frontier_points(loaded, result, ("q8_0", "q4_k_m"), eval_text, folder=tmp)
    pareto(points), verdict(points)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from analysis.core.progress import Progress, ShouldStop, check_stop, report as tell
from analysis.core.ticks import matplotlib_log_y

FRONTIER_TYPES = ("q8_0", "q5_k_m", "q4_k_m")       # the CLI's --frontier default
FRONTIER_CHOICES = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_1", "q4_0")   # what the Pipeline page offers
N_BOOT = 1000
LATTICE_BLOCK, LATTICE_LEVELS = 32, 16   # a 4-bit block type (Q4_0, Q4_1) holds <= 16 values per 32-value block
LATTICE_SHARE = 0.99                     # the share of blocks at which weights count as quantized before


def parse_types(text: str | None) -> tuple[str, ...]:
    """"q8_0,q4_k_m" -> the GGUF types of a frontier ("default": FRONTIER_TYPES; "" or None: none);
    InputError for a type GGUF has not or one named twice."""
    from analysis.compress.export.gguf.writer import WEIGHT_TYPES
    from analysis.core.errors import InputError
    if not text:
        return ()
    if text.strip() == "default":
        return FRONTIER_TYPES
    types = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    bad = [t for t in types if t not in WEIGHT_TYPES]
    if bad:
        raise InputError(f"Unknown GGUF type {bad[0]!r} for the frontier; choose from {', '.join(WEIGHT_TYPES)} "
                         f"(or 'default': {', '.join(FRONTIER_TYPES)}).")
    if len(set(types)) != len(types):
        raise InputError(f"The frontier names a GGUF type twice ({text}); give each once.")
    return types


def gguf_point(path: Path, ids: np.ndarray, *, window: int = 512, n_boot: int = N_BOOT, threads: int = 2) -> dict:
    """{"ppl", "lo", "hi", "tokens", "bytes"} of one GGUF file on the ids [N] (llama.cpp, f16 KV cache)."""
    from analysis.compress.export.gguf import llamacpp
    from analysis.measure.evaluation import bootstrap_perplexity
    sums, counts = llamacpp.window_nll(path, ids, window=window, threads=threads)    # [W], [W]
    boot = bootstrap_perplexity(sums[None], counts, n_boot)[:, 0]                   # [n_boot]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ppl": float(np.exp(sums.sum() / counts.sum())), "lo": float(lo), "hi": float(hi),
            "tokens": int(counts.sum()), "bytes": Path(path).stat().st_size}


def linear_blocks(model, max_blocks: int = 4096):
    """Each linear layer's weight (the output head apart) as [n, LATTICE_BLOCK] blocks of its rows, at
    most about `max_blocks` per tensor, evenly strided (a view: detached, in the weight's dtype)."""
    import torch
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head and module.in_features % LATTICE_BLOCK == 0:
            w = module.weight.detach().reshape(-1, LATTICE_BLOCK)                            # [n_blocks, 32]
            yield w[:: max(1, w.shape[0] // max_blocks)]                                     # [<=2*max, 32]


def prior_lattice(model, max_blocks: int = 4096) -> dict:
    """Whether the linear layers' weights (the output head apart: a tied embedding is often stored at
    more bits) were quantized before: {"share": of LATTICE_BLOCK-value blocks with at most LATTICE_LEVELS
    distinct values, "distinct": the mean per block, "blocks": how many were read (at most `max_blocks`
    per tensor, evenly strided)}. A checkpoint dequantized from a 4-bit GGUF (the built-in SmolLM2:
    Q4_1) has share 1.0; a trained float one ~0. Such weights requantize to their own type almost
    losslessly and to other grids unevenly (docs/EXPORT.md, "Requantizing a checkpoint that was
    quantized before"), which the frontier's dense series inherits and a recovered cut does not."""
    share = distinct = 0.0
    blocks = 0
    for w in linear_blocks(model, max_blocks):                                              # [n, 32]
        levels = 1 + (w.float().sort(dim=1).values.diff(dim=1) != 0).sum(dim=1)             # [n]
        share += float((levels <= LATTICE_LEVELS).sum())
        distinct += float(levels.sum())
        blocks += int(levels.numel())
    return {"share": share / blocks if blocks else 0.0, "distinct": distinct / blocks if blocks else 0.0,
            "blocks": blocks}


def lattice_line(points: dict) -> str | None:
    """The caveat the verdict adds when the dense series' weights were quantized before (a dense point
    carries `prior_lattice`'s dict as "lattice"); None otherwise."""
    lattice = next((p["lattice"] for p in points.values() if p.get("label") == "dense" and "lattice" in p), None)
    if lattice is None or lattice["share"] < LATTICE_SHARE:
        return None
    return (f"The dense model was quantized before: {lattice['share']:.1%} of the 32-value blocks of its linear "
            f"layers hold at most {LATTICE_LEVELS} distinct values ({lattice['distinct']:.1f} on average), the "
            f"lattice of a 4-bit type. It requantizes to that type almost losslessly and to other grids unevenly "
            f"(a 5-bit type can lose to a 4-bit one), while recovery moves a cut's weights off the lattice: at "
            f"4-6 bits this frontier favours the dense series more than it would for a model trained in float.")


def measured(points: dict) -> dict:
    """The points llama.cpp measured (not those the export's self-check refused)."""
    return {k: p for k, p in points.items() if "refused" not in p}


def pareto(points: dict) -> list[str]:
    """Keys of the measured points no other point beats in both size and perplexity, by size."""
    points = measured(points)
    front, best = [], math.inf
    for k in sorted(points, key=lambda k: (points[k]["bytes"], points[k]["ppl"])):
        if points[k]["ppl"] < best:
            front.append(k)
            best = points[k]["ppl"]
    return front


def verdict(points: dict) -> list[str]:
    """In words, per cut point: on the frontier or not, and against the best dense file at or below its
    size (perplexity difference); refused points with their reason."""
    ok = measured(points)
    front = set(pareto(ok))
    dense = [p for p in ok.values() if p["label"] == "dense"]
    lines = []
    for k, p in sorted(ok.items(), key=lambda kv: kv[1]["bytes"]):
        if p["label"] == "dense":
            continue
        smaller = [d for d in dense if d["bytes"] <= p["bytes"]]
        ref = min(smaller, key=lambda d: d["ppl"]) if smaller else None
        if ref is not None:
            against = (f"the best dense file at or below its size is {ref['type']} ({ref['bytes'] / 2**20:.1f} MiB, "
                       f"perplexity {ref['ppl']:.2f}): the cut is {p['ppl'] / ref['ppl'] - 1:+.1%}")
        elif dense:                  # on the frontier only by being smaller: say what that costs
            least = min(dense, key=lambda d: d["bytes"])
            against = (f"no dense file is this small; against the smallest, {least['type']} "
                       f"({least['bytes'] / 2**20:.1f} MiB, perplexity {least['ppl']:.2f}), the cut saves "
                       f"{1 - p['bytes'] / least['bytes']:.1%} of the file for {p['ppl'] / least['ppl'] - 1:+.1%} "
                       f"perplexity")
        else:
            against = "no dense file was measured"
        lines.append(f"{k}: {p['bytes'] / 2**20:.1f} MiB, perplexity {p['ppl']:.2f} [{p['lo']:.2f}, {p['hi']:.2f}], "
                     f"{'ON' if k in front else 'not on'} the frontier; {against}.")
    lines += [f"{k}: not written: {p['refused']}" for k, p in points.items() if "refused" in p]
    caveat = lattice_line(points)
    return lines + ([caveat] if caveat else [])


def frontier_points(loaded, result, types: Sequence[str], eval_text=None, *, folder, max_tokens: int = 4096,
                    window: int = 512, threads: int = 2, kv_policy: str = "auto", label: str = "cut",
                    progress: Progress | None = None, should_stop: ShouldStop | None = None) -> dict:
    """The dense model and `result`'s final model (a PipelineResult) as GGUF at each type, measured by
    llama.cpp on the first `max_tokens` ids of `eval_text` (None: the built-in evaluation split).
    Returns {"<label> <type>": point} (point: `gguf_point`'s keys + label, type, self_check, and for the
    dense ones `prior_lattice`'s "lattice"; or label, type, refused)."""
    from analysis.compress.export import export
    from analysis.compress.export.selfcheck import SelfCheckFailed
    from analysis.compress.recover.pipeline import export_round
    from analysis.measure.evaluation import default_text, token_ids
    ids = token_ids(loaded.tokenizer, eval_text if eval_text is not None else default_text(),
                    max_tokens=max_tokens).numpy()                                        # [N]
    g = loaded.geometry
    dense = np.zeros((g.n_layers, g.n_heads), bool)
    lattice = prior_lattice(loaded.model)
    jobs = [("dense", t) for t in types] + [(label, t) for t in types]
    points = {}
    for i, (who, gguf_type) in enumerate(jobs):
        check_stop(should_stop, "The frontier")
        tell(progress, i / len(jobs), f"frontier: {who} at {gguf_type} in llama.cpp")
        key, name = f"{who} {gguf_type}", f"frontier-{i}"
        try:
            if who == "dense":
                written = export("gguf", loaded.model, dense, folder, name, tokenizer=loaded.tokenizer,
                                 gguf_type=gguf_type)
            else:
                written = export_round("gguf", result.model, result.pruned, result.head_rounds, folder, name,
                                       tokenizer=loaded.tokenizer, kv_policy=kv_policy, gguf_type=gguf_type)
        except SelfCheckFailed as refused:
            points[key] = {"label": who, "type": gguf_type, "refused": str(refused)}
            continue
        points[key] = {**gguf_point(written.path / "model.gguf", ids, window=window, threads=threads),
                       "label": who, "type": gguf_type,
                       "self_check": written.checks[-1]["line"] if written.checks else "",
                       **({"lattice": lattice} if who == "dense" else {})}
    tell(progress, 1.0, "frontier measured")
    return points


ZOOM_RATIO = 1.5          # the right panel: perplexity up to this times the best dense file's


def _near_frontier(ok: dict) -> tuple[float, float] | None:
    """The right panel's perplexity range: from the lowest lower bound to ZOOM_RATIO x the best dense
    file's perplexity; None when there is no dense point or every point is already inside it."""
    dense = [p["ppl"] for p in ok.values() if p["label"] == "dense"]
    if not dense:
        return None
    top = ZOOM_RATIO * min(dense)
    if all(p["hi"] <= top for p in ok.values()):
        return None
    return 0.97 * min(p["lo"] for p in ok.values()), top


def _colors(ok: dict) -> dict[str, str]:
    """One colour per series label (dense first), the same in both panels."""
    labels = sorted({p["label"] for p in ok.values()}, key=lambda s: (s != "dense", s))
    return {label: f"C{i % 10}" for i, label in enumerate(labels)}


def _draw(ax, ok: dict, colors: dict[str, str], annotate: bool) -> None:
    """One series per label (dense first), CIs as error bars, the Pareto frontier as a grey step."""
    for i, label in enumerate(colors):
        group = sorted((p for p in ok.values() if p["label"] == label), key=lambda p: p["bytes"])
        if not group:
            continue
        x = [p["bytes"] / 2**20 for p in group]                                              # MiB
        y = [p["ppl"] for p in group]
        err = [[p["ppl"] - p["lo"] for p in group], [p["hi"] - p["ppl"] for p in group]]
        ax.errorbar(x, y, yerr=err, marker="o" if label == "dense" else "s", capsize=2, label=label,
                    linestyle="-" if label == "dense" else ":", color=colors[label])
        for p, xi, yi in zip(group, x, y) if annotate else ():
            # series at the same size (cuts of one head count) get their labels stacked, not overlaid
            ax.annotate(p["type"], (xi, yi), fontsize=6, xytext=(4, -9 + 7 * (i % 6)), textcoords="offset points")
    front = [ok[k] for k in pareto(ok)]
    ax.step([p["bytes"] / 2**20 for p in front], [p["ppl"] for p in front], where="post", color="black",
            alpha=0.35, linewidth=3, label="Pareto frontier")
    ax.set_xlabel("GGUF file (MiB)")
    ax.grid(alpha=0.3)


def plot_png(points: dict, path, title: str) -> None:
    """Size (MiB) against perplexity with CIs, one series per label, the frontier drawn; a PNG.

    Left: every file (log y: a damaged cut can sit at 10x dense). Right, when some point lies
    beyond it: the files within ZOOM_RATIO x the best dense perplexity on a linear axis, where
    the choice is made (points above it are named in the panel's title)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    ok = measured(points)
    zoom = _near_frontier(ok)
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(12 if zoom else 8, 5), dpi=150, squeeze=False)
    try:
        left = axes[0][0]
        colors = _colors(ok)
        _draw(left, ok, colors, annotate=not zoom)
        matplotlib_log_y(left, [v for p in ok.values() for v in (p["lo"], p["ppl"], p["hi"])])
        left.set_ylabel("llama.cpp perplexity (held-out, 95 % CI, log scale)")
        left.set_title("every file" if zoom else title, fontsize=9)
        left.legend(fontsize=7)
        if zoom:
            right = axes[0][1]
            inside = {k: p for k, p in ok.items() if p["ppl"] <= zoom[1]}
            _draw(right, inside, colors, annotate=True)
            right.set_ylim(*zoom)
            right.set_ylabel("llama.cpp perplexity (linear)")
            above = sorted({p["label"] for k, p in ok.items() if k not in inside})
            right.set_title(f"near the frontier (up to {ZOOM_RATIO:g}x the best dense file)"
                            + (f"; above it: {', '.join(above)}" if above else ""), fontsize=8)
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
