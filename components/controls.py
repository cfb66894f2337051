"""Widgets shared by several pages: scorer choice and parameters, mask policy, evaluation text.

The scorer list, labels and parameters come from the registry in analysis.score.scoring
(`SCORERS`, `Scorer.label`, `scorer_declarations`), so a new scorer shows up without changing
the pages; a parameter's widget is drawn from its declaration (`param_widget`: a radio for
choices, a number box with its bounds for a number; one declared without a label keeps its
default). z is the shared view slider and is passed in, not drawn.
"""
from __future__ import annotations

import streamlit as st

from analysis.core import text
from analysis.core.params import Param
from analysis.score import masks, scoring

from . import state

HIDDEN_SCORERS: tuple[str, ...] = ()   # registered scorers not offered in the UI
SPARSITY_STEP = 0.01

def _bound(param: Param, value: float):
    """A bound of the number widget in the parameter's own type (None where it has none)."""
    return None if value in (float("inf"), float("-inf")) else param.type(value)


def param_widget(param: Param, key: str, where=st):
    """The widget of a declared parameter (analysis/core/params.py): a horizontal radio over its
    choices (named by `param.shown`), else a number box within its bounds. The URL parses the same
    declaration (components/state.py), so a link and a widget accept the same values."""
    if param.choices is not None:
        return where.radio(param.label, list(param.choices), format_func=param.shown, horizontal=True, key=key,
                           help=param.help or None)
    step = None if param.step is None else param.type(param.step)
    return where.number_input(param.label, _bound(param, param.lo), _bound(param, param.hi), step=step,
                              format=param.number_format, key=key, help=param.help or None)


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


def offered_params(scorer: str) -> dict[str, Param]:
    """The scorer's parameters the app offers (declared with a label; z is the shared view slider)."""
    if scorer not in scoring.SCORERS:
        return {}
    return {name: p for name, p in scoring.scorer_declarations(scorer).items() if p.offered}


def default_params(scorer: str, z: float) -> dict:
    """The parameters `scorer_params` would return with every widget at its default."""
    return {name: (float(z) if name == "z" else p.default) for name, p in offered_params(scorer).items()}


def current_params(scorer: str, z: float) -> dict:
    """The parameters of the current view (`default_params` with the values the user or the link set)."""
    return {name: (default if state.get(name) is None or name == "z" else state.get(name))
            for name, default in default_params(scorer, z).items()}


def scorer_params(scorer: str, z: float, *, where=st) -> dict:
    """Widgets for the scorer's parameters (except z and batch size); returns the full params dict.

    Each value is a view field (in the URL while it differs from the scorer's default)."""
    params = {}
    for name, param in offered_params(scorer).items():
        if name == "z":
            params["z"] = float(z)
        else:
            value = param_widget(param, state.widget_key(name, value=param.default), where)
            state.set(name, None if value == param.default else value)
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


def policy_controls(where=st) -> str:
    """The mask policy widgets (view fields `policy`, and `m` for a policy that takes it) -> the policy's
    name; labels and help come from the registry (analysis.score.masks.POLICIES). Short labels fit the
    box at 1280x800; the tooltip has each policy's whole line."""
    policy = where.selectbox("Policy", list(masks.POLICIES), key=state.widget_key("policy"),
                             format_func=lambda p: masks.POLICIES[p].label if p in masks.POLICIES else p,
                             help="Which heads a sparsity removes:\n\n" + "\n".join(
                                 f"- **{name}**: {p.help}" for name, p in masks.POLICIES.items()))
    state.choose("policy", policy)
    if masks.policy_of(policy).takes_m:
        m = int(where.number_input("Keep at least m heads per layer", 0, 1024, step=1,
                                   key=state.widget_key("m", value=1)))
        state.set("m", None if m == 1 else m)
    return policy


def current_policy() -> str:
    """The current view's policy (what `policy_controls` returns)."""
    return state.get("policy")


def min_per_layer() -> int:
    """The current view's m of "keep at least m heads per layer" (1 until set)."""
    m = state.get("m")
    return 1 if m is None else int(m)


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
