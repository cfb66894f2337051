"""Benchmark: a rerun after a slider move on the Prune page vs that page's first run, on SmolLM2.

Measured in one process with Streamlit's AppTest. Before timing, the built-in SmolLM2 is
converted once (a one-time install cost, reported separately) and the heavy modules are
imported. The two sides are timed in interleaved pairs (bench/_timing.compare, self-timed so the
untimed setup stays outside: min / median / max of each side and of the per-pair ratio, load
average; the target is judged on the median per-pair ratio):
  first run  Streamlit's caches emptied, a new AppTest opens the page: loading the model, its row
             norms, the scores, the mask and the charts (what a user waits for on opening the page;
             the model's files and the imports are warm)
  rerun      the sparsity or the z slider of the last opened page moves (back and forth, in turn),
             and the rerun it triggers

    .venv/bin/python -m bench.bench_app [--pairs 5] [--max-pairs 13]
Target: rerun after a slider move / first run <= 0.10 (median of the interleaved pairs).
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

TARGET = 0.10


from bench._timing import compare, timed  # noqa: E402

CACHES = ("first run: Streamlit's st.cache_data / st.cache_resource emptied before each (the converted model's "
          "files and the imports warm); rerun: the page's caches warm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="least number of interleaved pairs")
    parser.add_argument("--max-pairs", type=int, default=13, help="most interleaved pairs")
    args = parser.parse_args()

    import gc

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from analysis.measure import evaluation  # noqa: F401  (imports warm)
    from analysis.score import masks  # noqa: F401
    from analysis.arch import models
    from analysis.measure import profiles  # noqa: F401
    from analysis.score import scoring  # noqa: F401
    from analysis.score import sweep  # noqa: F401
    from components import cache, charts, controls, state  # noqa: F401

    convert = timed(lambda: models.load_model(models.DEFAULT_MODEL))
    print(f"one-time setup (conversion if needed + one load, not part of the ratio): {convert:.2f} s")
    page = {"at": None, "moves": 0}

    def first_run() -> float:
        page["at"] = None
        st.cache_data.clear()
        st.cache_resource.clear()
        gc.collect()
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300)
        at.query_params.update(model=models.DEFAULT_MODEL, page="prune", scorer="mp-g", z="2", sparsity="0.3")
        seconds = timed(at.run)
        if at.exception:
            sys.exit(f"the Prune page raised: {at.exception[0].value}")
        if not [t for t in (el.proto.body for el in at.get("html")) if "heads pruned" in t]:
            sys.exit("the Prune page drew no mask grid")
        page["at"] = at
        return seconds

    def rerun() -> float:
        if page["at"] is None:              # the warm-up call comes first: open the page (untimed)
            first_run()
        at, i = page["at"], page["moves"]
        page["moves"] += 1
        if i % 2 == 0:
            widget, value = at.slider(key="hs.w.prune.sparsity"), (0.45 if i % 4 == 0 else 0.3)
        else:
            widget, value = at.slider(key="hs.w.prune.z"), (1.5 if i % 4 == 1 else 2.0)
        widget.set_value(value)
        seconds = timed(at.run)
        if at.exception:
            sys.exit(f"a rerun raised: {at.exception[0].value}")
        return seconds

    cmp = compare({"rerun": rerun, "first run": first_run}, min_pairs=args.pairs, max_pairs=args.max_pairs,
                  max_seconds=600.0, self_timed=True)
    cmp.report("Prune page: rerun after a slider move vs the first run", unit=1.0, unit_name="s",
               target=f"<= {TARGET:.2f}", caches=CACHES)
    print(f"ratio rerun / first run, median of {len(cmp.ratios)} interleaved pairs = {cmp.ratio:.3f} "
          f"(target <= {TARGET:.2f}): {'OK' if cmp.ratio <= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
