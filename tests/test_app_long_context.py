"""Long context page: a grid edit changes the counts, the map, the KV memory and the predicted speed to the
library's numbers for that plan; a bad kv_plan.json is one error box and leaves the grid as it was; the
plan, context, sinks and recent make a round trip through the URL (bad values: one line each); the fills;
the Export page offers the plan; the Walkthrough's long_context head reads analysis' own numbers."""
import json

import numpy as np
import pytest

from tests._apptools import (downloads, figure_titled, fresh_caches, heatmap_z, metric, new_app,  # noqa: F401
                             no_exception, out_root, texts, tiny_dir_for, tiny_model_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")
LIMIT, L, HKV, H, D = 512, 4, 2, 4, 8
COLS = ("KV 0 (q 0-1)", "KV 1 (q 2-3)")
GRID = "hs.w.long.grid.0"


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The apps tests' tiny Llama (4 layers x 4 heads, 2 KV heads, d = 8) reading 512 tokens."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=LIMIT)


def _open(model_dir, **params):
    at = new_app(model_dir, page="long_context", **params)
    no_exception(at)
    return at


def _grid(at) -> np.ndarray:
    """The modes the grid shows [L, Hkv] (its base; AppTest reads the table without the browser's edits)."""
    from analysis.arch.kvplan import MODES
    (editor,) = at.data_editor
    frame = editor.value
    return np.array([[MODES.index(v) for v in frame[c]] for c in COLS]).T


def _plan(modes, sinks, recent):
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.window import Window
    return KVPlan(np.asarray(modes, np.int8), Window(sinks, recent), H)


def _expected(model_dir, plan, context) -> dict:
    """What the page must show for `plan` at `context`, from the library."""
    from analysis.arch.models import load_model
    from analysis.arch.cut import Cut
    from analysis.compress.cost import predict
    from analysis.compress.verdict import speed_words
    from components.longctx import size_words
    p = predict(load_model(str(model_dir)).model, Cut.of_plan(plan), context)
    c = plan.counts()
    def speed(ratio):       # "1.96x" over "faster than dense" (the page's metric: value, delta)
        words = speed_words(ratio)
        return ("1.00x", "same as dense") if words.startswith("same") else (
            words.split()[0], f"{words.split()[1]} than dense")

    return {f"KV cache at {context:,} tokens": (size_words(p.cut.kv_bytes),
                                                f"{plan.kv_ratio(context):.2f}x dense ({size_words(p.dense.kv_bytes)})"),
            "Full / window / prune": (f"{c['full']} / {c['window']} / {c['prune']}", ""),
            "Prefill (predicted)": speed(p.ratio("prefill_flops")),
            "Decode (predicted)": speed(p.ratio("decode_bytes"))}


def _check_shown(at, model_dir, plan, context):
    shown = {m.label: (m.value, m.proto.delta) for m in at.get("metric")}
    for label, value in _expected(model_dir, plan, context).items():
        assert shown[label] == value, label
    np.testing.assert_array_equal(heatmap_z(figure_titled(at, "The plan, layer by layer")), plan.modes)
    assert plan.describe() + "." in [c.value for c in at.caption]


def test_grid_edit_changes_counts_map_and_kv_memory(tiny_long):
    at = _open(tiny_long, context=400, sinks=4, recent=60)
    _check_shown(at, tiny_long, _plan(np.zeros((L, HKV)), 4, 60), 400)
    before = metric(at, "KV cache at 400 tokens")
    at.session_state[GRID] = {"edited_rows": {"1": {COLS[0]: "window"}, "2": {COLS[1]: "prune"}, "3": {
        COLS[0]: "window", COLS[1]: "window"}}, "added_rows": [], "deleted_rows": []}
    at.run()
    no_exception(at)
    modes = np.array([[0, 0], [1, 0], [0, 2], [1, 1]])
    plan = _plan(modes, 4, 60)
    _check_shown(at, tiny_long, plan, 400)
    assert metric(at, "KV cache at 400 tokens") != before
    assert plan.kv_ratio(400) == pytest.approx((4 * 400 + 3 * 64) / (8 * 400))
    assert (at.query_params["kv"], at.query_params["plan"]) == ("ff.wf.fp.ww", "edited")
    at.number_input(key="hs.w.long_context.recent").set_value(10).run()     # the band moves the memory
    no_exception(at)
    _check_shown(at, tiny_long, _plan(modes, 4, 10), 400)
    assert at.query_params["recent"] == "10"


def _plan_file(**changes) -> bytes:
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.window import Window
    data = KVPlan(np.array([[0, 1], [1, 1], [2, 0], [0, 0]], np.int8), Window(2, 30), H, "tiny").as_dict()
    data.update(changes)
    return json.dumps(data).encode()


BAD_FILES = {
    "another model": (_plan_file(n_layers=5, modes=[["full", "full"]] * 5), "layers"),
    "a head it does not have": (_plan_file(n_kv_heads=4, modes=[["full"] * 4] * 4), "KV heads"),
    "KV heads that split no group": (_plan_file(n_kv_heads=3, modes=[["full"] * 3] * 4), "KV groups"),
    "an unknown policy": (_plan_file(modes=[["full", "stream"]] * 4), "kv_plan.json"),
    "a window of 0": (_plan_file(recent=0), "kv_plan.json"),
    "not JSON": (b"full, window, prune", "JSON"),
    "a path": (b"/etc/passwd", "JSON"),
    "binary": (b"\xff\xfe\x00garbage", "UTF-8"),
}


@pytest.mark.parametrize("what", list(BAD_FILES))
def test_a_bad_plan_file_is_one_error_box_and_the_grid_is_unchanged(tiny_long, what):
    content, needle = BAD_FILES[what]
    at = _open(tiny_long, kv="fw.ff.ff.pf", sinks=3, recent=40)
    grid, url = _grid(at), dict(at.query_params)
    at.file_uploader(key="hs.w.long.upload").set_value(("kv_plan.json", content, "application/json")).run()
    no_exception(at)
    assert len(at.error) == 1 and needle in at.error[0].value, [e.value for e in at.error]
    assert at.error[0].value.startswith("kv_plan.json: ")
    np.testing.assert_array_equal(_grid(at), grid)
    assert dict(at.query_params) == url
    _check_shown(at, tiny_long, _plan(grid, 3, 40), 512)


def test_a_good_plan_file_replaces_the_grid_and_the_band(tiny_long, downloads):
    at = _open(tiny_long)
    at.file_uploader(key="hs.w.long.upload").set_value(("mine.json", _plan_file(), "application/json")).run()
    no_exception(at)
    assert not at.error
    modes = np.array([[0, 1], [1, 1], [2, 0], [0, 0]])
    np.testing.assert_array_equal(_grid(at), modes)
    assert (at.query_params["kv"], at.query_params["plan"], at.query_params["sinks"], at.query_params["recent"]) == (
        "fw.ww.pf.ff", "file", "2", "30")
    _check_shown(at, tiny_long, _plan(modes, 2, 30), 512)
    assert "mine.json was written for tiny" in texts(at)
    from analysis.arch.kvplan import read_kv_plan
    assert np.array_equal(read_kv_plan(downloads["kv_plan.json"].decode()).modes, modes)   # what it downloads


def test_the_url_round_trip(tiny_long):
    at = _open(tiny_long, kv="pw.ff.wf.ff", context=300, sinks=2, recent=20, plan="mask")
    assert not at.warning, [w.value for w in at.warning]
    modes = np.array([[2, 1], [0, 0], [1, 0], [0, 0]])
    np.testing.assert_array_equal(_grid(at), modes)
    assert at.number_input(key="hs.w.long_context.context").value == 300
    _check_shown(at, tiny_long, _plan(modes, 2, 20), 300)
    assert {k: at.query_params[k] for k in ("kv", "context", "sinks", "recent", "plan")} == {
        "kv": "pw.ff.wf.ff", "context": "300", "sinks": "2", "recent": "20", "plan": "mask"}
    at.switch_page("pages/model.py").run()                # the plan stays in the view on other pages
    assert at.query_params["kv"] == "pw.ff.wf.ff"
    at.switch_page("pages/long_context.py").run()
    no_exception(at)
    np.testing.assert_array_equal(_grid(at), modes)


@pytest.mark.parametrize("params,needle", [
    (dict(context=100_000), "context of 100,000 tokens is longer than this model reads (512 tokens); using 512"),
    (dict(kv="fff.fff.fff.fff"), "does not fit this model"),
    (dict(kv="fx.ff.ff.ff"), "kv='fx.ff.ff.ff' was ignored"),
    (dict(recent=0), "recent='0' was ignored"),
])
def test_bad_link_values_are_one_line_each(tiny_long, params, needle):
    at = _open(tiny_long, **params)
    notes = [w.value for w in at.warning]
    assert len(notes) == 1 and needle in notes[0], notes
    assert not at.error
    limit = at.number_input(key="hs.w.long_context.context")
    assert limit.max == LIMIT and at.number_input(key="hs.w.long_context.recent").min == 1
    np.testing.assert_array_equal(_grid(at), np.zeros((L, HKV)))


def test_fill_from_the_prune_mask_and_all_full(tiny_long):
    from analysis.arch.models import load_model
    from analysis.score import masks, scoring
    from analysis.arch.kvplan import KVPlan
    at = _open(tiny_long, scorer="mp-g", sparsity=0.5, policy="groups")
    lm = load_model(str(tiny_long))
    scores = scoring.get_scorer("mp-g").score(lm.model)
    pruned = masks.plan_mask(scores, 0.5, group_size=2, policy="groups").pruned
    at.button(key="long.fill.mask").click().run()
    no_exception(at)
    want = KVPlan.from_mask(pruned, lm.geometry).modes
    assert (want == 2).sum() == 4
    np.testing.assert_array_equal(_grid(at), want)
    assert at.query_params["plan"] == "mask"
    at.button(key="long.fill.full").click().run()
    np.testing.assert_array_equal(_grid(at), np.zeros((L, HKV)))
    assert "kv" not in at.query_params and at.query_params["plan"] == "full"


def test_a_mask_that_splits_a_group_is_refused_in_one_line(tiny_long):
    at = _open(tiny_long, scorer="mp-g", sparsity=0.25, policy="global", kv="fw.ff.ff.ff")
    at.button(key="long.fill.mask").click().run()
    no_exception(at)
    assert len(at.error) == 1 and "groups policy" in at.error[0].value, [e.value for e in at.error]
    np.testing.assert_array_equal(_grid(at), [[0, 1], [0, 0], [0, 0], [0, 0]])


def test_set_many_heads_at_once(tiny_long):
    at = _open(tiny_long)
    at.slider(key="hs.w.long.range.layers").set_value((1, 2)).run()
    at.multiselect(key="hs.w.long.range.heads").set_value([1]).run()
    at.radio(key="hs.w.long.range.mode").set_value("prune").run()
    at.button(key="long.range.apply").click().run()
    no_exception(at)
    np.testing.assert_array_equal(_grid(at), [[0, 0], [0, 2], [0, 2], [0, 0]])


def test_export_offers_the_plan(tiny_long, downloads):
    from analysis.arch.kvplan import read_kv_plan
    at = new_app(tiny_long, page="export", kv="fw.ff.pp.ff", sinks=2, recent=16, plan="edited")
    no_exception(at)
    assert any(m.value.startswith("**The KV plan of the Long context page**: ") for m in at.markdown)
    plan = read_kv_plan(downloads["kv_plan.json"].decode())
    np.testing.assert_array_equal(plan.modes, [[0, 1], [0, 0], [2, 2], [0, 0]])
    assert (plan.window.sinks, plan.window.recent) == (2, 16)
    at = new_app(tiny_long, page="export")                      # no plan set: nothing about it
    assert not any("The KV plan of the Long context page" in m.value for m in at.markdown)


def _export(at, folder: str):
    at.selectbox(key="hs.w.export.format").set_value("pruned").run()
    at.text_input(key="hs.w.export.folder").set_value(folder).run()
    at.button(key="export.run").click().run()
    no_exception(at)


def test_export_writes_the_plan_with_the_model(tiny_long, out_root):
    """The export carries the plan (kv_plan.json, read back with the model's geometry): its windows as set, the
    groups the mask removes written as pruned; a plan pruning a group the mask keeps is one line, nothing written;
    the switch off writes none."""
    from analysis.compress.export import mask_from_json
    from analysis.arch.kvplan import read_kv_plan
    view = dict(policy="groups", sparsity=0.5, sinks=2, recent=16)
    at = new_app(tiny_long, page="export", kv="wf.fw.ff.wf", **view)
    _export(at, "with-plan")
    assert not at.error, [e.value for e in at.error]
    folder = out_root / "with-plan"
    pruned = mask_from_json(folder).reshape(L, HKV, H // HKV).all(-1)          # [L, Hkv] groups the mask removes
    plan = read_kv_plan(folder)
    want = np.where(pruned, 2, np.array([[1, 0], [0, 1], [0, 0], [1, 0]]))
    np.testing.assert_array_equal(plan.modes, want)
    assert (plan.window.sinks, plan.window.recent) == (2, 16) and pruned.any()
    assert any("kv_plan.json" in i.value for i in at.info), [i.value for i in at.info]
    keeps = np.argwhere(~pruned)[0]                                             # a group the mask keeps
    modes = np.zeros((L, HKV), np.int8)
    modes[keeps[0], keeps[1]] = 2
    from components.state import kv_text
    at = new_app(tiny_long, page="export", kv=kv_text(modes), **view)
    _export(at, "refused")
    assert len(at.error) == 1 and "prunes 1 KV heads the mask keeps" in at.error[0].value
    assert not (out_root / "refused").exists()
    at = new_app(tiny_long, page="export", kv="wf.fw.ff.wf", **view)
    at.checkbox(key="hs.w.export.with_kv_plan").set_value(False).run()
    _export(at, "without")
    assert (out_root / "without" / "mask.json").exists() and not (out_root / "without" / "kv_plan.json").exists()


def test_an_encoder_is_told_in_one_line(tmp_path):
    at = _open(tiny_model_dir(tmp_path / "bert", "bert"))
    assert not at.error and len(at.info) == 1 and "not a causal language model" in at.info[0].value


def test_walkthrough_head_is_analysis_numbers(tiny_long):
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.measure.longheads import last_rows
    from components.longctx import WALK_QUERIES, walk_text
    at = new_app(tiny_long, page="walkthrough", sinks=2, recent=40)
    at.button(key="walk.long.run").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    lm = load_model(str(tiny_long))
    ids, start, length = walk_text(lm.tokenizer, LIMIT)
    rows = last_rows(lm.model, ids, queries=WALK_QUERIES, window=Window(2, 40))
    needle = rows.share(start, start + length)
    layer, head = np.unravel_index(int(np.argmax(needle)), needle.shape)     # the sliders start there
    assert at.slider(key="hs.w.walk.long.layer").value == layer
    assert metric(at, "On the needle") == f"{100 * needle[layer, head]:.1f} %"
    assert metric(at, "Change if windowed") == f"{100 * rows.window_change[layer, head]:.1f} %"
    assert metric(at, "On the sinks") == f"{100 * rows.regions()['sinks'][layer, head]:.1f} %"
    at.slider(key="hs.w.walk.long.head").set_value(1).run()
    assert metric(at, "Change if windowed") == f"{100 * rows.window_change[layer, 1]:.1f} %"
    np.testing.assert_allclose(heatmap_z(figure_titled(at, "Each head's output change under a window")),
                               rows.window_change, rtol=1e-6)


SCORED = 320                     # tokens per row of the probes the heads' scores are measured on (the page's box)


def test_fill_from_the_heads_scores(tiny_long, downloads, tmp_path, monkeypatch):
    """Window 50 %, prune 25 %, retrieval heads full: the grid is kvscores.plan_from_scores of the same scores
    (measured here by the library on the page's rows: the shared scan of the probes' calibration rows with the page's
    window, never the test rows its probes judge on, and the KV groups' importance), and its kv_plan.json says where
    it came from."""
    from analysis.arch.models import load_model
    from analysis.arch.kvplan import read_kv_plan
    from analysis.arch.window import Window
    from analysis.measure.evaluation import context_length
    from analysis.measure.longpass import long_scan
    from analysis.measure.probes.longcontext import build_long
    from analysis.score.kvscores import KVScores, group_importance, plan_from_scores
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))    # measured by this test, not read back
    at = _open(tiny_long, sinks=2, recent=64)
    assert not any(b.key == "long.scores.fill" for b in at.button)          # nothing to fill from yet
    at.number_input(key="hs.w.long.probes.length").set_value(SCORED).run()
    for name in ("scan", "importance"):
        at.button(key=f"long.scores.{name}").click().run()
        no_exception(at)
        assert not at.error, [e.value for e in at.error]
    at.slider(key="hs.w.long.scores.prune").set_value(25).run()
    at.button(key="long.scores.fill").click().run()
    no_exception(at)
    lm = load_model(str(tiny_long))
    from analysis.measure.splits import SCORE_SPLIT, TEST
    from analysis.score.longscan import stored_scan
    rows = {split: build_long(["passkey"], lm.tokenizer, lm.kind, (SCORED,), depths=(0.1, 0.5, 0.9), n_items=2,
                              limit=context_length(lm.model), split=split) for split in (SCORE_SPLIT, TEST)}
    stored = {split: stored_scan(lm, rows[split], window=Window(2, 64), compute=False)[0] for split in rows}
    assert stored[SCORE_SPLIT] is not None and stored[TEST] is None    # the page scored calibration rows, not test ones
    built = rows[SCORE_SPLIT]
    scan = long_scan(lm.model, built, tokenizer=lm.tokenizer, window=Window(2, 64))
    dets = {"streaming": scan.streaming(), "retrieval": scan.retrieval()}
    scores = KVScores(dets["streaming"].extras["kv_scores"], dets["retrieval"].extras["kv_scores"],
                      group_importance(lm, 256), dets, prune_tokens=256)
    want = plan_from_scores(lm.geometry, scores, window_share=0.5, prune_share=0.25, keep_retrieval=True,
                            window=Window(2, 64))
    np.testing.assert_array_equal(_grid(at), want.modes)
    assert at.query_params["plan"] == "scores" and want.counts()["prune"] == 2
    notes = read_kv_plan(downloads["kv_plan.json"].decode()).notes
    assert any(n.startswith("windowed: the lowest streaming scores") for n in notes), notes


