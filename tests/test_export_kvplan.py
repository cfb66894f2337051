"""A KV plan written with an export (kv_plan.json; analysis/compress/export/kvfile.py, issue 41):

- every format's folder gets kv_plan.json: the plan in the original head slots, plus (physical formats) the
  file's KV heads and their modes; each format says in one line what its runtime does with the windows;
- a pruned export read back with its plan (`analysis.compress.export.planned.load_planned`) runs it: its greedy decode on the compact cache ==
  the dense model's under `applied(model, plan)` (float64, EXACT);
- the folder read back as a cut (`cut_of_folder`, the reports' --export) and the same cut built in memory
  (`exported_cut`, the app's Export page) both run the plan's function (float64, EXACT); a broken kv_plan.json
  link is refused in one line, never dropped;
- the mask and the plan describe one cut (a plan pruning a head the mask keeps is refused before anything is
  written; groups the mask removes are written as pruned);
- the CLI's `export --kv-plan FILE`: the plan alone is the cut; a plan of another model, a head that does not
  exist or a window of 0 is one line, exit 2, nothing written.
"""
import json

import numpy as np
import pytest
import torch

from analysis import cli
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, applied
from analysis.arch.window import Window
from analysis.compress.export import export_to
from analysis.compress.export.kvfile import read_export_plan
from analysis.compress.export.planned import load_planned
from analysis.compress.kvruntime import greedy
from analysis.core.errors import InputError
from tests._apptools import tiny_model_dir
from tests._tiny import tiny_input_ids, tiny_model
from tests._tolerance import EXACT

PLAN = [[WINDOW, PRUNE], [FULL, WINDOW], [PRUNE, WINDOW], [WINDOW, FULL]]      # one KV head pruned in two layers


def _model():
    m = tiny_model("llama", num_hidden_layers=4, dtype=torch.float64)
    m.config.dtype = torch.float64                  # what from_pretrained(dtype=float64) records; the export keeps it
    m.set_attn_implementation("sdpa")
    return m


def _plan(modes=PLAN) -> KVPlan:
    return KVPlan(np.array(modes), Window(1, 4), n_heads=4, model="tiny")


@pytest.mark.parametrize("fmt", ["pruned", "zeroed", "onnx"])
def test_every_format_writes_the_plan_and_says_what_runs_it(fmt, tmp_path):
    m, plan = _model(), _plan()
    result = export_to(fmt, m, None, tmp_path / fmt, kv_plan=plan)
    data = json.loads((tmp_path / fmt / "kv_plan.json").read_text())
    assert data["modes"] == plan.as_dict()["modes"]
    back = read_export_plan(tmp_path / fmt)
    assert np.array_equal(back.modes, plan.modes) and back.window == Window(1, 4)
    if fmt == "zeroed":                                                   # full shapes: the original slots only
        assert "file" not in data
    else:
        assert data["file"]["kv_heads"] == [[0], [0, 1], [1], [0, 1]]
        assert data["file"]["modes"] == [["window"], ["full", "window"], ["window"], ["window", "full"]]
    runtime = " ".join(result.notes)
    assert ("ONNX Runtime runs every KV head" in runtime) == (fmt == "onnx")
    assert ("load_planned" in runtime) == (fmt != "onnx")


def test_a_pruned_export_read_back_runs_its_plan(tmp_path):
    m, plan = _model(), _plan()
    export_to("pruned", m, None, tmp_path / "cut", kv_plan=plan)
    planned = load_planned(tmp_path / "cut")
    assert planned.model.dtype == torch.float64 and [r.tolist() for r in planned.rows] == [[WINDOW], [FULL, WINDOW], [WINDOW], [WINDOW, FULL]]
    x = tiny_input_ids(1, 20)
    with torch.no_grad():
        with applied(m, plan):
            reference = greedy(m, x[:, :8], 8)
        with planned.running():
            run = greedy(planned.model, x[:, :8], 8, cache=planned.cache(block=4), kv_bytes=lambda c: c.kv_bytes())
    assert torch.equal(run.tokens, reference.tokens)
    assert (run.logits - reference.logits).abs().max().item() <= EXACT
    assert run.kv_bytes == [planned.kv_bytes(8 + i) for i in range(8)]


def test_mask_and_plan_describe_one_cut(tmp_path):
    m, plan = _model(), _plan()
    keeps = np.zeros((4, 4), dtype=bool)                                 # a mask that removes nothing
    with pytest.raises(InputError, match="prunes 2 KV heads the mask keeps"):
        export_to("pruned", m, keeps, tmp_path / "x", kv_plan=plan)
    assert not (tmp_path / "x").exists()
    more = plan.pruned_heads().copy()
    more[1, 2:] = True                                                   # the mask also removes layer 1's group 1
    result = export_to("pruned", m, more, tmp_path / "more", kv_plan=plan)
    written = read_export_plan(tmp_path / "more")
    assert written.modes[1, 1] == PRUNE and written.counts()["prune"] == 3
    assert any("written as pruned" in n for n in result.notes)
    with pytest.raises(InputError, match="make the plan for this model"):
        export_to("pruned", m, None, tmp_path / "y", kv_plan=KVPlan(np.zeros((2, 2), np.int8), n_heads=4))
    assert not (tmp_path / "y").exists()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("kvplan-model") / "tiny", num_hidden_layers=4)


