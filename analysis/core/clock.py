"""The one clock of every timing: wall and process CPU seconds, each read after the device has finished its work.

A GPU call returns before its kernels have run, so a time read right after it measures the queueing, not the
work. `synchronize(device)` waits for a device's queued kernels (the table `SYNCHRONIZE`: CUDA, MPS; nothing to
wait for on the CPU) and `Clock(device)` reads (wall, CPU) only after that wait. The decode loop
(analysis.measure.decode), the harness's generations, the long-context probes' time estimate and the speed
report (analysis.compress.timing) all time through it.

CPU time is this process's (`time.process_time`): the steadier measure on a machine shared with other work
(time spent descheduled is not counted); on a GPU it counts the host's side only.

Light: torch is imported inside the synchronizing functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


def _cuda(device) -> None:
    import torch
    torch.cuda.synchronize(device)


def _mps(device) -> None:
    import torch
    torch.mps.synchronize()


# device type -> wait for its queued kernels (a device type not named here runs synchronously)
SYNCHRONIZE: dict[str, Callable[[object], None]] = {"cuda": _cuda, "mps": _mps}


def device_type(device) -> str:
    """"cpu", "cuda", "mps", ... of a torch.device or a name such as "cuda:1"."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def synchronize(device) -> None:
    """Wait until `device` (a torch.device or its name) has run every kernel queued on it (no-op on the CPU)."""
    wait = SYNCHRONIZE.get(device_type(device))
    if wait is not None:
        wait(device)


@dataclass(frozen=True)
class Clock:
    """Reads (wall, CPU) seconds after `device` has finished its queued work."""
    device: object = "cpu"

    def now(self) -> tuple[float, float]:
        """(perf_counter, process_time), read after the device's kernels are done."""
        synchronize(self.device)
        return time.perf_counter(), time.process_time()

    def since(self, start: tuple[float, float]) -> tuple[float, float]:
        """(wall, CPU) seconds from `start` (a `now()`) to now."""
        wall, cpu = self.now()
        return wall - start[0], cpu - start[1]
