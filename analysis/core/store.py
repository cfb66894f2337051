"""Results kept on disk: the one home of "measured once, read back after a restart" (issue 46).

A result is stored under a `Key`: the model's fingerprint (analysis.arch.stored.model_fingerprint: the
weights' hash, or a built-in's package version and conversion), the measure's name, its settings (a JSON
object) and the code that made it (`code_digest`: headscope's version, torch's and transformers' versions
and the bytes of the source files the measure names). A result is served only for the very same key: another
model, other settings or changed code is another file, never a wrong answer.

Where: `<cache_root()>/results/<measure>/<digest of the key>.npz` (cache_root: $HEADSCOPE_CACHE, else
$XDG_CACHE_HOME/headscope, else ~/.cache/headscope, the folder the built-in models are converted into), or
under $HEADSCOPE_RESULTS when set (the tests keep their results apart that way).

Format: one numpy .npz per result, read with allow_pickle=False, so reading runs no code: `__key__` (the key
as canonical JSON), `__about__` (who made it, when, in how many seconds: not part of the identity),
`__tree__` (the value as JSON, each array replaced by a reference) and the arrays a0, a1, ... (numbers and
bools only). `encode` / `decode` turn a value made of dicts (any plain keys), lists, tuples, strings,
numbers, bools, None and numpy arrays into that form and back; measures convert their own objects to such
trees (their `to_tree` / `from_tree`).

Safety: a write goes to a temporary file in the same folder, fsync'ed and renamed over the target
(analysis.core.atomic.replaced_atomically), so a reader never sees half a file and two processes writing the
same result at once leave one whole file (the last rename wins; both wrote the same value). A file that is
not a regular file, not a readable npz, or holds another key (copied or renamed by hand) is refused
(`Lookup.status`: "corrupt" / "foreign") and the caller recomputes and replaces it. `clear` removes results
(all, or one model's or one measure's); `entries` lists them.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import stat
import time
import zipfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from analysis.core.atomic import LEFTOVER, pid_alive, remove_dead_temps, replaced_atomically
from analysis.core.errors import InputError, OutputError

RESULTS = "results"                  # the store's folder under the cache root
RESULTS_ENV = "HEADSCOPE_RESULTS"     # a folder for the results instead (the tests' own)
SUFFIX = ".npz"
FORMAT = 1                           # bump when the file layout changes: older files read as foreign
MAX_FILE_BYTES = 1 << 30             # a stored result larger than this is refused, not read
VERSIONED = ("headscope", "torch", "transformers", "numpy")   # distributions whose versions are in every key
_ARRAY_KINDS = "biuf"                # numpy kinds a stored array may have: bool, ints, floats (never objects)
_REF = "__array__"
_TUPLE = "__tuple__"
_PAIRS = "__pairs__"                 # a dict whose keys are not all strings: [[key, value], ...]
_FLOAT = "__float__"                 # a float JSON cannot hold: "nan", "inf", "-inf"


def cache_root() -> Path:
    """headscope's cache root: $HEADSCOPE_CACHE, else $XDG_CACHE_HOME/headscope, else ~/.cache/headscope."""
    if os.environ.get("HEADSCOPE_CACHE"):
        return Path(os.environ["HEADSCOPE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "headscope"


def results_root() -> Path:
    """The store's folder: $HEADSCOPE_RESULTS, else cache_root()/results."""
    given = os.environ.get(RESULTS_ENV)
    return Path(given).expanduser() if given else cache_root() / RESULTS


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------

def canonical(value) -> str:
    """`value` (a JSON-able tree, tuples as lists) as one canonical JSON text: sorted keys, no spaces."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _plain(value):
    """Settings as plain JSON: tuples as lists, numpy scalars as Python numbers, floats that JSON cannot hold
    as words."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InputError(f"A stored result's settings must be plain values (numbers, text, lists); got "
                     f"{type(value).__name__}.")


@dataclass(frozen=True)
class Key:
    """What a stored result is of: model fingerprint, measure, settings (JSON-able), code digest."""
    model: str
    measure: str
    settings: dict = field(default_factory=dict)
    code: str = ""

    def text(self) -> str:
        return canonical(dict(format=FORMAT, model=self.model, measure=self.measure, settings=self.settings,
                              code=self.code))

    def digest(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:40]


def versions() -> dict[str, str]:
    """The installed versions of the distributions every key names (a new torch may change a kernel's rounding)."""
    out = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def code_digest(modules: tuple[str, ...] | list[str]) -> str:
    """sha256 of `versions()` and the source bytes of each module (dotted names, found without importing
    them): the code a stored result was made by. Editing any of those files gives another digest."""
    h = hashlib.sha256(canonical(versions()).encode())
    for name in sorted(set(modules)):
        spec = importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None)
        if spec is None or not origin or not os.path.isfile(origin):
            raise InputError(f"The module {name!r} a stored measure names has no source file.")
        h.update(name.encode() + b"\0" + Path(origin).read_bytes() + b"\0")
    return h.hexdigest()[:40]