def test_cli_export_with_a_plan_alone_writes_the_gguf_and_says_llama_cpp_runs_it_full(model_dir, tmp_path, capsys):
    plan_file = tmp_path / "kv_plan.json"
    plan_file.write_text(_plan().to_json())
    code = cli.main(["export", "--model", str(model_dir), "--kv-plan", str(plan_file), "--export-format", "gguf",
                     "--gguf-type", "f32", "--out-dir", str(tmp_path), "--name", "g", "--quiet"])
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert code == 0 and payload["kv_plan"]["prune"] == 2 and payload["n_pruned"] == 4
    assert (tmp_path / "g" / "model.gguf").is_file() and (tmp_path / "g" / "kv_plan.json").is_file()
    assert "llama.cpp runs every layer of model.gguf with full attention" in captured.err
    assert json.loads((tmp_path / "g" / "mask.json").read_text())["policy"] == "kv-plan"


@pytest.mark.parametrize("case, message", [
    ("other model", "make the plan for this model"),
    ("missing head", "heads in layer 0"),
    ("window of 0", "window of 0"),
])
def test_cli_bad_plans_are_one_line_and_write_nothing(model_dir, tmp_path, capsys, case, message):
    data = _plan().as_dict()
    if case == "other model":
        data = KVPlan(np.zeros((2, 2), np.int8), n_heads=4).as_dict()
    elif case == "missing head":
        data["modes"][0].append("full")
    else:
        data["recent"] = 0
    plan_file = tmp_path / "kv_plan.json"
    plan_file.write_text(json.dumps(data))
    code = cli.main(["export", "--model", str(model_dir), "--kv-plan", str(plan_file), "--out-dir", str(tmp_path),
                     "--name", "bad", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_the_streamed_export_writes_the_plan_too(model_dir, tmp_path):
    from analysis.compress.export.streamed import export_checkpoint
    result = export_checkpoint("pruned", model_dir, None, tmp_path / "s", kv_plan=_plan())
    data = json.loads((tmp_path / "s" / "kv_plan.json").read_text())
    assert data["file"]["kv_heads"] == [[0], [0, 1], [1], [0, 1]] and result.layout.kv_heads == data["file"]["kv_heads"]
    assert any("load_planned" in note for note in result.notes)
    planned = load_planned(tmp_path / "s")
    assert [r.tolist() for r in planned.rows] == [[WINDOW], [FULL, WINDOW], [WINDOW], [WINDOW, FULL]]


def _loaded(m):
    """A LoadedModel of a model built here (placement None: the model's own dtype, float64)."""
    from analysis.arch.adapters import adapter_for
    from analysis.arch.models import LoadedModel
    adapter = adapter_for(m)
    return LoadedModel(m, None, "tiny", "causal-lm", adapter, adapter.geometry(m), "")


def test_an_export_read_back_as_a_cut_is_the_cut_built_in_memory(tmp_path):
    """cut_of_folder (the CLI's --export, the folder's plan applied) and exported_cut (the app's Export page: the
    same cut before anything is written) run the plan's function: greedy decode on their compact caches == the
    dense model under `applied(model, plan)`, float64 EXACT."""
    from analysis.compress.export.planned import cut_of_folder, exported_cut
    loaded, plan = _loaded(_model()), _plan()
    export_to("pruned", loaded.model, None, tmp_path / "cut", kv_plan=plan)
    cuts = {"folder": cut_of_folder(tmp_path / "cut", loaded), "memory": exported_cut(loaded, None, plan)}
    x = tiny_input_ids(1, 20)
    with torch.no_grad():
        with applied(loaded.model, plan):
            reference = greedy(loaded.model, x[:, :8], 8)
        for name, cut in cuts.items():
            assert cut.kind == "model" and np.array_equal(cut.plan.modes, plan.modes), name
            assert [r.tolist() for r in cut.rows] == [[WINDOW], [FULL, WINDOW], [WINDOW], [WINDOW, FULL]], name
            with cut.running(loaded.model) as model:
                assert model.dtype == torch.float64, name
                run = greedy(model, x[:, :8], 8, cache=cut.new_cache(block=4))
            assert torch.equal(run.tokens, reference.tokens), name
            assert (run.logits - reference.logits).abs().max().item() <= EXACT, name


def test_a_broken_kv_plan_link_is_refused_never_dropped(tmp_path):
    from analysis.compress.export.kvfile import has_kv_plan
    from analysis.compress.export.planned import cut_of_folder
    folder, m = tmp_path / "cut", _model()
    export_to("pruned", m, None, folder, kv_plan=_plan())
    (folder / "kv_plan.json").unlink()
    (folder / "kv_plan.json").symlink_to(tmp_path / "gone.json")            # a dangling link
    assert has_kv_plan(folder)
    with pytest.raises(InputError, match="KV plan file"):
        load_planned(folder)
    with pytest.raises(InputError, match="KV plan file"):
        cut_of_folder(folder, _loaded(m))