def test_long_probes_of_the_plan_are_the_librarys(tiny_long, downloads):
    """The probes section: its run is analysis.score.longcontext.long_context_report of the grid's plan (the same
    rows, the same paired resamples: every cell's numbers equal), a dense-only run for an all-full plan, the
    downloads hold the report, and an edited grid says the result is stale instead of showing it."""
    from analysis.arch.models import load_model
    from analysis.measure.evaluation import context_length
    from analysis.arch.cut import Cut
    from analysis.measure.probes.longcontext import build_long
    from analysis.score.longcontext import long_context_report
    at = _open(tiny_long, kv="ff.ff.ff.ff")
    assert any("the plan is the dense model" in c.value for c in at.caption)
    at.number_input(key="hs.w.long.probes.length").set_value(320).run()
    at.button(key="long.probes.run").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    dense_only = json.loads(downloads["long_context.json"])
    assert dense_only["cut"] is None and all("cut_accuracy" not in c for c in dense_only["cells"])

    at = _open(tiny_long, kv="ww.ff.pw.ff", sinks=2, recent=16)
    at.number_input(key="hs.w.long.probes.length").set_value(320).run()
    label = next(b.label for b in at.button if b.key == "long.probes.run")
    assert "dense is measured" in label                       # the dense side is cached per model and settings
    at.button(key="long.probes.run").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    lm = load_model(str(tiny_long))
    built = build_long(["passkey"], lm.tokenizer, lm.kind, (320,), depths=(0.1, 0.5, 0.9), n_items=2,
                       limit=context_length(lm.model))
    plan = _plan([[1, 1], [0, 0], [2, 1], [0, 0]], 2, 16)
    want = long_context_report(lm, built=built, cut=Cut.of_plan(plan))
    got = json.loads(downloads["long_context.json"])
    assert got["cut"]["kind"] == "plan" and got["cut"]["kv_plan"] == {"full": 4, "window": 3, "prune": 1}
    assert (got["cut"]["sinks"], got["cut"]["recent"]) == (2, 16) and got["cut"]["describe"].endswith(plan.describe())
    assert [c["depth"] for c in got["cells"]] == [c.depth for c in want.changes]
    for mine, theirs in zip(got["cells"], want.rows()):
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-6, abs=1e-9) if isinstance(v, float) else mine[k] == v, k
    assert downloads["long_context.csv"].decode().splitlines()[0].startswith("probe,label,length,depth")
    table = at.table[-1].value
    assert list(table["depth"]) == [c.depth for c in want.changes]
    _edit_one_cell = at.number_input(key="hs.w.long_context.sinks").set_value(3).run()
    assert any("changed since the last run" in c.value for c in at.caption)
    assert not [t for t in at.table if "plan accuracy" in t.value.columns]


