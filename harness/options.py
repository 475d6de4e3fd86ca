"""The harness's command-line options: parsing, validation, and what ``auto`` resolves to."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_CASE_TIMEOUT_S = 120.0
DEFAULT_SEED = 1234
CPU_WORLD_SIZES = (1, 2, 4)
# The longest wait the platform can make: the pool waits on its ranks with poll(), whose timeout is
# a C int of milliseconds (2**31 - 1 ms, about 24.8 days); longer waits raise OverflowError.
MAX_CASE_TIMEOUT_S = float((2**31 - 1) // 1000)


class OptionError(ValueError):
    """A bad option value; the message is one line that names the option."""


@dataclass(frozen=True)
class Settings:
    world_sizes: tuple[int, ...]
    backend: str
    device: str
    report_dir: str
    case_timeout_s: float
    seed: int
    gpu_count: int
    fault: str | None = None  # a planted sync fault (the self-check's); never in a real run


def parse_world_sizes(text: str) -> tuple[int, ...] | None:
    """``auto`` gives None (resolved with the backend); otherwise a sorted tuple of distinct sizes."""
    text = text.strip()
    if text == "auto":
        return None
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise OptionError(
                f"--world-sizes: {part!r} is not a positive integer (give a comma list like 1,2,4, or auto)"
            )
        sizes.append(int(part))
    return tuple(sorted(set(sizes)))


def parse_backend(text: str) -> str:
    if text not in BACKENDS:
        raise OptionError(f"--backend: {text!r} is not one of {', '.join(BACKENDS)}")
    return text


def parse_case_timeout(text: str | float) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise OptionError(f"--case-timeout: {text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise OptionError(f"--case-timeout: {text!r} must be a positive number of seconds")
    if value > MAX_CASE_TIMEOUT_S:
        raise OptionError(f"--case-timeout: {text!r} is longer than this platform can wait "
                          f"(at most {MAX_CASE_TIMEOUT_S:.0f} s, about 24 days)")
    return value


def parse_seed(text: str | int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"--seed: {text!r} is not an integer") from None
    if value < 0:
        raise OptionError(f"--seed: {text!r} must be zero or positive")
    return value


def count_gpus() -> int:
    """CUDA devices this process can see. Without an NVIDIA driver there are none, and importing
    torch (seconds, in the controller and every xdist worker) is not needed to know it."""
    if not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidiactl"):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def resolve(
    *, world_sizes: str, backend: str, report_dir: str, case_timeout: str | float, seed: str | int,
    gpu_count: int | None = None, fault: str | None = None,
) -> Settings:
    """Validate every option and resolve ``auto``: nccl when every rank can have its own GPU."""
    sizes = parse_world_sizes(world_sizes)
    backend = parse_backend(backend)
    timeout = parse_case_timeout(case_timeout)
    seed_value = parse_seed(seed)
    gpus = count_gpus() if gpu_count is None else gpu_count
    if backend == "auto":
        wanted = max(sizes) if sizes else 1
        backend = "nccl" if gpus >= wanted and gpus > 0 else "gloo"
    if sizes is None:
        if backend == "nccl":
            sizes = tuple(2**k for k in range(int(math.log2(gpus)) + 1)) if gpus else (1,)
        else:
            sizes = CPU_WORLD_SIZES
    return Settings(
        world_sizes=sizes,
        backend=backend,
        device="cuda" if backend == "nccl" else "cpu",
        report_dir=report_dir,
        case_timeout_s=timeout,
        seed=seed_value,
        gpu_count=gpus,
        fault=fault,
    )
