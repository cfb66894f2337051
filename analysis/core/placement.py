"""Where a model lives and in which precision: the one home of device / dtype / placement options.

A `Placement` is what the user asked for (CLI options, the Model page, `load_model` keywords):

- `device`: "auto" | "cpu" | "cuda" | "cuda:N" | "mps". "auto" is CUDA when torch sees a GPU,
  else the CPU (mps only when asked for by name).
- `dtype`: "auto" | "float32" | "bfloat16" | "float16" (aliases fp32, bf16, fp16, or a
  torch.dtype). "auto" suits the device: float32 on the CPU (the exact reference path), bfloat16
  on a CUDA GPU that has it (else float16), float16 on mps.
- `max_memory`: "0=20GiB,cpu=8GiB" (GPU index, cpu, mps or disk = a size with a unit) and
  `offload_folder`: a folder for disk offload. Either one, or `device_map="auto"`, places the
  model with accelerate (`device_map="auto"`): blocks fill the devices in their budgets, then the
  CPU, then the disk.

`resolve()` checks everything before any weights are read and returns a `ResolvedPlacement`
(a torch.device, a torch.dtype, the accelerate keywords). Every mistake a user can make is one
line: InputError for a malformed option, ModelLoadError for a device this machine does not have,
a dtype whose kernels are missing there, or a placement the model cannot fit in (see
`check_fit`, the memory guard).

`input_device(model)` (the device token ids go to) and the offload helpers live in
analysis/arch/adapters.py, the layer that knows module internals.

torch is imported by what asks this machine (`resolve()`, the memory guard) and by `DTYPES`' values,
not by `Placement.of`: the CLI checks the options of every command before any heavy import.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.core.atomic import os_problem
from analysis.core.errors import InputError, ModelLoadError, OutputError

if TYPE_CHECKING:
    import torch


class _TorchDtypes(Mapping):
    """name -> torch.dtype for the supported dtypes: the names are known without torch, a value imports it."""

    NAMES = ("float32", "bfloat16", "float16")

    def __getitem__(self, name: str) -> "torch.dtype":
        if name not in self.NAMES:
            raise KeyError(name)
        import torch
        return getattr(torch, name)

    def __iter__(self):
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")  # plus "cuda:N"
DTYPES: Mapping[str, "torch.dtype"] = _TorchDtypes()
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_MAP_CHOICES = ("auto",)
HALF_DTYPE_NAMES = ("bfloat16", "float16")


def _torch_object(value, kind: str) -> bool:
    """Whether `value` is a torch.<kind> (a torch.device / torch.dtype); without torch imported, it cannot be."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, getattr(torch, kind))

_DEVICE = re.compile(r"^(cpu|mps|cuda)(?::(\d+))?$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY_KEY = re.compile(r"^(\d+|cpu|mps|disk)$")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse_device(device) -> str:
    """Normalize a device option: "auto" | "cpu" | "mps" | "cuda" | "cuda:N" (InputError otherwise)."""
    if _torch_object(device, "device"):
        device = str(device)
    text = str(device if device is not None else "auto").strip().lower()
    if text == "auto" or _DEVICE.match(text):
        if text.startswith(("cpu:", "mps:")) and not text.endswith(":0"):
            raise InputError(f"Unknown device {device!r}: only CUDA devices take an index. Use auto, cpu, "
                             f"cuda, cuda:N or mps.")
        return text.removesuffix(":0") if text.startswith(("cpu", "mps")) else text
    raise InputError(f"Unknown device {device!r}. Use auto, cpu, cuda, cuda:N (a GPU index) or mps.")


def parse_dtype(dtype) -> str:
    """Normalize a dtype option (a name, an alias or a torch.dtype) to "auto" or a DTYPES name."""
    if _torch_object(dtype, "dtype"):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise InputError(f"dtype {dtype_name(dtype)} is not supported; use one of {', '.join(DTYPES)}.")
    text = str(dtype if dtype is not None else "auto").strip().lower().removeprefix("torch.")
    text = DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_CHOICES:
        raise InputError(f"Unknown dtype {dtype!r}. Use one of {', '.join(DTYPE_CHOICES)}.")
    return text


def parse_size(text: str, what: str = "a memory size") -> int:
    """"20GiB" / "512MB" / a plain number of bytes -> bytes (InputError otherwise)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text).strip())
        if not match:
            raise InputError(f"{what}: {text!r} is not a size. Write a number with a unit, e.g. 8GiB, 512MiB "
                             f"or 2GB.")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if value <= 0:
        raise InputError(f"{what}: {text!r} must be more than 0 bytes.")
    return value


def parse_max_memory(spec) -> dict[int | str, int] | None:
    """"0=20GiB,cpu=8GiB" (or a dict) -> {0: bytes, "cpu": bytes}; None / "" -> None.

    Keys: a CUDA device index, cpu, mps or disk. InputError names the bad part."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    items = spec.items() if isinstance(spec, dict) else (
        part.split("=", 1) if "=" in part else (part, None) for part in str(spec).split(",") if part.strip())
    out: dict[int | str, int] = {}
    for key, value in items:
        name = str(key).strip().lower()
        if not _MEMORY_KEY.match(name) or value is None:
            raise InputError(f"max_memory: {str(key).strip()!r} is not DEVICE=SIZE with DEVICE a GPU index, cpu, "
                             f"mps or disk; write e.g. \"0=20GiB,cpu=8GiB\".")
        out[int(name) if name.isdigit() else name] = parse_size(value, f"max_memory for {name}")
    if not out:
        raise InputError("max_memory is empty; write e.g. \"0=20GiB,cpu=8GiB\".")
    return out


