"""The app's numbers for a mask are what surgery builds: the default scorer follows the model
(MP-G on GQA, MP on MHA) on a fresh session; the Prune page shows growth as growth, with the
warning that names its cause and the policy that avoids it; the balanced policy never expands;
the KV policy is offered on the Prune and Export pages and changes the counts as surgery would."""
import numpy as np
import pytest

from tests._apptools import (fresh_caches, metric, new_app, no_exception, smollm2_app,  # noqa: F401
                             texts, tiny_dir, tiny_model_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")


@pytest.fixture(scope="module")
def mha_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-mha"), num_key_value_heads=4)


@pytest.fixture(scope="module")
def g3_dir(tmp_path_factory):
    """4 layers x 6 heads, 2 KV heads (G = 3): uniform masks leave uneven groups."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-g3"), hidden_size=48, num_attention_heads=6,
                          num_key_value_heads=2)


def test_fresh_session_default_scorer_is_mpg_on_smollm2(smollm2_app):
    at = new_app(page="prune")                           # no ?scorer=: a fresh session, default model
    no_exception(at)
    assert at.selectbox(key="hs.w.prune.scorer").value == "mp-g" and at.query_params["scorer"] == "mp-g"


def test_default_scorer_follows_the_model_until_the_user_picks(tiny_dir, mha_dir):
    at = new_app(mha_dir, page="prune")
    no_exception(at)
    assert at.selectbox(key="hs.w.prune.scorer").value == "mp"            # MHA: MP (equal to MP-G there)
    at = new_app(tiny_dir, page="prune")
    assert at.selectbox(key="hs.w.prune.scorer").value == "mp-g"          # GQA: MP-G
    at.selectbox(key="hs.w.prune.scorer").set_value("magnitude").run()
    at.query_params["model"] = str(mha_dir)
    at.run()
    assert at.selectbox(key="hs.w.prune.scorer").value == "magnitude"     # a choice is kept
    at = new_app(tiny_dir, page="prune", scorer="mp")
    assert at.selectbox(key="hs.w.prune.scorer").value == "mp"            # so is the link's


def _counts_of_surgery(model_dir, pruned, kv_policy):
    from analysis.arch.models import count_parameters, load_model
    from analysis.compress.surgery import prune_heads
    lm = load_model(str(model_dir))
    smaller, layout = prune_heads(lm.model, pruned, kv_policy=kv_policy)
    return count_parameters(smaller) - count_parameters(lm.model), sum(len(kv) for kv in layout.kv_heads)


def test_prune_page_shows_growth_as_growth(g3_dir):
    from tests.test_app_prune import _mask_and_scores
    at = new_app(g3_dir, page="prune", scorer="mp", sparsity="0.17")   # uniform: 1 of 6 per layer
    at.selectbox(key="hs.w.prune.policy").set_value("uniform").run()
    no_exception(at)
    pruned, _, _ = _mask_and_scores(at)
    change, kv_after = _counts_of_surgery(g3_dir, pruned, "auto")
    assert metric(at, "Attention params change") == f"{change:+,}"
    assert metric(at, "KV heads after / before") == f"{kv_after} / 8"
    if change > 0:
        assert any("GROWS" in w.value and "'balanced'" in w.value for w in at.warning)
    assert any("K/V are expanded" in w.value for w in at.warning)
    # the balanced policy at the same sparsity never expands, and says it rounded
    at.selectbox(key="hs.w.prune.policy").set_value("balanced").run()
    no_exception(at)
    pruned, _, _ = _mask_and_scores(at)
    change, kv_after = _counts_of_surgery(g3_dir, pruned, "auto")
    assert change < 0 and metric(at, "Attention params change") == f"{change:+,}"
    assert not any("K/V are expanded" in w.value for w in at.warning)
    per_group = pruned.reshape(4, 2, 3).sum(-1)
    assert (per_group == per_group[:, :1]).all()
    # kv_policy expand on the uniform mask: counted as surgery with expand builds it
    at.selectbox(key="hs.w.prune.policy").set_value("uniform").run()
    at.selectbox(key="hs.w.prune.kv_policy").set_value("expand").run()
    pruned, _, _ = _mask_and_scores(at)
    change, kv_after = _counts_of_surgery(g3_dir, pruned, "expand")
    assert metric(at, "KV heads after / before") == f"{kv_after} / 8" and kv_after == 20
    assert "Stock config" in texts(at)


def test_export_page_offers_the_kv_policy_and_its_counts(g3_dir):
    at = new_app(g3_dir, page="prune", scorer="mp", sparsity="0.34")
    at.selectbox(key="hs.w.prune.policy").set_value("balanced-uniform").run()
    at.switch_page("pages/export.py").run()
    no_exception(at)
    assert "KV policy (surgery)" not in [s.label for s in at.selectbox]    # zeroed: no surgery, no KV policy
    at.selectbox(key="hs.w.export.format").set_value("stock").run()
    assert at.selectbox(key="hs.w.export.kv_policy").value == "auto"
    assert "A stock config describes this mask (4 query / 2 KV heads" in texts(at)
    assert metric(at, "KV heads after / before") == "8 / 8"
    at.selectbox(key="hs.w.export.kv_policy").set_value("strict").run()
    no_exception(at)
    assert np.isfinite(float(metric(at, "Attention params change").replace(",", "")))


def test_profiles_and_prune_pages_say_which_std_is_used(tiny_dir):
    at = new_app(tiny_dir, page="profiles")
    no_exception(at)
    assert "with the population (ddof = 0) std" in texts(at)
    at.radio(key="hs.w.profiles.std").set_value("sample").run()
    no_exception(at)
    assert "with the sample (ddof = 1, torch.std) std" in texts(at) and "sample std (divide by n − 1" in texts(at)
    at = new_app(tiny_dir, page="prune", scorer="mp-g")
    assert "with the population (ddof = 0) std" in texts(at)
    before = int(metric(at, "Heads with score 0 at z = 2"))
    at.radio(key="hs.w.prune.std").set_value("sample").run()
    no_exception(at)
    assert "with the sample (ddof = 1, torch.std) std" in texts(at)
    assert int(metric(at, "Heads with score 0 at z = 2")) >= before     # a larger std: no fewer in the bulk


def test_strict_kv_policy_refusal_is_a_message_not_a_broken_page(g3_dir):
    from tests.test_app_prune import _mask_and_scores
    at = new_app(g3_dir, page="prune", scorer="mp", sparsity="0.17")
    at.selectbox(key="hs.w.prune.policy").set_value("uniform").run()
    at.selectbox(key="hs.w.prune.kv_policy").set_value("strict").run()
    no_exception(at)
    assert any("'strict' KV policy refuses" in e.value and "'balanced'" in e.value for e in at.error)
    pruned, _, _ = _mask_and_scores(at)                 # the mask itself is still shown
    assert pruned.sum() == 4