# ---------------------------------------------------------------------------------------------
# Values: trees of plain values and numpy arrays
# ---------------------------------------------------------------------------------------------

def encode(value) -> tuple[str, list]:
    """(JSON text, arrays): the tree with every numpy array replaced by {"__array__": i}."""
    import numpy as np
    arrays: list = []

    def walk(v):
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in _ARRAY_KINDS:
                raise InputError(f"A stored array must hold numbers or bools; got dtype {v.dtype}.")
            arrays.append(np.ascontiguousarray(v))
            return {_REF: len(arrays) - 1}
        if isinstance(v, np.generic):
            return walk(v.item())
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in v):
                return {k: walk(x) for k, x in v.items()}
            return {_PAIRS: [[walk(k), walk(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {_TUPLE: [walk(x) for x in v]}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return {_FLOAT: repr(v)}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise InputError(f"A stored result holds plain values and arrays only; got {type(v).__name__}.")

    return json.dumps(walk(value), allow_nan=False), arrays


def decode(text: str, arrays: list):
    """The tree `encode` made, with its arrays back in place (ValueError for a malformed tree)."""
    def walk(v):
        if isinstance(v, dict):
            if set(v) == {_REF}:
                i = v[_REF]
                if not isinstance(i, int) or not 0 <= i < len(arrays):
                    raise ValueError("a reference to a missing array")
                return arrays[i]
            if set(v) == {_TUPLE}:
                return tuple(walk(x) for x in v[_TUPLE])
            if set(v) == {_PAIRS}:
                return {_hashable(walk(k)): walk(x) for k, x in v[_PAIRS]}
            if set(v) == {_FLOAT}:
                return float(v[_FLOAT])
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(json.loads(text))


def _hashable(key):
    if isinstance(key, list):
        raise ValueError("a dict key that is a list")
    return key


# ---------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lookup:
    """What a read found: status "hit" (value set), "miss" (no file), "corrupt" (unreadable) or "foreign"
    (a file that holds another key or another format), with a few words why."""
    status: str
    value: Any = None
    path: Path | None = None
    why: str = ""
    about: dict = field(default_factory=dict)

    @property
    def hit(self) -> bool:
        return self.status == "hit"


@dataclass(frozen=True)
class Entry:
    """One stored result as `Store.entries` lists it."""
    path: Path
    measure: str
    key: dict
    about: dict
    bytes: int


def _safe_name(measure: str) -> str:
    if not measure or not all(c.isalnum() or c in "-_." for c in measure) or measure.startswith("."):
        raise InputError(f"A stored measure's name is letters, digits and - _ .; got {measure!r}.")
    return measure


class Store:
    """Results under `root` (default: cache_root()/results). Every method is safe to call from several
    processes at once (module docstring)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root is not None else results_root()

    def path(self, key: Key) -> Path:
        return self.root / _safe_name(key.measure) / (key.digest() + SUFFIX)

    # -- reading ----------------------------------------------------------------------------------
    def get(self, key: Key) -> Lookup:
        path = self.path(key)
        read = _read(path)
        if read.status != "hit":
            return read
        stored_key, about, text, arrays = read.value
        if stored_key != key.text():
            return Lookup("foreign", path=path, why="it holds another result (its key differs)")
        try:
            value = decode(text, arrays)
        except (ValueError, TypeError, RecursionError) as err:
            return Lookup("corrupt", path=path, why=f"its value does not decode ({err})")
        return Lookup("hit", value, path, about=about)

    def entries(self) -> list[Entry]:
        """Every readable stored result (unreadable files are skipped; `clear` removes them too)."""
        out = []
        for path in self._files():
            read = _read(path, arrays=False)
            if read.status != "hit":
                continue
            key_text, about, _, _ = read.value
            try:
                key = json.loads(key_text)
            except ValueError:
                continue
            out.append(Entry(path, path.parent.name, key, about, path.stat().st_size))
        return out

    # -- writing ----------------------------------------------------------------------------------
    def put(self, key: Key, value, *, about: dict | None = None) -> Path:
        """Store `value` under `key` atomically (replacing what was there); OutputError when the folder is not
        writable or the disk is full (nothing half-written is left)."""
        import numpy as np
        text, arrays = encode(value)
        members = {"__key__": np.array(key.text()), "__about__": np.array(canonical(about or {})),
                   "__tree__": np.array(text), **{f"a{i}": a for i, a in enumerate(arrays)}}
        buffer = io.BytesIO()
        np.savez(buffer, **members)
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_dead_temps(path.parent, path.name)
            with replaced_atomically(path) as stream:
                stream.write(buffer.getbuffer())
        except OSError as err:
            from analysis.core.atomic import os_problem
            problem, fix = os_problem(err)
            raise OutputError(f"Cannot store the result in {path.parent}: {problem}; {fix} (or set HEADSCOPE_CACHE "
                              f"to a writable folder).") from err
        return path

    def clear(self, *, model: str | None = None, measure: str | None = None) -> int:
        """Remove stored results: all, or those of one model (its fingerprint or the name it was stored under)
        and / or one measure; unreadable files go too, and the temporaries of writers that were killed. Returns
        how many results were removed."""
        removed = 0
        for path in self._files():
            if measure is not None and path.parent.name != measure:
                continue
            if model is not None:
                read = _read(path, arrays=False)
                if read.status == "hit":
                    key_text, about, _, _ = read.value
                    try:
                        stored = json.loads(key_text).get("model")
                    except ValueError:
                        stored = None
                    if model not in (stored, about.get("model_name")):
                        continue
            with suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        for folder in (p for p in self.root.glob("*") if p.is_dir()) if self.root.is_dir() else ():
            for entry in folder.iterdir():                 # writers killed half-way (SIGKILL) left their temporary
                match = LEFTOVER.fullmatch(entry.name)
                if match and match["kind"] == "tmp" and not pid_alive(int(match["pid"])):
                    with suppress(OSError):
                        entry.unlink()
        return removed

    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(f"*/*{SUFFIX}") if not p.name.startswith("."))


def _read(path: Path, arrays: bool = True) -> Lookup:
    """(key text, about, tree text, arrays) of one stored file as Lookup.value, or why it cannot be read (arrays
    False: the key and the about only, for listing)."""
    import numpy as np
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Lookup("miss", path=path)
    except OSError as err:
        return Lookup("corrupt", path=path, why=err.strerror or "it cannot be read")
    if not stat.S_ISREG(info.st_mode):
        return Lookup("corrupt", path=path, why="it is not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        return Lookup("corrupt", path=path, why=f"it is larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        with np.load(path, allow_pickle=False) as data:
            names = set(data.files)
            if not {"__key__", "__about__", "__tree__"} <= names:
                return Lookup("foreign", path=path, why="it is not a headscope result")
            loaded = []
            while arrays and f"a{len(loaded)}" in names:
                a = data[f"a{len(loaded)}"]
                if a.dtype.kind not in _ARRAY_KINDS:
                    return Lookup("corrupt", path=path, why=f"it holds an array of dtype {a.dtype}")
                loaded.append(a)
            key_text, about_text = (str(data[n][()]) for n in ("__key__", "__about__"))
            tree = str(data["__tree__"][()]) if arrays else ""
        about = json.loads(about_text)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        return Lookup("corrupt", path=path, why=f"it is not a readable result ({type(err).__name__})")
    return Lookup("hit", (key_text, about if isinstance(about, dict) else {}, tree, loaded), path)


def remember(store: Store, key: Key, compute: Callable[[], Any] | None, *, to_tree: Callable = lambda v: v,
             from_tree: Callable = lambda t: t, about: dict | None = None, refresh: bool = False,
             on_refused: Callable[[Lookup], None] | None = None) -> tuple[Any, Lookup]:
    """The value under `key` if the store holds it (decoded by `from_tree`), else `compute()`, stored
    (`to_tree`) and returned. A corrupt or foreign file is reported to `on_refused` and replaced. `refresh`:
    recompute even when stored. compute None: only look (None for anything but a hit). Returns (value, what the
    read found)."""
    found = Lookup("miss") if refresh else store.get(key)
    if found.hit:
        try:
            return from_tree(found.value), found
        except (ValueError, TypeError, KeyError, IndexError) as err:
            found = Lookup("corrupt", path=found.path, why=f"its value does not fit this measure ({err})")
    if found.status in ("corrupt", "foreign") and on_refused is not None:
        on_refused(found)
    if compute is None:
        return None, found
    t0 = time.perf_counter()
    value = compute()
    store.put(key, to_tree(value), about=dict(about or {}, seconds=round(time.perf_counter() - t0, 3),
                                              stored=time.strftime("%Y-%m-%d %H:%M:%S")))
    return value, found


__all__ = ["Store", "Key", "Lookup", "Entry", "remember", "code_digest", "cache_root", "results_root", "canonical", "encode",
           "decode", "versions"]
