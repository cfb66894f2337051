"""Benchmark: the long-context probes on the dense built-in SmolLM2 (issue 41): what a 135M model retrieves at
1k-8k tokens, and what the probe set costs on this machine (a result, not a test).

For each length in --lengths (default 1,024, 2,048 and 4,096 tokens; the model reads at most 8,192), the three
long-context probes (passkey, needle with a distractor, long-range copying; analysis.measure.probes.longcontext)
are built at --depths (default 0.1, 0.5, 0.9) with --items sequences per depth, and measured dense
(analysis.score.longcontext.long_context_report): accuracy per probe x length x depth with 95 % bootstrap CIs
over sequences, exact match (every digit of a key right) for the digit probes. Before each length the time is
estimated (`row_seconds`: a timed forward at 256 tokens and the attention kernel at the length) and printed
next to the measured time: the probe set at 4,096 tokens is the issue's speed figure. Numbers are saved after
every length (--out), so a long run that is stopped keeps what it measured.

    nice -n 5 .venv/bin/python -m bench.bench_long_probes [--lengths 1024,2048,4096] [--depths 0.1,0.5,0.9]
        [--items 8] [--threads 2] [--cache-dir DIR] [--out FILE.json] [--write-docs] [--render-only FILE.json]
        [--quick]
--quick: 256 and 512 tokens, 2 sequences per depth: checks the script in a minute or two.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--items", type=int, default=8, help="sequences per length and depth")
    p.add_argument("--probes", default="passkey,needle,long-copying")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", dest="cache_dir", default=None)
    p.add_argument("--out", default=None, help="also write the numbers as JSON (after every length)")
    p.add_argument("--resume", action="store_true", help="keep the lengths --out already holds, measure the others")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--write-docs", dest="write_docs", action="store_true", help="write docs/results.md's section")
    p.add_argument("--render-only", dest="render_only", default=None, metavar="FILE.json",
                   help="no measuring: the tables (and --write-docs) from numbers an --out run saved")
    args = p.parse_args(argv)
    if args.render_only:
        finish(json.loads(Path(args.render_only).read_text()), args)
        return 0
    if args.quick:
        args.lengths, args.items = "256,512", 2

    import torch

    from analysis.arch.models import load_model
    from analysis.measure.probes.longcontext import build_long, row_seconds, step_seconds
    from analysis.score.longcontext import long_context_report, report_work
    from bench._timing import load_average, load_text

    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    depths = [float(d) for d in args.depths.split(",") if d]
    probes = [n for n in args.probes.split(",") if n]
    lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
    out = {"args": vars(args), "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "when": datetime.now(timezone.utc).isoformat(), "lengths": {}}
    if args.resume and args.out and Path(args.out).exists():
        before = json.loads(Path(args.out).read_text())
        out["lengths"] = {n: {"items": before["args"]["items"], **v} for n, v in before["lengths"].items()}
        out["when"] = before.get("when", out["when"])
    print(f"{lm.name}, long-context probes {', '.join(probes)} at {lengths} tokens, depths {depths}, {args.items} "
          f"sequences per depth, torch threads {torch.get_num_threads()}, load {load_text(load_average())}", flush=True)
    for length in lengths:
        if str(length) in out["lengths"]:
            print(f"  {length} tokens: kept from {args.out}", flush=True)
            continue
        built = build_long(probes, lm.tokenizer, lm.kind, [length], depths=depths, n_items=args.items, seed=args.seed)
        work = report_work(built)
        per_row = row_seconds(lm.model, [length], geometry=lm.geometry)
        estimate = work.seconds(per_row, step_seconds(lm.model, sorted(work.steps), geometry=lm.geometry))
        rows = sum(work.rows.values())
        print(f"  {length} tokens: {rows} rows, estimate {estimate:.0f} s ({per_row[length]:.2f} s a row), "
              f"load {load_text(load_average())}", flush=True)
        t0 = time.perf_counter()
        rep = long_context_report(lm, built=built, seed=args.seed)
        seconds = time.perf_counter() - t0
        per_probe = {name: sum(s.depths["all"].seconds for key, s in rep.dense.items() if key[0] == name) for name in probes}
        print(f"  {length} tokens: measured {seconds:.0f} s ({seconds / rows:.2f} s a row; estimate / measured "
              f"{estimate / seconds:.2f}); per probe " + ", ".join(f"{n} {s:.0f} s" for n, s in per_probe.items()),
              flush=True)
        for r in rep.rows():
            exact = f", exact {r['dense_exact']:.2f}" if "dense_exact" in r else ""
            print(f"    {r['probe']:>12} {r['depth']:>9}: accuracy {r['dense_accuracy']:.3f} [{r['dense_low']:.3f}, "
                  f"{r['dense_high']:.3f}]{exact}", flush=True)
        out["lengths"][str(length)] = dict(items=args.items, rows=rows, tokens=work.total_tokens, seconds=seconds,
                                           estimate_s=estimate,
                                           per_row_estimate_s=per_row[length], per_probe_s=per_probe,
                                           load=load_average(), cells=rep.rows(),
                                           rejected={k[0]: it.rejected_counts() for k, (_, _, it) in built.items()})
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    out["load_end"] = load_average()
    finish(out, args)
    return 0


def _ci(r: dict, key: str, low: str, high: str) -> str:
    return f"{r[key]:.2f} [{r[low]:.2f}, {r[high]:.2f}]" if key in r else "-"


def tables(out: dict) -> list[str]:
    by = {n: v for n, v in sorted(out["lengths"].items(), key=lambda kv: int(kv[0]))}
    lines = ["| tokens | rows | estimate | measured | a row | passkey | needle | long-copying | load (1 min) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, v in by.items():
        p = v["per_probe_s"]
        lines.append(f"| {int(n):,} | {v['rows']} | {v['estimate_s']:.0f} s | {v['seconds']:.0f} s | "
                     f"{v['seconds'] / v['rows']:.2f} s | " + " | ".join(f"{p.get(k, 0):.0f} s" for k in
                                                                      ("passkey", "needle", "long-copying"))
                     + f" | {v['load'][0]:.1f} |")
    lines += ["", "| probe | tokens | depth | sequences | accuracy [95 % CI] | exact match [95 % CI] |",
              "|---|---:|---|---:|---:|---:|"]
    for n, v in by.items():
        for r in v["cells"]:
            lines.append(f"| {r['label']} | {int(n):,} | {r['depth']} | {r['n_units']} | "
                         f"{_ci(r, 'dense_accuracy', 'dense_low', 'dense_high')} | "
                         f"{_ci(r, 'dense_exact', 'dense_exact_low', 'dense_exact_high')} |")
    return lines


def _span(out: dict) -> str:
    lengths = sorted(int(n) for n in out["lengths"])
    return f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}-{lengths[-1]:,}"


def _items_words(out: dict) -> str:
    """'8 sequences per length and depth', '... (4 at 8,192 tokens)' when a resumed run measured some lengths
    with another count."""
    counts = {int(n): v.get("items", out["args"]["items"]) for n, v in out["lengths"].items()}
    common = max(set(counts.values()), key=list(counts.values()).count)
    other = [f"{c} at {n:,} tokens" for n, c in sorted(counts.items()) if c != common]
    return (f"{common} sequences per length and depth (a key and its text, read at every depth)"
            + (f"; {', '.join(other)}" if other else ""))


def _load(avg) -> str:
    return "not recorded" if not avg else " / ".join(f"{x:.2f}" for x in avg)


def markdown(out: dict, verdict: str = "") -> str:
    from analysis.score.longcontext import LONG_PROBES_MARKERS
    a = out["args"]
    return "\n".join([
        LONG_PROBES_MARKERS[0], "",
        f"## Long-context probes: what the dense SmolLM2-135M retrieves at {_span(out)} tokens "
        "(bench/bench_long_probes.py)", "",
        f"Measured from {out['when'][:16].replace('T', ' ')} UTC on {out.get('machine', 'x86_64')}, {out['threads']} "
        f"torch threads, the machine shared with other jobs (the load average beside each length's time; at the "
        f"end {_load(out.get('load_end'))}); {_items_words(out)}, seed {a['seed']}; "
        f"rows of exactly the length given (instruction, real Wikipedia text, the needle, the question). Accuracy = "
        f"share of items (a key's digits read one by one; a copied token) whose correct token out-scores its "
        f"contrast (chance 0.5): another digit for the pass key, the distractor city's digit for the needle, another "
        f"token of the sequence for copying; exact match = share of keys with every digit right; CIs are 95 % "
        f"percentile bootstraps over sequences. Estimate: `row_seconds` (a timed forward of 8 x 256 tokens plus the "
        f"attention kernel at the length) x rows, printed before each length ran. "
        f"Command: `python -m bench.bench_long_probes --out FILE --write-docs`.", "",
        *tables(out), "", verdict, "", LONG_PROBES_MARKERS[1], ""])


GOOD = 0.9                 # a cell "retrieves" when its accuracy CI's lower bound is above this

CAVEATS = (
    "What this does not show: these are the easy forms of retrieval (one salient sentence that does not belong "
    "to the text around it, the pass key even stated twice; one distractor), read under teacher forcing against "
    "one contrast: a right item is \"the correct token out-scores one wrong one, the earlier digits given\", not "
    "free generation, so exact match here is an upper bound on what greedy decoding would produce. Needles that "
    "resemble the text, several facts to combine and aggregation are not tested. A cell of 1.00 [1.00, 1.00] is "
    "every sequence right: the bootstrap interval collapses then (the binomial 95 % lower bound of 8 of 8 is 0.63, "
    "of 4 of 4 0.40).")


def _back(length: int, depth: str) -> int:
    """About how many tokens lie between a needle at `depth` ("depth 0.1") and the end of a `length` row."""
    return int(round((1.0 - float(depth.split()[1])) * length, -2))


def verdict(out: dict) -> str:
    """The reading, from the numbers: how far back every probe retrieves (accuracy CI above GOOD), the cells where
    one does not (with its numbers and how far back the needle was), the caveats, and the cost at 4,096 tokens."""
    cells = [(int(n), r) for n, v in out["lengths"].items() for r in v["cells"] if r["depth"] != "all"]
    if not cells:
        return ""
    by_spot: dict[tuple, list] = {}
    for n, r in cells:
        by_spot.setdefault((n, r["depth"]), []).append(r)
    good = [spot for spot, rs in by_spot.items() if all(r["dense_low"] > GOOD for r in rs)]
    bad = sorted((spot for spot in by_spot if spot not in good), key=lambda s: (s[0], s[1]))
    lines = []
    if good:
        far = max(good, key=lambda s: _back(*s))
        lines.append(f"- Every probe retrieves (accuracy CI above {GOOD}) in {len(good)} of {len(by_spot)} length x "
                     f"depth cells, up to a needle about {_back(*far):,} tokens back ({far[0]:,} tokens, {far[1]}).")
    for n, depth in bad:
        parts = []
        for r in by_spot[(n, depth)]:
            words = f"{r['label'].lower()} {r['dense_accuracy']:.2f} [{r['dense_low']:.2f}, {r['dense_high']:.2f}]"
            words += " (at chance)" if r["dense_low"] <= 0.5 else ""
            if r["probe"] == "needle" and r["dense_low"] <= 0.5:
                from analysis.measure.probes.longcontext import DISTRACTOR_SHIFT
                other = (float(depth.split()[1]) + DISTRACTOR_SHIFT) % 1.0   # where NeedleProbe puts the other fact
                words += (f" (the other city's number, at depth {other:g}, is about "
                          f"{_back(n, f'depth {other}'):,} tokens back)")
            words += f", exact {r['dense_exact']:.2f}" if "dense_exact" in r else ""
            parts.append(words)
        lines.append(f"- At {n:,} tokens, {depth} (the needle about {_back(n, depth):,} tokens back): "
                     + "; ".join(parts) + ".")
    lines.append(f"- {CAVEATS}")
    v = out["lengths"].get("4096")
    if v:
        lines.append(f"- Cost: the probe set at 4,096 tokens ({v['rows']} rows) took {v['seconds']:.0f} s on "
                     f"{out['threads']} threads, {v['seconds'] / v['rows']:.1f} s a row, at a load average of "
                     f"{v['load'][0]:.1f} (estimated {v['estimate_s']:.0f} s before it ran).")
    return "\n".join(lines)


def finish(out: dict, args) -> None:
    """Print the tables; --out saves the numbers, --write-docs the section of docs/results.md."""
    print("\n" + "\n".join(tables(out)) + "\n\n" + verdict(out))
    if args.out and not args.render_only:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if args.write_docs:
        from analysis.core.atomic import write_section
        from analysis.score.longcontext import LONG_PROBES_MARKERS
        write_section(ROOT / "docs" / "results.md", markdown(out, verdict(out)), *LONG_PROBES_MARKERS)


if __name__ == "__main__":
    raise SystemExit(main())
