"""Dense's map and the KV frontier on the Long context page: where the dense model passes RULER (the test set every
verdict reads: analysis.measure.densemap) as a task x length heatmap, and beside the view's plan the frontier of
score against KV held for headscope's plans chosen on calibration rows and judged on test rows
(bench/bench_kv_frontier.py), each plan one click from becoming the view's.

Both are measured results kept with the project (docs/data/ruler_dense_map.json, docs/data/kv_frontier.json and
the plans under docs/data/plans/): shown for the model they were measured on, with how to measure them for
another.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import streamlit as st

from analysis.arch.kvplan import KVPlan, read_kv_plan
from analysis.core.errors import HeadscopeError
from analysis.measure.densemap import MIN_ROWS, PASS

from . import charts, longstate, state

FRONTIER_FILE = longstate.DATA / "kv_frontier.json"


def map_section(lm) -> None:
    """Dense's task x length heatmap, its test set and the tasks it fails everywhere, and the map's JSON."""
    st.subheader("Where dense passes: RULER's task x length map")
    found = longstate.dense_map(lm.name)
    if found is None:
        st.caption(f"Dense's map is measured for the built-in SmolLM2 (docs/data/ruler_dense_map.json). For this "
                   f"model: `python -m bench.bench_ruler_map --model {lm.name} --out map.json` (each cell's dense "
                   f"side is kept in the store, so a stopped run resumes).")
        return
    tasks, lengths, scores = found.grid()
    passes = np.array([[(t, n) in found.cells and found.cells[t, n].passes for n in lengths] for t in tasks])
    st.plotly_chart(charts.task_length_heatmap(tasks, lengths, scores, passes,
                                               title=f"Dense {lm.name}: RULER score (* = a test cell)"),
                    width="stretch", key="long.map")
    failed = found.failed_tasks()
    st.caption(f"Test set: {len(found.test_set())} of {len(found.cells)} cells where dense scores >= {PASS} on >= "
               f"{MIN_ROWS} test rows; every verdict reads these. Dense fails at every measured length: "
               + (", ".join(failed) if failed else "none") + " (listed, never averaged in).")
    st.download_button("Dense's map (JSON)", json.dumps(found.as_dict(), indent=1), "ruler_dense_map.json",
                       "application/json", key="long.map.json")


def frontier_section(lm, plan: KVPlan) -> None:
    """Score against KV held per method on the test set, the view's plan marked at its KV, each plan adoptable."""
    data = longstate.project_json(FRONTIER_FILE)
    if data is None or data.get("model") != lm.name or not data.get("points"):
        return
    st.subheader("The KV frontier: plans chosen on calibration rows, judged on test rows")
    pts, length = data["points"], int(data["length"])
    lines: dict = {}
    for name, p in pts["configs"].items():
        lines.setdefault(p["method"], []).append((p["kv"], p["score"], p["low"], p["high"]))
    d = pts["dense"]
    st.plotly_chart(charts.kv_frontier(lines, (d["score"], d["low"], d["high"]),
                                       title=f"RULER test set at {length:,} tokens ({data['rows']} rows)",
                                       mark=plan.kv_ratio(int(data.get("prompt", length)))),
                    width="stretch", key="long.frontier")
    used = data.get("rows_used", {})
    st.caption(f"Chosen on {used.get('chosen_on', {}).get('rows', '?')} calibration rows "
               f"({used.get('chosen_on', {}).get('what', '')}), judged on {used.get('judged_on', {}).get('rows', '?')} "
               f"test rows ({used.get('judged_on', {}).get('what', '')}); the dotted line is the KV the view's plan "
               f"holds at the rows' median prompt.")
    names = sorted(n for n, p in pts["configs"].items() if p.get("plan"))          # headscope's plans (files)
    if not names:
        return
    pick = st.selectbox("A plan of the frontier", names, key="long.frontier.pick")
    path = Path(__file__).resolve().parents[1] / pts["configs"][pick]["plan"]
    if path.is_file():
        try:
            theirs = read_kv_plan(path, geometry=lm.geometry)
        except HeadscopeError as err:
            st.caption(f"{pick}: {err}")
            return
        st.button(f"Use {pick} as the plan", key="long.frontier.use", on_click=state.adopt_plan,
                  args=(theirs, "frontier", longstate.context_limit(lm)))
        st.download_button(f"{pick} (kv_plan.json)", path.read_text(encoding="utf-8"), f"{pick.replace('@', '-kv')}.json",
                           "application/json", key="long.frontier.file")
