"""Gloo's summation order on CPU, as the oracle reproduces it (harness/rank/numerics/collectives.py,
``ring_average``): gloo's ring all-reduce and reduce-scatter cut a flat buffer into ``world_size``
segments and sum each segment's elements in one order down the ring (``ring_sum``); where each element
of a wrapper's gradients falls in the buffer it reduces (``ring_segments``: FSDP2's and ZeRO-3's
layout; ``flat_segments``: a flat buffer's, FSDP1's, ZeRO-1/2's, DDP's buckets); and the probes that
confirm the order on the installed gloo once per process (``ring_order_holds``,
``all_reduce_order_holds``). Kept apart from the oracle's collectives: this is a model of the backend,
which changes with gloo, not with what the checks send.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from harness.decorator import GLOO_AVG_SUMS
from harness.rank.numerics.backend_defects import found


def ring_segments(sizes: Sequence[torch.Size], world_size: int) -> list[torch.Tensor]:
    """For each of the gradients one FSDP2 reduce-scatter carries (``sizes``, in its order), the ring
    segment each element is summed in on gloo (flat, in the gradient's own element order).

    FSDP2 lays the reduce-scatter input out as ``world_size`` chunks of equal size, chunk ``c`` being
    every gradient's dim-0 shard ``c`` (``ceil(rows / world_size)`` rows, padded), flattened and
    concatenated in order (``torch._chunk_cat``). Gloo cuts that flat input into ``world_size``
    segments of ``S = 2 * ceil(total / (2 * world_size))`` elements and sums the elements of
    segment ``k`` in one order (``ring_sum``). When a chunk's size is even the segments are the
    chunks. Found on torch 2.13's gloo at world sizes 2 to 6, every element; tests/test_collectives.py
    checks it at 2, 3 and 4 ranks with uneven shapes, and ``ring_order_holds`` on the installed gloo."""
    shapes = [(s[0] if len(s) else 1, math.prod(s[1:]) if len(s) > 1 else 1) for s in sizes]
    rows_each = [-(-rows // world_size) for rows, _ in shapes]
    chunk = sum(r * rest for r, (_, rest) in zip(rows_each, shapes))
    segment = segment_size(chunk * world_size, world_size)
    out, offset = [], 0
    for r, (rows, rest) in zip(rows_each, shapes):
        row = torch.arange(rows)
        c = row // r
        start = c * chunk + offset + (row - c * r) * rest  # each row's first element in the flat input
        index = start[:, None] + torch.arange(rest)[None, :]
        out.append((index // segment).reshape(-1))
        offset += r * rest
    return out


def segment_size(total: int, world_size: int) -> int:
    """The elements in each of gloo's ring segments of a reduce-scatter input of ``total`` elements."""
    return 2 * -(-total // (2 * world_size))


def flat_segments(spans: Sequence[tuple[int, int]], total: int, world_size: int) -> list[torch.Tensor]:
    """For each tensor laid out at ``(offset, numel)`` in a flat reduce-scatter input of ``total``
    elements (FSDP1's padded unsharded flat gradient), the ring segment each element is summed in on
    gloo (``ring_segments`` says how gloo cuts it)."""
    segment = segment_size(total, world_size)
    return [(offset + torch.arange(numel)) // segment for offset, numel in spans]


def ring_sum(every: Sequence[torch.Tensor], segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's values (``every[r]``) summed in ``dtype``, each element in its ring segment's order:
    rank k-1's value first, then k-2's and so on down the ring to k+1's, rank k's own last."""
    world_size = len(every)
    total = torch.empty(every[0].shape, dtype=dtype)
    for k in range(world_size):
        at = segment == k
        order = [(k - j) % world_size for j in range(1, world_size)] + [k]
        s = every[order[0]][at].to(dtype)
        for r in order[1:]:
            s = s + every[r][at].to(dtype)
        total[at] = s
    return total


_ORDER_HOLDS: dict[tuple[int, torch.dtype, bool | str], str] = {}


def _probed(key: tuple[int, torch.dtype, bool | str], trial: Callable[[int], bool], differs: str) -> str:
    """Why gloo's ring order does not hold for the collective ``trial`` runs, or "" where it does: the
    backend is gloo and ``trial(rank)`` (one collective of values drawn to round differently in every
    order, against ``ring_sum``) agrees on every rank; ``differs`` says why where not. Asked once per
    process and ``key`` (world size, dtype, collective); a collective, so every rank asks."""
    world_size = key[0]
    if key not in _ORDER_HOLDS:
        backend = dist.get_backend() if world_size > 1 else "gloo"
        if backend != "gloo":
            _ORDER_HOLDS[key] = f"the {backend} backend's summation order is not known"
        elif world_size <= 2:
            _ORDER_HOLDS[key] = ""  # two terms, one rounding, in either order
        else:
            agree = torch.tensor([int(trial(dist.get_rank()))])
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)
            _ORDER_HOLDS[key] = "" if agree.item() else differs
    return _ORDER_HOLDS[key]


def _drawn(n: int, world_size: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's ``n`` values for a probe, of magnitudes spread over many binades (every order rounds
    them differently), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)).to(dtype)
            for _ in range(world_size)]


def ring_order_holds(world_size: int, dtype: torch.dtype, *, average: bool = True) -> str:
    """Why the ring order does not hold for reduce-scatters in ``dtype`` on the default group, or ""
    where it does: the backend is gloo and one reduce-scatter (ReduceOp.AVG, or SUM where not
    ``average``) of values drawn to round differently in every order (odd chunks, so that segments
    and chunks differ) comes out as ``ring_sum`` makes it, on every rank. Asked once per process,
    world size, dtype and op; a collective, so every rank asks."""
    chunk = 37

    def trial(rank: int) -> bool:
        every = _drawn(chunk * world_size, world_size, dtype, 28)
        out = torch.empty(chunk, dtype=dtype)
        dist.reduce_scatter_tensor(out, every[rank].clone(), op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM)
        total = ring_sum(every, ring_segments([torch.Size([chunk * world_size])], world_size)[0], dtype)
        # a gloo whose AVG sums (``PROBED``, harness/decorator.py) still sums in the ring's order, which is
        # what is asked here
        divides = average and GLOO_AVG_SUMS not in found()
        return torch.equal(out, (total / world_size if divides else total)[rank * chunk:(rank + 1) * chunk])

    return _probed((world_size, dtype, average), trial, "gloo's reduce-scatter here adds in another order")


def all_reduce_order_holds(world_size: int, dtype: torch.dtype) -> str:
    """Why gloo's ring order does not hold for an all-reduce (SUM) of a flat buffer in ``dtype`` on the
    default group, or "" where it does: the backend is gloo and one all-reduce of values drawn to round
    differently in every order, of an odd size (segments of unequal length), comes out on every rank
    as ``ring_sum`` over ``flat_segments`` makes it (the reduce-scatter's segments: gloo's ring
    all-reduce is its reduce-scatter, then an all-gather). Found on torch 2.13's gloo at world sizes 3
    and 4 for buffers of 1 to 2^20 + 3 elements (tests/test_collectives.py). Asked once per process,
    world size and dtype; a collective, so every rank asks."""
    total = 37 * world_size + 5

    def trial(rank: int) -> bool:
        every = _drawn(total, world_size, dtype, 34)
        out = every[rank].clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return torch.equal(out, ring_sum(every, flat_segments([(0, total)], total, world_size)[0], dtype))

    return _probed((world_size, dtype, "all_reduce"), trial, "gloo's all-reduce here adds in another order")