@pytest.fixture(scope="module")
def tiny_ruler(tmp_path_factory, smollm2):
    """A tiny Llama with SmolLM2's tokenizer (RULER's generators need real words and digits) reading 1,024 tokens."""
    return tiny_dir_for(tmp_path_factory.mktemp("tiny-ruler"), smollm2.tokenizer, max_position_embeddings=1024)


def test_rulers_expected_time_is_the_commands_estimate(tiny_ruler, monkeypatch, tmp_path):
    """The page's expected time is the ruler command's estimate (RulerWork.seconds: every row's prefill and every
    token it may generate, both sides) from this machine's timings: with the timings fixed, the caption says those
    seconds, as an upper bound. (Before a RULER job has run here: the first ruler test of this module.)"""
    from analysis.arch.models import load_model
    from analysis.measure.ruler import build_ruler, ruler_work
    from components import jobs, longstate
    monkeypatch.setattr(longstate, "per_row", lambda key, lengths, *a, **k: {n: 7.0 for n in lengths})
    monkeypatch.setattr(longstate, "per_step", lambda key, lengths, *a, **k: {n: 0.5 for n in lengths})
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))        # nothing stored: both sides run
    at = _open(tiny_ruler, kv="wf.pw", sinks=2, recent=64)
    at.multiselect(key="hs.w.long.ruler.tasks").set_value(["niah_single_1"]).run()
    at.number_input(key="hs.w.long.ruler.samples").set_value(3).run()
    lm = load_model(str(tiny_ruler))
    rows = build_ruler(["niah_single_1"], lm.tokenizer, (1024,), samples=3, seed=0, limit=1024)
    work = ruler_work(rows, cut=True)
    want = work.seconds({1024: 7.0}, {1024: 0.5})
    assert work.passes == 2 and want == 2 * (3 * 7.0 + 0.5 * work.new_tokens[1024])
    captions = [c.value for c in at.caption]
    assert any(c.startswith(f"Expected: about {jobs.seconds_words(want)} ") and "at most" in c
               for c in captions), captions


