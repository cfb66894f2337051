"""Helpers of the hostile-input tests (issue 36): the one-line contract, the CLI in-process with a deadline,
the CLI in a subprocess with a memory ceiling, a FIFO that cannot hang a test, and the peak memory of a call.

The contract: a user error exits 2 with exactly one line starting "error: " on stderr (naming the problem
and the fix), no traceback, nothing on stdout. A case that hangs or grows without bound on a broken build
must fail the test, not stall the suite: in-process calls run under `deadline` (SIGALRM) or in a thread
released by `released_fifo`, and subprocesses are killed at a memory ceiling (`run_cli`).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer tiny Llama folder with a tokenizer (tests/_apptools.tiny_model_dir), shared: copy it to change it."""
    from tests._apptools import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("inputs") / "tiny", num_hidden_layers=2)


def one_error_line(err: str, *patterns: str) -> str:
    """The single "error: " line of `err` (asserting there is exactly one, and no traceback), which
    must match every regex in `patterns` (case-insensitive)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, f"expected one error line, got: {err[-2000:]!r}"
    assert "Traceback" not in err, err[-2000:]
    for pattern in patterns:
        assert re.search(pattern, lines[0], re.I), f"{pattern!r} not in: {lines[0]}"
    return lines[0]


class Overran(BaseException):
    """Raised by `deadline` in the main thread: the call ran past its time (no Exception: nothing swallows it)."""


def run_captured(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m analysis ARGV` run in this process (capsys)."""
    from analysis import cli
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def only_error_line(err: str) -> str:
    """stderr that is one "error: " line and nothing else (no traceback, no warning): that line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@contextlib.contextmanager
def deadline(seconds: float):
    """Abort the block with Overran after `seconds` (main thread only): a command that would run for ever
    on a broken build fails the test instead."""
    def expire(signum, frame):
        raise Overran(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def address_space(extra: int = 4 * 2**30):
    """Cap this process's address space at its present size + `extra` for the block (the soft RLIMIT_AS,
    restored after): a call that would allocate without end gets a MemoryError instead of the OOM killer,
    which would take the whole test session with it."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    ceiling = _status("VmSize") + extra
    if hard != resource.RLIM_INFINITY:
        ceiling = min(ceiling, hard)
    resource.setrlimit(resource.RLIMIT_AS, (ceiling, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def cli_run(argv, seconds: float = 60) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m analysis argv` run in this process, within `seconds` and
    4 GiB of new address space."""
    from analysis import cli
    out, err = io.StringIO(), io.StringIO()
    with deadline(seconds), address_space(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def cli_error(argv, *patterns: str, seconds: float = 60) -> str:
    """Run the CLI in-process and assert the one-line contract (exit 2, nothing on stdout)."""
    code, out, err = cli_run(argv, seconds)
    assert code == 2, (code, err[-2000:])
    assert out == "", out[:500]
    return one_error_line(err, *patterns)


def run_cli(argv, *, timeout: float = 120, max_rss: int = 2 * 2**30, env: dict | None = None,
            stdout=subprocess.PIPE, cwd=None) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in bytes) of `python -m analysis argv` in a subprocess, killed (and the
    test failed) past `timeout` seconds or `max_rss` bytes of resident memory."""
    import psutil
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "analysis", *map(str, argv)], cwd=cwd or ROOT, env=environment,
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE)
    watched, peak, started = psutil.Process(proc.pid), 0, time.monotonic()
    drained: list[bytes] = []
    reader = threading.Thread(target=lambda: drained.append(proc.stderr.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, watched.memory_info().rss)
        if peak > max_rss or time.monotonic() - started > timeout:
            proc.kill()
            proc.wait()
            raise AssertionError(f"killed: {peak / 2**20:.0f} MiB resident after {time.monotonic() - started:.0f} s "
                                 f"(limits {max_rss / 2**20:.0f} MiB, {timeout} s)")
        time.sleep(0.02)
    reader.join(10)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode, (drained[0] if drained else b"").decode("utf-8", "replace"), peak


@contextlib.contextmanager
def released_fifo(path: Path):
    """Make `path` a FIFO; on leaving, open it for writing and close it, so a reader a broken build left
    blocked on it (open() waits for a writer) returns and the test can fail instead of hanging."""
    os.mkfifo(path)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)     # ENXIO when nobody is blocked reading
            os.close(fd)


def in_thread(fn, seconds: float, release=None):
    """fn()'s result, run in a daemon thread; if it is still running after `seconds`, call `release` (which
    unblocks it, e.g. by opening a FIFO it waits on) and fail."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as err:             # handed to the test thread
            box["error"] = err
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        if release is not None:
            release()
        worker.join(10)
        raise AssertionError(f"still running after {seconds} s (blocked on a FIFO, or reading without end)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


@contextlib.contextmanager
def peak_memory():
    """Yields a dict whose "grew" is, after the block, how far this process's peak resident memory rose above
    its resident memory before it (Linux: the peak is reset through /proc/self/clear_refs where allowed; else
    the old peak stays and only growth past it is seen, which never fails a test wrongly)."""
    result = {"grew": 0}
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    before, old_peak = _status("VmRSS"), _status("VmHWM")
    yield result
    result["grew"] = max(0, _status("VmHWM") - max(before, old_peak))
