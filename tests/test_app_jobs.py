"""components/jobs.py: heavy jobs across sessions (issue 33, a class on one server). The model's lock
serves jobs in the order they asked, each waiting job is told its real place and the expected wait,
the same cached call is computed once while a second caller waits for it, and time estimates come
from this machine's measured pace and follow a job's own progress (never a frozen number)."""
import threading
import time

import numpy as np
import pytest

from tests._apptools import fresh_caches, tiny_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("fresh_caches")


def test_queue_order_position_and_expected_wait():
    from components.jobs import Board, Job
    b = Board()
    b.record("ablation", "m", 100.0, 50.0)                      # 0.5 s per unit, measured
    running = b.add(Job("Ablating heads", "m", kind="ablation", work=100.0))
    b.start(running)
    running.started -= 10.0                                      # 10 s in, 40 % done: its own pace says 15 s left
    b.update(running, 0.4, "layer 12/30")
    second = b.add(Job("Evaluating", "m", kind="ablation", work=40.0))     # expected 20 s
    third = b.add(Job("Sweeping z", "m"))
    other_model = b.add(Job("Tagging heads", "other"))
    assert b.ahead(third) == [running, second] and b.ahead(other_model) == []
    assert b.first_in_line(second) and not b.first_in_line(third)
    words = b.waiting_words(second)
    assert words.startswith("waiting: 2nd in line behind 'Ablating heads' (15 s left)"), words
    assert "expected wait about 15 s" in words
    assert "3rd in line" in b.waiting_words(third) and "and 1 more" in b.waiting_words(third)
    assert "expected wait about 35 s" in b.waiting_words(third)


def test_time_left_follows_the_measured_pace_and_the_jobs_own():
    from components.jobs import Job
    job = Job("x", "m", expected_s=100.0)
    job.started = time.monotonic() - 30.0
    assert job.left_s() == pytest.approx(70.0, abs=0.5)          # no progress yet: the prior, counting down
    job.fraction = 0.5                                           # half done in 30 s: its own pace says 60 s in all
    assert job.left_s() == pytest.approx(30.0, abs=0.5)
    slow = Job("y", "m", expected_s=10.0)
    slow.started = time.monotonic() - 30.0                       # past its estimate, no progress: not negative
    assert slow.left_s() == 0.0
    unknown = Job("z", "m")
    unknown.started = time.monotonic()
    assert unknown.left_s() is None


def test_pace_replaces_the_forward_prior_once_a_job_ran():
    from components.jobs import FORWARD_TOKENS, Board
    b = Board()
    assert b.estimate("evaluate", "m", 100) is None
    b.record("forward", "m", 64, 0.64)                           # 10 ms per token
    assert b.estimate("ablation", "m", 100) == pytest.approx(100 * 0.01 * FORWARD_TOKENS["ablation"])
    b.record("ablation", "m", 100, 5.0)
    assert b.estimate("ablation", "m", 200) == pytest.approx(10.0)
    assert b.knows("ablation", "m") and not b.knows("evaluate", "m")


def test_the_same_call_is_computed_once_while_a_second_caller_waits(tiny_dir, monkeypatch):
    """Two sessions asking for the same check at once: one computes, the other waits for it (with its
    progress) and reads the cached result."""
    from analysis.measure import evaluation
    from components import cache, jobs, state
    calls = []
    real = evaluation.evaluate

    def slow(*a, **k):
        calls.append(1)
        time.sleep(1.0)
        return real(*a, **k)

    monkeypatch.setattr(evaluation, "evaluate", slow)
    key = state.ModelKey(str(tiny_dir))
    masks = np.zeros((2, 4, 4), dtype=bool)
    results = []

    def ask():
        results.append(cache.cached_call(cache.evaluate_masks, key, masks, "some words to score here", 16,
                                         label="Evaluating"))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join(60)
    assert len(calls) == 1 and len(results) == 2 and all(r is not None for r in results)
    assert not jobs.board().running_call(jobs.call_key(cache.evaluate_masks, (key, masks, "some words to score here", 16)))


def test_the_lock_serves_jobs_in_arrival_order(tiny_dir):
    from components import cache, jobs, state
    key = state.ModelKey(str(tiny_dir))
    cache.load(key)
    order = []

    def job(name, hold):
        with cache.exclusive(key, what=name):
            order.append(name)
            time.sleep(hold)

    first = threading.Thread(target=job, args=("first", 1.0))
    first.start()
    time.sleep(0.2)
    waiting = []
    for name in ("second", "third", "fourth"):
        t = threading.Thread(target=job, args=(name, 0.05))
        t.start()
        waiting.append(t)
        time.sleep(0.1)
    queued = [j.label for j in jobs.board().ahead(jobs.Job("probe", repr(key), number=10**9))]
    for t in [first, *waiting]:
        t.join(30)
    assert order == ["first", "second", "third", "fourth"]
    assert queued == ["first", "second", "third", "fourth"]


def test_the_pipeline_prior_counts_the_probes_on_dense_and_on_every_round():
    """The report runs the capability probes on the dense model and after each round; the roles phase reads
    its own fixed tokens. (Left out, the first estimate of a pipeline run was 3x low.)"""
    from components import jobs
    shape = dict(rounds=3, recovery_steps=4, batch=2, seq_len=64, eval_tokens=64, int8=False, recovering=True)
    without, with_probes = jobs.pipeline_units(**shape), jobs.pipeline_units(**shape, probe_tokens=1000)
    assert with_probes["dense"] - without["dense"] == pytest.approx(jobs.PROBE_FORWARDS * 1000)
    assert with_probes["rounds"] - without["rounds"] == pytest.approx(3 * jobs.PROBE_FORWARDS * 1000)
    assert with_probes["curves"] == without["curves"] and with_probes["roles"] == without["roles"] > 0
    more_eval = jobs.pipeline_units(**{**shape, "eval_tokens": 4096})
    assert more_eval["roles"] == without["roles"]
    assert "roles" not in jobs.pipeline_units(**{**shape, "recovering": False, "recovery_steps": 0})
