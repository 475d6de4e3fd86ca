"""Deviations of the installed backend from its own contract, and what it cannot do, found by asking it:
a collective or two at a rank's start-up, before any cell (so no planted fault can answer for it), never
a version number. What each deviation is, and how a cell it touches is judged: ``PROBED`` in
harness/decorator.py; a cell that needs what the backend cannot do is ``skip``, saying so."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.decorator import GLOO_AVG_SUMS

# what the backend cannot do, by name: why
AVG_ALL_REDUCE = "all-reduce with ReduceOp.AVG"

_found: frozenset[str] = frozenset()
_lacks: dict[str, str] = {}


def probe() -> None:
    """Ask the default group's backend for its known deviations (collectives: every rank at start-up).
    gloo's reduce-scatter with ``ReduceOp.AVG``: rank r holding r + 1 must get the mean,
    (world size + 1) / 2; the sum, world size * (world size + 1) / 2, is pytorch/pytorch#162338. And its
    all-reduce with AVG, which gloo before torch 2.8 refuses as it is called, on every rank alike ("Cannot
    use ReduceOp.AVG with Gloo"), and FSDP2's HSDP averages the replicas' shards with. One rank has
    nothing to average: there the two are one."""
    global _found, _lacks
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    _found, _lacks = frozenset(), {}
    if world_size < 2 or dist.get_backend() != "gloo":
        return
    mean, total = (world_size + 1) / 2, world_size * (world_size + 1) / 2
    out = torch.empty(1)
    # the call FSDP2 makes on this torch (reduce_scatter_tensor before reduce_scatter_single replaced it)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, torch.full((world_size,), float(dist.get_rank() + 1)), op=dist.ReduceOp.AVG)
    _found = frozenset({GLOO_AVG_SUMS}) if out.item() == total else frozenset()
    value = torch.tensor([float(dist.get_rank() + 1)])
    try:
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    except RuntimeError as exc:
        _lacks[AVG_ALL_REDUCE] = f"torch {torch.__version__}'s gloo refuses it ({str(exc).splitlines()[0]})"
    else:
        if value.item() != mean:
            _lacks[AVG_ALL_REDUCE] = f"torch {torch.__version__}'s gloo gives {value.item():g} for the mean {mean:g}"


def found() -> frozenset[str]:
    """The deviations ``probe`` found (none before it ran: a process that is no pool's or launcher's rank)."""
    return _found


def lacks(capability: str) -> str:
    """Why the backend cannot do ``capability`` (``AVG_ALL_REDUCE``), as ``probe`` found; "" where it can."""
    return _lacks.get(capability, "")
