"""Showing errors in the app: a user's mistake gets its fix, a bug gets a short note, never a traceback.

`shown_errors(what)` is a context manager: a `HeadscopeError` inside it is shown with
`st.error(str(err))` (its message already says how to fix the problem); any other exception
is shown as one short line plus a folded-away "Details" expander. Streamlit's own control
flow (`st.stop`, `st.rerun`, a rerun interrupting the script) derives from BaseException and
passes through untouched.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager

import streamlit as st

from analysis.core.errors import CancelledError, HeadscopeError


def show_exception(err: BaseException, what: str = "This step") -> None:
    """Render one exception: warning for a cancel, error for a user problem, note + details for a bug."""
    if isinstance(err, CancelledError):
        st.warning(str(err))
    elif isinstance(err, HeadscopeError):
        st.error(str(err))
    else:
        first_line = (str(err).strip().splitlines() or [""])[0][:300]
        st.error(f"{what} failed unexpectedly ({type(err).__name__}{': ' + first_line if first_line else ''}). "
                 "Try other settings or reload the page; if it keeps failing, report it with the details below.")
        with st.expander("Details", expanded=False):
            st.code("".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:],
                    language="text")


@contextmanager
def shown_errors(what: str = "This step"):
    """Run the block; show (do not raise) any Exception it raises."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - the point is to show it, not crash the page
        show_exception(err, what)
