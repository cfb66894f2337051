"""Ctrl-C while a long-context run builds its inputs, issue 47 item 4 class 3: every builder of long contexts
(the haystack, the long probes' rows, the retrieval needles, the streaming score's texts) and what runs before
the first pass (the time estimate's forward) stops at its next cancel point, not after building everything.

Before the fix `longctx --lengths 8192` went on for 27 to 92 s after a SIGINT during its build on this 2-core
machine under load (the build, then the estimate's uninterrupted forward); a SIGINT during its passes waited
168 s for the 8k-token row to end (the CLI gives no should_stop, and the layer checks needed one). After: the
error line 0.00 to 0.52 s after the signal in every phase (the process exits about 3 s later: torch's
interpreter teardown on the loaded machine). The oracle here needs no clock: the built-in articles are read one
by one, and the read that asks to stop (as the SIGINT handler does) must be the last one read.
"""
from __future__ import annotations

import signal

import pytest
import torch

from analysis.core import progress
from analysis.core.errors import CancelledError
from analysis.measure import haystack as haystack_module
from analysis.measure.haystack import haystack
from analysis.measure.longheads import StreamingDetector, needle_items
from analysis.measure.probes.longcontext import build_long, row_seconds, stop_between_layers
from tests._tiny import tiny_model

AFTER = 3          # the article read that asks to stop


class Interrupting:
    """The built-in articles as `haystack` reads them; the `after`-th read asks to stop, as Ctrl-C does."""

    def __init__(self, articles, after: int):
        self.articles, self.after, self.reads = articles, after, 0

    def __len__(self):
        return len(self.articles)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.after:
            progress.request_stop(signal.SIGINT)
        return self.articles[i]


@pytest.fixture
def flag():
    """The signal flag cleared before and after the test (no stop request leaks into the next one)."""
    progress.clear_stop()
    yield
    progress.clear_stop()


@pytest.fixture(scope="module")
def long_model():
    return tiny_model("llama", max_position_embeddings=4096)


BUILDERS = {
    "haystack": lambda tok, model, stop: haystack(tok, 4096, should_stop=stop),
    "needle_items": lambda tok, model, stop: needle_items(tok, [2048], should_stop=stop),
    "streaming texts": lambda tok, model, stop: StreamingDetector([2048], tokenizer=tok).sequences(model, stop),
    "long probes": lambda tok, model, stop: build_long(None, tok, "causal-lm", [2048], n_items=2, should_stop=stop),
}


@pytest.mark.parametrize("name", BUILDERS)
def test_a_signal_stops_a_builder_at_the_next_article(name, smollm2, long_model, flag, monkeypatch):
    halves = {half: Interrupting(getattr(haystack_module, half)(), AFTER)       # a score reads the calibration
              for half in ("evaluation_articles", "calibration_articles")}    # half, a verdict the evaluation one
    for half, articles in halves.items():
        monkeypatch.setattr(haystack_module, half, lambda articles=articles: articles)
    with pytest.raises(KeyboardInterrupt):
        BUILDERS[name](smollm2.tokenizer, long_model, None)
    assert sorted(a.reads for a in halves.values()) == [0, AFTER]            # one half read, stopped at AFTER


@pytest.mark.parametrize("name", BUILDERS)
def test_stop_ends_a_builder(name, smollm2, long_model, flag):
    """The app's Stop (should_stop) ends the same builds, after the call that said so."""
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= AFTER
    with pytest.raises(CancelledError, match="cancelled"):
        BUILDERS[name](smollm2.tokenizer, long_model, stop)
    assert len(calls) == AFTER


def _asks_to_stop_after_layer_0(model) -> list:
    """A hook on layer 0 that asks to stop (as Ctrl-C does), and the list of the later layers that ran."""
    ran = []
    model.model.layers[0].register_forward_hook(lambda *a: progress.request_stop(signal.SIGINT))
    for i, layer in enumerate(model.model.layers[1:], 1):
        layer.register_forward_hook(lambda *a, i=i: ran.append(i))
    return ran


def test_a_signal_stops_a_long_forward_between_layers_without_should_stop(flag):
    """The CLI gives no should_stop: the layer checks still read the signal flag (a row of 8k tokens took 168 s
    to notice Ctrl-C)."""
    model = tiny_model("llama", num_hidden_layers=3)
    ran = _asks_to_stop_after_layer_0(model)
    with torch.no_grad(), stop_between_layers(model, None), pytest.raises(KeyboardInterrupt):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert ran == []
    progress.clear_stop()
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))                   # the hooks are gone after the block
    assert ran == [1, 2]


def test_a_signal_stops_the_time_estimate_within_its_forward(flag):
    model = tiny_model("llama", num_hidden_layers=3)
    ran = _asks_to_stop_after_layer_0(model)
    with pytest.raises(KeyboardInterrupt):
        row_seconds(model, [64], short=16, rows=2)
    assert ran == []
