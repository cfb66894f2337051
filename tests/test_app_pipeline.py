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
    assert not at.error, [e.value for e in at.error]
    assert any("8 of 16 heads pruned in 2 round(s)" in s.value for s in at.success), [s.value for s in at.success]
    stages = at.dataframe[0].value["stage"].tolist()
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
