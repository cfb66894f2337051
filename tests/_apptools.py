"""Helpers for the app tests: a tiny model folder the picker can load, AppTest runs, chart decoding.

- `tiny_model_dir(path, ...)`: saves a seeded tiny Llama (tests/_tiny.py) plus a trivial
  character-level tokenizer, so `load_model(path)` works offline in well under a second.
- `new_app(model, page=..., **params)`: an AppTest of app.py opened on `page` with the view's
  query parameters set (as a shared link would), after one run.
- `figure(at, i)`: the i-th plotly chart's figure as a dict, numpy arrays decoded from base64
  `bdata`; `heatmap_z(fig)` the first heatmap's z as an array.
- `mask_grid(at)`: the `charts.mask_grid` drawn on the page, read back from its HTML.
- `texts(at)`: every markdown/caption/metric/error/... text on the page, for assertions.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "app.py")
TIMEOUT = 60


def trivial_tokenizer():
    """One token per printable ASCII character (ids 0..94), plus <unk> and </s>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<unk>": 95, "</s>": 96})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def tiny_model_dir(path: Path, model_type: str = "llama", **overrides) -> Path:
    """Save a tiny random model (default 4 layers x 4 heads, 2 KV heads) with a tokenizer to `path`."""
    from tests._tiny import tiny_model
    overrides.setdefault("num_hidden_layers", 4)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny_model(model_type, **overrides).save_pretrained(path)
    trivial_tokenizer().save_pretrained(path)
    return path


