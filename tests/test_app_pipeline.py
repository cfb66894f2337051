"""Pipeline page: runs the schedule on a copy (the cached model is unchanged), shows the report and
its downloads, exports the final model with the rounds in its head layout, shows bad input as an error."""
import json

import pytest
import torch

from tests._apptools import downloads, fresh_caches, new_app, no_exception, out_root, tiny_dir  # noqa: F401
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

pytestmark = pytest.mark.usefixtures("fresh_caches")


def _settings(at, **values):
    for key, value in values.items():
        widget = at.number_input(key=f"hs.w.pipe.{key}") if key in ("recovery", "budget", "batch", "seq", "eval") \
            else at.slider(key=f"hs.w.pipe.{key}")
        widget.set_value(value)
    at.toggle(key="hs.w.pipe.int8").set_value(False)
    return at.run()


def test_run_report_downloads_and_export(tiny_dir, out_root, downloads):
    from components import cache, state
    at = new_app(tiny_dir, page="pipeline")
    no_exception(at)
    model = cache.load(state.ModelKey(str(tiny_dir))).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    at = _settings(at, target=0.5, step=0.25, recovery=2, batch=2, seq=16, eval=64)
    at.button(key="pipe.run").click().run()
    no_exception(at)
    # a tiny model's latencies are noise: a stage may be flagged slower than its input, nothing else is an error
    assert not [e.value for e in at.error if not e.value.startswith("Worse than the stage")], [e.value for e in at.error]
    assert any("8 of 16 heads pruned in 2 round(s)" in s.value for s in at.success), [s.value for s in at.success]
    stages = at.table[0].value["stage"].tolist()
    assert stages[0] == "dense" and stages[-1] == "final" and "round 2 recovered" in stages
    assert json.loads(downloads["report.json"])["stages"][0]["name"] == "dense"
    assert downloads["ppl_vs_sparsity.png"][:4] == b"\x89PNG"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    at.text_input(key="hs.w.pipe.folder").set_value("final").run()
    at.button(key="pipe.export").click().run()
    no_exception(at)
    layout = json.loads((out_root / "final" / "head_layout.json").read_text())
    assert sorted({r for row in layout["rounds"] for r in row}) == [0, 1, 2]


def test_budget_below_dense_is_an_error_not_a_traceback(tiny_dir, out_root):
    at = new_app(tiny_dir, page="pipeline")
    at = _settings(at, budget=1.0, eval=64)
    at.button(key="pipe.run").click().run()
    no_exception(at)
    assert any("not above the dense" in e.value for e in at.error), [e.value for e in at.error]


def _report_with_a_broken_stage():
    """A made-up report: round 1 cut is 4.5x slower in decode than dense, the INT8 file is broken."""
    import types

    import numpy as np

    from analysis.compress.recover.report import CompressionReport, Stage, _with_ratios
    from analysis.compress.verdict import worse_than_input

    def stage(name, prefill, decode, metric, made_from=None):
        return Stage(name, 0.25, 100, 4.0, 1, prefill, decode, metric, kv_bytes_per_token=80, made_from=made_from)

    dense, cut = stage("dense", 10.0, 1.0, 17.5), stage("round 1 cut", 9.0, 4.5, 20.0, "dense")
    final = stage("final", 9.0, 4.5, 20.0, "round 1 cut")
    broken = stage("INT8 weight-only (ONNX)", 9.0, None, 3076.0, "final")
    cut.flags = worse_than_input(times={"decode": (1.0, 4.5)})
    broken.flags = worse_than_input(floor={"passed": False, "agreement": 0.9, "perplexity_ratio": 1.5,
                                           "top1_agreement": 0.129, "ratio": 176.0})
    rep = CompressionReport("tiny", "perplexity", {"policy": "groups"}, _with_ratios([dense, cut, final, broken]),
                            {}, [])
    pruned = np.zeros((4, 4), bool)
    pruned[0, :2] = True
    result = types.SimpleNamespace(pruned=pruned, accepted=[1], dense_metric=17.5, final_metric=20.0,
                                   stopped_by_budget=False, model=None, head_rounds=None)
    return rep, result


def test_a_stage_worse_than_its_input_is_red_and_named(tiny_dir, out_root):
    """Issue 33: a pipeline INT8 row at perplexity 3,076 (176x) sat in the report as a normal stage."""
    from components import state
    rep, result = _report_with_a_broken_stage()
    at = new_app(tiny_dir, page="pipeline", run=False)
    at.session_state[state._MEMO + "pipe.last"] = (rep, result, [], None)
    at.run()
    no_exception(at)
    banner = next(e.value for e in at.error if e.value.startswith("Worse than the stage"))
    assert "**round 1 cut** (decode 4.50x slower)" in banner and "BROKEN: below the INT8 floor" in banner
    table = at.table[0]
    frame = table.value
    flagged = frame["worse than its input"].tolist()
    assert flagged[0] == "" and flagged[2] == "" and "4.50x slower" in flagged[1] and "BROKEN" in flagged[3]
    assert "4.50x slower" in frame["decode"][1]                     # the ratio to dense in words
    styles = table.proto.arrow_data.styler.styles
    red_rows = {int(r) for r in __import__("re").findall(r"#T_\w+_row(\d+)_col0", styles)}
    assert "#fadbd8" in styles and red_rows == {1, 3}, styles


def test_target_sparsity_follows_the_prune_view_in_steps_of_0_01(tiny_dir):
    """Issue 33: the target sparsity moved in steps of 0.05 and was not the Prune view's."""
    at = new_app(tiny_dir, page="pipeline", sparsity="0.37")
    no_exception(at)
    target = at.slider(key="hs.w.pipe.target")
    assert target.value == pytest.approx(0.37) and target.proto.step == pytest.approx(0.01)
    assert any(m.label == "Estimated time" for m in at.metric)


def test_the_frontier_of_a_report_is_drawn_with_its_verdict(tiny_dir, out_root):
    """Issue 35: the frontier (GGUF size vs llama.cpp perplexity) on the Pipeline page, with the verdict."""
    from components import state
    from tests._apptools import figure_titled
    rep, result = _report_with_a_broken_stage()
    mib = 2 ** 20
    rep.frontier = {"dense q8_0": {"label": "dense", "type": "q8_0", "bytes": 138 * mib, "ppl": 15.3, "lo": 14.3,
                                   "hi": 16.4, "tokens": 512},
                    "final q8_0": {"label": "final", "type": "q8_0", "bytes": 131 * mib, "ppl": 19.0, "lo": 18.0,
                                   "hi": 20.0, "tokens": 512},
                    "final q4_k_m": {"label": "final", "type": "q4_k_m", "refused": "self-check FAILED: x"}}
    at = new_app(tiny_dir, page="pipeline", run=False)
    at.session_state[state._MEMO + "pipe.last"] = (rep, result, [], None)
    at.run()
    no_exception(at)
    fig = figure_titled(at, "GGUF size vs llama.cpp perplexity")
    assert [t["name"] for t in fig["data"]] == ["dense", "final", "Pareto frontier"]
    shown = [c.value for c in at.caption]
    assert any(c.startswith("final q8_0: 131.0 MiB") and "ON the frontier" in c for c in shown), shown
    assert "final q4_k_m: not written: self-check FAILED: x" in shown
