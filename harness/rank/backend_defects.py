"""Deviations of the installed backend from its own contract, found by asking it: one collective at a
rank's start-up, before any cell (so no planted fault can answer for it), never a version number. What
each one is, and how a cell it touches is judged: ``PROBED`` in harness/decorator.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.decorator import GLOO_AVG_SUMS

_found: frozenset[str] = frozenset()


def probe() -> None:
    """Ask the default group's backend for its known deviations (a collective: every rank at start-up).
    gloo's reduce-scatter with ``ReduceOp.AVG``: rank r holding r + 1 must get the mean,
    (world size + 1) / 2; the sum, world size * (world size + 1) / 2, is pytorch/pytorch#162338. One rank
    has nothing to average: there the two are one."""
    global _found
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size < 2 or dist.get_backend() != "gloo":
        _found = frozenset()
        return
    out = torch.empty(1)
    # the call FSDP2 makes on this torch (reduce_scatter_tensor before reduce_scatter_single replaced it)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, torch.full((world_size,), float(dist.get_rank() + 1)), op=dist.ReduceOp.AVG)
    _found = frozenset({GLOO_AVG_SUMS}) if out.item() == world_size * (world_size + 1) / 2 else frozenset()


def found() -> frozenset[str]:
    """The deviations ``probe`` found (none before it ran: a process that is no pool's or launcher's rank)."""
    return _found
