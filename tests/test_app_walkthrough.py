"""Walkthrough page: the worked head's numbers are analysis' own (and the raw weights'), they follow z,
the slice picture uses the real shapes, the uneven-mask count is what surgery builds, the step links
keep the view, and the MHA encoder shows MP-G == MP."""
from urllib.parse import parse_qs

import numpy as np
import pytest
from safetensors.torch import load_file

from tests._apptools import (figure_titled, fresh_caches, metric, new_app, no_exception, texts,  # noqa: F401
                             tiny_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")
L, H, HKV, D_HEAD, HIDDEN = 4, 4, 2, 8, 32
LAYER, HEAD = 2, 3                       # head 3 is in KV group 1
NUMBERS = ("Own excess (Q + O)", "KV group 1 excess (K + V)", "MP score", "MP-G score")


def _open(tiny_dir, z: float):
    at = new_app(tiny_dir, page="walkthrough", z=z)
    at.slider(key="hs.w.walk.layer").set_value(LAYER).run()
    at.slider(key="hs.w.walk.head").set_value(HEAD).run()
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    return at


def _shown(at) -> np.ndarray:
    """The worked numbers at full precision (each metric's help says "Full precision: <repr>")."""
    helps = {m.label: m.proto.help for m in at.get("metric")}
    for label in NUMBERS:
        assert float(metric(at, label)) == pytest.approx(float(helps[label].split(": ")[1]), rel=1e-5)
    return np.array([float(helps[label].split(": ")[1]) for label in NUMBERS])


def _from_analysis(tiny_dir, z: float) -> np.ndarray:
    from analysis.measure import profiles
    from analysis.score import scoring
    from analysis.arch.models import load_model
    prof = profiles.profile_model(load_model(str(tiny_dir)).model)
    own, group = prof.excess_sums(z)
    mp = scoring.get_scorer("mp", z=z).score(prof).scores
    mpg = scoring.get_scorer("mp-g", z=z).score(prof).scores
    return np.array([own[LAYER, HEAD], group[LAYER, 1], mp[LAYER, HEAD], mpg[LAYER, HEAD]])


def _from_weights(tiny_dir, z: float) -> tuple[float, float]:
    """Own and group excess of (LAYER, HEAD) by hand from the checkpoint (population std, ddof 0)."""
    weights = load_file(tiny_dir / "model.safetensors")
    excess = {}
    for p in "qkvo":
        w = weights[f"model.layers.{LAYER}.self_attn.{p}_proj.weight"].double()
        n = (w.t() if p == "o" else w).norm(dim=1).numpy()              # [units*d]
        e = np.maximum(n - (n.mean() + z * n.std()), 0.0).reshape(-1, D_HEAD)   # [units, d]
        excess[p] = e[HEAD if p in "qo" else 1].sum()
    return excess["q"] + excess["o"], excess["k"] + excess["v"]


@pytest.mark.parametrize("z", [0.5, 1.0])
def test_worked_numbers_are_analysis_values(tiny_dir, z):
    at = _open(tiny_dir, z)
    shown, expected = _shown(at), _from_analysis(tiny_dir, z)
    np.testing.assert_array_equal(shown, expected)                      # analysis' own floats, bit for bit
    np.testing.assert_allclose(shown[:2], _from_weights(tiny_dir, z), rtol=1e-5)   # float32 norms vs float64
    own, e_kv, mp, mpg = shown
    assert mp == pytest.approx(own + e_kv, rel=1e-12) and mpg == pytest.approx(own + e_kv / 2, rel=1e-12)
    assert expected[0] > 0 and expected[1] > 0, "pick a z where the worked head has excess on both sides"


def test_numbers_follow_the_z_slider(tiny_dir):
    at = _open(tiny_dir, 0.5)
    before = _shown(at)
    at.slider(key="hs.w.walkthrough.z").set_value(1.0).run()
    no_exception(at)
    after = _shown(at)
    assert at.query_params["z"] == ["1"] or at.query_params["z"] == "1"
    np.testing.assert_array_equal(after, _from_analysis(tiny_dir, 1.0))
    assert np.all(after != before), (before, after)
    fig = figure_titled(at, "among their populations at z = 1")
    taus = [t for t in fig["data"] if t["name"].startswith("tau")]
    assert len(taus) == 4 and all(len(t["y"]) == 2 for t in taus)        # one panel (and tau) per projection


def test_slice_picture_uses_the_real_shapes(tiny_dir):
    at = _open(tiny_dir, 2.0)
    fig = figure_titled(at, "Query head 3")
    slices = fig["data"][0]["text"]
    assert slices == ["W_Q rows 24..31 (head 3)", "W_K rows 8..15 (KV group 1)", "W_V rows 8..15 (KV group 1)",
                      "W_O columns 24..31 (head 3)"]
    matrices = [s for s in fig["layout"]["shapes"] if s.get("fillcolor") == "#eef2f7"]   # the four outlines
    sizes = [(s["y1"] - s["y0"], s["x1"] - s["x0"]) for s in matrices]
    assert sizes == [(H * D_HEAD, HIDDEN), (HKV * D_HEAD, HIDDEN), (HKV * D_HEAD, HIDDEN), (HIDDEN, H * D_HEAD)]


@pytest.fixture(scope="module")
def tiny_g3_dir(tmp_path_factory):
    """A tiny Llama like SmolLM2's layout: 9 query heads in 3 KV groups (G = 3), d = 4."""
    from tests._apptools import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-g3"), num_attention_heads=9, num_key_value_heads=3,
                          hidden_size=36)


