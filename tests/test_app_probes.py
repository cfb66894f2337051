"""The capability probes in the app (components/probes.py): the Prune page's "What this cut breaks" panel
(dense vs the mask shown, the probes a tokenizer cannot build listed with why, a lost capability as one
red line), the Heads page's probe map and domain comparison, and bad text for a domain (empty, binary,
too large) as one error line with nothing computed."""
import numpy as np
import pytest

from analysis.measure.probes import PROBES
from tests._apptools import fresh_caches, new_app, no_exception, texts, tiny_dir, trivial_tokenizer  # noqa: F401
from tests._probekit import PLANTED, planted_model

pytestmark = pytest.mark.usefixtures("fresh_caches")


def _table(at, index: int = 0):
    return at.dataframe[index].value


def test_prune_panel_shows_dense_vs_cut(tiny_dir):
    at = new_app(tiny_dir, page="prune", sparsity="0.25", policy="global", scorer="mp")
    at.button(key="prune.probes").click().run()
    no_exception(at)
    table = _table(at, len(at.dataframe) - 1)
    assert list(table["probe"]) == [PROBES["copying"].label, PROBES["code"].label]
    assert {"dense accuracy", "cut accuracy"} <= set(table.columns)
    shown = texts(at)
    assert "Not measured: ioi: The Indirect object (IOI) probe could build only 0 item(s)" in shown


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("planted")
    planted_model(dtype=__import__("torch").float32).save_pretrained(folder)
    trivial_tokenizer().save_pretrained(folder)
    return folder


def _random_seed_pruning(head_pruned: bool) -> int:
    """A seed of the random scorer whose global 25 % mask of the planted model does / does not cut head (1, 2)."""
    from analysis.score.masks import plan_mask
    from analysis.score.scoring import get_scorer
    for seed in range(100):
        scores = get_scorer("random", seed=seed).score(planted_model())
        if bool(plan_mask(scores, 0.25, group_size=2).pruned[1, 2]) is head_pruned:
            return seed
    raise AssertionError("no seed")


@pytest.mark.parametrize("cut_it", [True, False])
def test_a_lost_capability_is_one_red_line(planted_dir, cut_it, monkeypatch):
    monkeypatch.setitem(PROBES, "planted", PLANTED)        # the toy probe, registered in one place
    seed = _random_seed_pruning(cut_it)
    at = new_app(planted_dir, page="prune", scorer="random", seed=seed, sparsity="0.25", policy="global")
    at.button(key="prune.probes").click().run()
    no_exception(at)
    lost = [e.value for e in at.error if "LOSES a capability" in e.value]
    assert len(lost) == (1 if cut_it else 0)
    if cut_it:
        assert "loses planted copy" in lost[0]
        table = _table(at, len(at.dataframe) - 1)
        assert list(table[""])[list(table["probe"]).index("Planted copy")].startswith("LOST")


def test_heads_page_probe_map_and_domains(tiny_dir):
    at = new_app(tiny_dir, page="heads")
    at.button(key="heads.probe_map").click().run()
    no_exception(at)
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("drop of the mean logit difference" in t for t in titles)
    at.button(key="heads.domains").click().run()
    no_exception(at)
    assert any("minus" in c.proto.spec for c in at.get("plotly_chart"))
    assert any("scored on" in str(v) for v in _table(at, len(at.dataframe) - 1)["cut"])


@pytest.mark.parametrize("text,words", [("   ", "empty"), ("abc\x00def " * 20, "binary"), ("x" * 5000, "MiB")])
def test_bad_domain_text_is_one_error_line(tiny_dir, text, words, monkeypatch):
    monkeypatch.setattr("analysis.score.domains.USER_TEXT_MAX_BYTES", 4096)
    at = new_app(tiny_dir, page="heads")
    charts = len(at.get("plotly_chart"))
    at.radio(key="hs.w.heads.domains.B").set_value("own").run()
    at.text_area(key="hs.w.heads.domains.B.text").set_value(text).run()
    no_exception(at)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and words.lower() in errors[0].lower() and "\n" not in errors[0]
    assert not [b for b in at.button if b.key == "heads.domains"]       # nothing to run on bad text
    assert len(at.get("plotly_chart")) == charts


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    """A tiny BERT encoder without an LM head (like all-MiniLM-L6-v2) with a tokenizer."""
    from transformers import AutoModel
    from tests._tiny import tiny_config
    folder = tmp_path_factory.mktemp("encoder")
    AutoModel.from_config(tiny_config("bert")).save_pretrained(folder)
    trivial_tokenizer().save_pretrained(folder)
    return folder


def test_an_encoder_gets_one_line_and_no_probe(encoder_dir):
    at = new_app(encoder_dir, page="prune", sparsity="0.25")
    no_exception(at)
    assert "prune.probes" not in [b.key for b in at.button]
    shown = texts(at)
    assert "No capability probe applies to this model" in shown and "no language-model head" in shown
    at = new_app(encoder_dir, page="heads")
    no_exception(at)
    assert "heads.probe_map" not in [b.key for b in at.button]
    assert "No capability probe applies to this model (no language-model head)." in texts(at)
