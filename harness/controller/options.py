"""The harness's command-line options: parsing, validation, and what ``auto`` resolves to."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from harness.wrappers.registry import parse as parse_wrappers
from harness.wrappers.registry import parse_meshes

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
    launched: bool = False  # the ranks are a launcher's processes (python -m harness launch), not local pools
    # under a launcher: how to start the same launch again, before `-m harness launch` (the rerun command)
    relaunch: tuple[str, ...] = ()
    # the wrappers cells run under (--wrappers): "auto" or names (harness/wrappers/registry.py)
    wrappers: tuple[str, ...] | str = "auto"
    # the meshes FSDP2 cells also run on (--meshes): "auto" (each case's own) or names, () for none
    meshes: tuple[str, ...] | str = "auto"


def argparse_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from one of these parsers, whose message already names the option (argparse
    names it again: the parser's own name is dropped)."""
    import argparse

    def convert(text: str) -> object:
        try:
            return parse(text)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    return convert


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


# The controller and xdist workers never import torch, nor initialise CUDA: the GPU count comes from a
# short-lived process, once a session (xdist workers inherit it through this variable).
GPU_COUNT_VARIABLE = "GRADSYNC_HARNESS_GPU_COUNT"
# Device files of the drivers torch's CUDA and ROCm builds use; with none of them there is no GPU.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")
_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def probe_gpus(command: Sequence[str] | None = None, *, timeout_s: float = 120.0) -> int:
    """GPUs that torch (a CUDA or a ROCm build) sees, counted in a separate process; 0 if it fails."""
    command = list(command) if command is not None else [sys.executable, "-c", _PROBE]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def gpu_driver_present() -> bool:
    """Whether a GPU driver torch's CUDA or ROCm build uses is on this host (one of GPU_DEVICE_FILES)."""
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def count_gpus() -> int:
    """GPUs this session's ranks can use (CUDA_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES apply)."""
    cached = os.environ.get(GPU_COUNT_VARIABLE, "")
    if cached.isdigit():
        return int(cached)
    gpus = probe_gpus() if gpu_driver_present() else 0
    os.environ[GPU_COUNT_VARIABLE] = str(gpus)
    return gpus


def resolve(
    *, world_sizes: str, backend: str, report_dir: str, case_timeout: str | float, seed: str | int,
    gpu_count: int | None = None, fault: str | None = None, wrappers: str = "auto", meshes: str = "auto",
) -> Settings:
    """Validate every option and resolve ``auto``: nccl when every rank can have its own GPU."""
    sizes = parse_world_sizes(world_sizes)
    backend = parse_backend(backend)
    timeout = parse_case_timeout(case_timeout)
    seed_value = parse_seed(seed)
    try:
        wrapper_selection = parse_wrappers(wrappers)
    except ValueError as exc:
        raise OptionError(f"--wrappers: {exc}") from None
    try:
        mesh_selection = parse_meshes(meshes)
    except ValueError as exc:
        raise OptionError(f"--meshes: {exc}") from None
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
        wrappers=wrapper_selection,
        meshes=mesh_selection,
    )
