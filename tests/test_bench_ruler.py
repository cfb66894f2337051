"""bench/bench_ruler.py's own logic, without a model (the bench itself is a result, run by hand):
- the grid plans hold at most the KV ratio asked, and one windowed head fewer would not reach it (the share is
  the smallest that gets there; every head windowed where windows alone cannot);
- a config's cells are analysis.measure.ruler.score_cell of the same rows (paired with dense), the average over
  tasks is the mean of each row over tasks;
- kvpress's settings are named by their KV of dense (compression ratio r -> KV 1 - r), the DuoAttention ones by the
  plan they were fed;
- the goal line follows from the cells: met / missed, and the comparison with each kvpress press.
"""
import numpy as np
import pytest

from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import KVPlan
from analysis.arch.window import Window
from bench import bench_ruler as B

GEO = HeadGeometry(30, 9, 3, 64, 576)


@pytest.mark.parametrize("length", [1024, 4096, 8192])
@pytest.mark.parametrize("ratio", B.GRID)
def test_the_grid_share_is_the_smallest_that_reaches_the_ratio(length, ratio):
    from analysis.score.kvscores import plan_kv
    window = Window(4, 256)
    n = GEO.n_layers * GEO.n_kv_heads
    share = B.window_share_for(ratio, length, window, n)
    scores = np.random.default_rng(0).random((GEO.n_layers, GEO.n_kv_heads))
    plan = plan_kv(GEO, scores, window_share=share, window=window)
    if window.kept(length) / length > ratio:                            # windows alone cannot get there
        assert plan.windowed.all()
        return
    assert plan.kv_ratio(length) <= ratio + 1e-12
    fewer = KVPlan(plan.modes.copy(), window, GEO.n_heads)
    lowest = np.unravel_index(np.argmax(np.where(plan.windowed, scores, -np.inf)), scores.shape)
    fewer.modes[lowest] = 0                                             # one windowed head fewer
    assert fewer.kv_ratio(length) > ratio


def test_cells_pair_the_rows_and_average_over_tasks():
    from analysis.measure.ruler import score_cell
    rng = np.random.default_rng(1)
    dense = {"niah_single_1": rng.integers(0, 2, 8).tolist(), "ruler_vt": rng.random(8).tolist()}
    other = {t: [max(0.0, v - 0.5 * rng.random()) for v in vs] for t, vs in dense.items()}
    rec = dict(prefill_s=1.0, decode_s=1.0, tokens_per_s=2.0, new_tokens=3, kv_bytes_prompt=10, kv_bytes_end=12)
    costs = ({t: [rec] * 8 for t in dense}, {t: [rec] * 8 for t in dense})
    cells = B.cells_of(dense, other, costs, 4096, seed=0)
    assert [c["task"] for c in cells] == ["niah_single_1", "ruler_vt", "average"]
    want = score_cell("ruler_vt", "x", 4096, np.array([dense["ruler_vt"], other["ruler_vt"]]), [[rec] * 8] * 2, 0).row()
    assert cells[1]["cut_score"] == want["cut_score"] and cells[1]["change_low"] == want["change_low"]
    assert cells[2]["dense_score"] == pytest.approx(np.mean([np.mean(v) for v in dense.values()]))
    assert cells[2]["cut_score"] == pytest.approx(np.mean([np.mean(v) for v in other.values()]))


def test_kvpress_settings_are_named_by_their_kv():
    peer = {"results": [dict(setting="none"), dict(setting="streaming@0.75"), dict(setting="snapkv@0.5"),
                        dict(setting="duo:duo-streaming@0.5-4096")]}
    named = B._peer_settings(peer, {"streaming@0.5": "/x/duo-streaming@0.5-4096"})
    assert set(named) == {"none@1", "streaming@0.25", "snapkv@0.5", "duo(streaming@0.5)"}


