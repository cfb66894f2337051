"""The threshold options of a norm profile, declared once: the norm order, the population scope, the
std convention and z, with their defaults, bounds and checks (InputError in one line).

Light on purpose (no torch, no numpy): the scorers' declared parameters (analysis.score.scorer_registry)
and so the CLI's parser read them, and `analysis.measure.profiles` (which computes with them)
re-exports them.
"""
from __future__ import annotations

import math

from analysis.core.errors import InputError

ORDS = (1, 2)
SCOPES = ("layer", "model")
STD_DDOF = {"population": 0, "sample": 1}  # std convention -> ddof (numpy's `std(ddof=...)`)
DEFAULT_STD = "population"
DEFAULT_Z = 2.0
Z_MAX = 10.0  # beyond this every row of a real model is in the bulk; the mask is pure tie-break


def check_z(z: float) -> float:
    """Validate a threshold z; return it as a float. InputError for NaN, negative, huge."""
    try:
        value = float(z)
    except (TypeError, ValueError):
        raise InputError(f"z must be a number between 0 and {Z_MAX:g}; got {z!r}.") from None
    if math.isnan(value) or math.isinf(value):
        raise InputError(f"z must be a finite number between 0 and {Z_MAX:g}; got {value}.")
    if value < 0:
        raise InputError(
            f"z = {value:g} is negative: the threshold would fall inside the bulk and count "
            f"ordinary rows as outliers. Use a z between 0 and {Z_MAX:g} (the default is {DEFAULT_Z:g})."
        )
    if value > Z_MAX:
        raise InputError(
            f"z = {value:g} is too large: every row would be in the bulk and every head would score 0. "
            f"Use a z between 0 and {Z_MAX:g} (the paper uses 1.5 to 2.5)."
        )
    return value


def check_scope(scope: str) -> str:
    """Validate a population scope name."""
    if scope not in SCOPES:
        raise InputError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}.")
    return scope


def check_std(std: str) -> str:
    """Validate a std convention name ("population", ddof = 0, or "sample", ddof = 1)."""
    if std not in STD_DDOF:
        raise InputError(f"std must be one of {', '.join(STD_DDOF)} (ddof 0 or 1); got {std!r}.")
    return std


def check_ord(ord: int) -> int:
    """Validate a norm order (1 or 2)."""
    if ord not in ORDS:
        raise InputError(f"norm order must be 1 (L1) or 2 (L2); got {ord!r}.")
    return int(ord)
