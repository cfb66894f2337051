"""Makes sure every page runs inside app.py (navigation, URL state, the sidebar model picker).

Streamlit treats an app whose entry script has a sibling `pages/` folder as a legacy multipage
app until the first `st.navigation` call: on a fresh server (and on every AppTest run) it may
run `pages/<page>.py` directly, without app.py. Each page therefore starts with
`shell.ensure_app()`: outside app.py it runs app.py (which renders this same page inside it)
and then ends the outer run.
"""
from __future__ import annotations

import runpy
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import streamlit as st

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
    st.stop()
