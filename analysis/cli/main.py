"""The entry point: the parser built from the registered commands, SIGTERM as Ctrl-C, and `main`
(one error line and exit 2 for a user error, 130 for an interrupt; rank 0 alone writes)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from analysis.cli.common import COMMANDS, render
from analysis.core import distributed
from analysis.core.atomic import atomic_write, check_output_file
from analysis.core.errors import HeadscopeError


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every registered command. With `argv`, only the command it names gets its options
    built (the others stay in the listing with their help): a command's options may import heavy parts
    of the library (the export formats, the pipeline), which the other commands never pay for."""
    prog = "headscope" if Path(sys.argv[0]).name == "headscope" else "python -m analysis"
    parser = argparse.ArgumentParser(prog=prog,
                                     description="headscope: score, mask, sweep, evaluate and export attention heads headlessly.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None) if argv is not None else None
    for command in COMMANDS.values():
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        if chosen is None or command.name == chosen:
            command.add_arguments(child)
    return parser


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt like Ctrl-C, so `finally` blocks remove temporaries; restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    ns = parser.parse_args(argv)
    out = getattr(ns, "out", None)
    command = COMMANDS[ns.command]
    team = distributed.SOLO
    try:
        with sigterm_as_interrupt():
            team = ns.team = distributed.team()          # SOLO unless a launcher started several processes
            if not team.is_main:
                if not command.distributed:
                    return 0                             # rank 0 runs this command alone
                if hasattr(ns, "quiet"):
                    ns.quiet = True                      # one set of progress bars: rank 0's
            if out is not None:
                check_output_file(out, "--out")          # before any work: say now what is wrong with it
            payload, rows = command.run(ns)
            text = render(payload, rows, getattr(ns, "format", "json"))
            if not team.is_main:
                pass                                     # rank 0 alone writes the result
            elif out is not None:
                atomic_write(out, text, what="--out")
            else:
                sys.stdout.write(text)
    except HeadscopeError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)   # one line, whatever the message holds
        return 2
    except KeyboardInterrupt:
        if team.is_distributed:
            print(f"error: the {team.world}-process run was stopped ({team.describe()}): another process ended "
                  f"(see the launcher's report) or the run was interrupted; nothing was written.", file=sys.stderr)
        else:
            print("error: interrupted (Ctrl-C or SIGTERM); temporary files were removed and nothing was "
                  "half-written. Run the command again to finish it.", file=sys.stderr)
        return 130
    finally:
        distributed.leave(team)
    return 0