def format_bytes(n: float) -> str:
    """2.50 GiB / 300 MiB / 1 KiB / 12 B."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


# -- what this machine has -------------------------------------------------------------------

def cuda_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def mps_available() -> bool:
    import torch
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _current_cuda() -> int:
    """The GPU a bare "cuda" means: torch's current device. Under a launch each process has set it
    to its local rank (analysis.core.distributed.team), so 8 processes load onto 8 GPUs, not all on 0."""
    import torch
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def resolve_device(device) -> torch.device:
    """The torch.device for a device option; ModelLoadError when this machine lacks it."""
    import torch
    text = parse_device(device)
    if text == "auto":
        return torch.device("cuda", _current_cuda()) if cuda_count() else torch.device("cpu")
    if text.startswith("cuda"):
        count = cuda_count()
        if not count:
            raise ModelLoadError(f"--device {text}: torch sees no CUDA GPU on this machine (a CPU-only torch "
                                 f"build, or no driver). Use --device cpu or --device auto.")
        index = int(text.split(":")[1]) if ":" in text else _current_cuda()
        if index >= count:
            raise ModelLoadError(f"--device {text}: this machine has {count} CUDA GPU(s), numbered 0 to "
                                 f"{count - 1}. Pick one of those, or --device auto.")
        return torch.device("cuda", index)
    if text == "mps" and not mps_available():
        raise ModelLoadError("--device mps: Apple's Metal backend is not available here. Use --device cpu or auto.")
    return torch.device(text)


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype "auto" picks: float32 on the CPU, bfloat16 on CUDA where supported (else float16), float16 on mps."""
    import torch
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float16 if device.type == "mps" else torch.float32


# the precisions a run of long passes may choose (analysis.arch.attention.precision_block): float32 as the model is,
# or bfloat16 autocast where fast_bfloat16
PASS_PRECISIONS = ("float32", "bfloat16")
# CPU flags (Linux /proc/cpuinfo names) whose instructions multiply bfloat16 matrices natively: AVX-512 BF16
# (AMD Zen 4 and later, Intel Cooper Lake / Sapphire Rapids) and AMX (Intel Sapphire Rapids and later)
FAST_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo's first "flags" line (or `text`); empty where there is none."""
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
                text = stream.read(1 << 20)
        except OSError:
            return frozenset()
    for line in text.splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def fast_bfloat16(device_type: str = "cpu", flags: frozenset[str] | None = None) -> bool:
    """Whether bfloat16 matrix products are native here (faster than float32): a CUDA GPU with bfloat16, or a
    CPU with one of FAST_BFLOAT16_FLAGS (`flags`: the CPU's, default cpu_flags())."""
    if device_type == "cuda":
        import torch
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type != "cpu":
        return False
    return any(f in (cpu_flags() if flags is None else flags) for f in FAST_BFLOAT16_FLAGS)


