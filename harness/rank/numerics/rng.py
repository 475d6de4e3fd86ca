"""torch's global RNG, seeded and saved per rank: a stable seed from labels, a block seeded or run under a
saved state and then put back, a rank's seeding of its own device only. Shared by the models and data
(harness/rank/models.py), the watch's replay of a loop's forward (harness/rank/watch/), and the runner."""

from __future__ import annotations

import contextlib
import zlib
from typing import ContextManager, Iterator, Optional, Tuple

import torch


def derive_seed(seed: int, *parts: object) -> int:
    """A stable 31-bit seed from a base seed and any labels (case, variant, rank, ...)."""
    text = "/".join(str(p) for p in (seed, *parts))
    return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


def forked_rng(device: torch.device | None = None) -> ContextManager[None]:
    """A block after which torch's global RNG (the CPU's, and ``device``'s when it is a GPU) is as
    it was before it."""
    devices = []
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    return torch.random.fork_rng(devices=devices)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run the block with torch's global RNG (the CPU's, and ``device``'s when it is a GPU) seeded
    with ``seed``; the state before it is restored after, so the block takes nothing from it."""
    with forked_rng(device):
        seed_rng(seed, device)
        yield


RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]


def rng_state(device: torch.device) -> RngState:
    """torch's global RNG state now: the CPU's, and ``device``'s when it is a GPU."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def under_rng_state(state: RngState, device: torch.device) -> Iterator[None]:
    """Run the block under ``state`` (from ``rng_state``); the state before it is restored after."""
    cpu, gpu = state
    with forked_rng(device):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
        yield


def seed_rng(seed: int, device: torch.device | None = None) -> None:
    """Seed the CPU's global RNG, and ``device``'s when it is a GPU (the one a rank uses).

    Not ``torch.manual_seed``: on a host where CUDA, XPU or MTIA is not initialised it queues a seed
    for each of them with a formatted stack (about a millisecond a call, several calls a cell), seeds
    that would apply to a device this rank never uses, and that no ``fork_rng`` puts back."""
    torch.random.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(seed)


def generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen
