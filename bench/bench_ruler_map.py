"""Benchmark: dense's map, the dense model's RULER score on every offline task at every length (issue 52 item 1; a
result, not a test).

Per (task, length) cell: RULER's test rows (analysis.measure.splits: seed 0, the evaluation half of the built-in
text), --samples rows, dense's greedy generations through the harness bridge, kept in analysis.core.store (the
`ruler` command, the Long context page and bench_ruler read the same dense side back), the score with its 95 %
bootstrap CI. The map (analysis.measure.densemap.DenseMap) is rewritten after every cell, so a run stopped part way
keeps what it measured and a rerun skips the cells it has (resumable across sessions through --out, and through the
store on the same machine). Cells where dense scores >= 0.8 on >= 25 rows are the test set.

Beside RULER, the long-context probes whose answer the model writes (--probes: pass key twice and once, the needle
with a distractor; analysis.measure.probes.longcontext), as cells named "probe:<name>": dense's greedy answer, exact
match of the whole key (`generated`), over --probe-depths x --probe-rows rows (5 x 5 = 25 by default), their test
rows (the evaluation half of the built-in text). Long-range copying has no generated answer in headscope (it is
read teacher-forced only), so it is not a cell of this map.

Usage: nice -n 10 .venv/bin/python -m bench.bench_ruler_map [--lengths 1024,2048,4096] [--tasks all | none] [--samples 25]
       [--probes passkey,passkey-once,needle | none] [--probe-rows 5] [--probe-depths 0.1,0.3,0.5,0.7,0.9]
       [--threads 1] [--out docs/data/ruler_dense_map.json] [--write-docs] [--render-only]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis.core.atomic import write_section
from analysis.core.errors import HeadscopeError, InputError

ROOT = Path(__file__).resolve().parents[1]
MAP_MARKERS = ("<!-- ruler-map:begin -->", "<!-- ruler-map:end -->")
DEFAULT_OUT = ROOT / "docs" / "data" / "ruler_dense_map.json"


def measure_cell(loaded, task: str, length: int, samples: int):
    """DenseCell of one task at one length: its test rows, dense's stored (or generated and stored) run."""
    from analysis.measure.densemap import DenseCell
    from analysis.measure.ruler import build_ruler, ruler_cells, stored_dense
    rows = build_ruler([task], loaded.tokenizer, (length,), samples=samples, seed=0)
    t0 = time.perf_counter()
    dense, _ = stored_dense(loaded, rows)
    cell = next(c for c in ruler_cells(rows, dense) if c.task == task)
    return DenseCell.of_ruler(cell, rows.split, round(time.perf_counter() - t0, 1))


PROBE_PREFIX = "probe:"
PROBES = ("passkey", "passkey-once", "needle")            # the probes whose answer is generated and matched exactly


def measure_probes(loaded, names, length: int, depths, rows: int) -> list:
    """DenseCell of each probe at `length`: dense's generated answers' exact match over depths x rows test rows,
    mean with its bootstrap CI (analysis.measure.probes.longcontext.measure_long, one prefill per row)."""
    from analysis.measure.densemap import DenseCell
    from analysis.measure.probes.longcontext import ALL, build_long, measure_long
    t0 = time.perf_counter()
    built = build_long(list(names), loaded.tokenizer, loaded.kind, [length], depths=depths, n_items=rows)
    scores = measure_long(loaded.model, built, tokenizer=loaded.tokenizer)
    seconds = round((time.perf_counter() - t0) / max(len(built), 1), 1)
    out = []
    for (name, n), got in scores.items():
        extras = got.depths[ALL].extras
        out.append(DenseCell(PROBE_PREFIX + name, n, float(extras["generated"][0]), float(extras["generated_low"][0]),
                             float(extras["generated_high"][0]), int(got.generated.size), seconds))
    return out


def render(dense_map, path: Path, write_docs: bool) -> None:
    dense_map.write(path)
    if write_docs:
        write_section(ROOT / "docs" / "results.md", "\n".join([MAP_MARKERS[0], dense_map.markdown(), MAP_MARKERS[1]]),
                      *MAP_MARKERS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--tasks", default="all")
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--probes", default=",".join(PROBES), help="long probes with a generated answer, or none")
    p.add_argument("--probe-rows", dest="probe_rows", type=int, default=5, help="rows per depth and probe")
    p.add_argument("--probe-depths", dest="probe_depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--write-docs", dest="write_docs", action="store_true")
    p.add_argument("--render-only", dest="render_only", action="store_true")
    args = p.parse_args(argv)
    from analysis.measure.densemap import DenseMap
    out = Path(args.out)
    try:
        dense_map = DenseMap.read(out) if out.exists() else DenseMap(args.model)
        if args.render_only:
            print(dense_map.markdown())
            render(dense_map, out, args.write_docs)
            return 0
        import torch

        from analysis.arch.models import load_model
        from analysis.measure.ruler import check_tasks
        torch.set_num_threads(args.threads)
        loaded = load_model(args.model)
        probes = [] if args.probes.strip().lower() == "none" else [p.strip() for p in args.probes.split(",")]
        unknown = [p for p in probes if p not in PROBES]
        if unknown:
            raise InputError(f"--probes: {', '.join(unknown)} has no generated answer here; choose from "
                             f"{', '.join(PROBES)} or none.")
        depths = tuple(float(d) for d in args.probe_depths.split(","))
        for length in (int(n) for n in args.lengths.split(",")):
            todo = [p for p in probes if (PROBE_PREFIX + p, length) not in dense_map.cells
                    or dense_map.cells[PROBE_PREFIX + p, length].n < len(depths) * args.probe_rows]
            if todo:
                print(f"probes {', '.join(todo)} @ {length:,} ...", flush=True)
                for cell in measure_probes(loaded, todo, length, depths, args.probe_rows):
                    dense_map.add(cell)
                    print(f"  {cell.task}: {cell.score:.3f} [{cell.low:.3f}, {cell.high:.3f}] ({cell.n} rows)",
                          flush=True)
                render(dense_map, out, args.write_docs)
            for task in ([] if args.tasks.strip().lower() == "none" else check_tasks(args.tasks)):
                if (task, length) in dense_map.cells and dense_map.cells[task, length].n >= args.samples:
                    continue
                print(f"{task} @ {length:,} ...", flush=True)
                cell = measure_cell(loaded, task, length, args.samples)
                dense_map.add(cell)
                print(f"  {cell.score:.3f} [{cell.low:.3f}, {cell.high:.3f}] ({cell.n} rows, {cell.seconds} s)",
                      flush=True)
                render(dense_map, out, args.write_docs)
    except HeadscopeError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(dense_map.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
