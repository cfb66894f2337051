"""Widgets shared by several pages: scorer choice and parameters, mask policy, evaluation text.

The scorer list, labels and parameters come from the registry in analysis.score.scoring
(`SCORERS`, `Scorer.label`, `scorer_parameters`), so a new scorer shows up without changing
the pages; this module only knows how to draw a widget for a parameter name (a parameter
without one keeps its default). z is the shared view slider and is passed in, not drawn.
"""
from __future__ import annotations

import streamlit as st

from analysis.score import masks

from analysis.measure import profiles

from analysis.score import scoring

from analysis.core import text

from . import state

HIDDEN_SCORERS: tuple[str, ...] = ()   # registered scorers not offered in the UI
SPARSITY_STEP = 0.01

# parameter name -> widget factory (label, default) -> value
_PARAM_WIDGETS = {
    "scope": lambda key, default, where: where.radio(
        "Population", ["layer", "model"], horizontal=True, key=key,
        help="Threshold per projection of each layer, or per projection across all layers."),
    "ord": lambda key, default, where: where.radio("Norm", [2, 1], format_func=lambda o: f"L{o}",
                                                   horizontal=True, key=key),
    "std": lambda key, default, where: std_choice(key, where),
    "normalize": lambda key, default, where: where.radio(
        "Per-layer normalization", ["none", "layer"], horizontal=True, key=key,
        format_func={"none": "none (as defined)", "layer": "divide by the layer's mean"}.get,
        help="Activation-based scores carry each layer's activation scale into the global ranking; 'layer' "
             "divides every layer's scores by that layer's mean score (each layer's mean becomes 1)."),
    "a_q": lambda key, default, where: where.number_input("a_q (own Q/O weight)", 0.0, 10.0, step=0.1, key=key),
    "a_kv": lambda key, default, where: where.number_input("a_kv (shared K/V weight)", 0.0, 10.0, step=0.1,
                                                           key=key),
    "seed": lambda key, default, where: where.number_input("Seed", 0, 2**31 - 1, step=1, key=key),
    "n_sequences": lambda key, default, where: where.number_input("Calibration sequences", 1, 64, step=1, key=key),
    "seq_len": lambda key, default, where: where.number_input("Tokens per sequence", 8, 1024, step=8, key=key),
    "damping": lambda key, default, where: where.number_input("Damping", 1e-6, 1.0, format="%.4f", key=key),
    "n_steps": lambda key, default, where: where.number_input("Integration steps", 1, 64, step=1, key=key),
}


STD_LABELS = {"population": "population (ddof = 0)", "sample": "sample (ddof = 1, torch.std)"}


def std_choice(key: str, where=st) -> str:
    """The std convention radio of tau = mean + z * std."""
    return where.radio("Std in the threshold", list(profiles.STD_DDOF), format_func=STD_LABELS.get,
                       horizontal=True, key=key,
                       help="population: divide by n (headscope's default); sample: by n - 1 (PyTorch's "
                            "Tensor.std). At the boundary they move a few heads in or out of the bulk.")


def scorer_names() -> list[str]:
    return [n for n in scoring.SCORERS if n not in HIDDEN_SCORERS]


def label(name: str) -> str:
    """The registered scorer's label (analysis.score.scoring), or the name itself for an unknown one."""
    cls = scoring.SCORERS.get(name)
    return cls.label if cls is not None else name


def scorer_choice(where=st, *, key: str = "scorer") -> str:
    """The shared scorer selectbox (view field `scorer`)."""
    names = scorer_names()
    if state.get("scorer") not in names:
        st.warning(f"Unknown scorer {state.get('scorer')!r} (from the link?); choose one of "
                   f"{', '.join(names)}. Showing {names[0]}.")
        state.set("scorer", names[0])
        state.reset_widget(key)
    choice = where.selectbox("Scorer", names, format_func=label, key=state.widget_key(key),
                             help="Default: MP-G on GQA models (shared K/V counted once per group), MP on MHA "
                                  "models, where the two are equal.")
    state.choose_scorer(choice)
    return choice


def constructor_defaults(scorer: str) -> dict:
    """{parameter: default} of the scorer's constructor."""
    return scoring.scorer_parameters(scorer) if scorer in scoring.SCORERS else {}


def default_params(scorer: str, z: float) -> dict:
    """The parameters `scorer_params` would return with every widget at its default."""
    return {name: (float(z) if name == "z" else default) for name, default in constructor_defaults(scorer).items()
            if name == "z" or name in _PARAM_WIDGETS}


def scorer_params(scorer: str, z: float, *, where=st, prefix: str = "param") -> dict:
    """Widgets for the scorer's parameters (except z and batch size); returns the full params dict."""
    params = {}
    for name, default in constructor_defaults(scorer).items():
        if name == "z":
            params["z"] = float(z)
        elif name in _PARAM_WIDGETS:
            key = state.widget_key(f"{prefix}.{name}", value=default)
            params[name] = _PARAM_WIDGETS[name](key, default, where)
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
            out[name] = int(where.number_input(label, step=1, key=key, help=opt.help or None))
        else:
            out[name] = where.text_input(label, key=key, help=opt.help or None)
    return out


def policy_controls(where=st, *, prefix: str = "policy") -> dict:
    """Mask policy widgets -> kwargs for analysis.score.masks.plan_mask (policy, min_per_layer)."""
    policies = list(masks.POLICIES)
    policy = where.selectbox("Policy", policies, key=state.widget_key(f"{prefix}.policy", value=policies[0]),
                             help="global: the k lowest heads anywhere; min-per-layer: the same, but keep at "
                                  "least m heads in every layer; uniform: the same number in every layer; "
                                  "balanced (GQA): the same number from every KV group of a layer, so K/V never "
                                  "expand; balanced-uniform: that, with one count in every layer (a stock "
                                  "config); groups (GQA): whole KV groups.")
    out = dict(policy=policy)
    if policy == "min-per-layer":
        out["min_per_layer"] = int(where.number_input("Keep at least m heads per layer", 0, 1024, step=1,
                                                      key=state.widget_key(f"{prefix}.min", value=1)))
    return out


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