def _cfg(tool, score, low, high, dense=(0.8, 0.7, 0.9), held=0.5, read=None):
    avg = dict(task="average", dense_score=dense[0], dense_low=dense[1], dense_high=dense[2], cut_score=score,
               cut_low=low, cut_high=high, change=score - dense[0], change_low=low - dense[0],
               change_high=high - dense[0], lost=high < dense[0])
    rec = dict(kv_bytes_prompt=held * 100, kv_bytes_read=(read if read is not None else held) * 100)
    return dict(tool=tool, cells=[avg], costs={"t": [rec]})


def test_the_goal_line_follows_from_the_cells():
    dense = dict(costs={"t": [dict(kv_bytes_prompt=100)]}, values={"t": [1.0]})
    entry = dict(dense=dense, configs={"ours@0.5": _cfg("headscope", 0.78, 0.7, 0.85),
                                       "ours@0.25": _cfg("headscope", 0.9, 0.8, 0.95, held=0.25),
                                       "kvpress:snapkv@0.5": _cfg("kvpress", 0.6, 0.5, 0.7),
                                       "kvpress:duo(x)": _cfg("kvpress", 0.95, 0.9, 1.0, held=1.0, read=0.5)})
    lines = B.goal_lines(entry, 4096)
    assert "ours@0.25" in lines[0] and "inside dense's CI" in lines[0]          # the best at KV <= 0.5x
    assert any("snapkv" in line and "at or above it" in line for line in lines)
    assert any("duo(x)" in line and "**below it**" in line for line in lines)  # KV read 0.5: compared, and beaten
    entry["configs"] = {"ours@0.5": _cfg("headscope", 0.5, 0.4, 0.6)}
    assert "goal missed" in B.goal_lines(entry, 4096)[0]
    entry["configs"] = {"ours@0.5": _cfg("headscope", 0.8, 0.7, 0.9, held=0.5 * (1 + B.GOAL_SLACK / 2))}
    assert "ours@0.5" in B.goal_lines(entry, 4096)[0]                            # 0.5 within the slack
    entry["configs"] = {"ours@0.55": _cfg("headscope", 0.8, 0.7, 0.9, held=0.55)}
    assert "no headscope plan" in B.goal_lines(entry, 4096)[0]                   # above it: not at the goal's KV


def test_the_section_shows_every_config_its_minutes_and_the_note():
    dense_values = {"niah_single_1": [1.0] * 6}
    rec = dict(prefill_s=1.0, decode_s=1.0, tokens_per_s=2.0, new_tokens=3, kv_bytes_prompt=100, kv_bytes_end=120)
    dense_costs = {"niah_single_1": [rec] * 6}
    half = dict(rec, kv_bytes_prompt=50)
    cfg_values = {"niah_single_1": [0.0] * 6}
    cfg_costs = {"niah_single_1": [half] * 6}
    cells = B.cells_of(dense_values, cfg_values, (dense_costs, cfg_costs), 4096, seed=0)
    out = dict(args=dict(threads=2, dtype="float32", samples=6, seed=0), machine="x86_64", load=(1.0, 1.0, 1.0),
               model="smollm2-135m", tasks=["niah_single_1"], command="python -m bench.bench_ruler --samples 6",
               note="Sized to this session.",
               lengths={"4096": dict(dense=dict(values=dense_values, costs=dense_costs, seconds=600.0),
                                     configs={"streaming@0.5": dict(tool="headscope", values=cfg_values,
                                                                    costs=cfg_costs, cells=cells, seconds=1200.0),
                                              "kvpress:snapkv@0.5": dict(tool="kvpress", values=cfg_values,
                                                                         costs=cfg_costs, cells=cells)})})
    text = B.markdown(out)
    assert "Sized to this session." in text and "| config | tool | minutes |" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert " | 10 | 1.000 | 1.000 |" in rows["dense"]                        # 600 s: 10 minutes
    assert " | 20 | 0.500 | 0.500 |" in rows["streaming@0.5"]                # held half of dense's bytes
    assert " | - | 0.500 |" in rows["kvpress:snapkv@0.5"]                    # not timed: said, not invented
    assert "**no**" in rows["streaming@0.5"] and "**L**" in rows["streaming@0.5"]   # every row lost
