"""Widgets shared by several pages: scorer choice and parameters, mask policy, evaluation text.

The scorer list, labels and parameters come from the registry in analysis.score.scoring
(`SCORERS`, `Scorer.label`, `scorer_parameters`), so a new scorer shows up without changing
the pages; this module only knows how to draw a widget for a parameter name (a parameter
without one keeps its default). z is the shared view slider and is passed in, not drawn.
"""
from __future__ import annotations

import streamlit as st

from analysis.score import masks

from analysis.score import scoring

from analysis.core import text

from . import state

HIDDEN_SCORERS: tuple[str, ...] = ()   # registered scorers not offered in the UI
SPARSITY_STEP = 0.01

# parameter name -> widget factory (key, default, where) -> value; options and bounds are the URL's
# (components/state.py SCORER_PARAMS), so a link and a widget accept the same values
def _opts(name: str) -> list:
    return list(state.SCORER_PARAMS[name].parse.options)


def _number(name: str, label: str, **kwargs):
    bounds = state.SCORER_PARAMS[name].parse
    return lambda key, default, where: where.number_input(label, bounds.lo, bounds.hi, key=key, **kwargs)


_PARAM_WIDGETS = {
    "scope": lambda key, default, where: where.radio(
        "Population", _opts("scope"), horizontal=True, key=key,
        help="Threshold per projection of each layer, or per projection across all layers."),
    "ord": lambda key, default, where: where.radio("Norm", _opts("ord"), format_func=lambda o: f"L{o}",
                                                   horizontal=True, key=key),
    "std": lambda key, default, where: std_choice(key, where),
    "normalize": lambda key, default, where: where.radio(
        "Per-layer normalization", _opts("normalize"), horizontal=True, key=key,
        format_func={"none": "none (as defined)", "layer": "divide by the layer's mean"}.get,
        help="Activation-based scores carry each layer's activation scale into the global ranking; 'layer' "
             "divides every layer's scores by that layer's mean score (each layer's mean becomes 1)."),
    "a_q": _number("a_q", "a_q (own Q/O weight)", step=0.1),
    "a_kv": _number("a_kv", "a_kv (shared K/V weight)", step=0.1),
    "seed": _number("seed", "Seed", step=1),
    "n_sequences": _number("n_sequences", "Calibration sequences", step=1),
    "seq_len": _number("seq_len", "Tokens per sequence", step=8),
    "damping": _number("damping", "Damping", format="%.4f"),
    "n_steps": _number("n_steps", "Integration steps", step=1),
}


STD_LABELS = {"population": "population (ddof = 0)", "sample": "sample (ddof = 1, torch.std)"}


def std_choice(key: str, where=st) -> str:
    """The std convention radio of tau = mean + z * std."""
    return where.radio("Std in the threshold", _opts("std"), format_func=STD_LABELS.get,
                       horizontal=True, key=key,
                       help="population: divide by n (headscope's default); sample: by n - 1 (PyTorch's "
                            "Tensor.std). At the boundary they move a few heads in or out of the bulk.")


def scorer_names() -> list[str]:
    return [n for n in scoring.SCORERS if n not in HIDDEN_SCORERS]


def label(name: str) -> str:
    """The registered scorer's label (analysis.score.scoring), or the name itself for an unknown one."""
    cls = scoring.SCORERS.get(name)
    return cls.label if cls is not None else name


def scorer_color(name: str) -> str:
    """The scorer's own colour in every chart (its place in the registry picks it)."""
    from components.charts import PALETTE
    names = list(scoring.SCORERS)
    return PALETTE[names.index(name) % len(PALETTE)] if name in names else PALETTE[-1]


def scorer_choice(where=st, *, key: str = "scorer", group_size: int = 1) -> str:
    """The shared scorer selectbox (view field `scorer`); an unknown one falls back to the model's default."""
    names = scorer_names()
    if state.get("scorer") not in names:
        fallback = scoring.default_scorer(group_size)
        st.warning(f"Unknown scorer {state.get('scorer')!r}; choose one of {', '.join(names)}. "
                   f"Showing {label(fallback)}, this model's default.")
        state.set("scorer", fallback)
        state.reset_widget(key)
    choice = where.selectbox("Scorer", names, format_func=label, key=state.widget_key(key),
                             help="Default: MP-G on GQA models (shared K/V counted once per group), MP on MHA "
                                  "models, where the two are equal.")
    state.choose("scorer", choice)
    return choice


def constructor_defaults(scorer: str) -> dict:
    """{parameter: default} of the scorer's constructor."""
    return scoring.scorer_parameters(scorer) if scorer in scoring.SCORERS else {}


def default_params(scorer: str, z: float) -> dict:
    """The parameters `scorer_params` would return with every widget at its default."""
    return {name: (float(z) if name == "z" else default) for name, default in constructor_defaults(scorer).items()
            if name == "z" or name in _PARAM_WIDGETS}


def current_params(scorer: str, z: float) -> dict:
    """The parameters of the current view (`default_params` with the values the user or the link set)."""
    return {name: (default if state.get(name) is None or name == "z" else state.get(name))
            for name, default in default_params(scorer, z).items()}


