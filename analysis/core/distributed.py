"""Multi-process runs: split independent work items over the processes of a launch, gather them in order.

A launcher (`accelerate launch --multi_gpu --num_processes N ...`, `torchrun --nproc_per_node N ...`,
several nodes: docs/DISTRIBUTED.md) starts N copies of the same command and sets RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR / MASTER_PORT. `team()` reads them and joins the process group (NCCL
when the processes have GPUs, gloo on CPU; one GPU per process, cuda:LOCAL_RANK), or returns
`SOLO` (one process, nothing to join) when no launcher is there.

Every process runs the same program; where the work splits, each calls `Team.map(fn, n)`:
- the n items get owners by a rule every process computes the same way (round-robin, or the
  heaviest item first to the least-loaded process when items have weights);
- each process computes fn(i) for its own items only, exactly as one process would (same
  inputs, same batch shapes), so every item's numbers are those of a single-process run;
- the per-item results are gathered (all-gather of pickled CPU objects over gloo) and every
  process gets the full list in item order; callers then do any sum in the single-process order.
Only the main process (rank 0) writes files or prints results (`Team.is_main`).

A lost process: every gather runs under a deadline of HEADSCOPE_DIST_TIMEOUT_S seconds (default
600, also the process group's timeout). A peer that died (its sockets close) or stops answering
(timeout) raises `DistributedError` on the others, one clear line in the CLI; a watchdog thread
ends the process (exit status 2, the same line on stderr) should a backend still hang
TIMEOUT + 10 s later. The launcher then stops the remaining processes.

Test hook: HEADSCOPE_DIST_FAULT="kill:R" makes rank R SIGKILL itself at its first gather,
"hang:R" makes it stop answering there, waiting at a cancel point, so the launcher's SIGTERM ends it
as it ends a busy worker (tests/test_distributed.py uses both).

torch is imported where a launch needs it: a single process (SOLO) never imports it here, so the CLI's
start and its refusals stay fast.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

from analysis.core.errors import DistributedError, InputError, first_line
from analysis.core.progress import raise_if_signalled

TIMEOUT_ENV = "HEADSCOPE_DIST_TIMEOUT_S"
FAULT_ENV = "HEADSCOPE_DIST_FAULT"
DEFAULT_TIMEOUT_S = 600.0
WATCHDOG_GRACE_S = 10.0
LOST_EXIT_STATUS = 2

T = TypeVar("T")


def timeout_seconds(environ=os.environ) -> float:
    """HEADSCOPE_DIST_TIMEOUT_S as a positive float (default 600); InputError for anything else."""
    text = environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InputError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds > 0; e.g. {TIMEOUT_ENV}=600.")
    return value


def owners(n: int, world: int, weights: Sequence[float] | None = None) -> list[int]:
    """Rank that computes each of n items: round-robin, or with `weights` the heaviest item first
    to the least-loaded rank (ties: the lower item index, the lower rank). Deterministic. [n]"""
    if weights is None:
        return [i % world for i in range(n)]
    if len(weights) != n:
        raise InputError(f"owners: {len(weights)} weights for {n} items.")
    load = [0.0] * world
    out = [0] * n
    for i in sorted(range(n), key=lambda i: (-float(weights[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[i] = rank
        load[rank] += float(weights[i])
    return out


@dataclass(frozen=True)
class Team:
    """The processes of one run, seen from one of them; `SOLO` is a single-process run."""

    rank: int = 0
    world: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: object = None          # gloo process group for object gathers (None = the default group)
    backend: str = "none"         # "gloo" | "nccl" | "none" (single process)

    @property
    def is_main(self) -> bool:
        """The process that writes outputs and prints results."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"

    def mine(self, n: int, weights: Sequence[float] | None = None) -> list[int]:
        """The items of n this process computes, in item order."""
        return [i for i, r in enumerate(owners(n, self.world, weights)) if r == self.rank]

    def map(self, fn: Callable[[int], T], n: int, *, weights: Sequence[float] | None = None,
            what: str = "the work") -> list[T]:
        """[fn(0), ..., fn(n-1)]: each process computes its own items, every process gets all of them.

        fn must depend only on i (and on state every process shares): item i then has the same
        value whichever process computed it. One process: a plain loop, nothing else."""
        if not self.is_distributed:
            return [fn(i) for i in range(n)]
        done = {i: fn(i) for i in self.mine(n, weights)}
        merged: dict[int, T] = {}
        for part in self.all_gather(done, what):
            merged.update(part)
        return [merged[i] for i in range(n)]

    def fold(self, fn: Callable[[int], T], n: int, add: Callable[[T | None, T], T], *,
             what: str = "the work") -> T | None:
        """add(...add(add(None, fn(0)), fn(1))..., fn(n-1)): the per-item values summed in item order.

        One process streams (one item's value alive at a time); a launch computes the items on their
        owners, gathers them and folds them in the same order, so the sum is the single-process one."""
        acc = None
        if not self.is_distributed:
            for i in range(n):
                acc = add(acc, fn(i))
            return acc
        for value in self.map(fn, n, what=what):
            acc = add(acc, value)
        return acc

    def all_gather(self, obj, what: str = "the work") -> list:
        """Every process's `obj` (picklable, on the CPU), in rank order, on every process.

        DistributedError when a peer is lost (closed connection or no answer within the timeout)."""
        if not self.is_distributed:
            return [obj]
        import torch.distributed as dist

        _fault_hook(self)
        out = [None] * self.world
        with self.deadline(what):
            try:
                dist.all_gather_object(out, on_cpu(obj), group=self.group)
            except (RuntimeError, ConnectionError, OSError) as err:   # torch.distributed.DistError is a RuntimeError
                raise DistributedError(self.lost_message(what, backend_reason(err))) from None
        return out

    def barrier(self, what: str = "the end of the run") -> None:
        """Wait until every process gets here (an all-gather of nothing, under the same deadline)."""
        self.all_gather(None, what)

    def lost_message(self, what: str, reason: str) -> str:
        return (f"the {self.world}-process run lost a worker during {what} ({self.describe()}: {reason}). "
                f"A process ended or stopped answering within {self.timeout_s:g} s ({TIMEOUT_ENV}); "
                f"nothing was written. See the launcher's report for the process that ended, then run "
                f"the command again.")

    @contextmanager
    def deadline(self, what: str) -> Iterator[None]:
        """Watchdog: if the block has not finished TIMEOUT + grace seconds from now, print the lost-worker
        line and end this process (a backend that hangs past its own timeout cannot hold the run)."""
        finished = threading.Event()

        def watch() -> None:
            if not finished.wait(self.timeout_s + WATCHDOG_GRACE_S):
                reason = f"no answer for {self.timeout_s + WATCHDOG_GRACE_S:g} s"
                sys.stderr.write(f"error: {self.lost_message(what, reason)}\n")
                sys.stderr.flush()
                os._exit(LOST_EXIT_STATUS)

        thread = threading.Thread(target=watch, name="headscope-dist-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            finished.set()


SOLO = Team()


def backend_reason(err: BaseException) -> str:
    """The first sentence of a backend's error, without its source-file prefix ("[.../pair.cc:553] ")."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().splitlines()[0] if str(err).strip() else "")
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    return sentence[:160] or type(err).__name__


def on_cpu(obj):
    """obj with every tensor inside nested dicts / lists / tuples moved to the CPU (what a gather sends)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


def launched(environ=os.environ) -> bool:
    """True when a launcher started several processes (WORLD_SIZE > 1)."""
    try:
        return int(environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def _backend(environ=os.environ) -> str:
    """NCCL when this process has a GPU to itself and accelerate did not ask for the CPU, else gloo."""
    import torch

    use_cpu = environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return "nccl" if torch.cuda.is_available() and not use_cpu else "gloo"


def team(environ=os.environ) -> Team:
    """This process's Team: SOLO without a launcher; else join (once) the launcher's process group.

    On NCCL, process LOCAL_RANK uses GPU cuda:LOCAL_RANK ("cuda" means that GPU from here on)."""
    if not launched(environ):
        return SOLO
    import torch
    import torch.distributed as dist

    timeout = timeout_seconds(environ)
    delta = datetime.timedelta(seconds=timeout)
    if not dist.is_initialized():
        backend = _backend(environ)
        if backend == "nccl":
            torch.cuda.set_device(int(environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend=backend, timeout=delta)
        except (RuntimeError, ValueError, ConnectionError, OSError) as err:
            raise DistributedError(f"Could not join the multi-process run ({first_line(err)}). Start it with "
                                   f"`accelerate launch` or `torchrun` (docs/DISTRIBUTED.md).") from None
    backend = dist.get_backend()
    group = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=delta)
    return Team(dist.get_rank(), dist.get_world_size(), timeout, group, backend)


def leave(t: Team) -> None:
    """Leave the process group at the end of a run (a no-op for SOLO)."""
    if t.is_distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _fault_hook(t: Team) -> None:
    """The test hook of the module docstring (HEADSCOPE_DIST_FAULT)."""
    action, _, rank = os.environ.get(FAULT_ENV, "").partition(":")
    if not rank.strip().isdigit() or int(rank) != t.rank:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":          # never answers; the launcher's SIGTERM (recorded by the CLI) ends it
        while True:
            raise_if_signalled()
            time.sleep(0.1)
