"""What a prepared model shows on one rank (``Observed``): its parameters and gradients as this rank
holds them, and how to cut the same part from a full tensor. Read by ``sharding.observe`` (DDP, FSDP)
and ``deepspeed_cpu.observe`` (ZeRO).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.rank.numerics.closeness import Expectation

Piece = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


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
    # the span (start, numel) of each flattened gradient that this rank's own partition holds, where the
    # gradients are shown whole but each element was reduced and held by one rank (DeepSpeed ZeRO-1/2 at
    # a boundary): a diagnosis fits this rank's part (a defect of one rank's partition shows there alone)
    owned: dict[str, tuple[int, int]] = field(default_factory=dict)
    _full_params: Callable[[], dict[str, torch.Tensor]] | None = None
    _full_grads: Callable[[], dict[str, torch.Tensor | None]] | None = None

    @property
    def plain(self) -> bool:
        """Whether every gradient is shown whole, as the rank holds it (DDP, no wrapper)."""
        return not (self.sharded or self.hidden or self.shards_shown or self.pieces or self._full_grads is not None)

    def piece(self, pname: str, full: torch.Tensor) -> torch.Tensor:
        return self.pieces.get(pname, _identity)(full)

    def piece_of(self, pname: str, expected: Expectation) -> Expectation:
        allowed = expected.allowed  # a 0-dim allowance holds for every part alike
        return Expectation(self.piece(pname, expected.value), self.piece(pname, allowed) if allowed.dim() else allowed)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (a collective when sharded)."""
        return self._full_params() if self._full_params is not None else self.params

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every gradient whole (a collective when sharded)."""
        return self._full_grads() if self._full_grads is not None else self.grads
