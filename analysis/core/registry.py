"""Registries: name -> record, every record registered once.

The extension points of headscope (scorers, head detectors, mask policies) are each a `Registry`: a
dict filled by `add` (a second record under a taken name is refused; the same record again is a no-op)
and read by `of` (an unknown name is one line naming the choices). The CLI, the app and the library
read the same dict, so a record added at run time shows up in all of them.
"""
from __future__ import annotations

from typing import Any

from analysis.core.errors import InputError


class Registry(dict):
    """name -> record of one kind (`what`: "scorer", "detector", "mask policy")."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def add(self, name: str, record: Any) -> Any:
        """Register `record` under `name`; InputError when another record has the name."""
        if self.get(name, record) != record:
            raise InputError(f"A {self.what} named {name!r} is already registered ({self[name]!r:.60}).")
        self[name] = record
        return record

    def of(self, name: str) -> Any:
        """The record named `name`; InputError naming the choices otherwise."""
        if name not in self:
            raise InputError(f"Unknown {self.what} {name!r}; choose one of {', '.join(self)}.")
        return self[name]
