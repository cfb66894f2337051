"""The view's state lives in the URL: a link opens the same page with the same model, scorer, z and
sparsity; moving a control rewrites the URL; values survive page switches; bad link values are
replaced by defaults with a note that says how to fix them."""
import pytest

from tests._apptools import fresh_caches, new_app, no_exception, tiny_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_link_opens_the_same_view(tiny_dir):
    at = new_app(tiny_dir, page="prune", scorer="mp-g", z="1.5", sparsity="0.25")
    no_exception(at)
    assert [t.value for t in at.title] == ["Prune"]
    assert at.selectbox(key="hs.w.prune.scorer").value == "mp-g"
    assert at.slider(key="hs.w.prune.z").value == pytest.approx(1.5)
    assert at.slider(key="hs.w.prune.sparsity").value == pytest.approx(0.25)
    assert at.query_params["page"] == "prune"
    assert at.query_params["model"] == str(tiny_dir)


def test_moving_controls_rewrites_the_url(tiny_dir):
    at = new_app(tiny_dir, page="prune")
    at.slider(key="hs.w.prune.sparsity").set_value(0.5).run()
    at.slider(key="hs.w.prune.z").set_value(1.25).run()
    at.selectbox(key="hs.w.prune.scorer").set_value("magnitude").run()
    no_exception(at)
    assert at.query_params["sparsity"] == "0.5"
    assert at.query_params["z"] == "1.25"
    assert at.query_params["scorer"] == "magnitude"


def test_values_survive_switching_pages(tiny_dir):
    at = new_app(tiny_dir, page="profiles")
    at.slider(key="hs.w.profiles.z").set_value(0.75).run()
    at.switch_page("pages/model.py").run()
    assert at.query_params["z"] == "0.75" and at.query_params["page"] == "model"
    at.switch_page("pages/prune.py").run()
    no_exception(at)
    assert at.slider(key="hs.w.prune.z").value == pytest.approx(0.75)
    assert at.query_params["page"] == "prune"


@pytest.mark.parametrize("field,raw", [("z", "abc"), ("z", "1e9"), ("sparsity", "5"), ("sparsity", "nan")])
def test_absurd_link_values_fall_back_with_a_fix(tiny_dir, field, raw):
    at = new_app(tiny_dir, page="prune", **{field: raw})
    no_exception(at)
    notes = [w.value for w in at.warning]
    assert any(f"{field}={raw!r}" in n and "Fix the" in n for n in notes), notes
    default = {"z": 2.0, "sparsity": 0.3}[field]
    assert at.slider(key=f"hs.w.prune.{field}").value == pytest.approx(default)


def test_unknown_scorer_in_link_is_replaced(tiny_dir):
    at = new_app(tiny_dir, page="prune", scorer="no-such-scorer")
    no_exception(at)
    assert any("scorer='no-such-scorer'" in w.value and "the model's default scorer" in w.value
               and "Fix the" in w.value for w in at.warning), [w.value for w in at.warning]
    assert at.query_params["scorer"] == at.selectbox(key="hs.w.prune.scorer").value != "no-such-scorer"


def test_trust_remote_code_is_never_taken_from_a_link(tiny_dir):
    at = new_app(tiny_dir, page="model", trust="1", trust_remote_code="true")
    no_exception(at)
    assert at.toggle(key="hs.w.trust").value is False


def test_a_stop_leaves_one_note_and_the_next_run_is_not_cancelled(tiny_dir):
    at = new_app(tiny_dir, page="heads")
    at.session_state["hs.stop"] = True            # what the Stop button's on_click leaves behind
    at.session_state["hs.stopped"] = "Ablating heads"
    at.run()
    no_exception(at)
    assert [w.value for w in at.warning if w.value.startswith("Stopped: Ablating heads")], [w.value for w in at.warning]
    assert at.session_state["hs.stop"] is True     # the click's own rerun still cancels restarted work
    at.run()
    assert not [w.value for w in at.warning if w.value.startswith("Stopped")]
    assert at.session_state["hs.stop"] is False    # ... and the run after it runs normally
