"""components.cache: one shared model per name, scores cached by parameters, and work that runs the
shared model serialized (masks are hooks on it, so two runs at once would see each other's gates)."""
import threading
import time

import numpy as np
import pytest

from tests._apptools import fresh_caches, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_model_is_loaded_once_per_name(tiny_dir):
    from components import cache, state
    assert cache.load(state.ModelKey(str(tiny_dir))) is cache.load(state.ModelKey(str(tiny_dir)))


def test_scores_are_cached_by_parameters(tiny_dir, monkeypatch):
    from analysis.score import scoring
    from components import cache, state
    calls = []
    real = scoring.MPScorer._compute
    monkeypatch.setattr(scoring.MPScorer, "_compute", lambda self, *a: calls.append(self.z) or real(self, *a))
    name = str(tiny_dir)
    for z in (1.0, 2.0, 1.0, 2.0):
        cache.scores(state.ModelKey(name), "mp", cache.params_key(dict(z=z, scope="layer", ord=2)))
    assert calls == [1.0, 2.0]
    assert cache.params_key(dict(b=1, a=2)) == cache.params_key(dict(a=2, b=1))


def test_work_on_the_shared_model_waits_for_the_lock(tiny_dir):
    from components import cache, state
    name = str(tiny_dir)
    order = []

    def evaluate():
        cache.evaluate_masks(state.ModelKey(name), np.zeros((1, 4, 4), dtype=bool), "some words to score here", 16)
        order.append("evaluated")

    with cache.exclusive(state.ModelKey(name)):
        worker = threading.Thread(target=evaluate)
        worker.start()
        time.sleep(1.5)                 # a tiny evaluation takes well under this when it does not wait
        order.append("released")
    worker.join(60)
    assert order == ["released", "evaluated"]


def test_a_dropped_model_is_freed_without_the_cycle_collector(tiny_dir):
    """cache.settle_heap freezes what exists after a load (so Streamlit's gc after every run scans
    only new objects); that is safe because a model and its tokenizer hold no reference cycles:
    dropping them frees them by reference counting alone."""
    import gc
    import weakref

    from analysis.arch.models import load_model
    from components import cache, state
    lm = load_model(str(tiny_dir))
    refs = [weakref.ref(lm.model), weakref.ref(lm.tokenizer)]
    gc.collect()
    gc.disable()
    try:
        del lm
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
    frozen = gc.get_freeze_count()
    cache.load(state.ModelKey(str(tiny_dir)))
    assert gc.get_freeze_count() > frozen                 # the load settled the heap
