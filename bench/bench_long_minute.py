"""Benchmark (issue 46): the Long context page's long passes on the built-in SmolLM2, separate vs shared vs
bfloat16, their estimates, and a second visit read from the store (a result, not a test).

What the page fills from scores plus the plan's probes, at --length tokens (default 2,048; the page's defaults
otherwise: the pass key, depths 0.1 / 0.5 / 0.9, 2 sequences per depth, 4 sink + 256 recent tokens):

  separate  today's way, float32: the streaming score on its own text (1 pass), the retrieval score on its
            needle items (2 needles x 3 depths), the probes' dense side (6 rows), the plan's side (6 rows), the
            KV groups' importance (256 tokens);
  shared    one scan of the probes' rows (analysis.measure.longpass: the probes' dense side, the retrieval and
            the streaming score from the same 6 passes), the plan's side, the importance; float32;
  bf16      the same with the passes in bfloat16 (torch.autocast, attention in float32), where the CPU has native
            bfloat16 kernels (analysis.core.placement.fast_bfloat16).

The plan is the one the page's fill makes from the scan's scores (window 50 % of the KV heads, prune 25 %,
retrieval heads full). For every job: the app's estimate before it (rows x this machine's seconds per row from
`row_seconds`' two short timings; the importance from the sweep's forward count) next to the measured seconds
and their ratio (target 0.67 .. 1.5). Then a second visit: every result of the shared run read back from the
store in a fresh process state (no Streamlit cache) and the CLI after the app (`kv-plan --rows probes`, `longctx
--kv-plan`, wall time of the whole command including Python's start and the model's load). Then what bfloat16
changes: Spearman's rho of the streaming and retrieval scores against float32, the overlap of the top heads,
the share of KV heads the plan treats alike, the probes' accuracy dense and under the plan.

    nice -n 5 .venv/bin/python -m bench.bench_long_minute [--length 2048] [--threads 2] [--out FILE.json]
        [--write-docs] [--render-only FILE.json] [--quick] [--no-separate] [--no-bf16]
--quick: 512 tokens (checks the script in a few minutes). Results are written to a fresh store in a temporary
folder (HEADSCOPE_RESULTS), never the user's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- long-minute:begin -->", "<!-- long-minute:end -->")
TARGET = 1.5
TOP = 10


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _job(rows: list, name: str, estimate: float | None, seconds: float, **extra) -> None:
    ratio = None if not estimate else estimate / seconds
    rows.append(dict(job=name, estimate=estimate, seconds=seconds, ratio=ratio, load=os.getloadavg()[0], **extra))
    shown = "-" if ratio is None else f"{ratio:.2f}"
    print(f"  {name:<44} estimate {('-' if estimate is None else f'{estimate:6.1f} s'):>8}   measured {seconds:6.1f} s"
          f"   ratio {shown}   load {os.getloadavg()[0]:.1f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-separate", dest="separate", action="store_false")
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--render-only", dest="render_only", default=None, metavar="FILE.json")
    args = p.parse_args(argv)
    if args.render_only:
        finish(json.loads(Path(args.render_only).read_text()), args)
        return 0
    if args.quick:
        args.length = 512
    os.environ["HEADSCOPE_RESULTS"] = tempfile.mkdtemp(prefix="bench-long-minute-")
    import numpy as np
    import torch

    from analysis.arch.cut import Cut
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.core.placement import fast_bfloat16
    from analysis.core.store import Store
    from analysis.measure.detectors import detect_heads
    from analysis.measure.long_options import PAGE_IMPORTANCE_TOKENS
    from analysis.measure.longpass import precision_block
    from analysis.measure.probes.longcontext import long_work, measure_long, row_seconds, step_seconds
    from analysis.score.kvscores import KVScores, plan_from_scores
    from analysis.score.longcontext import items_key
    from analysis.score.longscan import (importance_seconds, page_rows, stored_dense, stored_importance,
                                         stored_report, stored_scan)
    from bench._timing import load_average, load_text

    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
    g, window, tokens = lm.geometry, Window(), PAGE_IMPORTANCE_TOKENS
    built = page_rows(lm, (args.length,))
    n_rows = sum(items.ids.shape[0] for (_, _, items) in built.values())
    out = dict(args=vars(args), machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
               when=datetime.now(timezone.utc).isoformat(), rows=n_rows, length=args.length,
               bf16_native=fast_bfloat16("cpu"), load_before=load_average(), jobs=[], effect={})
    print(f"{lm.name}: the Long context page's passes at {args.length} tokens ({n_rows} probe rows), "
          f"{torch.get_num_threads()} torch threads, load {load_text(load_average())}", flush=True)
    from analysis.score.longscan import head_fraction, importance_ablations
    t_rows, per_row = _timed(lambda: row_seconds(lm.model, [args.length], geometry=g))
    work = long_work(built)
    t_steps, per_step = _timed(lambda: step_seconds(lm.model, sorted(work.steps), geometry=g) if work.steps else {})
    t_imp, imp_row = _timed(lambda: row_seconds(lm.model, [tokens], short=tokens, rows=importance_ablations(g),
                                                geometry=g))
    est_pass = work.seconds(per_row, per_step)
    est_imp = importance_seconds(g, tokens, imp_row[tokens], head_fraction(lm.model))
    t_rows += t_imp
    jobs = out["jobs"]
    _job(jobs, "timing this machine (row_seconds + step_seconds, once)", None, t_rows + t_steps, side="setup")

    def plan_of(scan, importance):
        dets = {"streaming": scan.streaming(), "retrieval": scan.retrieval()}
        return plan_from_scores(g, KVScores(dets["streaming"].extras["kv_scores"], dets["retrieval"].extras["kv_scores"],
                                            importance, dets), window_share=0.5, prune_share=0.25, window=window,
                                model=lm.name)

    # -- separate (today's way) --------------------------------------------------------------------------------
    if args.separate:
        print("separate (float32):", flush=True)
        from analysis.measure.detectors import get_detector
        stream_passes = get_detector("streaming", lm.tokenizer, lengths=(args.length,)).passes(lm.model)
        retr_passes = get_detector("retrieval", lm.tokenizer, lengths=(args.length,), needles=2).passes(lm.model)
        est = lambda passes: sum(per_row[n] for n in passes)                       # noqa: E731 (one length)
        s, _ = _timed(lambda: detect_heads(lm, ["streaming"], options=dict(lengths=(args.length,))))
        _job(jobs, f"streaming score ({len(stream_passes)} pass)", est(stream_passes), s, side="separate")
        s, _ = _timed(lambda: detect_heads(lm, ["retrieval"], options=dict(lengths=(args.length,), needles=2)))
        _job(jobs, f"retrieval score ({len(retr_passes)} passes)", est(retr_passes), s, side="separate")
        s, dense_alone = _timed(lambda: measure_long(lm.model, built, tokenizer=lm.tokenizer))
        _job(jobs, f"probes' dense side ({n_rows} rows)", est_pass, s, side="separate")
    print("shared (float32):", flush=True)
    s, (imp, _) = _timed(lambda: stored_importance(lm, tokens))
    _job(jobs, f"KV groups' importance ({tokens} tokens)", est_imp, s, side="both")
    s, (scan32, _) = _timed(lambda: stored_scan(lm, built, window=window))
    _job(jobs, f"shared scan ({n_rows} rows: probes + both scores)", est_pass, s, side="shared")
    plan = plan_of(scan32, imp)
    cut = Cut.of_plan(plan, info=dict(source="bench"))
    dense32, _ = stored_dense(lm, built)
    s, (rep32, _) = _timed(lambda: stored_report(lm, built, cut, dense=dense32))
    _job(jobs, f"the plan's side ({n_rows} rows, {plan.describe()})", est_pass, s, side="both")
    out["plan"] = dict(describe=plan.describe(), counts=plan.counts())
    if args.separate:
        same = all(np.array_equal(dense_alone[k].depths[lab].logit_diff,
                                  dense32[items_key(*k, built[k][2])].depths[lab].logit_diff)
                   and dense_alone[k].written == dense32[items_key(*k, built[k][2])].written
                   for k in built for lab in dense_alone[k].depths)
        out["dense_equal"] = bool(same)
        print(f"  the scan's probes' dense side equals the separate run's: {same}", flush=True)

    # -- bf16 -------------------------------------------------------------------------------------------------
    if args.bf16 and fast_bfloat16("cpu"):
        print("shared (bfloat16 passes):", flush=True)
        t16, (row16, imp_row16) = _timed(lambda: (
            row_seconds(lm.model, [args.length], geometry=g, precision="bfloat16"),
            row_seconds(lm.model, [tokens], short=tokens, rows=importance_ablations(g), geometry=g,
                        precision="bfloat16")))
        _job(jobs, "timing this machine in bfloat16 (once)", None, t16, side="setup")
        est_pass16 = work.seconds(row16, per_step)
        est_imp16 = importance_seconds(g, tokens, imp_row16[tokens], head_fraction(lm.model))
        s, (imp16, _) = _timed(lambda: stored_importance(lm, tokens, precision="bfloat16"))
        _job(jobs, f"KV groups' importance, bfloat16 ({tokens} tokens)", est_imp16, s, side="bf16")
        s, (scan16, _) = _timed(lambda: stored_scan(lm, built, window=window, precision="bfloat16"))
        _job(jobs, f"shared scan, bfloat16 ({n_rows} rows)", est_pass16, s, side="bf16")
        dense16, _ = stored_dense(lm, built, precision="bfloat16")
        plan16 = plan_of(scan16, imp16)
        cut16 = Cut.of_plan(plan16, info=dict(source="bench"))

        def plan16_side():
            with precision_block(lm.model, "bfloat16"):
                return stored_report(lm, built, cut16, dense=dense16, precision="bfloat16")
        s, (rep16, _) = _timed(plan16_side)
        _job(jobs, f"the plan's side, bfloat16 ({n_rows} rows)", est_pass16, s, side="bf16")
        out["effect"] = effect(scan32, scan16, plan, plan16, rep32, rep16, imp, imp16)
        for k, v in out["effect"].items():
            print(f"  {k}: {v}", flush=True)
    elif args.bf16:
        print("bfloat16: this CPU has no native bfloat16 kernels (no avx512_bf16 / amx_bf16): not measured", flush=True)

    # -- a second visit, the CLI after the app ---------------------------------------------------------------------
    print("second visit (everything read back from the store):", flush=True)
    fresh = Store()

    def read_back():
        sc, f1 = stored_scan(lm, built, window=window, compute=False, store=fresh)
        im, f2 = stored_importance(lm, tokens, compute=False, store=fresh)
        de, f3 = stored_dense(lm, built, compute=False, store=fresh)
        rp, f4 = stored_report(lm, built, cut, dense=de, compute=False, store=fresh)
        assert all(f.hit for f in (f1, f2, f3, f4)), (f1, f2, f3, f4)
        return sc.streaming(), sc.retrieval(), im, rp
    s, back = _timed(read_back)
    _job(jobs, "second visit: scores, importance, probes, plan", None, s, side="second")
    assert back[3].rows() == rep32.rows()
    plan_file = Path(os.environ["HEADSCOPE_RESULTS"]) / "kv_plan.json"
    plan_file.write_text(plan.to_json())
    for name, cli in (("CLI after: kv-plan --rows probes", ["kv-plan", "--rows", "probes", "--lengths", str(args.length),
                                                           "--prune-share", "0.25"]),
                      ("CLI after: longctx --kv-plan (plan's side stored)",
                       ["longctx", "--probe", "passkey", "--lengths", str(args.length), "--items", "2", "--kv-plan",
                        str(plan_file)])):
        cmd = [sys.executable, "-m", "analysis", *cli, "--quiet"] + (["--cache-dir", args.cache_dir] if args.cache_dir
                                                                     else [])
        s, done = _timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT))
        stored = json.loads(done.stdout).get("stored") if done.returncode == 0 else done.stderr[-300:]
        _job(jobs, name, None, s, side="second", stored=stored)
    s, _ = _timed(lambda: subprocess.run([sys.executable, "-c", "import torch, transformers"], capture_output=True))
    _job(jobs, "  of which: python + import torch, transformers", None, s, side="second")
    if args.length == 2048:                                   # the page's default rows (the URL cannot set them)
        for name, seconds in app_visits(plan, args).items():
            _job(jobs, name, None, seconds, side="second")
    out["load_after"] = load_average()
    finish(out, args)
    return 0


def app_visits(plan, args) -> dict:
    """Seconds of the Long context page (Streamlit's AppTest, this process) with the plan in its URL once every
    result is stored: after a restart (every Streamlit cache empty: the model loads, the results come from disk)
    and a second visit of the same server. Each run must show the stored scores and the plan's probes."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from components.state import kv_text
    if args.cache_dir:
        os.environ["HEADSCOPE_CACHE"] = args.cache_dir

    def visit() -> float:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
        at.query_params.update(model="smollm2-135m", page="long_context", kv=kv_text(plan.modes))
        t0 = time.perf_counter()
        at.run()
        seconds = time.perf_counter() - t0
        shown = " ".join(c.value for c in at.caption)
        assert not at.exception and shown.count("Read from this machine's stored results") == 3, shown[:500]
        return seconds

    visit()                                                   # Streamlit's and the app's imports, once
    st.cache_data.clear()
    st.cache_resource.clear()
    restart = visit()
    return {"app after a restart: the page, all stored": restart, "app, second visit (same server)": visit()}


def effect(scan32, scan16, plan32, plan16, rep32, rep16, imp32, imp16) -> dict:
    """What bfloat16 changes against float32 (module docstring)."""
    import numpy as np
    from scipy.stats import spearmanr
    s32, s16 = scan32.streaming().extras["kv_scores"].ravel(), scan16.streaming().extras["kv_scores"].ravel()
    r32, r16 = scan32.retrieval().scores.ravel(), scan16.retrieval().scores.ravel()
    top = lambda a, k: set(np.argsort(-a, kind="stable")[:k].tolist())           # noqa: E731
    low = lambda a, k: set(np.argsort(a, kind="stable")[:k].tolist())            # noqa: E731
    k_window = int(0.5 * s32.size)

    def acc(rep, side):
        return {c["depth"]: (round(c[f"{side}_accuracy"], 3), round(c.get(f"{side}_generated", float("nan")), 3))
                for c in rep.rows()}
    return dict(streaming_rho=round(float(spearmanr(s32, s16)[0]), 4),
                streaming_windowed_overlap=f"{len(low(s32, k_window) & low(s16, k_window))}/{k_window}",
                retrieval_rho=round(float(spearmanr(r32, r16)[0]), 4),
                retrieval_top_overlap=f"{len(top(r32, TOP) & top(r16, TOP))}/{TOP}",
                retrieval_heads=f"{int((r32 >= 0.1).sum())} float32, {int((r16 >= 0.1).sum())} bfloat16",
                plan_same_modes=round(float((plan32.modes == plan16.modes).mean()), 3),
                importance_rho=round(float(spearmanr(np.ravel(imp32), np.ravel(imp16))[0]), 4),
                dense_accuracy=dict(float32=acc(rep32, "dense"), bfloat16=acc(rep16, "dense")),
                plan_accuracy=dict(float32=acc(rep32, "cut"), bfloat16=acc(rep16, "cut")))


def finish(out: dict, args) -> None:
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    text = section(out)
    print(text)
    if args.write_docs:
        from analysis.core.atomic import write_section
        write_section(ROOT / "docs" / "results.md", text, *MARKERS, what="docs/results.md")


def section(out: dict) -> str:
    jobs = out["jobs"]
    by = lambda side: [j for j in jobs if j["side"] in side]                      # noqa: E731
    total = lambda side: sum(j["seconds"] for j in by(side))                     # noqa: E731
    lines = [MARKERS[0], f"## Long context in a minute ({out['length']:,} tokens, {out['rows']} probe rows)", "",
             f"`bench/bench_long_minute.py` on {out['machine']}, {out['threads']} torch threads, load before "
             f"{out['load_before']}, after {out.get('load_after')}; plan: {out.get('plan', {}).get('describe', '-')}.",
             "", "| job | side | estimate (s) | measured (s) | estimate / measured |", "|---|---|---:|---:|---:|"]
    for j in jobs:
        est = "-" if j["estimate"] is None else f"{j['estimate']:.1f}"
        ratio = "-" if j["ratio"] is None else f"{j['ratio']:.2f}"
        lines.append(f"| {j['job']} | {j['side']} | {est} | {j['seconds']:.1f} | {ratio} |")
    lines += ["", f"- everything the page fills from scores plus the plan's probes: separate {total(('separate', 'both')):.1f} s, "
              f"shared {total(('shared', 'both')):.1f} s"
              + (f", shared in bfloat16 {total(('bf16',)):.1f} s" if by(("bf16",)) else "") + "."]
    if "dense_equal" in out:
        lines.append(f"- the scan's probes' dense side equals the separate run's, number for number: {out['dense_equal']}.")
    if out.get("effect"):
        e = out["effect"]
        lines.append(f"- bfloat16 against float32: streaming rho {e['streaming_rho']}, windowed KV heads in common "
                     f"{e['streaming_windowed_overlap']}; importance rho {e['importance_rho']}; retrieval rho "
                     f"{e['retrieval_rho']}, top-{TOP} heads in common "
                     f"{e['retrieval_top_overlap']} (retrieval heads: {e['retrieval_heads']}); the plan treats "
                     f"{100 * e['plan_same_modes']:.0f} % of the KV heads alike; probes' (accuracy, generated exact match) "
                     f"dense {e['dense_accuracy']}, under the plan {e['plan_accuracy']}.")
    lines.append(MARKERS[1])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