def test_ruler_of_the_plan_is_the_librarys(tiny_ruler, downloads):
    """The RULER section: its run is analysis.measure.ruler.ruler_report of the grid's plan, generating with the
    plan's compact cache (the same rows, the same paired resamples: every cell equal), the dense side cached per
    model and settings and kept on disk (a restarted server finds it), the downloads hold the report."""
    from analysis.arch.cut import Cut
    from analysis.arch.models import load_model
    from analysis.measure.ruler import build_ruler, ruler_report
    params = dict(kv="wf.pw", sinks=2, recent=64)
    at = _open(tiny_ruler, **params)
    at.multiselect(key="hs.w.long.ruler.tasks").set_value(["niah_single_1"]).run()
    at.number_input(key="hs.w.long.ruler.samples").set_value(2).run()
    label = next(b.label for b in at.button if b.key == "long.ruler.run")
    assert "2 rows of 1,024 tokens, dense and plan" in label
    at.button(key="long.ruler.run").click().run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    lm = load_model(str(tiny_ruler))
    rows = build_ruler(["niah_single_1"], lm.tokenizer, (1024,), samples=2, seed=0, limit=1024)
    plan = KVPlan_of(lm, [[1, 0], [2, 1]], 2, 64)
    want = ruler_report(lm, rows, cut=Cut.of_plan(plan))
    got = json.loads(downloads["ruler.json"])
    assert got["cut"]["kind"] == "plan" and got["cut"]["kv_plan"] == {"full": 1, "window": 2, "prune": 1}
    assert len(got["cells"]) == len(want.cells) == 2                    # the task and the average
    for mine, theirs in zip(got["cells"], want.table()):
        for k in ("task", "n", "dense_score", "dense_low", "dense_high", "cut_score", "cut_low", "cut_high",
                  "change", "lost", "cut_kv_bytes_prompt"):
            assert mine[k] == pytest.approx(theirs[k]) if isinstance(theirs[k], float) else mine[k] == theirs[k], k
    head_dim = lm.geometry.head_dim
    prompts = [g["prompt_tokens"] for g in got["generations"]["cut"]["niah_single_1"]]
    assert [g["kv_bytes_prompt"] for g in got["generations"]["cut"]["niah_single_1"]] == [
        plan.kv_bytes(n, head_dim=head_dim) for n in prompts]             # the compact cache holds the plan's bytes
    assert downloads["ruler.csv"].decode().splitlines()[0].startswith("task,label,length,n")
    at = _open(tiny_ruler, kv="ww.ff", sinks=2, recent=64)
    at.multiselect(key="hs.w.long.ruler.tasks").set_value(["niah_single_1"]).run()
    at.number_input(key="hs.w.long.ruler.samples").set_value(2).run()
    assert "dense is measured" in next(b.label for b in at.button if b.key == "long.ruler.run")
    from components import ruler as ruler_section
    ruler_section.dense_side.clear()
    ruler_section.dense_measured.clear()                                # a restarted server: the disk store alone
    at = _open(tiny_ruler, kv="ww.ff", sinks=2, recent=64)
    at.multiselect(key="hs.w.long.ruler.tasks").set_value(["niah_single_1"]).run()
    at.number_input(key="hs.w.long.ruler.samples").set_value(2).run()
    assert "dense is measured" in next(b.label for b in at.button if b.key == "long.ruler.run")