def scorer_params(scorer: str, z: float, *, where=st) -> dict:
    """Widgets for the scorer's parameters (except z and batch size); returns the full params dict.

    Each value is a view field (in the URL while it differs from the scorer's default)."""
    params = {}
    for name, default in constructor_defaults(scorer).items():
        if name == "z":
            params["z"] = float(z)
        elif name in _PARAM_WIDGETS:
            value = _PARAM_WIDGETS[name](state.widget_key(name, value=default), default, where)
            state.set(name, None if value == default else value)
            params[name] = value
    return params


def format_options(where, fmt: str, options: dict, *, prefix: str = "export.opt") -> dict:
    """Widgets for an export format's own options (analysis.compress.export.FormatOption): a choice box
    where the option lists its values, else a widget of the default's type; returns name -> value."""
    out = {}
    for name, opt in options.items():
        key = state.widget_key(f"{prefix}.{fmt}.{name}", value=opt.default)
        label = name.replace("_", " ")
        if opt.choices is not None:
            out[name] = where.selectbox(label, list(opt.choices), key=key, help=opt.help or None)
        elif isinstance(opt.default, bool):
            out[name] = where.checkbox(label, key=key, help=opt.help or None)
        elif isinstance(opt.default, int):
            low, high = opt.bounds or (None, None)          # the library refuses the rest in one line too
            out[name] = int(where.number_input(label, min_value=low, max_value=high, step=1, key=key,
                                               help=opt.help or None))
        else:
            out[name] = where.text_input(label, key=key, help=opt.help or None)
    return out


# Short labels that fit the select box at 1280x800 (they were cut at "(never grow"); the whole
# explanation of each is POLICY_HELP, the box's tooltip. The prefixes ("global:", "balanced (GQA)")
# are what a user (and the browser tests) recognise.
POLICY_LABELS = {
    "global": "global: lowest anywhere (paper)",
    "min-per-layer": "min-per-layer: global, m kept",
    "uniform": "uniform: same count per layer",
    "balanced": "balanced (GQA): same per group",
    "balanced-uniform": "balanced-uniform (GQA)",
    "groups": "groups (GQA): whole KV groups",
}
POLICY_HELP = {
    "global": "the lowest-scored heads anywhere in the model: the paper's setting. On GQA models it leaves KV "
              "groups unevenly pruned, which surgery can only build by copying K/V (a bigger model).",
    "min-per-layer": "global, but every layer keeps at least m heads.",
    "uniform": "the same number of heads pruned in every layer.",
    "balanced": "(GQA) the same number pruned from every KV group, so K/V never expand.",
    "balanced-uniform": "(GQA) balanced, with one count in every layer: the pruned model is a stock config.",
    "groups": "(GQA) whole KV groups (a KV head with all its query heads): never makes the model bigger. "
              "The default on GQA models.",
}


def policy_controls(where=st) -> dict:
    """The mask policy widgets (view fields `policy`, `m`) -> kwargs for analysis.score.masks.plan_mask."""
    policy = where.selectbox("Policy", list(masks.POLICIES), key=state.widget_key("policy"),
                             format_func=lambda p: POLICY_LABELS.get(p, p),
                             help="Which heads a sparsity removes:\n\n" + "\n".join(
                                 f"- **{p}**: {POLICY_HELP.get(p, '')}" for p in masks.POLICIES))
    state.choose("policy", policy)
    return _with_m(policy, where)


def _with_m(policy: str, where=None) -> dict:
    out = dict(policy=policy)
    if policy == "min-per-layer":
        m = state.get("m")
        if where is not None:
            m = int(where.number_input("Keep at least m heads per layer", 0, 1024, step=1,
                                       key=state.widget_key("m", value=1)))
            state.set("m", None if m == 1 else m)
        out["min_per_layer"] = 1 if m is None else int(m)
    return out


def current_policy() -> dict:
    """The current view's policy kwargs for plan_mask (what `policy_controls` would return)."""
    return _with_m(state.get("policy"))


def text_and_tokens(*, prefix: str, tokens_key: str, default: int, most: int) -> tuple[str | None, int]:
    """`text_source` beside a "Tokens to use" box (16..most, step 64) -> (text, tokens)."""
    c1, c2 = st.columns([3, 1])
    with c1:
        chosen = text_source(prefix=prefix)
    tokens = int(c2.number_input("Tokens to use", 16, most, step=64,
                                 key=state.widget_key(tokens_key, value=default)))
    return chosen, tokens


def text_source(*, prefix: str) -> str | None:
    """Built-in held-out Wikipedia text (None, attribution shown) or the user's own text (cleaned).

    Raises InputError (shown by the caller) for empty own text."""
    choice = st.radio("Text", ["built-in", "own"], horizontal=True,
                      format_func={"built-in": "Built-in Wikipedia (held-out split)", "own": "My own text"}.get,
                      key=state.widget_key(f"{prefix}.text_source", value="built-in"))
    if choice == "built-in":
        st.caption(text.WIKI_ATTRIBUTION)
        return None
    c1, c2 = st.columns([3, 2])
    raw = c1.text_area("Your text", height=120, key=state.widget_key(f"{prefix}.text", value=""),
                       placeholder="Paste a few paragraphs of plain text, or upload a .txt file.")
    upload = c2.file_uploader("Or upload a .txt file (UTF-8)", type=["txt"], key=state.unseeded_widget_key(f"{prefix}.upload"),
                              help="An uploaded file is used instead of the pasted text.")
    return text.clean_user_text(upload.getvalue() if upload is not None else raw)
