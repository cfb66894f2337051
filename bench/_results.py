"""Where a long-context bench's numbers go (bench_kv_quality, bench_ruler): --out's JSON, replaced whole after
every step (analysis.core.atomic: a run stopped part way leaves the last complete file, which a rerun resumes
from), and --write-docs' section of docs/results.md between the script's markers."""
import json
from pathlib import Path

from analysis.core.atomic import atomic_write, write_section

ROOT = Path(__file__).resolve().parents[1]


def save_results(out: dict, args, *, markdown, markers: tuple[str, str], ready: bool) -> None:
    """`out` to args.out (when given) as JSON, and markdown(out) into docs/results.md between `markers` when
    args.write_docs and the numbers are `ready` (a section needs what it shows)."""
    if args.out:
        atomic_write(args.out, json.dumps(out, indent=1, default=str), what="The bench's --out file")
    if args.write_docs and ready:
        write_section(ROOT / "docs" / "results.md", markdown(out), *markers)