def KVPlan_of(lm, modes, sinks, recent):
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.window import Window
    return KVPlan(np.asarray(modes, np.int8), Window(sinks, recent), lm.geometry.n_heads, lm.name)


def test_a_duoattention_pattern_shows_beside_the_plan_and_becomes_it(tiny_long, downloads):
    """The DuoAttention section: an uploaded pattern (full_attention_heads.tsv + config.json) is compared with the
    grid's plan by analysis.compress.export.duo.full_agreement (the metrics are its counts), 'Use' makes it the
    plan (its window too), the plan downloads as a pattern that reads back as the same plan, and a malformed file
    is one line with the plan unchanged."""
    import io
    import zipfile

    from analysis.compress.export import duo
    theirs = _plan([[0, 1], [1, 1], [1, 0], [0, 0]], 3, 40)
    pattern = duo.pattern_from_plan(theirs)
    files = [(duo.HEADS_FILE, duo.heads_text(pattern.gates).encode(), "text/tab-separated-values"),
             (duo.CONFIG_FILE, json.dumps(pattern.config_dict()).encode(), "application/json")]
    at = _open(tiny_long, kv="ww.ff.ff.wf", sinks=2, recent=16)
    mine = _plan(_grid(at), 2, 16)
    at.file_uploader(key="hs.w.long.duo.upload").set_value(files).run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    counts = duo.full_agreement(theirs, mine).as_dict(("pattern", "plan"))["counts"]
    shown = {m.label: m.value for m in at.metric}
    assert shown["KV heads full in both"] == str(counts["both"])
    assert shown["Full in one only"] == str(counts["only_pattern"] + counts["only_plan"])
    at.button(key="long.duo.use").click().run()
    no_exception(at)
    np.testing.assert_array_equal(_grid(at), theirs.modes)
    assert (at.query_params["plan"], at.query_params["sinks"], at.query_params["recent"]) == ("duo", "3", "40")
    with zipfile.ZipFile(io.BytesIO(downloads["duo_pattern.zip"])) as z:
        back = duo.pattern_from_texts(z.read(duo.HEADS_FILE).decode(), z.read(duo.CONFIG_FILE).decode())
    np.testing.assert_array_equal(duo.plan_from_pattern(back, n_heads=H).modes, theirs.modes)
    at.file_uploader(key="hs.w.long.duo.upload").set_value(
        [(duo.HEADS_FILE, b"1\t0\nnan\t1\n", "text/tab-separated-values")]).run()
    no_exception(at)
    assert any("gate" in w.value for w in at.warning), [w.value for w in at.warning]
    np.testing.assert_array_equal(_grid(at), theirs.modes)


