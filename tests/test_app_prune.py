"""Prune page: the mask grid prunes exactly floor(s*L*H) heads, the lowest-scored ones, and the
page's counts agree with it; every number of the live view and the grid come from one (scores, mask)
after each z or sparsity move; z and sparsity moves never re-read the weights; the perplexity check
evaluates exactly the mask that is shown; calibration scorers run on request; bad text is refused."""
import math

import numpy as np
import pytest

from tests._apptools import (downloads, figure_titled, fresh_caches, mask_grid, mask_grids, metric,  # noqa: F401
                             new_app, no_exception, parse_mask_grid, smollm2_app, tiny_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")


def _mask_and_scores(at):
    grid = mask_grid(at)
    return grid.pruned, grid.scores, grid


def _check_mask(at, sparsity, n_heads):
    pruned, scores, grid = _mask_and_scores(at)
    k = math.floor(sparsity * n_heads + 1e-9)
    assert pruned.size == n_heads and int(pruned.sum()) == k
    assert metric(at, "Query heads after / before") == f"{n_heads - k} / {n_heads}"
    assert grid.title == f"{k} of {n_heads} heads pruned"
    if 0 < k < n_heads:
        assert scores[pruned].max() <= scores[~pruned].min()   # the lowest-scored heads went first
    return pruned, scores


@pytest.mark.parametrize("group_size", [1, 3])
def test_mask_grid_reads_back_what_it_draws(group_size):
    from components import charts
    rng = np.random.default_rng(0)
    pruned = rng.random((5, 6)) < 0.4                                  # [L, H]
    scores = rng.standard_normal((5, 6))                               # [L, H]
    body = charts.mask_grid(pruned, scores, score_name="<b>x</b> & y", group_size=group_size)
    grid = parse_mask_grid(body)
    np.testing.assert_array_equal(grid.pruned, pruned)
    np.testing.assert_array_equal(grid.scores, scores)                # exact: the score as Python writes it
    np.testing.assert_array_equal(grid.per_layer, pruned.sum(axis=1))
    assert grid.title == f"{int(pruned.sum())} of 30 heads pruned"
    assert "<b>" not in body and "<b>x</b> & y" in grid.hover[0]     # escaped in the HTML, shown as written
    assert ("(KV group 1)" in grid.hover[3]) == (group_size == 3)
    assert body.count('class="k s"') + body.count('class="p s"') == (5 if group_size == 3 else 0)  # group gaps


@pytest.mark.parametrize("scorer", ["mp", "mp-g", "magnitude", "random"])
def test_sparsity_slider_prunes_floor_s_LH_heads(tiny_dir, scorer):
    at = new_app(tiny_dir, page="prune", policy="global", scorer=scorer)
    for s in (0.0, 0.3, 0.55, 0.95):
        at.slider(key="hs.w.prune.sparsity").set_value(s).run()
        no_exception(at)
        _check_mask(at, s, 16)


def test_zero_score_count_and_per_layer_counts(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global", scorer="mp", sparsity="0.5")
    for z in (0.0, 1.0, 3.0):
        at.slider(key="hs.w.prune.z").set_value(z).run()
        pruned, scores = _check_mask(at, 0.5, 16)
        assert int(metric(at, f"Heads with score 0 at z = {z:g}")) == int((scores == 0).sum())
        np.testing.assert_array_equal(mask_grid(at).per_layer, pruned.sum(axis=1))
    # a high z leaves more heads in the bulk than a low z
    assert int(metric(at, "Heads with score 0 at z = 3")) >= 1


def test_live_view_shows_one_mask_after_every_move(tiny_dir, downloads):
    """After each key press (z or sparsity, either order) the grid, every number beside it, the
    downloads and the URL are the mask of the widgets' values, computed here independently."""
    import json

    from analysis.score import masks

    from analysis.arch import models

    from analysis.measure import profiles

    from analysis.score import scoring
    lm = models.load_model(str(tiny_dir))
    prof = profiles.profile_model(lm.model)
    at = new_app(tiny_dir, page="prune", policy="global", scorer="mp-g", z="2", sparsity="0.3")
    for key, value in (("z", 0.5), ("sparsity", 0.6), ("z", 3.0), ("sparsity", 0.2), ("z", 0.0), ("sparsity", 0.45)):
        at.slider(key=f"hs.w.prune.{key}").set_value(value).run()
        no_exception(at)
        z, sparsity = at.slider(key="hs.w.prune.z").value, at.slider(key="hs.w.prune.sparsity").value
        expected = scoring.get_scorer("mp-g", z=z).score(prof)
        plan = masks.plan_mask(expected, sparsity, group_size=lm.geometry.group_size)
        grid = mask_grid(at)
        np.testing.assert_array_equal(grid.pruned, plan.pruned)
        np.testing.assert_array_equal(grid.scores, expected.scores)           # the same scores, bit for bit
        np.testing.assert_array_equal(grid.per_layer, plan.pruned.sum(axis=1))
        assert grid.title == f"{plan.n_pruned} of 16 heads pruned"
        assert metric(at, "Query heads after / before") == f"{16 - plan.n_pruned} / 16"
        assert int(metric(at, f"Heads with score 0 at z = {z:g}")) == int((expected.scores == 0).sum())
        rows = downloads["mp-g_scores.csv"].decode().strip().splitlines()[1:]
        assert [bool(int(r.split(",")[3])) for r in rows] == plan.pruned.ravel().tolist()
        assert json.loads(downloads["mp-g_mask_summary.json"])["n_pruned"] == plan.n_pruned
        assert (float(at.query_params["z"]), float(at.query_params["sparsity"])) == (z, sparsity)


def test_moving_z_or_sparsity_never_rereads_weights(tiny_dir, monkeypatch):
    from analysis.arch import adapters
    from analysis.measure import profiles
    calls = {"n": 0}
    real_read = adapters.Adapter.read_heads
    real_profile = profiles.profile_model

    def counting_read(self, *args, **kwargs):
        calls["n"] += 1
        return real_read(self, *args, **kwargs)

    profile_calls = []
    monkeypatch.setattr(adapters.Adapter, "read_heads", counting_read)
    monkeypatch.setattr(profiles, "profile_model", lambda *a, **k: profile_calls.append(1) or real_profile(*a, **k))
    at = new_app(tiny_dir, page="prune", policy="global", scorer="mp-g")
    after_first = calls["n"]
    assert len(profile_calls) == 1
    masks = set()
    for z, s in ((0.5, 0.3), (0.5, 0.6), (2.5, 0.6), (1.0, 0.1)):
        at.slider(key="hs.w.prune.z").set_value(z).run()
        at.slider(key="hs.w.prune.sparsity").set_value(s).run()
        no_exception(at)
        masks.add(_mask_and_scores(at)[0].tobytes())
    assert calls["n"] == after_first and len(profile_calls) == 1
    assert len(masks) > 1


def test_perplexity_check_evaluates_the_shown_mask(tiny_dir):
    from analysis.measure.evaluation import evaluate
    from analysis.arch.models import load_model
    at = new_app(tiny_dir, page="prune", policy="global", sparsity="0.5")
    at.number_input(key="hs.w.prune.max_tokens").set_value(64).run()
    at.button(key="prune.check").click().run()
    no_exception(at)
    pruned, _, _ = _mask_and_scores(at)
    expected = evaluate(load_model(str(tiny_dir)), None, pruned=np.stack([np.zeros_like(pruned), pruned]),
                        max_tokens=64).values
    assert float(metric(at, "Dense perplexity")) == pytest.approx(expected[0], rel=1e-3)
    assert float(metric(at, "Masked perplexity")) == pytest.approx(expected[1], rel=1e-3)
    assert any("CC BY-SA 4.0" in c.value for c in at.caption)  # the built-in text is attributed


def test_empty_own_text_is_refused_with_a_fix(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global")
    at.radio(key="hs.w.prune.text_source").set_value("own").run()
    no_exception(at)
    assert any("text is empty" in e.value and "Paste" in e.value for e in at.error)


def test_z_sweep_chart(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global", scorer="mp", sparsity="0.5")
    at.number_input(key="hs.w.prune.sweep_tokens").set_value(64).run()
    at.button(key="prune.sweep").click().run()
    no_exception(at)
    fig = figure_titled(at, "vs z at sparsity 0.5")
    zs = np.asarray(fig["data"][0]["x"], dtype=float)
    assert zs.size > 3 and np.all(np.diff(zs) > 0)
    suggested = float(fig["layout"]["title"]["text"].split("suggested z = ")[1].rstrip(")"))
    at.button(key="prune.use_z").click().run()
    assert at.slider(key="hs.w.prune.z").value == pytest.approx(suggested)
    assert float(at.query_params["z"]) == pytest.approx(suggested)


def test_calibration_scorer_runs_on_request(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global", scorer="wanda", sparsity="0.25")
    no_exception(at)
    assert not mask_grids(at) and not at.get("plotly_chart")   # nothing is shown before the scores exist
    at.number_input(key="hs.w.prune.n_sequences").set_value(2).run()
    at.number_input(key="hs.w.prune.seq_len").set_value(16).run()
    at.button(key="prune.compute").click().run()
    no_exception(at)
    _check_mask(at, 0.25, 16)
    at.slider(key="hs.w.prune.sparsity").set_value(0.5).run()   # cached: no button needed again
    _check_mask(at, 0.5, 16)


@pytest.mark.slow
def test_smollm2_sparsity_slider(smollm2_app):
    at = new_app(smollm2_app, page="prune", policy="global", scorer="mp-g")
    for s in (0.1, 0.37):
        at.slider(key="hs.w.prune.sparsity").set_value(s).run()
        no_exception(at)
        _check_mask(at, s, 270)


def test_downloads_hold_the_shown_scores_and_mask(tiny_dir, downloads):
    import json
    at = new_app(tiny_dir, page="prune", policy="global", scorer="mp", sparsity="0.4")
    no_exception(at)
    pruned, scores, _ = _mask_and_scores(at)
    rows = downloads["mp_scores.csv"].decode().strip().splitlines()
    assert rows[0] == "layer,head,score,pruned" and len(rows) == 1 + 16
    for row in rows[1:]:
        layer, head, score, was_pruned = row.split(",")
        assert float(score) == pytest.approx(scores[int(layer), int(head)], rel=1e-6)
        assert bool(int(was_pruned)) == pruned[int(layer), int(head)]
    data = json.loads(downloads["mp_scores.json"])
    np.testing.assert_allclose(np.asarray(data["scores"]), scores, rtol=1e-9)
    assert json.loads(downloads["mp_mask_summary.json"])["n_pruned"] == int(pruned.sum()) == 6


def test_stop_flag_cancels_long_work(tiny_dir):
    at = new_app(tiny_dir, page="prune", policy="global", scorer="wanda")
    at.number_input(key="hs.w.prune.n_sequences").set_value(2).run()
    at.number_input(key="hs.w.prune.seq_len").set_value(16).run()
    at.session_state["hs.stop"] = True          # what the Stop button's click sets before the rerun
    at.button(key="prune.compute").click().run()
    no_exception(at)
    assert any("cancelled" in w.value for w in at.warning), [w.value for w in at.warning]
    assert not mask_grids(at) and not at.get("plotly_chart")
    assert at.session_state["hs.stop"] is False  # the next start is not cancelled again
    at.button(key="prune.compute").click().run()
    _check_mask(at, 0.3, 16)
