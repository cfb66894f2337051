"""The scorer registry: one registration (name, label, parameters, needs_calibration) is what the
CLI (--scorer choices, options, weight-only set), the app (scorer list, labels, defaults) and
scripts/results.py read. A toy scorer registered here once shows up in all of them; a toy scorer
parameter declared once (analysis.core.params.Param) is the scorer's constructor check and params(),
a CLI option, a URL field and a widget."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from analysis import cli

from analysis.score import scoring
from analysis.core.errors import InputError
from analysis.core.params import Param
from analysis.measure.profiles import profile_model
from tests._apptools import fresh_caches, tiny_dir  # noqa: F401
from tests._registry import registered
from tests._tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


class ToyScorer(scoring.Scorer):
    """alpha * (layer index + 1) for every head: weight-only, one new parameter."""

    name = "toy-registry-test"
    label = "Toy scorer (registry test)"

    def __init__(self, alpha: float = 0.5):
        self.alpha = float(alpha)

    def params(self) -> dict:
        return dict(alpha=self.alpha)

    def _compute(self, target, calibration, cost, progress, should_stop):
        L, H = target.n_layers, target.n_heads
        return self.alpha * np.repeat(np.arange(1.0, L + 1)[:, None], H, axis=1), None  # [L, H]


@pytest.fixture
def toy():
    with registered(scoring.register_scorer, scoring.SCORERS, ToyScorer, ToyScorer.name) as cls:
        yield cls


def _scorer_action(parser, command="score"):
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {a.dest: a for a in sub._actions}


def test_a_registered_scorer_is_a_cli_choice_with_its_parameter(toy):
    actions = _scorer_action(cli.build_parser())
    assert toy.name in actions["scorer"].choices
    assert actions["alpha"].option_strings == ["--alpha"] and actions["alpha"].type is float
    assert toy.name in scoring.weight_only_scorers()


def test_the_cli_scores_with_a_registered_scorer(toy, tmp_path, capsys):
    folder = tmp_path / "tiny"
    model = tiny_model("llama", num_hidden_layers=3)
    model.save_pretrained(folder)
    code = cli.main(["score", "--checkpoint", str(folder), "--scorer", toy.name, "--alpha", "2", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["name"] == toy.name and out["params"] == {"alpha": 2.0}
    expected = ToyScorer(alpha=2.0).score(profile_model(model)).scores
    np.testing.assert_array_equal(np.asarray(out["scores"]), expected)
    assert expected[2, 0] == 6.0


def test_a_registered_scorer_is_in_the_apps_list_with_its_label(toy):
    from components import controls
    assert toy.name in controls.scorer_names()
    assert controls.label(toy.name) == toy.label
    assert controls.default_params(toy.name, z=1.0) == {}       # alpha has no widget: its default is used
    assert controls.constructor_defaults(toy.name) == {"alpha": 0.5}


def test_a_registered_scorer_gets_a_row_in_the_results_script(toy, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    results = __import__("results")
    args = types.SimpleNamespace(n_sequences=2, seq_len=8, batch_size=2, ig_steps=2, ablation_sequences=1,
                                 ablation_seq_len=8)
    rows = dict(results.scorer_rows(args))
    assert isinstance(rows[toy.label], ToyScorer)
    assert {s.name for s in rows.values()} == set(scoring.SCORERS) - {"random"}
    sys.modules.pop("results", None)


def test_registration_needs_a_name_label_and_a_free_name(toy):
    with pytest.raises(InputError, match="already registered"):
        scoring.register_scorer(type("Other", (ToyScorer,), {}))
    with pytest.raises(InputError, match="label"):
        scoring.register_scorer(type("NoLabel", (scoring.Scorer,), {"name": "no-label"}))
    scoring.register_scorer(ToyScorer)                          # registering the same class again is a no-op
    assert scoring.SCORERS[toy.name] is ToyScorer


class ToyDeclared(scoring.Scorer):
    """beta * (head index + 1) for every layer: weight-only, one DECLARED parameter (its one home)."""

    name = "toy-declared-test"
    label = "Toy scorer (declared parameter)"
    parameters = {"beta": Param(3, "Beta (toy)", "toy multiplier of the head index", lo=1, hi=9, step=1)}

    def _compute(self, target, calibration, cost, progress, should_stop):
        L, H = target.n_layers, target.n_heads
        return self.beta * np.repeat(np.arange(1.0, H + 1)[None, :], L, axis=0), None  # [L, H]


@pytest.fixture
def declared():
    with registered(scoring.register_scorer, scoring.SCORERS, ToyDeclared, ToyDeclared.name) as cls:
        yield cls


def test_a_declared_parameter_builds_the_constructor_and_params(declared):
    assert declared().params() == {"beta": 3} and declared(beta=5).beta == 5
    with pytest.raises(InputError, match="beta must be a whole number from 1 to 9"):
        declared(beta=10)
    with pytest.raises(TypeError, match="no parameter 'gamma'"):
        declared(gamma=1)


def test_a_declared_parameter_is_a_cli_option(declared, tmp_path, capsys):
    action = _scorer_action(cli.build_parser())["beta"]
    assert action.option_strings == ["--beta"] and action.type is int and action.help == "toy multiplier of the head index"
    folder = tmp_path / "tiny"
    tiny_model("llama", num_hidden_layers=2).save_pretrained(folder)
    code = cli.main(["score", "--checkpoint", str(folder), "--scorer", declared.name, "--beta", "4", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["params"] == {"beta": 4} and out["scores"][1][2] == 12.0
    code = cli.main(["score", "--checkpoint", str(folder), "--scorer", declared.name, "--beta", "0", "--quiet"])
    assert code == 2 and "beta must be a whole number from 1 to 9" in capsys.readouterr().err


@pytest.mark.usefixtures("fresh_caches")
def test_a_declared_parameter_is_a_url_field_and_a_widget(declared, tiny_dir):
    from components import controls, state
    from tests._apptools import new_app, no_exception
    assert state.FIELDS["beta"].parse("7") == 7 and state.FIELDS["beta"].default is None
    assert controls.default_params(declared.name, z=1.0) == {"beta": 3}
    at = new_app(tiny_dir, page="prune", scorer=declared.name, beta="7")        # a shared link
    no_exception(at)
    box = at.number_input(key="hs.w.prune.beta")
    assert box.label == "Beta (toy)" and box.value == 7 and (box.min, box.max) == (1, 9)
    box.set_value(5).run()                                                     # the widget writes the URL
    no_exception(at)
    assert at.query_params["beta"] == "5"
    at = new_app(tiny_dir, page="prune", scorer=declared.name, beta="20")       # the same bounds for a link
    assert any("beta='20'" in w.value and "outside 1 .. 9" in w.value for w in at.warning)
    assert at.number_input(key="hs.w.prune.beta").value == 3