def test_dense_map_and_the_frontier_show_what_their_files_hold(tiny_long, tmp_path, monkeypatch):
    """Issue 52: dense's task x length map is the map file's scores, test cells starred; the frontier draws a line
    per method from the frontier file, and one of its plans becomes the view's plan in one click."""
    from analysis.arch.kvplan import KVPlan
    from analysis.arch.models import load_model
    from analysis.arch.window import Window
    from analysis.measure.densemap import DenseCell, DenseMap
    from components import longmap, longstate
    name = load_model(str(tiny_long)).name
    found = DenseMap(name)
    for task, length, score in (("niah_single_1", 1024, 1.0), ("niah_single_1", 2048, 0.9), ("ruler_vt", 1024, 0.2)):
        found.add(DenseCell(task, length, score, score - 0.1, min(score + 0.1, 1.0), 25))
    (tmp_path / "map.json").write_text(json.dumps(found.as_dict()))
    modes = np.zeros((L, HKV), np.int8)
    modes[1:, 0] = 1
    plan_path = tmp_path / "search-kv0.5.json"
    plan_path.write_text(KVPlan(modes, Window(4, 60), H, name).to_json())
    points = dict(configs={"search@0.5": dict(method="search", target=0.5, kv=0.49, score=0.9, low=0.8, high=1.0,
                                              lost=False, plan=str(plan_path)),
                           "prior@0.5": dict(method="prior", target=0.5, kv=0.5, score=0.4, low=0.3, high=0.5,
                                             lost=True, plan=str(plan_path))},
                  dense=dict(score=0.95, low=0.9, high=1.0))
    (tmp_path / "frontier.json").write_text(json.dumps(dict(model=name, length=512, rows=50, prompt=400, points=points,
                                                            rows_used={})))
    monkeypatch.setattr(longstate, "MAP_FILE", tmp_path / "map.json")
    monkeypatch.setattr(longmap, "FRONTIER_FILE", tmp_path / "frontier.json")
    at = _open(tiny_long)
    z = heatmap_z(figure_titled(at, "RULER score"))
    np.testing.assert_array_equal(z, found.grid()[2])
    shown = texts(at)
    assert "Test set: 2 of 3 cells" in shown and "every measured length: ruler_vt" in shown
    fig = figure_titled(at, "RULER test set")
    assert sorted(tr["name"] for tr in fig["data"] if tr.get("type") == "scatter") == ["prior", "search"]
    at.selectbox(key="long.frontier.pick").select("search@0.5").run()
    at.button(key="long.frontier.use").click().run()
    no_exception(at)
    np.testing.assert_array_equal(_grid(at), modes)


def test_the_ruler_section_names_the_tasks_dense_does_not_pass_at_its_length():
    """A task outside dense's test set at the chosen length is named (a loss cannot show there); none without a
    map for the model."""
    from analysis.measure.densemap import DenseCell, DenseMap
    from components.ruler import not_test_cells
    found = DenseMap("m")
    for task, length, score in (("niah_single_1", 1024, 1.0), ("niah_single_1", 2048, 0.6), ("ruler_vt", 1024, 0.2)):
        found.add(DenseCell(task, length, score, score - 0.1, min(score + 0.1, 1.0), 25))
    assert not_test_cells(found, ["niah_single_1", "ruler_vt"], 1024) == ["ruler_vt"]
    assert not_test_cells(found, ["niah_single_1", "ruler_cwe"], 2048) == ["niah_single_1", "ruler_cwe"]
    assert not_test_cells(None, ["ruler_vt"], 1024) == []
