"""Reading a user's input file: the one capped, regular-file-only reader.

Every file headscope reads on a user's behalf (--text-file, --train-text / --eval-text,
--ablation-file, mask.json, head_layout.json, config.json, a checkpoint's index) goes through
`read_file_bytes` (or `read_file_text`; a reader that parses a file piece by piece, such as the GGUF
header reader, opens it with `open_regular`), so none of them can:

- hang on a FIFO: the file is opened with O_NONBLOCK (a FIFO with no writer opens at once) and
  refused from its fstat before a byte is read;
- exhaust memory on /dev/zero, /dev/urandom or a huge file: only regular files are read, and never
  more than `max_bytes` + 1 bytes (a larger file is cut, or refused, as the caller asks);
- leak a raw OSError: a missing file, a folder, a name too long (errno 36), a permission problem
  become one InputError naming the problem and the fix (worded by `atomic.os_problem`).
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from analysis.core.atomic import os_problem
from analysis.core.errors import InputError, shorten

_ENDLESS = "(a device, pipe or socket may never end)"
# st_mode test -> how a non-regular file is described (checked in this order)
_NOT_REGULAR = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, f"a pipe (FIFO) {_ENDLESS}"),
    (stat.S_ISCHR, f"a character device {_ENDLESS}"),
    (stat.S_ISBLK, f"a block device {_ENDLESS}"),
    (stat.S_ISSOCK, f"a socket {_ENDLESS}"),
)
# an input file that is not there is worded for a file, not for a folder on the path
_MISSING = ("it does not exist", "check the path")


def describe_kind(mode: int) -> str:
    """What a non-regular st_mode is, in words ("a folder", "a pipe (FIFO) ...")."""
    return next((words for test, words in _NOT_REGULAR if test(mode)), "not a regular file")


@contextmanager
def open_regular(path, *, what: str, fix: str) -> Iterator[tuple[BinaryIO, int]]:
    """(binary handle, size in bytes) of the regular file `path`, for a reader that parses it piece
    by piece (a GGUF header): opened with O_NONBLOCK and refused from its fstat unless it is a regular
    file, like `read_file_bytes`; OSErrors while it is open become the same InputError."""
    text = os.fspath(path) if not isinstance(path, str) else path
    if not str(text).strip() or "\x00" in str(text):
        raise InputError(f"{what} path {str(text)[:80]!r} is empty or holds a NUL byte; {fix}.")
    shown = shorten(text, 120)
    try:
        fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        problem, how = _MISSING if err.errno == errno.ENOENT else os_problem(err)
        raise InputError(f"Cannot read {_object(what)} {shown}: {problem}; {how}, or {fix}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{what} {shown} is {describe_kind(info.st_mode)}, not a regular file; {fix}.")
        os.set_blocking(fd, True)
    except OSError as err:
        os.close(fd)
        problem, how = os_problem(err)
        raise InputError(f"Cannot read {_object(what)} {shown}: {problem}; {how}, or {fix}.") from None
    except BaseException:
        os.close(fd)
        raise
    handle = os.fdopen(fd, "rb")
    try:
        yield handle, info.st_size
    except OSError as err:
        problem, how = os_problem(err)
        raise InputError(f"Cannot read {_object(what)} {shown}: {problem}; {how}, or {fix}.") from None
    finally:
        handle.close()


def read_file_bytes(path, max_bytes: int, *, what: str, fix: str, cut: bool = False) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them.

    `cut=False`: a larger file is an InputError ("larger than ..."); `cut=True`: its first
    `max_bytes` bytes are returned (the caller trims a cut character). `what` names the input in
    the message ("--text-file", "The mask file"), `fix` says what to do instead."""
    chunks, left = [], max_bytes + 1
    with open_regular(path, what=what, fix=fix) as (handle, _length):
        while left > 0:
            chunk = handle.read(min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        if not cut:
            raise InputError(f"{what} {shorten(path, 120)} is larger than {_size(max_bytes)}, far more than such a "
                             f"file holds; {fix}.")
        return data[:max_bytes]
    return data


def check_regular_size(path, max_bytes: int, *, what: str, fix: str) -> int:
    """The size of the regular file `path` (nothing is read), InputError if it is no regular file or
    larger than `max_bytes`: for files another library reads (a tokenizer through transformers)."""
    with open_regular(path, what=what, fix=fix) as (_handle, size):
        pass
    if size > max_bytes:
        raise InputError(f"{what} {shorten(path, 120)} is larger than {_size(max_bytes)}, far more than such a file "
                         f"holds; {fix}.")
    return size


def read_file_text(path, max_bytes: int, *, what: str, fix: str) -> str:
    """`read_file_bytes` decoded as UTF-8 (InputError if it is not UTF-8 text)."""
    data = read_file_bytes(path, max_bytes, what=what, fix=fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{what} {str(path)[:120]} is not UTF-8 text; {fix}.") from None


def _object(what: str) -> str:
    """`what` in the middle of a sentence ("Cannot read the mask file ..."): a leading "The" lowered."""
    return "t" + what[1:] if what.startswith("The ") else what


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB" if n >= 2**10 else f"{n} bytes"
