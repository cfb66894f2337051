"""Registries: name -> record, every record registered once; implementations named lazily.

The extension points of headscope (scorers, mask policies, head detectors, capability probes, export
formats) are each a `Registry`: a dict filled by `add` (a second record under a taken name is refused;
the same record again is a no-op) and read by `of` (an unknown name is one line naming the choices).
The CLI, the app and the library read the same dict, so a record added at run time shows up in all of
them.

Declarations apart from implementations. What the CLI's parser, `--help` and the lists read (names,
labels, help lines, parameters, options) is declared in light modules that import neither torch nor
transformers; the implementation is named by a *reference*, "package.module:Name" (`load`), and
imported the first time it is used. Two forms:

- a record whose implementation field holds a reference (a probe's class, a detector's builder):
  the record resolves it itself (`load`) when the probe or detector is built;
- a `Declaration` registered in place of a class (scorers, export formats): the registry holds the
  declaration until the entry itself is read (`registry[name]`, `.get`, `.of`, `.values()`,
  `.items()`), then imports the implementation once and holds it from then on. `declaration(name)` /
  `declared()` read an entry's declaration without importing anything (for an entry registered as a
  class, the class itself, which carries the same attributes), and a declared class takes its
  declared attributes from its declaration when it is defined (`take_declared`), so each is written
  once.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterable

from analysis.core.errors import InputError


def load(ref: str) -> Any:
    """The object named by `ref`, "package.module:Name" (Name may be dotted: "module:Class.method"),
    importing its module (the import system keeps it: the second call is a dictionary lookup)."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"{ref!r} does not name an implementation as 'package.module:Name'.")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def ref_of(obj: Any) -> str:
    """The reference ("package.module:QualName") that names a class or function."""
    return f"{obj.__module__}:{obj.__qualname__}"


def resolved(value: Any) -> Any:
    """`value` itself, or the object it names when it is a reference string."""
    return load(value) if isinstance(value, str) else value


def taken_keywords(cls: type) -> set[str]:
    """The keyword names a class's constructor declares (`**kwargs` and `*args` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind in kinds} - {"self"}


class Declaration:
    """A registry entry declared without importing its implementation. Subclasses are frozen records
    with a `name`, the declared attributes, and `cls`: the reference of the implementing class."""

    name: str
    cls: str

    def load(self) -> Any:
        """What the registry holds once the entry is read: the class (export formats: an instance)."""
        return load(self.cls)

    def names(self, value: Any) -> bool:
        """Whether `value` (a class, or an instance of one) is the implementation this declares."""
        return ref_of(value if isinstance(value, type) else type(value)) == self.cls


def take_declared(cls: type, registry: "Registry", fields: Iterable[str]) -> None:
    """Give a declared class its declared attributes: when `registry` has a declaration under the class's
    own `name` that names this very class, each of `fields` is copied from it onto the class. Called
    by a base class's `__init_subclass__`, so the class body writes only `name` and its methods; a field
    written in both places is refused (TypeError: one home)."""
    name = cls.__dict__.get("name")
    declaration = registry.declarations.get(name) if isinstance(name, str) and name else None
    if declaration is None or declaration.cls != ref_of(cls):
        return
    twice = [f for f in fields if f in cls.__dict__]
    if twice:
        raise TypeError(f"{cls.__qualname__} sets {', '.join(twice)}, which its declaration in the {registry.what} "
                        f"registry already gives; write them in one place (the declaration).")
    for f in fields:
        setattr(cls, f, getattr(declaration, f))


class Registry(dict):
    """name -> record of one kind (`what`: "scorer", "detector", "mask policy"), in registration order."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.declarations: dict[str, Declaration] = {}    # every entry registered as a Declaration

    # -- registering ---------------------------------------------------------------------------

    def add(self, name: str, record: Any) -> Any:
        """Register `record` (or a `Declaration`) under `name`; InputError when another record has the
        name. The same record again is a no-op, and so is the class a declaration names."""
        declared = self.declarations.get(name)
        current = dict.get(self, name, record)
        same = (current == record or (declared is not None and declared == record)
                or (declared is not None and not isinstance(record, Declaration) and declared.names(record)))
        if not same:
            raise InputError(f"A {self.what} named {name!r} is already registered ({current!r:.60}).")
        if isinstance(record, Declaration):
            self.declarations[name] = record
            if name not in self:
                dict.__setitem__(self, name, record)
        elif declared is None or name not in self:
            dict.__setitem__(self, name, record)
        return record

    def pop(self, name: str, *default: Any) -> Any:
        """Remove an entry (and its declaration)."""
        self.declarations.pop(name, None)
        return dict.pop(self, name, *default)

    # -- reading (an entry read is an entry loaded) ----------------------------------------------

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if isinstance(value, Declaration):
            value = value.load()
            dict.__setitem__(self, name, value)
        return value

    def __iter__(self):                     # also makes dict(registry) and {**registry} read through []
        return dict.__iter__(self)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def values(self) -> list:
        return [self[name] for name in self]

    def items(self) -> list[tuple[str, Any]]:
        return [(name, self[name]) for name in self]

    def of(self, name: str) -> Any:
        """The record named `name`; InputError naming the choices otherwise."""
        if name not in self:
            raise InputError(f"Unknown {self.what} {name!r}; choose one of {', '.join(self)}.")
        return self[name]

    # -- reading declarations (nothing imported) -------------------------------------------------

    def declaration(self, name: str) -> Any:
        """What `name` was declared as, without importing its implementation: its `Declaration`, or the
        record itself for an entry registered as one. InputError naming the choices otherwise."""
        if name not in self:
            raise InputError(f"Unknown {self.what} {name!r}; choose one of {', '.join(self)}.")
        return self.declarations.get(name) or dict.__getitem__(self, name)

    def declared(self) -> dict[str, Any]:
        """{name: `declaration(name)`} of every entry, in order; nothing imported."""
        return {name: self.declaration(name) for name in self}

    def reorder(self, key) -> None:
        """Sort the entries by key(declaration) (stable: equal keys keep their order); nothing imported."""
        ordered = sorted(((name, dict.__getitem__(self, name)) for name in self),
                         key=lambda item: key(self.declaration(item[0])))
        dict.clear(self)
        dict.update(self, ordered)
