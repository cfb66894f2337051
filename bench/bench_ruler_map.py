"""Benchmark: dense's map, the dense model's RULER score on every offline task at every length (issue 52 item 1; a
result, not a test).

Per (task, length) cell: RULER's test rows (analysis.measure.splits: seed 0, the evaluation half of the built-in
text), --samples rows, dense's greedy generations through the harness bridge, kept in analysis.core.store (the
`ruler` command, the Long context page and bench_ruler read the same dense side back), the score with its 95 %
bootstrap CI. The map (analysis.measure.densemap.DenseMap) is rewritten after every cell, so a run stopped part way
keeps what it measured and a rerun skips the cells it has (resumable across sessions through --out, and through the
store on the same machine). Cells where dense scores >= 0.8 on >= 25 rows are the test set.

Usage: nice -n 10 .venv/bin/python -m bench.bench_ruler_map [--lengths 1024,2048,4096] [--tasks all] [--samples 25]
       [--threads 1] [--out docs/data/ruler_dense_map.json] [--write-docs] [--render-only]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from analysis.core.atomic import atomic_write, write_section
from analysis.core.errors import HeadscopeError

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
    return DenseCell(task, length, cell.dense["score"], cell.dense["low"], cell.dense["high"], cell.n,
                     round(time.perf_counter() - t0, 1), rows.split)


def render(dense_map, path: Path, write_docs: bool) -> None:
    import json
    atomic_write(path, json.dumps(dense_map.as_dict(), indent=1))
    if write_docs:
        write_section(ROOT / "docs" / "results.md", "\n".join([MAP_MARKERS[0], dense_map.markdown(), MAP_MARKERS[1]]),
                      *MAP_MARKERS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--tasks", default="all")
    p.add_argument("--samples", type=int, default=25)
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
        for length in (int(n) for n in args.lengths.split(",")):
            for task in check_tasks(args.tasks):
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
