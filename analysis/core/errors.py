"""User-facing errors of headscope.

Every error a user can cause (bad path, unsupported architecture, absurd number) is raised
as a HeadscopeError subclass whose message says what went wrong *and how to fix it*. The
UI shows `str(err)` in an error box; it never shows a traceback for these.
"""


def shorten(text, limit: int = 100) -> str:
    """`text` (a path, a typed value) fit for a one-line message: cut after `limit` characters,
    with "..." saying so, so a 5,000-character input does not become a 5,000-character message."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


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


class DistributedError(HeadscopeError):
    """A multi-process run lost a process (it ended or stopped answering) or could not start."""


# a Ctrl-C while the CLI starts (its imports take seconds), before its own handler is in place
INTERRUPTED_AT_START = "error: interrupted (Ctrl-C) while headscope was starting; nothing was written."


def first_line(err: BaseException, limit: int = 200) -> str:
    """"Type: first line of its message" (just the type when it has none), to quote a library's error."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:limit]}" if text else type(err).__name__


def custom_code_refused(where: str, how: str = "trust_remote_code=True") -> ModelLoadError:
    """The error for a config whose auto_map asks to run code while trust_remote_code is off."""
    return ModelLoadError(f"{where} asks to run custom model code (auto_map), which is off. Pass {how} only if you "
                          f"trust that code, or use a model of an architecture transformers ships.")


def check_whole_number(value, what: str, *, low: int = 1, high: int | None = None, none_ok: bool = False):
    """`value` as an int in low .. high (None passes when `none_ok`); InputError otherwise.

    The one check for counts a user or a script passes (tokens, window, stride, batch size):
    2.5, nan, "8", True and 10**30 are refused before anything is allocated."""
    import numbers
    if value is None and none_ok:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and low <= int(value) and (high is None or int(value) <= high):
        return int(value)
    span = f"from {low:,} to {high:,}" if high is not None else f">= {low:,}"
    raise InputError(f"{what} must be a whole number {span}; got {str(value)[:40]!r}.")


SEED_MAX = 2**63 - 1                 # what numpy's and torch's generators both take


def check_seed(seed, what: str = "The seed") -> int:
    """`seed` as an int in 0 .. SEED_MAX (`check_whole_number`); InputError otherwise (2**70 would end in an
    OverflowError deep inside torch)."""
    return check_whole_number(seed, what, low=0, high=SEED_MAX)


def derived_seed(seed: int, offset: int) -> int:
    """The seed of a run's next generator (a second text set, a training epoch): `seed + offset` wrapped into
    0 .. SEED_MAX, so a seed `check_seed` passed never derives one that numpy or torch refuses (the same value
    as `seed + offset` whenever that is in range)."""
    return (int(seed) + int(offset)) % (SEED_MAX + 1)
