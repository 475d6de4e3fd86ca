"""Expected sync points and optimizer steps, from accelerate's documented accumulation contract."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# The accumulation contracts an oracle holds a case to (``contract=``). ``accelerate``: each backward's
# loss divided by the configured accumulation steps, as ``Accelerator.backward`` documents, so a window
# the dataloader ends early weighs its micro-batches as a full one would and the window's gradient is
# smaller. ``full_batch``: each window's gradient is the mean over the micro-batches the window really
# had, the gradient of one batch holding all of them: a short window's micro-batches weigh more.
CONTRACTS = ("accelerate", "full_batch")
# A script's (``python -m harness watch --contract``) adds ``tokens``: each window's update is the one the
# mean loss over every valid label token of the global window gives; the oracle holds it as
# ``accelerate`` with each window weighed by its tokens (``Oracle.token_window``).
TOKENS = "tokens"
SCRIPT_CONTRACTS = (*CONTRACTS, TOKENS)


@dataclass(frozen=True)
class MicroStep:
    """One micro-batch of the schedule.

    ``sync``: the backward of this micro-batch must leave the all-rank average.
    ``optimizer_step``: the optimizer (and scheduler) must step, and zero_grad must clear.
    """

    index: int  # 1-based over the whole cell; the ``step`` of a failure
    epoch: int
    batch: int  # 0-based within the epoch
    sync: bool
    optimizer_step: bool
    end_of_dataloader: bool

    def where(self) -> str:
        return f"step {self.index} (epoch {self.epoch}, batch {self.batch})"


def accumulation_schedule(
    batches_per_epoch: int | Sequence[int],
    *,
    epochs: int,
    num_steps: int,
    sync_with_dataloader: bool = True,
    sync_each_batch: bool = False,
) -> list[MicroStep]:
    """The contract of ``accumulate()`` with ``GradientAccumulationPlugin``:

    - a counter advances by one per micro-batch; gradients sync and the optimizer steps when it
      reaches a multiple of ``num_steps``;
    - with ``sync_with_dataloader``, the last batch of the dataloader also syncs and steps, and the
      counter starts again (a window never spans epochs); without it, windows continue across epochs;
    - with ``sync_each_batch``, every backward averages gradients, but the optimizer still steps only
      at the points above.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if isinstance(batches_per_epoch, int):
        lengths = [batches_per_epoch] * epochs
    else:
        lengths = list(batches_per_epoch)
        if len(lengths) != epochs:
            raise ValueError(f"{len(lengths)} epoch lengths given for {epochs} epochs")
    points = []
    counter = 0
    index = 0
    for epoch, length in enumerate(lengths):
        for batch in range(length):
            index += 1
            end = batch == length - 1
            if sync_with_dataloader and end:
                counter = 0
                boundary = True
            else:
                counter += 1
                boundary = counter % num_steps == 0
            points.append(
                MicroStep(
                    index=index,
                    epoch=epoch,
                    batch=batch,
                    sync=boundary or sync_each_batch,
                    optimizer_step=boundary,
                    end_of_dataloader=end,
                )
            )
    return points


def batches_per_rank(samples: int, *, batch_size: int, world_size: int, split_batches: bool = False,
                     drop_last: bool = False) -> int:
    """How many batches each rank's prepared dataloader yields with ``even_batches=True`` (the default):
    the dataset is cut into global batches of ``batch_size * world_size`` samples (``batch_size`` with
    ``split_batches``), the last one completed from the start, and each rank gets one slice of each.
    With ``drop_last`` the loader's short last batch is dropped, and so is a last group of batches
    too small to give every rank one."""
    if drop_last:
        loader_batches = samples // batch_size
        return loader_batches if split_batches else loader_batches // world_size
    global_batch = batch_size if split_batches else batch_size * world_size
    return math.ceil(samples / global_batch)


def dispatched_batches_per_rank(samples: int, *, batch_size: int, world_size: int, split_batches: bool = False) -> int:
    """How many batches each rank receives when the prepared dataloader dispatches (``dispatch_batches=True``):
    only the main process iterates the user's DataLoader (batches of ``batch_size``, the last one short),
    and every rank receives its slice of one such batch (``split_batches``) or of ``world_size`` of them
    concatenated. A short last group still makes one batch for every rank, completed from the start."""
    loader_batches = math.ceil(samples / batch_size)
    return loader_batches if split_batches else math.ceil(loader_batches / world_size)


def windows(schedule: Sequence[MicroStep]) -> list[int]:
    """The 0-based accumulation window of each micro-step: a window ends at an optimizer step."""
    numbers = []
    window = 0
    for point in schedule:
        numbers.append(window)
        if point.optimizer_step:
            window += 1
    return numbers


def window_lengths(schedule: Sequence[MicroStep]) -> dict[int, int]:
    """The number of micro-batches in the accumulation window of each micro-step, by its ``index``: a
    full window has ``num_steps``; the last of an epoch (``sync_with_dataloader``) can have fewer."""
    numbers = windows(schedule)
    sizes: dict[int, int] = {}
    for number in numbers:
        sizes[number] = sizes.get(number, 0) + 1
    return {point.index: sizes[number] for point, number in zip(schedule, numbers)}


@dataclass(frozen=True)
class Accumulation:
    """The accumulation settings a cell gave its Accelerator: the one place the oracle and the schedules
    take them from, so that they are given once (harness/rank/context.py)."""

    num_steps: int = 1
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


class Windows:
    """The schedules made in one cell so far, as its checks need them: the last micro-step of any (a check
    surely follows one before it) and each micro-step's window length, by index. Shared by the cell's
    context and the watches that make the schedules of a loop as it runs (harness/rank/watch/)."""

    def __init__(self) -> None:
        self.last_point = 0
        self.lengths: dict[int, int] = {}  # the micro-batches of each micro-step's window, by index

    def add(self, schedule: Sequence[MicroStep]) -> None:
        """Note the micro-steps of a schedule made."""
        self.last_point = max([self.last_point, *(p.index for p in schedule)])
        self.lengths.update(window_lengths(schedule))

    def more_after(self, step: MicroStep | int) -> bool:
        """Whether a check surely follows one at ``step``: a micro-step of a schedule made here, not its
        last (a step given as a number could be the case's last)."""
        return isinstance(step, MicroStep) and step.index < self.last_point
