"""The detector registry: one record (analysis.measure.detectors.DetectorSpec: name, title, help, how to
read it, where it applies, how to build it) is what the CLI (`roles --detector` choices and help), the
Heads page (its tab, map title, caption and folded text) and `detect_heads` read. A toy detector
registered here once shows up in all of them. (Detectors have no URL field: the Heads page runs the
detectors that apply to the model when its button is pressed.)"""
import json

import numpy as np
import pytest

from analysis import cli
from analysis.arch.adapters import adapter_for
from analysis.core.errors import InputError
from analysis.measure import detectors
from analysis.measure.headmaps import Detection
from tests._apptools import figure_titled, fresh_caches, heatmap_z, new_app, no_exception, texts, tiny_dir  # noqa: F401
from tests._registry import registered

NAME = "toy-detector-test"


class ToyDetector:
    """scale * (head index) in every layer; one verb: detect."""

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)

    def detect(self, model, ids=None, *, gates=None, layout=None, progress=None, should_stop=None) -> Detection:
        g = adapter_for(model).geometry(model)
        scores = self.scale * np.tile(np.arange(g.n_heads, dtype=np.float64), (g.n_layers, 1))   # [L, H]
        return Detection(NAME, scores, threshold=2.0, unit="toy units")


SPEC = detectors.DetectorSpec(NAME, "Toy score (registry test)", "the head index times a scale",
                              about="A toy map: the head index, scaled. Nothing to read into it.",
                              build=lambda tokenizer, options: ToyDetector(options.get("scale", 1.0)))


@pytest.fixture
def toy():
    with registered(detectors.register_detector, detectors.DETECTORS, SPEC, NAME) as spec:
        yield spec


def _roles_actions(parser):
    sub = next(a for a in parser._actions if a.dest == "command").choices["roles"]
    return {a.dest: a for a in sub._actions}


def test_a_registered_detector_is_built_and_run_by_name(toy, tiny_dir):
    from analysis.arch.models import load_model
    assert isinstance(detectors.get_detector(NAME, scale=3.0), ToyDetector)
    out = detectors.detect_heads(load_model(str(tiny_dir)), [NAME])
    np.testing.assert_array_equal(out[NAME].scores[2], [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(InputError, match="already registered"):
        detectors.register_detector(detectors.DetectorSpec(NAME, "other", "other", "other", build=lambda t, o: None))
    detectors.register_detector(SPEC)                          # the same record again is a no-op
    assert detectors.DETECTORS[NAME] is SPEC


def test_a_registered_detector_is_a_cli_choice(toy, tiny_dir, capsys):
    action = _roles_actions(cli.build_parser())["detector"]
    assert NAME in action.choices and "the head index times a scale" in action.help
    code = cli.main(["roles", "--model", str(tiny_dir), "--detector", NAME, "--quiet", "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and list(out["detectors"]) == [NAME]
    assert out["detectors"][NAME]["unit"] == "toy units" and out["detectors"][NAME]["scores"][0] == [0, 1, 2, 3]


@pytest.mark.usefixtures("fresh_caches")
def test_a_registered_detector_has_its_tab_on_the_heads_page(toy, tiny_dir):
    at = new_app(tiny_dir, page="heads")
    at.number_input(key="hs.w.heads.taxonomy.tokens").set_value(64).run()
    at.button(key="heads.taxonomy").click().run()
    no_exception(at)
    shown = heatmap_z(figure_titled(at, "Toy score (registry test)")).astype(float)
    np.testing.assert_array_equal(shown, np.tile(np.arange(4.0), (4, 1)))
    page = texts(at)
    assert "the head index times a scale" in page and "A toy map: the head index, scaled." in page
