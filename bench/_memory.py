"""Peak-memory helpers shared by the bench scripts (Linux /proc): the process's resident set
(VmRSS), its peak (VmHWM) and a reset of that peak, and the peak RSS growth during one call.

RSS only falls when freed memory goes back to the OS. glibc raises its mmap threshold after
large frees (up to 32 MiB), after which freed tensors stay in the heap and a later allocation
reuses them without the RSS growing: `fixed_mmap_threshold()` pins the threshold so every
allocation of 64 KiB or more is its own mapping, returned on free, and the RSS follows the live
tensors. Call it once at startup, before the big allocations."""
import ctypes
import gc
import re

_M_MMAP_THRESHOLD = -3          # glibc mallopt parameter


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def rss_bytes() -> int:
    return 1024 * _status_kib("VmRSS")


def peak_bytes() -> int:
    return 1024 * _status_kib("VmHWM")


def reset_peak() -> None:
    """Set the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def fixed_mmap_threshold(threshold: int = 64 * 1024) -> bool:
    """Pin glibc's mmap threshold (see the module doc); False when libc is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def peak_growth(fn):
    """(peak RSS during fn() minus the RSS before it, in bytes; fn's result). The result is still
    alive when the peak is read, so memory it holds counts."""
    gc.collect()
    before = rss_bytes()
    reset_peak()
    result = fn()
    return peak_bytes() - before, result
