"""A prepared model's parameters and gradients on this rank, read the way its wrapper keeps them.

DDP (or no wrapper) keeps the whole of every tensor on every rank. FSDP2 keeps DTensors: each rank
holds its shard of every parameter and, after a sync, of every gradient; between sync points its
``p.grad`` stays None while the unsharded gradients accumulate inside FSDP. The checks then compare
this rank's shard with the same shard of the oracle's full expectation (DESIGN.md, "Sharded
wrappers"). FSDP1 (``use_orig_params=True``) keeps flat shards; ``summon_full_params(with_grads=True)``
shows the full tensors, which are compared whole.

Reading full tensors of a sharded model is a collective: every rank reads every model at every
check, in the same order, as the checks already do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from harness.closeness import Expectation
from harness.replica import unwrap

Piece = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _dtensor_class() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


@dataclass
class Observed:
    """One model on one rank: ``params``/``grads`` are what this rank holds (its shard under
    FSDP2), ``piece(pname, full)`` is the same part of a full tensor, and ``sharded`` says that the
    ranks hold different parts (so there is no copy to compare with rank 0's)."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    sharded: bool = False
    # parameters whose gradient the wrapper shows as a reduced shard where this rank's own, full
    # gradient was due (FSDP1 between sync points): it synced early
    shards_shown: list[str] = field(default_factory=list)
    # the wrapper keeps this model's gradients where they cannot be read now (DeepSpeed ZeRO-2/3
    # between optimizer steps, even where the contract syncs: their reduced partitions live inside
    # the optimizer): no claim is made of them
    hidden: bool = False
    pieces: dict[str, Piece] = field(default_factory=dict)
    _full_params: Callable[[], dict[str, torch.Tensor]] | None = None
    _full_grads: Callable[[], dict[str, torch.Tensor | None]] | None = None

    def piece(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return self.pieces.get(pname, _identity)(full)

    def piece_of(self, pname: str, expected: Expectation) -> Expectation:
        return Expectation(self.piece(pname, expected.value), self.piece(pname, expected.allowed))

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (a collective when sharded)."""
        return self._full_params() if self._full_params is not None else self.params

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every gradient whole (a collective when sharded)."""
        return self._full_grads() if self._full_grads is not None else self.grads


def observe(model: nn.Module, names: list[str], *, sync: bool) -> Observed:
    """Read ``model`` (prepared) as its wrapper keeps it. ``sync``: whether the last backward was due
    to sync (FSDP1 shows full gradients only after one)."""
    from harness.wrappers import peel_compiled, prepared_as

    kind = prepared_as(model)
    if kind == "fsdp1":
        return _fsdp1(model, with_grads=sync)
    if kind.startswith("deepspeed-"):
        from harness import deepspeed_cpu

        return deepspeed_cpu.observe(peel_compiled(model), names, sync=sync)
    params = dict(unwrap(model).named_parameters())
    DTensor = _dtensor_class()
    if DTensor is None or not any(isinstance(p, DTensor) for p in params.values()):
        return Observed(params={n: p.detach() for n, p in params.items()},
                        grads={n: None if p.grad is None else p.grad.detach() for n, p in params.items()})
    pieces = {n: _piece_fn(p) if isinstance(p, DTensor) else _identity for n, p in params.items()}

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    observed = Observed(
        params={n: local(p.detach()) for n, p in params.items()},
        grads={n: None if p.grad is None else local(p.grad.detach()) for n, p in params.items()},
        sharded=True,
        pieces=pieces,
        _full_params=lambda: {n: full(p.detach()) for n in names for p in [params[n]]},
        _full_grads=lambda: {n: None if params[n].grad is None else full(params[n].grad.detach()) for n in names},
    )
    return observed


def _piece_fn(dtensor: Any) -> Piece:
    """This rank's part of a full tensor laid out as ``dtensor`` (Shard and Replicate placements, as
    DTensor itself splits: ``torch.chunk`` along the sharded dimension, empty past the last chunk)."""
    mesh, placements = dtensor.device_mesh, dtensor.placements
    coordinate = mesh.get_coordinate()
    local_shape = tuple(dtensor.to_local().shape)

    def piece(full: torch.Tensor) -> torch.Tensor:
        out = full
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
                index = coordinate[mesh_dim]
                out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
            elif not placement.is_replicate():
                raise ValueError(f"the harness cannot compare a tensor placed as {placement}")
        if tuple(out.shape) != local_shape:
            raise ValueError(f"this rank's shard has shape {local_shape}, but its part of the full tensor "
                             f"({tuple(full.shape)}, placed {placements}) has {tuple(out.shape)}")
        return out

    return piece


def _fsdp1(model: nn.Module, *, with_grads: bool) -> Observed:
    """Full tensors: after a sync through ``summon_full_params(with_grads=True)``; between sync
    points FSDP1's ``no_sync`` leaves each parameter's full, unsharded local gradient on it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from harness.wrappers import peel_compiled

    fsdp = peel_compiled(model)
    inner = unwrap(model)
    grads: dict[str, torch.Tensor | None] = {}
    if not with_grads:
        grads = {_clean(n): None if p.grad is None else p.grad.detach().clone() for n, p in inner.named_parameters()}
    with FullyShardedDataParallel.summon_full_params(fsdp, writeback=False, with_grads=with_grads):
        params = {_clean(n): p.detach().clone() for n, p in inner.named_parameters()}
        if with_grads:
            grads = {_clean(n): None if p.grad is None else p.grad.detach().clone() for n, p in inner.named_parameters()}
    shown = [n for n, g in grads.items() if g is not None and n in params and g.shape != params[n].shape]
    return Observed(params=params, grads=grads, shards_shown=shown)