def tiny_dir_for(path: Path, tokenizer, **overrides) -> Path:
    """Save a tiny random Llama (tests._tiny's shape unless `overrides` say otherwise) sized to `tokenizer`'s
    vocabulary, with that tokenizer, to `path` (a real tokenizer: RULER's generators and the long probes need
    real words and digits)."""
    from tests._tiny import tiny_model
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny_model("llama", vocab_size=len(tokenizer), **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def new_app(model: str | None = None, page: str | None = None, run: bool = True, **params):
    """AppTest of app.py with ?model=...&page=...&<params> set, run once (unless run=False)."""
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if model is not None:
        at.query_params["model"] = str(model)
    if page is not None:
        at.query_params["page"] = page
    for key, value in params.items():
        at.query_params[key] = str(value)
    return at.run() if run else at


def _decode(obj):
    """Replace plotly's {"dtype", "bdata", "shape"} typed arrays by numpy arrays, recursively."""
    if isinstance(obj, dict):
        if "bdata" in obj and "dtype" in obj:
            arr = np.frombuffer(base64.b64decode(obj["bdata"]), dtype=np.dtype(obj["dtype"]))
            shape = obj.get("shape")
            if shape:
                dims = [int(s) for s in str(shape).split(",")] if isinstance(shape, str) else list(shape)
                arr = arr.reshape(dims)
            return arr
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def figure(at, index: int = 0) -> dict:
    """The index-th plotly chart on the page, as a decoded figure dict."""
    return _decode(json.loads(at.get("plotly_chart")[index].proto.spec))


def figures(at) -> list[dict]:
    return [_decode(json.loads(el.proto.spec)) for el in at.get("plotly_chart")]


def figure_titled(at, needle: str) -> dict:
    """The first chart whose title contains `needle` (AssertionError listing titles otherwise)."""
    figs = figures(at)
    for fig in figs:
        if needle in title_of(fig):
            return fig
    raise AssertionError(f"no chart titled with {needle!r}; titles: {[title_of(f) for f in figs]}")


def title_of(fig: dict) -> str:
    title = fig.get("layout", {}).get("title", "")
    return title.get("text", "") if isinstance(title, dict) else str(title)


def heatmap_z(fig: dict) -> np.ndarray:
    for trace in fig["data"]:
        if trace.get("type") == "heatmap":
            return np.asarray(trace["z"])
    raise AssertionError("the figure has no heatmap trace")


@dataclass
class MaskGrid:
    """What a `charts.mask_grid` block shows: the title, every cell and every row's count."""
    title: str
    pruned: np.ndarray      # [L, H] bool
    scores: np.ndarray      # [L, H] float
    per_layer: np.ndarray   # [L] the count written beside each row
    hover: list[str]        # [L * H] each cell's tooltip


class _GridParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.title, self.cells, self.counts, self._in_title, self.shape = "", [], [], False, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if "hsm" in classes:
            self.shape = (int(a["data-layers"]), int(a["data-heads"]))
        self._in_title = "hsm-t" in classes
        if "data-s" in a:
            self.cells.append(("p" in classes, float(a["data-s"]), a.get("data-t", a.get("title", ""))))
        if "data-n" in a:
            self.counts.append(int(a["data-n"]))

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        self._in_title = False


def mask_grids(at) -> list[str]:
    """The HTML bodies of every mask grid on the page."""
    return [el.proto.body for el in at.get("html") if 'class="hsm"' in el.proto.body]


def mask_grid(at) -> MaskGrid:
    """The (one) mask grid on the page (AssertionError if there is none)."""
    bodies = mask_grids(at)
    assert len(bodies) == 1, f"expected one mask grid, found {len(bodies)}"
    return parse_mask_grid(bodies[0])


def parse_mask_grid(body: str) -> MaskGrid:
    """A `charts.mask_grid` HTML body read back."""
    parser = _GridParser()
    parser.feed(body)
    assert parser.shape is not None and len(parser.cells) == parser.shape[0] * parser.shape[1]
    pruned, scores, hover = zip(*parser.cells)
    return MaskGrid(parser.title, np.asarray(pruned).reshape(parser.shape),
                    np.asarray(scores, dtype=float).reshape(parser.shape), np.asarray(parser.counts), list(hover))


def texts(at) -> str:
    """All visible text of common elements, joined by newlines."""
    parts = []
    for kind in ("title", "header", "subheader", "markdown", "caption", "text", "error", "warning", "info",
                 "success", "code", "exception"):
        for el in at.get(kind):
            parts.append(str(getattr(el, "value", "") or getattr(el, "body", "") or ""))
    for m in at.get("metric"):
        parts.append(f"{m.label}: {m.value}")
    return "\n".join(parts)


def errors(at) -> list[str]:
    return [str(e.value) for e in at.error]


def metric(at, label: str) -> str:
    for m in at.get("metric"):
        if m.label == label:
            return m.value
    raise AssertionError(f"no metric {label!r}; have {[m.label for m in at.get('metric')]}")


# -- pytest fixtures (import them into a test module to use them) ------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama (4 layers x 4 heads, 2 KV heads, d = 8) with a tokenizer."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """The datasets library's cache (where it keeps the harness tasks' data as Arrow files) in a temporary
    folder, not the user's ~/.cache (read at each load_dataset, so patching the setting suffices): on for
    every test of a module that imports it."""
    import datasets.config
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        yield


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> Path:
    """A saved tiny Llama (4 layers x 4 heads, 2 KV heads) that reads 512 tokens, with the character tokenizer
    (its needles need ~170): the long-context detectors' and kv-plan's tests' model."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=512)


@pytest.fixture
def results_store(tmp_path, monkeypatch):
    """A results store of the test's own (analysis.core.store.Store), where every command it starts stores."""
    from analysis.core.store import Store
    monkeypatch.setenv("HEADSCOPE_RESULTS", str(tmp_path / "results"))
    return Store(tmp_path / "results")


@pytest.fixture(autouse=False)
def fresh_caches():
    """st.cache_data / st.cache_resource outlive a test: clear them before and after."""
    import streamlit as st
    st.cache_data.clear()
    st.cache_resource.clear()
    yield
    st.cache_data.clear()
    st.cache_resource.clear()


@pytest.fixture
def smollm2_app(smollm2, builtin_cache_dir, monkeypatch):
    """Point the app's model cache at the test session's converted SmolLM2 (converted once)."""
    monkeypatch.setenv("HEADSCOPE_CACHE", str(builtin_cache_dir))
    return "smollm2-135m"


def no_exception(at) -> None:
    """The page shows no uncaught exception (Streamlit's traceback element)."""
    assert not at.exception, [e.value for e in at.exception]


@pytest.fixture
def out_root(tmp_path, monkeypatch):
    """The app's export root, in this test's temporary folder ($HEADSCOPE_EXPORT_ROOT)."""
    root = tmp_path / "exports"
    monkeypatch.setenv("HEADSCOPE_EXPORT_ROOT", str(root))
    return root


@pytest.fixture
def downloads(monkeypatch) -> dict:
    """{file_name: bytes} of every st.download_button the app renders (captured as it is added)."""
    from streamlit.runtime.media_file_manager import MediaFileManager
    seen: dict = {}
    real_add = MediaFileManager.add

    def recording_add(self, path_or_data, mimetype, coordinates, file_name=None, is_for_static_download=False):
        if file_name is not None:
            data = path_or_data.encode() if isinstance(path_or_data, str) else bytes(path_or_data)
            seen[file_name] = data
        return real_add(self, path_or_data, mimetype, coordinates, file_name, is_for_static_download)

    monkeypatch.setattr(MediaFileManager, "add", recording_add)
    return seen