@functools.lru_cache(maxsize=16)
def _kernels_work(device_type: str, index: int | None, dtype: torch.dtype) -> str | None:
    """None when a matmul, softmax and layer norm run in `dtype` on the device, else the error."""
    import torch
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        x = torch.ones(2, 4, 8, device=device, dtype=dtype)  # [B, T, D]
        y = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])  # [B, 1, T, D]
        torch.nn.functional.layer_norm(x @ x.transpose(-1, -2), (4,)).softmax(-1).sum() + y.sum()
    except (RuntimeError, TypeError, NotImplementedError) as err:
        return str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    return None


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """The torch.dtype for a dtype option on `device`; ModelLoadError when its kernels are missing there."""
    import torch
    name = parse_dtype(dtype)
    value = default_dtype(device) if name == "auto" else DTYPES[name]
    if value != torch.float32:
        problem = _kernels_work(device.type, device.index, value)
        if problem:
            raise ModelLoadError(f"--dtype {dtype_name(value)}: this torch has no {dtype_name(value)} kernels on "
                                 f"{device} ({problem}). Use --dtype float32.")
    return value


def check_offload_folder(folder) -> Path:
    """Create `folder` if needed and prove it is writable (a temp file); OutputError otherwise."""
    path = Path(os.fspath(folder)).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".headscope-probe-"):
            pass
    except OSError as err:
        problem, fix = os_problem(err)              # the one errno -> plain words table
        raise OutputError(f"--offload-folder {path}: cannot write there ({problem}); {fix}, on a disk with room "
                          f"for the offloaded weights.") from None
    return path


def disk_free(folder: Path) -> int:
    return shutil.disk_usage(folder).free


# -- the user's request and its resolution -----------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """What the user asked for; every field is a plain value (a cache key for the app)."""
    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None            # None or "auto" (accelerate); implied by the two below
    max_memory: str | None = None            # "0=20GiB,cpu=8GiB"
    offload_folder: str | None = None

    @classmethod
    def of(cls, device="auto", dtype="auto", device_map=None, max_memory=None, offload_folder=None) -> "Placement":
        """Normalized options (InputError for malformed ones; nothing about this machine is checked yet)."""
        if device_map not in (None, "", *DEVICE_MAP_CHOICES):
            raise InputError(f"Unknown device_map {device_map!r}; use auto (or leave it out).")
        if isinstance(max_memory, dict):
            max_memory = ",".join(f"{k}={v}" for k, v in max_memory.items())
        parse_max_memory(max_memory)
        return cls(parse_device(device), parse_dtype(dtype), device_map or None,
                   (max_memory or "").strip() or None,
                   None if offload_folder in (None, "") else os.fspath(offload_folder))

    @property
    def dispatched(self) -> bool:
        """Whether accelerate places the model (device_map, max_memory or an offload folder)."""
        return bool(self.device_map or self.max_memory or self.offload_folder)

    def resolve(self) -> "ResolvedPlacement":
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        budgets = parse_max_memory(self.max_memory)
        if budgets:
            for key in budgets:
                if isinstance(key, int):
                    resolve_device(f"cuda:{key}")
                elif key == "mps":
                    resolve_device("mps")
        folder = check_offload_folder(self.offload_folder) if self.offload_folder else None
        return ResolvedPlacement(self, device, dtype, self.dispatched, budgets, folder)


@dataclass(frozen=True)
class ResolvedPlacement:
    request: Placement
    device: torch.device
    dtype: torch.dtype
    dispatched: bool
    max_memory: dict[int | str, int] | None = None
    offload_folder: Path | None = None
    budgets: dict = field(default_factory=dict)   # what check_fit granted per device (bytes)

    def describe(self) -> str:
        where = "device_map=auto" if self.dispatched else str(self.device)
        extra = f", offload to {self.offload_folder}" if self.offload_folder else ""
        return f"{where}, {dtype_name(self.dtype)}{extra}"

    def load_kwargs(self) -> dict:
        """Keywords for from_pretrained: dtype and either device_map=<device> or accelerate's placement."""
        if not self.dispatched:
            return {"dtype": self.dtype, "device_map": str(self.device)} if self.device.type != "cpu" else {
                "dtype": self.dtype}
        kwargs = {"dtype": self.dtype, "device_map": "auto", "max_memory": dict(self.budgets)}
        if self.offload_folder is not None:
            kwargs["offload_folder"] = str(self.offload_folder)
        return kwargs


