"""The process a rank runs in, without torch: what the controller asks of it (``process_alive``, the
launcher's ``ACCELERATE_*`` settings the ranks drop) and the environment a rank sets before it imports
torch (one thread, its heap, the flight recorder, the variables accelerate reads)."""

from __future__ import annotations

import ctypes
import os


def process_alive(pid: int) -> bool:
    """Whether the process is there and not a zombie. A controller killed outright stays a zombie
    until whoever started it reaps it, who may first wait for the end of the run's output, which
    the run's resource tracker holds for as long as a rank holds the tracker's pipe."""
    try:
        os.kill(pid, 0)  # PermissionError: it is there, as another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True

# accelerate reads its launcher's settings from ACCELERATE_* variables (`accelerate launch` sets
# mixed precision, accumulation steps, FSDP, DeepSpeed, dynamo, debug mode): a cell's setup is its
# variant's alone, so ranks drop them all but these.
KEPT_ACCELERATE_VARIABLES = ("ACCELERATE_DISABLE_RICH", "ACCELERATE_LOG_LEVEL")


def launcher_settings() -> list[str]:
    """The names of the ACCELERATE_* settings a launcher or the user's shell left, which ranks drop."""
    return sorted(n for n in os.environ if n.startswith("ACCELERATE_") and n not in KEPT_ACCELERATE_VARIABLES)


def drop_launcher_settings() -> list[str]:
    """Remove the ACCELERATE_* settings a launcher or the user's shell left; return their names."""
    dropped = launcher_settings()
    for name in dropped:
        del os.environ[name]
    os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")
    return dropped


def limit_threads() -> None:
    """One thread a rank on CPU: ranks share the machine's cores with each other and with other pools
    (and the same thread count everywhere keeps the arithmetic, and so the differences, alike)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# glibc's mallopt parameters, and how large an allocation the rank's heap keeps (see below)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

HEAP_KEEPS_BYTES = 32 << 20

HEAP_TRIMS_BYTES = 1 << 30

# torch's switch for transparent huge pages under its CPU tensors of 2 MiB and more (c10's alloc_cpu),
# read once, at a process's first tensor
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def keep_large_allocations() -> None:
    """Let the rank's heap keep allocations of up to 32 MiB instead of mapping fresh pages for each,
    and map the larger ones on huge pages.

    glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with pages
    straight from the kernel, zeroed, and unmaps them on free; and it gives the top of the heap back
    beyond its trim threshold. A check of a model of 1e7 parameters makes tensors of 40 MB, which
    paid their page faults again at each (a loop of 80 MB temporaries here: 500 -> 105 ms an iteration
    with them kept in the heap). But a heap that kept the 400 MB tensors of a model of 1e8 parameters
    (the threshold at 1 GiB, as it was) fragmented: a rank held 12 GB after a few cells of that size
    and faulted in gigabytes a cell all the same. So the mmap threshold is pinned at 32 MiB (glibc
    would move it with the blocks freed), the heap's top is given back beyond 1 GiB, and the larger
    tensors are mapped on huge pages (torch's THP_MEM_ALLOC_ENABLE, set here before any tensor where
    this runs first): what a rank holds follows what it uses, and a fresh 400 MB costs 200 faults, not
    100,000 (bench/README.md, "Against model size"). Elsewhere than glibc the thresholds are not set."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, HEAP_KEEPS_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIMS_BYTES)
    except (OSError, AttributeError):
        pass


def record_collectives() -> None:
    """Have torch's flight recorder keep each collective this rank issues (before its process group
    is made), for the collective accounting (harness/rank/numerics/accounting.py)."""
    from harness.rank.numerics.accounting import enable

    enable()


def set_environment(rank: int, world_size: int, backend: str) -> None:
    # accelerate reads these to learn that it runs distributed; the process group itself is
    # created here, through a FileStore, so no port is ever opened. World size 1 is a plain
    # single process (``python train.py``): accelerate sees no launcher and wraps nothing in DDP.
    # A local pool runs on one host: its local rank is its rank (and its GPU is that one).
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if world_size > 1:
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    limit_threads()
    keep_large_allocations()
    drop_launcher_settings()
    record_collectives()
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
