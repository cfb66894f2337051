"""The mask-policy registry: one record (analysis.score.masks.MaskPolicy: name, label, help, where it
applies, its planner) is what `plan_mask`, the CLI (--policy choices and help), the URL (?policy=) and
the app's policy box read. A toy policy registered here once shows up in all of them."""
import json

import numpy as np
import pytest

from analysis import cli
from analysis.core.errors import InputError
from analysis.score import masks
from tests._apptools import fresh_caches, mask_grid, new_app, no_exception, tiny_dir  # noqa: F401
from tests._registry import registered

NAME = "toy-policy-test"
TOY = masks.MaskPolicy(NAME, "toy: the first k heads", "the first k heads in (layer, head) order, whatever "
                       "their scores", lambda r: (np.arange(r.flat.size) < r.k, ""))


@pytest.fixture
def toy():
    with registered(masks.register_policy, masks.POLICIES, TOY, NAME) as policy:
        yield policy


def test_a_registered_policy_plans_masks(toy):
    scores = np.arange(12.0)[::-1].reshape(3, 4)               # the global policy would prune the last heads
    plan = masks.plan_mask(scores, 0.25, group_size=2, policy=NAME)
    assert plan.policy == NAME and plan.pruned.reshape(-1).tolist() == [True] * 3 + [False] * 9
    assert masks.plan_mask(scores, 0.25, group_size=2, policy="global").pruned[2, 1:].all()
    with pytest.raises(InputError, match="already registered"):
        masks.register_policy(masks.MaskPolicy(NAME, "other", "other", TOY.plan))
    masks.register_policy(TOY)                                 # the same record again is a no-op


def _mask_actions(parser):
    sub = next(a for a in parser._actions if a.dest == "command").choices["mask"]
    return {a.dest: a for a in sub._actions}


def test_a_registered_policy_is_a_cli_choice(toy, tiny_dir, capsys):
    action = _mask_actions(cli.build_parser())["policy"]
    assert NAME in action.choices and "the first k heads in (layer, head) order" in action.help
    code = cli.main(["mask", "--model", str(tiny_dir), "--sparsity", "0.25", "--policy", NAME, "--quiet",
                     "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["policy"] == NAME
    assert np.asarray(out["pruned"]).reshape(-1).tolist() == [1] * 4 + [0] * 12


@pytest.mark.usefixtures("fresh_caches")
def test_a_registered_policy_is_a_url_field_and_in_the_policy_box(toy, tiny_dir):
    at = new_app(tiny_dir, page="prune", policy=NAME, scorer="mp", sparsity="0.25")    # a shared link
    no_exception(at)
    assert not [w.value for w in at.warning if "policy=" in w.value]            # the link's policy was taken
    box = at.selectbox(key="hs.w.prune.policy")
    assert box.value == NAME and TOY.label in box.options and "the first k heads" in box.help
    assert mask_grid(at).pruned.reshape(-1).tolist() == [True] * 4 + [False] * 12
    box.set_value("global").run()                                                    # the box writes the URL
    assert at.query_params["policy"] == "global"
    box.set_value(NAME).run()
    assert at.query_params["policy"] == NAME