# -- the memory guard ----------------------------------------------------------------------------

def check_fit(resolved: ResolvedPlacement, need: int, name: str, *, available_bytes: int | None,
              estimate=None, margin_bytes: int = 0, margin_fraction: float = 0.0) -> ResolvedPlacement:
    """Refuse (ModelLoadError) only a model that cannot be placed anywhere it may go; else return
    the placement with the budgets accelerate gets.

    need: the estimate in the chosen dtype (weights * (1 + margin_fraction) + margin_bytes).
    available_bytes: free RAM (default: what the OS reports; tests pass a number). estimate:
    dtype -> need, so the message can say whether a smaller dtype would fit. Single device: the
    model must fit its free memory. Dispatched: the devices' budgets (max_memory, capped by what is
    free) plus the offload folder's free disk must hold it; the refusal names the option that
    would make it fit (--dtype, --offload-folder, --max-memory)."""
    import torch
    import psutil
    free_ram = psutil.virtual_memory().available if available_bytes is None else int(available_bytes)
    asked = resolved.max_memory or {}
    dtype = dtype_name(resolved.dtype)

    def gpu_free(index: int) -> int:
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)

    def weights_of(total: int) -> int:  # the part of an estimate a device must hold (no fixed margin)
        return max(0, int((total - margin_bytes) / (1 + margin_fraction)))

    def fits_in(dtype_: torch.dtype, capacity: int) -> bool:
        return estimate is not None and estimate(dtype_) <= capacity

    smaller = [DTYPES[n] for n in HALF_DTYPE_NAMES if DTYPES[n].itemsize < resolved.dtype.itemsize]
    if not resolved.dispatched:
        where = resolved.device
        free = gpu_free(where.index or 0) if where.type == "cuda" else free_ram
        if need <= free:
            return resolved
        hints = [f"--dtype {dtype_name(d)} (about {format_bytes(estimate(d))})" for d in smaller if fits_in(d, free)]
        hints.append("--offload-folder DIR (accelerate places what does not fit on the disk)")
        raise ModelLoadError(f"'{name}' needs about {format_bytes(need)} of {'RAM' if where.type == 'cpu' else where} "
                             f"in {dtype} but only {format_bytes(free)} is free. Close other programs, load it "
                             f"with {' or '.join(hints)}, or pick a smaller model.")
    budgets: dict[int | str, int] = {}
    if resolved.device.type == "cuda" and not any(isinstance(k, int) for k in asked):
        for index in range(cuda_count()):
            budgets[index] = weights_of(gpu_free(index))
    for key, value in asked.items():
        if key == "disk":
            continue
        budgets[key] = min(value, gpu_free(key)) if isinstance(key, int) else (
            min(value, weights_of(free_ram)) if key == "cpu" else value)
    budgets.setdefault("cpu", weights_of(free_ram))
    disk = 0
    if resolved.offload_folder is not None:
        disk = min(asked.get("disk", disk_free(resolved.offload_folder)), disk_free(resolved.offload_folder))
    weights = weights_of(need)
    capacity = sum(budgets.values()) + disk
    if weights <= capacity:
        return ResolvedPlacement(resolved.request, resolved.device, resolved.dtype, True, resolved.max_memory,
                                 resolved.offload_folder, budgets)
    hints = [f"--dtype {dtype_name(d)}" for d in smaller if fits_in(d, margin_bytes + int(capacity * (1 + margin_fraction)))]
    if resolved.offload_folder is None:
        hints.append("--offload-folder DIR (disk offload)")
    if asked:
        hints.append("a larger --max-memory")
    budget_text = ", ".join(f"{k}={format_bytes(v)}" for k, v in budgets.items())
    raise ModelLoadError(f"'{name}' needs about {format_bytes(weights)} for its weights in {dtype} but the placement "
                         f"holds only {format_bytes(capacity)} ({budget_text}"
                         f"{f', disk={format_bytes(disk)}' if resolved.offload_folder else ''}). "
                         f"Load it with {' or '.join(hints) or 'a smaller model'}.")
