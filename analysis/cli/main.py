"""The entry point: the parser built from the registered commands, SIGTERM as Ctrl-C, and `main`
(one error line and exit 2 for a user error, a refused option included; 130 for an interrupt; rank 0
alone writes). Building the parser imports neither torch nor transformers (the options come from the
registries' declarations), so `--help` and the parser's refusals answer at once."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import warnings
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Iterator

from analysis.cli.common import COMMANDS, placement_kwargs, render
from analysis.core import distributed
from analysis.core import progress as cancel     # signals: a flag checked at cancel points
from analysis.core.atomic import atomic_write, check_output_file
from analysis.core.errors import INTERRUPTED_AT_START, HeadscopeError, check_seed
from analysis.core.placement import Placement


class Parser(argparse.ArgumentParser):
    """argparse with a refusal in one line (exit 2), like every other user error of the CLI: the usage
    block is what `--help` shows, not what a mistyped option prints."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every registered command. With `argv`, only the command it names gets its options
    built (the others stay in the listing with their help). Options are built from declarations only
    (scorers, policies, probes, detectors, formats): no command's options import torch or transformers."""
    prog = "headscope" if Path(sys.argv[0]).name == "headscope" else "python -m analysis"
    parser = Parser(prog=prog,
                    description="headscope: score, mask, sweep, evaluate and export attention heads headlessly.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None) if argv is not None else None
    for command in COMMANDS.values():
        child = sub.add_parser(command.name, help=command.help, description=command.help)
        if chosen is None or command.name == chosen:
            command.add_arguments(child)
    return parser


def is_seed(dest: str) -> bool:
    """Whether an option's dest is a seed (`--seed`, `--probe-seed`, `--train-seed`, a scorer's `seed`)."""
    return dest == "seed" or dest.endswith("_seed")


def check_seeds(ns: argparse.Namespace) -> None:
    """Every seed option of the command in 0 .. SEED_MAX (`check_seed`) before any work: -1 or 2**70 is one
    line naming the option, not numpy's or torch's traceback after the model loaded and the passes ran."""
    for dest, value in vars(ns).items():
        if is_seed(dest) and value is not None:
            check_seed(value, f"--{dest.replace('_', '-')}")


def _terminate(signum, frame) -> None:
    """Record the signal; the next cancel point raises KeyboardInterrupt (analysis.core.progress).
    A second signal before that point raises at once (work with no cancel point for a long time)."""
    if cancel.stop_requested():
        raise KeyboardInterrupt(f"signal {signum}")
    cancel.request_stop(signum)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT stop the run like Ctrl-C at the next cancel point, so `finally` blocks remove
    temporaries; the handlers are restored after. A signal landing in a finalizer (tqdm.__del__) is
    not lost: the handler only sets a flag."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    cancel.clear_stop()
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cancel.clear_stop()


# libraries whose WARNING log records are held like warnings (accelerate's "Some parameters are on
# the meta device ..." comes before the error that a Gradient-Head scorer on an offloaded model gives)
HELD_LOGGERS = ("accelerate",)


class _Held:
    """The warnings and library log warnings of one command: `emit()` shows them (after a success);
    after a user error they are dropped, so the error line is all of stderr."""

    def __init__(self, caught: list, records: list, showwarning):
        self.caught, self.records, self.showwarning = caught, records, showwarning

    def emit(self) -> None:
        for w in self.caught:
            self.showwarning(w.message, w.category, w.filename, w.lineno)
        for record in self.records:
            logging.getLogger(record.name).handle(record)


@contextmanager
def held_warnings() -> Iterator[_Held]:
    """Hold Python warnings (torch's "Detected pickle protocol 4 ..." before a pickle refusal) and
    HELD_LOGGERS' warnings while a command runs; the caller emits them once the command succeeded."""
    showwarning = warnings.showwarning
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in HELD_LOGGERS]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")           # each distinct warning once, as without holding
            yield _Held(caught, records, showwarning)
    finally:
        for lg, propagate in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:                                                 # a refused option: one line, exit 2 (Parser.error)
        ns = build_parser(argv).parse_args(argv)
    except KeyboardInterrupt:                            # before the handler below is in place
        print(INTERRUPTED_AT_START, file=sys.stderr)
        return 130
    out = getattr(ns, "out", None)
    command = COMMANDS[ns.command]
    team = distributed.SOLO
    try:
        with sigterm_as_interrupt(), held_warnings() as held:
            check_seeds(ns)
            team = ns.team = distributed.team()          # SOLO unless a launcher started several processes
            if not team.is_main:
                if not command.distributed:
                    return 0                             # rank 0 runs this command alone
                if hasattr(ns, "quiet"):
                    ns.quiet = True                      # one set of progress bars: rank 0's
            if out is not None:
                check_output_file(out, "--out")          # before any work: say now what is wrong with it
            Placement.of(**placement_kwargs(ns))         # --device / --dtype / ..., whatever the source (--checkpoint)
            stdout = sys.stdout                          # the result's alone: what the work prints goes to stderr
            with redirect_stdout(sys.stderr):            # (a harness task's module, a library's print)
                payload, rows = command.run(ns)
            cancel.raise_if_signalled()          # stopped after the last cancel point: write nothing
            text = render(payload, rows, getattr(ns, "format", "json"))
            if not team.is_main:
                pass                                     # rank 0 alone writes the result
            elif out is not None:
                atomic_write(out, text, what="--out")
            else:
                stdout.write(text)
        held.emit()                                  # a success: the held warnings, after the result
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