def _layer0_after_surgery(model_dir, kept: list[int], group_size: int, head_dim: int) -> tuple[int, int, int]:
    """(query heads, KV heads, attention params) of layer 0 after surgery keeps kept[g] heads of group g."""
    from analysis.compress import surgery
    from analysis.arch.models import load_model
    lm = load_model(str(model_dir))
    pruned = np.zeros((lm.geometry.n_layers, lm.geometry.n_heads), dtype=bool)   # [L, H]
    pruned[0] = True
    for g, count in enumerate(kept):
        pruned[0, g * group_size: g * group_size + count] = False
    smaller, _ = surgery.prune_heads(lm.model, pruned)
    attn = smaller.model.layers[0].self_attn
    params = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                 for m in (attn.q_proj, attn.k_proj, attn.v_proj)) + attn.o_proj.weight.numel()   # O's bias kept
    return attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim, params


@pytest.mark.parametrize("which,group_size,head_dim,patterns", [
    ("tiny_dir", 2, D_HEAD, ["2 + 2", "2 + 1"]),
    ("tiny_g3_dir", 3, 4, ["3 + 3 + 3", "2 + 1 + 0", "3 + 0 + 0", "3 + 3 + 1"]),
])
def test_uneven_count_is_what_surgery_builds(request, which, group_size, head_dim, patterns):
    """Every row of the worked count (heads, KV heads, parameters) equals a real surgery of that layer."""
    model_dir = request.getfixturevalue(which)
    at = new_app(model_dir, page="walkthrough")
    no_exception(at)
    table = at.table[0].value
    assert list(table.index) == patterns
    dense_params = _layer0_after_surgery(model_dir, [group_size] * (len(patterns[0].split(" + "))), group_size,
                                         head_dim)[2]
    for pattern in patterns:
        row = table.loc[pattern]
        kept = [int(k) for k in pattern.split(" + ")]
        built = _layer0_after_surgery(model_dir, kept, group_size, head_dim)
        assert (int(row["query heads"]), int(row["KV heads after surgery"]), int(row["attention params"])) == built
        assert row["vs dense"] == f"{built[2] - dense_params:+,}"
        uneven = len({k for k in kept if k}) > 1
        assert row["K/V copied per query head"] == ("yes" if uneven else "no")
    if which == "tiny_g3_dir":   # 3 + 3 + 1: 7 query heads, 7 KV copies > the dense layer's 9 + 3
        assert "bigger than the dense layer" in texts(at)
        assert table.loc["3 + 3 + 1", "KV heads after surgery"] == 7


def test_step_links_keep_the_view(tiny_dir):
    at = new_app(tiny_dir, page="walkthrough", z=1.25, sparsity=0.5, scorer="magnitude")
    no_exception(at)
    links = at.get("page_link")
    assert [link.proto.page for link in links] == ["profiles", "prune", "prune", "compare", "heads", "export"]
    for link in links:
        query = {k: v[0] for k, v in parse_qs(link.proto.query_string).items()}
        assert (query["z"], query["sparsity"], query["scorer"], query["page"]) == (
            "1.25", "0.5", "magnitude", link.proto.page)
        assert query["model"] == str(tiny_dir)
    assert "the mask prunes **8 of 16** heads" in texts(at)


def test_minilm_mha_says_mpg_equals_mp():
    at = new_app("minilm-l6", page="walkthrough", z=1.0)
    no_exception(at)
    assert not at.error, [e.value for e in at.error]
    page = texts(at)
    assert "MP-G equals MP exactly" in page and "multi-head (G = 1)" in page
    assert metric(at, "MP score") == metric(at, "MP-G score")
    assert not at.table                                                  # no uneven-mask count on MHA
