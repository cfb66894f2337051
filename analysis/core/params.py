"""Declared parameters: everything the layers need to know about one keyword parameter, written once.

A `Param` is a parameter's default, the values it takes (`choices`, or the bounds `lo` .. `hi` that
the app offers and a link may carry), the label of its widget ("" = no widget: its default is used),
a help line, how a widget names each choice, and the library's own check. A class that declares its
parameters (a scorer's `parameters`) builds its constructor (`bind`) and its `params()` from them;
the CLI's option (`--name-with-dashes`, typed from the default), the URL field (`Param.parse` /
`Param.text`) and the app's widget are derived from the same declaration, so a new parameter is one
line in one place.

`Range` and `Choice` are the parsers of link text (ValueError saying why, "it is ...", which the app
completes into "ignored because ..."); the app's other view fields use them too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from analysis.core.errors import InputError, check_whole_number


@dataclass(frozen=True)
class Range:
    """A number in lo .. hi (an integer when `integer`): parses URL text, and bounds the widget."""
    lo: float
    hi: float
    integer: bool = False

    def __call__(self, raw: str) -> float | int:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError("it is not a number") from None
        if not math.isfinite(value) or not self.lo <= value <= self.hi:
            raise ValueError(f"it is outside {self.lo:g} .. {self.hi:g}")
        if self.integer:
            if value != int(value):
                raise ValueError("it is not a whole number")
            return int(value)
        return value


@dataclass(frozen=True)
class Choice:
    """One of `options` (compared as text, returned as the option itself, e.g. the int 1)."""
    options: tuple

    def __call__(self, raw: str) -> Any:
        for option in self.options:
            if str(option) == str(raw).strip():
                return option
        raise ValueError(f"it is not one of {', '.join(map(str, self.options))}")


@dataclass(frozen=True, eq=False)
class Param:
    """One keyword parameter, declared once (see the module docstring)."""
    default: Any
    label: str = ""                               # the app's widget label; "" = not offered in the app
    help: str = ""                                # CLI help and the widget's tooltip
    choices: tuple | None = None                  # the allowed values (the widget shows them in this order)
    lo: float = -math.inf                         # bounds of a number: what the app offers, a link may carry
    hi: float = math.inf
    step: float | None = None                     # the number widget's step
    number_format: str | None = None              # the number widget's printf format
    names: Mapping | None = None                  # choice -> what the widget shows for it
    check: Callable[[Any], Any] | None = None     # the library's check (returns the value to keep);
                                                  # None: the choices, or a number of the default's type in lo .. hi
    recorded: bool = True                         # part of params() (batch_size is not: it never changes a result)

    @property
    def type(self) -> type:
        """What the CLI parses the option as: the type of the default (or of the first choice)."""
        return type(self.choices[0] if self.choices else self.default)

    def validate(self, name: str, value) -> Any:
        """The value the library keeps; InputError (naming `name`) for a value it refuses."""
        if self.check is not None:
            return self.check(value)
        if self.choices is not None:
            if value not in self.choices:
                raise InputError(f"{name} must be one of {', '.join(map(str, self.choices))}; got {value!r}.")
            return value
        if self.type is int:
            return check_whole_number(value, name, low=int(max(self.lo, -2**63)), high=int(min(self.hi, 2**63)))
        if self.type is float:
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number) or not self.lo <= number <= self.hi:
                raise InputError(f"{name} must be a finite number in {self.lo:g} .. {self.hi:g}; got {value!r}.")
            return number
        return value

    def parse(self, raw: str) -> Any:
        """A link's text -> the value (ValueError "it is ..." when the app would not offer it)."""
        if self.choices is not None:
            return Choice(self.choices)(raw)
        return Range(self.lo, self.hi, integer=self.type is int)(raw)

    def text(self, value) -> str:
        """The value as a link shows it."""
        return f"{float(value):g}" if isinstance(value, float) else str(value)

    def shown(self, choice) -> str:
        """What a widget shows for a choice."""
        return str((self.names or {}).get(choice, choice))

    @property
    def offered(self) -> bool:
        """Whether the app draws a widget for it (and a link may carry it)."""
        return bool(self.label)


def bind(declared: Mapping[str, Param], given: Mapping[str, Any], what: str) -> dict[str, Any]:
    """{name: checked value} of every declared parameter: the given value, else the default.

    TypeError for a name `declared` lacks (as Python's own keyword arguments); InputError for a value
    its declaration refuses."""
    unknown = [name for name in given if name not in declared]
    if unknown:
        raise TypeError(f"{what} has no parameter {unknown[0]!r}; it takes {', '.join(declared) or 'none'}.")
    return {name: param.validate(name, given.get(name, param.default)) for name, param in declared.items()}
