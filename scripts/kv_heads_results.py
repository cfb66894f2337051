"""Write the "Retrieval and streaming heads" section of docs/results.md (SmolLM2-135M).

Measured with analysis.measure.longheads on the built-in text: the retrieval score (Wu et al. 2024) at each
--lengths over 3 depths x 2 needles (words, a number), the streaming score at --streaming-length (sinks 4 +
recent 256: the KV plan's defaults), the end-to-end oracle of the streaming score on a shorter text
(windowing each KV head alone, --oracle-tokens with a window scaled down to match), and how both roles
relate to MP-G (ROC AUC, 10,000 seeded permutations: analysis.score.specialization) and to the induction
heads. Every number is written as it comes out.

    .venv/bin/python scripts/kv_heads_results.py [--lengths 1024,2048,4096] [--out docs/results.md]
    .venv/bin/python scripts/kv_heads_results.py --from-json artifacts/kv_heads_smollm2.json   # re-render only

The raw numbers go to artifacts/kv_heads_smollm2.json and the maps to artifacts/kv_heads_smollm2.png.
The section lives between KV_HEADS_MARKERS (analysis.score.kvscores); scripts/results.py keeps it.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from analysis.arch.models import load_model  # noqa: E402
from analysis.arch.window import Window  # noqa: E402
from analysis.core.atomic import atomic_write, write_section  # noqa: E402
from analysis.measure.attribution import rank_correlation  # noqa: E402
from analysis.measure.detectors import detect_heads  # noqa: E402
from analysis.measure.longheads import (RETRIEVAL_THRESHOLD, STREAMING_THRESHOLD, RetrievalDetector,  # noqa: E402
                                        StreamingDetector, streaming_scores, streaming_text, windowing_effect)
from analysis.score.kvscores import KV_HEADS_MARKERS, plan_kv  # noqa: E402
from analysis.score.specialization import mpg_scores, permutation_p, roc_auc, role_tests  # noqa: E402

COMMAND = ".venv/bin/python scripts/kv_heads_results.py"
DEPTHS = (0.1, 0.5, 0.9)
SINKS, RECENT = 4, 256
BAND = Window(SINKS, RECENT)
INDUCTION_THRESHOLD = 0.4


def measure(args) -> dict:
    lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
    g = lm.geometry
    out = dict(model="smollm2-135m", geometry=g.as_dict(), depths=list(DEPTHS), needles=2, seed=args.seed,
               threads=torch.get_num_threads(), retrieval={}, seconds={})
    for n in args.lengths:
        t0 = time.perf_counter()
        det = RetrievalDetector((n,), DEPTHS, 2, args.seed, tokenizer=lm.tokenizer).detect(
            lm.model, progress=lambda f, m: print(f"  {m}", flush=True))
        out["retrieval"][str(n)] = dict(scores=det.scores.tolist(), accuracy=det.extras["answer_accuracy"],
                                        seconds=time.perf_counter() - t0)
        print(f"retrieval {n}: {time.perf_counter() - t0:.0f} s, accuracy {det.extras['answer_accuracy']:.3f}",
              flush=True)
    t0 = time.perf_counter()
    sd = StreamingDetector((args.streaming_length,), BAND, 64, n_sequences=args.streaming_sequences,
                           seed=args.seed, tokenizer=lm.tokenizer)
    det = sd.detect(lm.model)
    out["streaming"] = dict(length=args.streaming_length, sinks=SINKS, recent=RECENT, sequences=sd.n_sequences,
                            kv=det.extras["kv_scores"].tolist(), head=det.extras["head_scores"].tolist(),
                            seconds=time.perf_counter() - t0)
    print(f"streaming {args.streaming_length}: {time.perf_counter() - t0:.0f} s", flush=True)
    ind = detect_heads(lm, ["induction"], options=dict(seed=args.seed))["induction"]
    out["induction"] = ind.scores.tolist()
    out["mpg"] = mpg_scores(lm, 2.0).scores.tolist()
    if args.oracle_tokens:
        t0 = time.perf_counter()
        ids = streaming_text(lm.tokenizer, args.oracle_tokens, seed=args.seed + 7)
        oracle = Window(SINKS, args.oracle_recent)
        kv, _ = streaming_scores(lm.model, [ids], window=oracle, queries=64)
        eff = windowing_effect(lm.model, ids[None], window=oracle,
                               progress=lambda f, m: print(f"  {m}", flush=True))
        out["oracle"] = dict(tokens=args.oracle_tokens, sinks=SINKS, recent=args.oracle_recent, cheap=kv.tolist(),
                             kl=eff.kl.tolist(), loss_delta=eff.loss_delta.tolist(), base_loss=eff.base_loss,
                             predictions=eff.n_predictions, seconds=time.perf_counter() - t0)
        print(f"oracle: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _heads(mask: np.ndarray) -> str:
    return ", ".join(f"L{l}H{h}" for l, h in zip(*np.nonzero(mask))) or "none"


def render(data: dict, permutations: int) -> str:
    g = data["geometry"]
    L, H, Hkv = g["n_layers"], g["n_heads"], g["n_kv_heads"]
    G = H // Hkv
    lengths = list(data["retrieval"])
    per = {n: np.array(data["retrieval"][n]["scores"]) for n in lengths}
    retrieval = np.mean([per[n] for n in lengths], axis=0)                # [L, H]: equal items per length
    stream = np.array(data["streaming"]["kv"])                           # [L, Hkv]
    stream_h = np.repeat(stream, G, axis=1)                              # [L, H]
    induction = np.array(data["induction"])
    mpg = np.array(data["mpg"])
    is_ret = retrieval >= RETRIEVAL_THRESHOLD
    is_ind = induction >= INDUCTION_THRESHOLD
    lines = [KV_HEADS_MARKERS[0], "## Retrieval and streaming heads (scripts/kv_heads_results.py)", "",
             f"Generated by `{COMMAND} --lengths {','.join(lengths)}` on SmolLM2-135M ({L} layers x {H} heads, "
             f"{Hkv} KV heads), float32 on the CPU ({data['threads']} thread{'s' if data['threads'] != 1 else ''}). Definitions: docs/DEFINITIONS.md, "
             "'Heads for long contexts'. Retrieval: built-in text with a needle (5 random words or 7 digits) at "
             f"depths {', '.join(f'{d:g}' for d in data['depths'])}, 2 needles per length and depth, the needle "
             f"teacher-forced as the answer; a retrieval head copies >= {RETRIEVAL_THRESHOLD:g} of the needle's "
             f"tokens (Wu et al. 2024's cut). Streaming: {data['streaming']['sequences']} text(s) of "
             f"{data['streaming']['length']} tokens, {SINKS} sink + {RECENT} recent tokens, 64 query rows each.", "",
             "| context | items | model's answer accuracy (teacher-forced top-1) | retrieval heads (>= 0.1) | "
             "highest score | seconds |", "|---|---|---|---|---|---|"]
    for n in lengths:
        r = data["retrieval"][n]
        s = per[n]
        lines.append(f"| {n} | {len(data['depths']) * data['needles']} | {r['accuracy']:.3f} | "
                     f"{int((s >= RETRIEVAL_THRESHOLD).sum())} | {s.max():.3f} (L{np.unravel_index(s.argmax(), s.shape)[0]}"
                     f"H{np.unravel_index(s.argmax(), s.shape)[1]}) | {r['seconds']:.0f} |")
    order = np.argsort(-retrieval, axis=None)[:8]
    top = [f"L{i // H}H{i % H} {retrieval.flat[i]:.3f}" for i in order]
    layers = sorted({int(l) for l in np.nonzero(is_ret)[0]})
    lines += ["", f"Over all {len(lengths)} lengths: **{int(is_ret.sum())} of {L * H} heads "
              f"({is_ret.mean():.1%}) are retrieval heads**: {_heads(is_ret)} (layers {layers or 'none'}); "
              f"the highest scores: {', '.join(top)}.", ""]
    # relation to induction heads
    both = is_ret & is_ind
    rho_ind = rank_correlation(retrieval, induction)
    auc_ind = roc_auc(induction, is_ret)
    p_ind = permutation_p(induction, is_ret, n_permutations=permutations, seed=data["seed"])
    lines.append(f"Induction heads (score >= {INDUCTION_THRESHOLD:g} on repeated random tokens): {int(is_ind.sum())}; "
                 f"{int(both.sum())} of the retrieval heads are induction heads ({_heads(both)}). Spearman rho between "
                 f"the two scores over all heads: {rho_ind:.3f}; the induction score as a classifier of 'retrieval "
                 f"head': ROC AUC {auc_ind:.3f} (p {p_ind:.4f}).")
    # streaming
    strong = stream >= STREAMING_THRESHOLD
    by_layer = stream.mean(1)
    lines += ["", f"Streaming score per KV head ({Hkv * L} KV heads): median {np.median(stream):.3f}, "
              f"min {stream.min():.3f}, max {stream.max():.3f}; {int(strong.sum())} KV heads at >= "
              f"{STREAMING_THRESHOLD:g} (at least half the output from outside the window). Mean per layer: "
              + ", ".join(f"L{l} {v:.2f}" for l, v in enumerate(by_layer)) + "."]
    ret_kv = retrieval.reshape(L, Hkv, G).max(-1) >= RETRIEVAL_THRESHOLD
    if ret_kv.any():
        lines.append(f"KV heads holding a retrieval head: {int(ret_kv.sum())}; their streaming scores "
                     f"{', '.join(f'{v:.2f}' for v in stream[ret_kv])} (median of the others "
                     f"{np.median(stream[~ret_kv]):.3f}). "
                     f"{int((stream[ret_kv] <= np.quantile(stream, 0.5)).sum())} of them are in the lower half of all "
                     "streaming scores, so a plan from the streaming score alone (measured on plain text, where "
                     "there is nothing to retrieve) would window them: the plan keeps KV heads with a retrieval "
                     "head full.")
    from analysis.arch.geometry import HeadGeometry
    geo = HeadGeometry(L, H, Hkv, g["head_dim"], g["hidden"])
    plan = plan_kv(geo, stream, window_share=0.5, keep=ret_kv, window=BAND)
    lines.append(f"The kv-plan default (window 50 % of the KV heads, retrieval heads kept full): {plan.describe()}; KV "
                 f"cache {plan.kv_ratio(2048):.3f}x of dense at 2,048 tokens, {plan.kv_ratio(8192):.3f}x at 8,192.")
    if "oracle" in data:
        o = data["oracle"]
        cheap, kl, dl = (np.array(o[k]) for k in ("cheap", "kl", "loss_delta"))
        lines += ["", f"Oracle check of the streaming score ({o['tokens']} tokens, {o['sinks']} sink + {o['recent']} "
                  f"recent, {o['predictions']} predictions beyond the window; each KV head windowed alone, end to "
                  f"end, {o['seconds']:.0f} s): Spearman rho of the cheap score with the KL divergence from the dense "
                  f"model's next-token distribution {rank_correlation(cheap, kl):.3f}, with the loss change "
                  f"{rank_correlation(cheap, dl):.3f}; the KV head the cheap score ranks highest "
                  f"(L{np.unravel_index(cheap.argmax(), cheap.shape)[0]}KV{np.unravel_index(cheap.argmax(), cheap.shape)[1]}) "
                  f"is number {int((kl > kl.flat[cheap.argmax()]).sum()) + 1} of {kl.size} by KL; the largest loss "
                  f"change when one KV head is windowed: {dl.max():+.4f} nats (dense {o['base_loss']:.3f}).",
                  "(With 90 KV heads, |rho| > 0.27 is below 1 % under independent rankings.)"]
    tests = role_tests(mpg, {"retrieval": (retrieval, RETRIEVAL_THRESHOLD),
                             "streaming (needs the full context)": (stream_h, STREAMING_THRESHOLD)},
                       n_permutations=permutations, seed=data["seed"])
    lines += ["", "Does MP find them? MP-G (z = 2) as a classifier of each role (the streaming role per query head: "
              "each head carries its KV head's score):", "",
              "| role | heads with role | ROC AUC | p (two-sided) | mean MP-G with / without |", "|---|---|---|---|---|"]
    for t in tests:
        auc = "n/a" if not np.isfinite(t.auc) else f"{t.auc:.3f}"
        p = "n/a" if not np.isfinite(t.p_value) else f"{t.p_value:.4f}"
        lines.append(f"| {t.role} | {t.n_with_role} | {auc} | {p} | {t.mean_score_with:.3g} / "
                     f"{t.mean_score_without:.3g} |")
    lines += ["", "Maps: artifacts/kv_heads_smollm2.png (not tracked); raw numbers: artifacts/kv_heads_smollm2.json.",
              KV_HEADS_MARKERS[1]]
    return "\n".join(lines)


def figure(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = data["geometry"]
    retrieval = np.mean([np.array(v["scores"]) for v in data["retrieval"].values()], axis=0)
    stream = np.repeat(np.array(data["streaming"]["kv"]), g["n_heads"] // g["n_kv_heads"], axis=1)
    fig, axes = plt.subplots(1, 2, figsize=(9, 7))
    for ax, m, title in ((axes[0], retrieval, "Retrieval score"), (axes[1], stream, "Streaming score (per KV head)")):
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        ax.set_title(title)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--streaming-length", type=int, default=2048)
    p.add_argument("--streaming-sequences", type=int, default=2)
    p.add_argument("--oracle-tokens", type=int, default=512, help="0: skip the oracle check")
    p.add_argument("--oracle-recent", type=int, default=64)
    p.add_argument("--permutations", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-json", default=None, help="render a saved run instead of measuring")
    args = p.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    raw = ROOT / "artifacts" / "kv_heads_smollm2.json"
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        data = measure(args)
        raw.parent.mkdir(exist_ok=True)
        atomic_write(raw, json.dumps(data))
    figure(data, ROOT / "artifacts" / "kv_heads_smollm2.png")
    section = render(data, args.permutations)
    write_section(args.out, section, *KV_HEADS_MARKERS, what="The results file")
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
