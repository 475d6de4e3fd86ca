"""What a watch needs of the cell it runs in (``WatchedCell``): the narrow view of ``RankContext``
(harness/rank/context.py) that a loop's watch and a script's take, so that neither reaches into the
context's own state, and the context's module and the watch's need not import each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from harness.rank.judging.recorder import Recorder
    from harness.rank.oracle.core import Oracle
    from harness.rank.oracle.schedule import Accumulation, Windows
    from harness.wrappers.registry import WrapperSpec


class WatchedCell(Protocol):
    """The cell a watch runs in: its rank's device, its world size, its recorder, its wrapper's spec, the
    micro-step it is at (which the watch moves as the loop runs), the schedules made so far, and what
    the watch asks of it: the Accelerator's accumulation settings, the batches a rank's prepared loader
    must yield, and an oracle."""

    device: torch.device
    world_size: int
    recorder: Recorder
    at_step: int
    made_schedules: Windows

    @property
    def spec(self) -> WrapperSpec: ...

    def accumulation_settings(self) -> Accumulation: ...

    def expected_batches(self, samples: int, batch_size: int, *, split_batches: bool, dispatch_batches: bool,
                         drop_last: bool = False) -> int: ...

    def oracle_for(self, models: Mapping[str, nn.Module], *, num_steps: int, contract: str, replay_rng: Any,
                   **options: Any) -> Oracle: ...
