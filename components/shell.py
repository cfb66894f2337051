"""Makes sure every page runs inside app.py (navigation, URL state, the sidebar model picker).

Streamlit treats an app whose entry script has a sibling `pages/` folder as a legacy multipage
app until the first `st.navigation` call: on a fresh server (and on every AppTest run) it may
run `pages/<page>.py` directly, without app.py. Each page therefore starts with
`shell.ensure_app()`: outside app.py it runs app.py (which renders this same page inside it)
and then ends the outer run.

Every early end of a run goes through `end_run()`, never `st.stop()`: st.stop() also drops every
rerun the browser asked for while the run was going (a key press on a slider while the page drew),
so the press was shown on the slider and never reached the page.
"""
from __future__ import annotations

import runpy
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import NoReturn

import streamlit as st

try:   # how st.stop() ends a run, without its request_stop() that discards the reruns queued meanwhile
    from streamlit.runtime.scriptrunner import get_script_run_ctx as _script_ctx
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException as _StopRun
except ImportError:  # pragma: no cover - another Streamlit layout: st.stop() (loses queued key presses)
    _script_ctx = _StopRun = None

APP = Path(__file__).resolve().parents[1] / "app.py"
_INSIDE_APP: ContextVar[bool] = ContextVar("headscope_inside_app", default=False)


@contextmanager
def inside_app():
    """app.py runs the current page inside this context."""
    token = _INSIDE_APP.set(True)
    try:
        yield
    finally:
        _INSIDE_APP.reset(token)


def ensure_app() -> None:
    """First call of every page: run app.py around this page if Streamlit started the page alone."""
    if _INSIDE_APP.get():
        return
    runpy.run_path(str(APP), run_name="__main__")
    end_run()


def end_run() -> NoReturn:
    """End this run (or fragment run) here, like st.stop(), keeping the reruns the browser asked for
    meanwhile: they run next, as they would after a run that reached its end."""
    if _StopRun is not None and _script_ctx() is not None:
        raise _StopRun()
    st.stop()
