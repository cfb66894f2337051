"""lm-evaluation-harness imported on demand: its pinned version, whether it is installed (`installed`,
`harness_missing`: the one line that says what to install, `require_harness`), where its own task configs
live, and the two settings every run is made under: the harness's and datasets' logging and progress bars
off (headscope reports progress itself) and the datasets library offline (nothing is downloaded: a hub
dataset must be in the cache).

`lm_eval` is imported only by this package and only when a run needs it.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

from analysis.core.errors import InputError, first_line

HARNESS_VERSION = "0.4.13"
HARNESS_REQUIREMENT = f"lm_eval=={HARNESS_VERSION}"
DOCS = "docs/HARNESS.md"


def installed() -> bool:
    """Whether lm_eval is there, without importing it (a page asks on every run; `harness_missing` imports)."""
    import importlib.util
    try:
        return importlib.util.find_spec("lm_eval") is not None
    except (ImportError, ValueError):          # a broken or blocked package
        return False


def harness_missing() -> str:
    """"" when lm-evaluation-harness imports, else the one line that says what to install."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as err:
        return (f"lm-evaluation-harness is not installed ({first_line(err)}): install it with "
                f"`pip install {HARNESS_REQUIREMENT}` in this environment (.venv/bin/python -m pip install "
                f"{HARNESS_REQUIREMENT}).")
    return ""


def require_harness() -> None:
    """InputError with `harness_missing()`'s line when the harness is not installed."""
    missing = harness_missing()
    if missing:
        raise InputError(missing)


def tasks_folder() -> Path:
    import lm_eval.tasks
    return Path(lm_eval.tasks.__file__).parent


_QUIET_LOCK = threading.Lock()
_quiet_depth = 0
_saved: dict = {}


@contextlib.contextmanager
def quiet():
    """The harness's and datasets' own logging and progress bars off for a run (headscope reports progress
    itself); restored when the last run in this process ends."""
    global _quiet_depth
    import logging

    import datasets
    import lm_eval.api.task as task_module
    from tqdm import tqdm
    with _QUIET_LOCK:
        if _quiet_depth == 0:
            _saved.update(level=logging.getLogger("lm_eval").level, tqdm=task_module.tqdm,
                          bars=datasets.is_progress_bar_enabled())
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
            task_module.tqdm = functools.partial(tqdm, disable=True)       # build_all_requests' bar
            datasets.disable_progress_bars()
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                logging.getLogger("lm_eval").setLevel(_saved["level"])
                task_module.tqdm = _saved["tqdm"]
                if _saved["bars"]:
                    datasets.enable_progress_bars()


@contextlib.contextmanager
def offline():
    """The datasets library offline for the block (nothing from a hub: a hub dataset must be in the cache)."""
    import datasets.config
    import huggingface_hub.constants as hub
    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before
