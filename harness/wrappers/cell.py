"""One cell's configuration, frozen: what its variant asks for (precision, wrapper, the wrapper's dtype
policy, mesh), the accumulation steps and the contract its oracle holds the loop to, and which rank
of how many this is. Built once by the cell's context (harness/rank/context.py, ``RankContext.config``),
which makes the Accelerator's arguments from it and gives it whole to the oracle
(harness/rank/oracle/core.py) and so to the sharded wrappers' reduction (harness/rank/oracle/sharded_reduce.py).
What is known only later (the accumulation steps, once the case made its Accelerator; an oracle's own
contract) is set with ``dataclasses.replace``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from harness.decorator import ALL_PRECISIONS
from harness.wrappers.mesh import shape as mesh_shape
from harness.wrappers.registry import DDP, WRAPPERS, WrapperSpec
from harness.wrappers.registry import spec as spec_of


@dataclass(frozen=True)
class CellConfig:
    """``precision``: ``fp32``, ``bf16`` or ``fp16``; ``wrapper``: its name (harness/wrappers/registry.py);
    ``reduce`` and ``grad_accum``: the wrapper's dtype policy where the variant sets one
    (the spec's ``mixed_axis``: FSDP2's reduce dtype, ZeRO-1's accumulation dtype), else None; ``mesh``: a
    harness/wrappers/mesh.py ``Shape``, None without one; ``num_steps``: the accumulation steps;
    ``contract``: what a window's gradient must be (harness/rank/oracle/schedule.py ``CONTRACTS``);
    ``rank`` and ``world_size``: this rank, of how many."""

    precision: str = "fp32"
    wrapper: str = DDP
    reduce: str | None = None
    grad_accum: str | None = None
    mesh: Any = None
    num_steps: int = 1
    contract: str = "accelerate"
    rank: int = 0
    world_size: int = 1

    @classmethod
    def of_variant(cls, name: str, params: Mapping[str, Any], *, rank: int, world_size: int) -> CellConfig:
        """What the variant ``name`` (its parameters ``params``) asks for, at this rank of ``world_size``:
        an unknown wrapper or precision refused in one line, a mesh that cannot be formed ``SkipCell``.
        The accumulation steps are set once the case made its Accelerator, a contract by each oracle."""
        wrapper = str(params.get("wrapper", DDP))
        if wrapper not in WRAPPERS:
            raise ValueError(f"variant {name!r}: unknown wrapper {wrapper!r}; known: {', '.join(WRAPPERS)}")
        mesh = mesh_shape(str(params["mesh"]), world_size) if "mesh" in params else None
        precision = str(params.get("precision", "fp32"))
        if precision not in ALL_PRECISIONS:
            raise ValueError(f"variant {name!r}: unknown precision {precision!r}; known: {', '.join(ALL_PRECISIONS)}")
        return cls(precision=precision, wrapper=wrapper, reduce=params.get("reduce"),
                   grad_accum=params.get("grad_accum"), mesh=mesh, rank=rank, world_size=world_size)

    @property
    def spec(self) -> WrapperSpec:
        """The wrapper's spec (harness/wrappers/registry.py): how it reduces, what it casts."""
        return spec_of(self.wrapper)

    @property
    def data_rank(self) -> int:
        """The data shard this rank draws: under a mesh, tensor- and context-parallel peers draw one."""
        return self.rank if self.mesh is None else self.mesh.data_index(self.rank)
