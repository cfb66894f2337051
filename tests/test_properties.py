"""Property-based tests (hypothesis) of the parsers that read what a user or a file hands in:
mask.json (`analysis.compress.export.read_mask_json`), head_layout.json (`HeadLayout.from_dict` /
`from_json`) and the app's URL parameters (`components.state.FIELDS`).

The contract for every parser: any input either parses into a value that meets every invariant
the rest of the code relies on, or raises the project's InputError (ValueError for a URL
field) - never another exception. Valid files written by the exporter always read back exactly."""
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.core.errors import InputError
from analysis.compress.export import MaskRecord, mask_from_json, mask_record, read_mask_json
from analysis.arch.geometry import HeadGeometry
from analysis.compress.surgery import HeadLayout

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any JSON value, a little nested: what a tampered or random file may hold.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**15, 10**15) | st.floats(allow_nan=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@st.composite
def geometries(draw):
    n_kv = draw(st.integers(1, 4))
    group = draw(st.integers(1, 3))
    return HeadGeometry(n_layers=draw(st.integers(1, 4)), n_heads=n_kv * group, n_kv_heads=n_kv,
                        head_dim=draw(st.sampled_from([2, 4, 8])), hidden=32)


@st.composite
def masks(draw):
    g = draw(geometries())
    bits = draw(st.lists(st.booleans(), min_size=g.n_layers * g.n_heads, max_size=g.n_layers * g.n_heads))
    return g, np.array(bits, dtype=bool).reshape(g.n_layers, g.n_heads)


def _valid_mask_dict(g: HeadGeometry, pruned: np.ndarray) -> dict:
    scores = np.arange(pruned.size, dtype=float).reshape(pruned.shape)   # [L, H]
    return json.loads(mask_record(pruned, geometry=g, model="m", model_type="llama", scores=scores).to_json())


def _assert_mask_invariants(record: MaskRecord) -> None:
    pruned = record.pruned()
    assert pruned.shape == (record.n_layers, record.n_heads) and pruned.dtype == bool
    assert 1 <= record.n_kv_heads <= record.n_heads and record.n_heads % record.n_kv_heads == 0
    for row in record.kept:
        assert all(type(h) is int and 0 <= h < record.n_heads for h in row) and len(set(row)) == len(row)


# -- mask.json -----------------------------------------------------------------------------------

@SETTINGS
@given(masks())
def test_mask_json_round_trips(case):
    g, pruned = case
    text = json.dumps(_valid_mask_dict(g, pruned))
    assert np.array_equal(mask_from_json(text), pruned)
    assert np.array_equal(mask_from_json(text, geometry=g), pruned)


@SETTINGS
@given(JSON)
def test_mask_json_any_value_is_a_record_or_an_input_error(value):
    try:
        record = read_mask_json(value) if isinstance(value, dict) else read_mask_json(json.dumps(value))
    except InputError:
        return
    _assert_mask_invariants(record)


MASK_FIELDS = ("n_layers", "n_heads", "n_kv_heads", "kept", "scores", "tiebreak", "format", "z", "sparsity",
               "model", "scorer", "policy")


@SETTINGS
@given(masks(), st.sampled_from(MASK_FIELDS), JSON)
def test_mask_json_one_tampered_field(case, field, value):
    g, pruned = case
    data = _valid_mask_dict(g, pruned)
    data[field] = value
    try:
        record = read_mask_json(data)
    except InputError as err:
        assert "mask.json" in str(err) or "mask file" in str(err)
        return
    _assert_mask_invariants(record)
    if field not in ("n_layers", "n_heads", "n_kv_heads", "kept"):
        assert np.array_equal(record.pruned(), pruned)     # other fields never change the mask


@SETTINGS
@given(masks(), st.sampled_from(["n_layers", "n_heads", "kept"]),
       st.sampled_from(["12", 1.7, True, 2.0, -1, 10**13, None, [], {}]))
def test_mask_json_never_coerces(case, field, bad):
    g, pruned = case
    data = _valid_mask_dict(g, pruned)
    data[field] = [[bad]] if field == "kept" else bad
    with pytest.raises(InputError):
        read_mask_json(data)


@SETTINGS
@given(masks(), geometries())
def test_mask_json_checks_the_model_geometry(case, other):
    g, pruned = case
    text = json.dumps(_valid_mask_dict(g, pruned))
    same = (g.n_layers, g.n_heads, g.n_kv_heads) == (other.n_layers, other.n_heads, other.n_kv_heads)
    if same:
        assert np.array_equal(mask_from_json(text, geometry=other), pruned)
    else:
        with pytest.raises(InputError, match="use the mask exported for this model"):
            mask_from_json(text, geometry=other)


# -- head_layout.json ----------------------------------------------------------------------------

@SETTINGS
@given(masks(), st.sampled_from(["auto", "expand"]))
def test_head_layout_round_trips(case, kv_policy):
    g, pruned = case
    layout = HeadLayout.from_mask(pruned, g, "llama", kv_policy=kv_policy)
    again = HeadLayout.from_json(layout.to_json())
    assert again == layout and np.array_equal(again.pruned_mask(), pruned)


def _assert_layout_invariants(layout: HeadLayout) -> None:
    assert layout.n_kv_heads >= 1 and layout.n_heads % layout.n_kv_heads == 0 and layout.n_layers >= 1
    for layer in range(layout.n_layers):
        heads, kv = layout.heads[layer], layout.kv_heads[layer]
        assert heads == sorted(set(heads)) and all(0 <= h < layout.n_heads for h in heads)
        assert all(0 <= k < layout.n_kv_heads for k in kv)
        assert (not heads and not kv) or (kv and len(heads) % len(kv) == 0)
        assert layout.layer_counts(layer) == (len(heads), len(kv))
    layout.kv_cache_report()                                   # derived values never fail on a valid layout


LAYOUT_FIELDS = ("model_type", "n_heads", "n_kv_heads", "head_dim", "heads", "kv_heads", "kv_policy", "format")


@SETTINGS
@given(masks(), st.sampled_from(LAYOUT_FIELDS), JSON)
def test_head_layout_one_tampered_field(case, field, value):
    g, pruned = case
    data = json.loads(HeadLayout.from_mask(pruned, g, "llama").to_json())
    data[field] = value
    try:
        layout = HeadLayout.from_dict(data)
    except InputError as err:
        assert "head_layout.json" in str(err)
        return
    _assert_layout_invariants(layout)


@SETTINGS
@given(JSON)
def test_head_layout_any_value_is_a_layout_or_an_input_error(value):
    try:
        layout = HeadLayout.from_json(json.dumps(value))
    except InputError:
        return
    _assert_layout_invariants(layout)


@SETTINGS
@given(st.lists(st.lists(st.integers(-3, 12), max_size=6), min_size=1, max_size=4),
       st.lists(st.lists(st.integers(-3, 6), max_size=6), min_size=1, max_size=4),
       st.integers(1, 12), st.integers(1, 6))
def test_head_layout_random_head_lists(heads, kv_heads, n_heads, n_kv_heads):
    data = dict(model_type="llama", n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=4, heads=heads,
                kv_heads=kv_heads)
    try:
        layout = HeadLayout.from_dict(data)
    except InputError:
        return
    _assert_layout_invariants(layout)


# -- URL parameters ------------------------------------------------------------------------------

state = pytest.importorskip("components.state")


@SETTINGS
@given(st.sampled_from(sorted(state.FIELDS)), st.text(max_size=40) | st.from_regex(r"-?\d{0,3}(\.\d{0,4})?([eE]-?\d)?"))
def test_url_fields_parse_or_say_why(name, raw):
    field = state.FIELDS[name]
    try:
        value = field.parse(raw)
    except ValueError as why:
        assert str(why).startswith("it ")                      # completes "ignored because ..."
        return
    if isinstance(field.default, float):
        lo_hi = {"z": (0.0, float(state.Z_MAX)), "sparsity": (0.0, state.SPARSITY_MAX)}[name]
        assert isinstance(value, float) and math.isfinite(value) and lo_hi[0] <= value <= lo_hi[1]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):   # a scorer parameter (a_kv, ord, ...)
        assert math.isfinite(value)
    else:
        assert value == value.strip() and value and value.isprintable() and len(value) <= state.TEXT_MAX
    again = field.parse(field.fmt(value))                      # what the URL then shows parses again,
    assert field.parse(field.fmt(again)) == again              # and is stable from there on


@SETTINGS
@given(st.sampled_from(["z", "sparsity"]), st.sampled_from(["nan", "inf", "-inf", "1e999", "-0.5", "", " ", "0x1"]))
def test_url_numbers_refuse_non_finite_and_out_of_range(name, raw):
    with pytest.raises(ValueError):
        state.FIELDS[name].parse(raw)


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_kv_plan_link_text_round_trips(n_layers, n_kv_heads, data):
    """The Long context page's plan in a link (`kv`): modes -> text -> the same modes; all full -> no text."""
    modes = np.array(data.draw(st.lists(st.lists(st.integers(0, 2), min_size=n_kv_heads, max_size=n_kv_heads),
                                        min_size=n_layers, max_size=n_layers)), np.int8)
    text = state.kv_text(modes)
    assert (text is None) == (not modes.any())
    if text is not None:
        assert state.FIELDS["kv"].parse(text) == text
    np.testing.assert_array_equal(state.kv_modes(text, modes.shape), modes)
    with pytest.raises(ValueError, match="^it "):
        state.kv_modes(text or "f", (n_layers + 1, n_kv_heads))
