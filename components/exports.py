"""Where the app's exports go: the export root typed on the Export page (the Pipeline page writes there
too), checked and shown as the absolute folder before anything is written, and the server's switch
for hosting a class (`HEADSCOPE_EXPORTS`).

- A relative root is refused: it would land in the folder the server was started from (issue 33: a
  typed `relative/dir` wrote 516 MiB into the app's own folder). The refusal names that folder.
- A root that cannot take an export says the true reason before the button is pressed
  (`analysis.compress.export.check_export_root`: a real probe, so /proc says it takes no folders).
- `HEADSCOPE_EXPORTS` = `on` (default: any root the user types), `fixed` (only the root in
  `HEADSCOPE_EXPORT_ROOT`, not editable: for a shared server) or `off` (no model is written on the
  server; downloads such as mask.json and the reports still work).
"""
from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from analysis.compress import export as export_mod
from analysis.core.errors import HeadscopeError, InputError

from . import state

EXPORTS_ENV = "HEADSCOPE_EXPORTS"
MODES = ("on", "fixed", "off")
OFF_NOTE = (f"Exports to the server's disk are off on this server ({EXPORTS_ENV}=off, e.g. for a class). "
            "The downloads (mask.json, reports, figures) still work.")


def mode() -> str:
    """The server's export mode (`HEADSCOPE_EXPORTS`; an unknown value counts as `off`, the safe one)."""
    value = os.environ.get(EXPORTS_ENV, "on").strip().lower() or "on"
    return value if value in MODES else "off"


def default_root() -> str:
    return str(export_mod.default_export_root())


def checked_root(text: str) -> Path:
    """The export root typed as `text`, absolute and writable; InputError / ExportError saying why not."""
    typed = str(text).strip() or default_root()
    path = Path(typed).expanduser()
    if not path.is_absolute():
        raise InputError(f"The export root {typed!r} is a relative path: it would land in {Path.cwd() / path}, "
                         f"inside the folder the server was started from. Type an absolute path (such as "
                         f"{Path.home() / 'headscope-exports'} or ~/headscope-exports).")
    return export_mod.check_export_root(path)


def root_widget(where=st) -> Path | None:
    """The Export page's root: a text box (or, in `fixed` mode, the server's root as a caption), checked.
    Returns the absolute root, or None after showing why nothing can be written there."""
    if mode() == "off":
        where.info(OFF_NOTE, icon=":material/block:")
        return None
    if mode() == "fixed":
        text = default_root()
        where.caption(f"Export root (fixed by the server, {EXPORTS_ENV}=fixed): **{text}**")
    else:
        text = where.text_input("Export root: every export becomes a folder in here (an absolute path)",
                                key=state.widget_key("export.root", value=default_root()),
                                help=f"Default {export_mod.DEFAULT_EXPORT_ROOT}, or the folder in the environment "
                                     f"variable {export_mod.EXPORT_ROOT_ENV}. A relative path is refused: it would "
                                     "land in the server's working folder.")
    return _shown(text, where)


def kept_root(where=st) -> Path | None:
    """The root set on the Export page (for the Pipeline page), checked; None after showing why."""
    if mode() == "off":
        where.info(OFF_NOTE, icon=":material/block:")
        return None
    text = default_root() if mode() == "fixed" else str(state.kept("export.root", default_root()))
    return _shown(text, where)


def _shown(text: str, where) -> Path | None:
    try:
        return checked_root(text)
    except HeadscopeError as err:
        where.error(str(err))
        return None
