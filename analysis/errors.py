"""User-facing errors of headscope.

Every error a user can cause (bad path, unsupported architecture, absurd number) is raised
as a HeadscopeError subclass whose message says what went wrong *and how to fix it*. The
UI shows `str(err)` in an error box; it never shows a traceback for these.
"""


class HeadscopeError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""


class ModelLoadError(HeadscopeError):
    """The model could not be found, read, or would not fit in memory."""


class UnsupportedModelError(HeadscopeError):
    """The model's architecture has no adapter (or no attention heads at all)."""


class InputError(HeadscopeError, ValueError):
    """A bad argument: empty text, z out of range, a mask of the wrong shape, ..."""


class CancelledError(HeadscopeError):
    """Long work was stopped by the user through its cancel callback."""


class OutputError(HeadscopeError):
    """A result could not be written (full disk, missing or read-only folder); nothing half-written is left."""
