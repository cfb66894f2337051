"""`python -m analysis ...` and the `headscope` command (`run`): the headless CLI (see analysis/cli/).

The CLI's own Ctrl-C and SIGTERM handling starts inside `analysis.cli.main`; the imports before it (the
parser's: light, no torch or transformers; a fraction of a second) can still meet a Ctrl-C, which is
caught here: one line and exit status 130, never a KeyboardInterrupt traceback. Nothing has been
written yet at that point.
"""

import sys

from analysis.core.errors import INTERRUPTED_AT_START       # a module without imports: nothing to wait for


def run() -> int:
    """Import the CLI and run it; a Ctrl-C during the imports is one error line (exit 130)."""
    try:
        from analysis.cli import main
    except KeyboardInterrupt:
        print(INTERRUPTED_AT_START, file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
