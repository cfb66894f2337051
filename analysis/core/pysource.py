"""Built-in Python source: the running interpreter's own standard-library files (nothing is downloaded).

The code text of the domain comparison and the code probe's items come from these files, read
(never changed) from sysconfig's "stdlib" folder of the Python that runs headscope, in the fixed
order of `STDLIB_FILES` (plain-Python modules present in CPython 3.9 to 3.13); the text therefore
follows the interpreter's version, which `python_version()` names wherever it is reported.
Licence: the Python Software Foundation License Version 2 (the LICENSE.txt in that folder);
`PYTHON_ATTRIBUTION` says so wherever the text is shown.
"""
from __future__ import annotations

import platform
import sysconfig
from functools import lru_cache
from pathlib import Path

from analysis.core.errors import HeadscopeError
from analysis.core.text import Article, _joined

STDLIB_FILES = ("string.py", "textwrap.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py", "calendar.py",
                "difflib.py", "shlex.py", "csv.py", "fnmatch.py", "glob.py", "colorsys.py", "dataclasses.py",
                "functools.py", "json/decoder.py", "json/encoder.py", "argparse.py", "configparser.py",
                "gettext.py", "ipaddress.py", "pprint.py", "random.py", "tokenize.py", "copy.py", "enum.py",
                "html/parser.py", "email/utils.py", "urllib/parse.py", "ast.py")


def python_version() -> str:
    return platform.python_version()


PYTHON_ATTRIBUTION = (f"Built-in code: source files of the Python {python_version()} standard library, "
                      "Copyright (c) Python Software Foundation, under the PSF License Version 2 (LICENSE.txt in "
                      "the interpreter's library folder).")


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def stdlib_sources() -> tuple[tuple[str, str], ...]:
    """(relative path, text) of every file of STDLIB_FILES this interpreter has, in that order."""
    folder = stdlib_folder()
    out = []
    for name in STDLIB_FILES:
        try:
            out.append((name, (folder / name).read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    if not out:
        raise HeadscopeError(f"No Python standard-library source files were found in {folder} (a Python built "
                             "without them); the built-in code text needs them. Upload your own code text instead.")
    return tuple(out)


def python_source_text(max_chars: int | None = None) -> str:
    """The standard-library files joined like the built-in articles (core.text), cut to at most `max_chars`."""
    return _joined([Article(name, text) for name, text in stdlib_sources()], max_chars)
