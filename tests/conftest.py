"""Shared test fixtures: the hub is offline for every test, and the real built-in models are
loaded once per test session.

`smollm2` converts the GGUF file into a plain checkpoint on first use. The cache folder is
$HEADSCOPE_TEST_CACHE, else a fixed folder under the system temp dir, so repeated test runs on
one machine convert once (a fresh machine converts, which exercises the conversion; set
HEADSCOPE_TEST_FRESH_CACHE=1 to force it into a per-session temp folder).
"""
import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# huggingface_hub reads these once at import: set them before any test module imports it.
os.environ.update(_OFFLINE)


def _worker_threads() -> int | None:
    """Under pytest-xdist (scripts/test.sh runs `-n N`): this worker's share of the CPUs, so N
    workers with torch's default of one thread per core do not run N x cores threads on the
    cores (OpenMP threads that outnumber the cores spin and wait on each other). None when not
    a worker. Set before torch is imported (it reads OMP_NUM_THREADS once); the servers and
    command lines the tests start inherit it."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not count:
        return None
    return max(1, len(os.sched_getaffinity(0)) // int(count))


# Results a test stores (analysis.core.store) go to a folder of this session's, never the user's cache, and no
# stored result of an earlier run is served to a test; command lines the tests start inherit it.
os.environ["HEADSCOPE_RESULTS"] = tempfile.mkdtemp(prefix="headscope-test-results-")
atexit.register(shutil.rmtree, os.environ["HEADSCOPE_RESULTS"], ignore_errors=True)

_THREADS = _worker_threads()
if _THREADS and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


# The longest test modules first, so N workers (`--dist loadfile`: a module stays on one worker,
# its module fixtures built once) end together instead of one waiting on the other's last long
# module (longest-first is the classic schedule: what is left at the end are the short modules).
# Ranks only: the order inside a module, and of the rest, is pytest's. xdist keeps this order only with
# --no-loadscope-reorder (scripts/test.sh passes it): by default `--dist loadfile` re-sorts the modules by
# their number of tests, so the long modules with few tests (the browser journeys: 13 tests; multi-process:
# 11) started after the many-test modules and could leave one worker running alone at the end. By their summed test times
# in a full two-worker run here (issue 51, seconds): gguf 362, journeys 192, quantize 130, distributed
# 125, selfcheck 114, newcomer 112, app_long_context 107, bad_input_cli 78, bad_input_kills 64, fit 62,
# browser 56, streamed_export 56 (the next are below 52 s); since then (estimated from per-test times,
# not a full run) gguf ~100 s less (llama.cpp on the worker's share of the cores), quantize ~+35 s and
# selfcheck ~-56 s (SmolLM2's self-checked INT8 export moved to test_quantize, sharing its trace).
_LONG_MODULES = ("tests/test_gguf.py", "e2e/test_journeys.py", "tests/test_quantize.py",
                 "tests/test_distributed.py", "e2e/test_newcomer.py",
                 "tests/test_app_long_context.py", "tests/test_bad_input_cli.py", "tests/test_bad_input_kills.py",
                 "e2e/test_fit.py", "tests/test_selfcheck.py", "e2e/test_browser.py", "tests/test_streamed_export.py")


def _module_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    for rank, long in enumerate(_LONG_MODULES):
        if path.endswith(long):
            return rank
    return len(_LONG_MODULES) + (0 if "/e2e/" in path else 1)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)          # stable: pytest's order within each rank


@pytest.fixture(autouse=True, scope="session")
def _llama_cpp_on_the_workers_share():
    """Under pytest-xdist: llama.cpp runs on this worker's share of the cores too. Its default is a
    fixed 2 threads (analysis.compress.export.gguf.llamacpp.DEFAULT_THREADS, so deployment speeds compare
    across runs), and ggml's threads spin at every step: beside another worker on 2 cores, one of the two
    is always waiting for the other (measured here with one other process on the cores: SmolLM2's three
    GGUF perplexities 48.5 s on 2 threads, 20.8 s on 1). Each dot product is one thread's, so the numbers
    a test checks are the same; speeds are only checked for their shape. Command lines the tests start
    keep the default."""
    if not _THREADS or _THREADS >= 2:
        yield
        return
    import functools
    from analysis.compress.export.gguf import llamacpp
    real = llamacpp.load

    @functools.wraps(real)
    def load(path, *, threads: int = llamacpp.DEFAULT_THREADS, **options):
        if type(threads) is int and threads > _THREADS:      # a bad count still reaches the library's check
            threads = _THREADS
        return real(path, threads=threads, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llamacpp, "load", load)
        yield


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    """No test may reach a model hub (a test could unset them; this restores them)."""
    for key, value in _OFFLINE.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="session")
def builtin_cache_dir(tmp_path_factory) -> Path:
    if os.environ.get("HEADSCOPE_TEST_FRESH_CACHE"):
        return tmp_path_factory.mktemp("headscope-cache")
    default = Path(tempfile.gettempdir()) / f"headscope-test-cache-{os.getuid()}"
    return Path(os.environ.get("HEADSCOPE_TEST_CACHE") or default)


@pytest.fixture(scope="session")
def smollm2(builtin_cache_dir):
    """The built-in SmolLM2-135M (LoadedModel), loaded offline from its PyPI package."""
    from analysis.arch.models import load_model
    return load_model("smollm2-135m", cache_dir=builtin_cache_dir)


@pytest.fixture(scope="session")
def minilm(builtin_cache_dir):
    """The built-in all-MiniLM-L6-v2 encoder (LoadedModel)."""
    from analysis.arch.models import load_model
    return load_model("minilm-l6", cache_dir=builtin_cache_dir)


@pytest.fixture(scope="session")
def smollm2_f64(smollm2):
    """A float64 copy of the built-in SmolLM2 (~1 GB), for equality claims that must hold on
    every CPU (tests/_tolerance.py); the shared float32 `smollm2` fixture is never changed."""
    import copy
    import dataclasses
    return dataclasses.replace(smollm2, model=copy.deepcopy(smollm2.model).double(), placement=None)
