"""The prepared dataloaders a watch follows (harness/rank/watch/loop.py): each one's count of batches
against accelerate's sharding contract, and its class's iteration patched to tell the watch."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

# the attribute a watched dataloader carries its watch in
WATCH_ATTRIBUTE = "_gradsync_watch"


@dataclass
class Loader:
    """One dataloader the loop prepared, as the watch follows it."""

    number: int  # 1-based, in the order the loop prepared them
    expected: int  # the batches each rank's prepared loader must yield per epoch (the contract)
    epochs: int = 0  # iterations begun
    seen: int = 0  # batches drawn in the current iteration
    # the batches drawn that no backward has taken yet, oldest first (a loop that draws a window's
    # batches before their backwards holds several)
    drawn: list[Drawn] = field(default_factory=list)
    trained: bool = False  # a backward has taken one of its batches

    def name(self) -> str:
        return f"prepared dataloader {self.number}"


@dataclass
class Drawn:
    """One batch a watched loader yielded, until a backward takes it."""

    loader: Loader
    epoch: int  # 0-based iteration of its loader
    seen: int  # 1-based, in its iteration
    batch: Any  # a copy, as drawn
    rng: Any  # the RNG state when it was drawn (the forward's, where no forward of it is seen)
    tensors: list[Any]  # the batch's own tensors, held so that their ids stay theirs
    backwards: int  # the watch's backwards when it was drawn: one drawn since the last backward has them all

    def holds(self, ids: set[int]) -> bool:
        """Whether any of the tensors ``ids`` names is one of this batch's own."""
        return any(id(t) in ids for t in self.tensors)

    def where(self) -> str:
        return f"batch {self.seen} of epoch {self.epoch} of the {self.loader.name()}"


def follow_iteration(cls: type, watch_class: type, restore: list[Callable[[], None]]) -> None:
    """Make ``cls``'s iteration hand its batches to the watch a loader carries (an instance of
    ``watch_class`` under ``WATCH_ATTRIBUTE``: its ``iterate``), until ``restore``'s last entry runs;
    a loader that carries none iterates as before."""
    own = "__iter__" in vars(cls)
    before = vars(cls).get("__iter__")
    iterate = cls.__iter__
    if getattr(iterate, WATCH_ATTRIBUTE, False):  # inherited from a class the watch follows already
        return

    @functools.wraps(iterate)
    def __iter__(loader: Any) -> Iterator[Any]:
        batches = iterate(loader)
        watch = vars(loader).get(WATCH_ATTRIBUTE)
        return watch.iterate(loader, batches) if isinstance(watch, watch_class) else batches

    setattr(__iter__, WATCH_ATTRIBUTE, True)
    cls.__iter__ = __iter__  # type: ignore[attr-defined]
    restore.append(lambda: setattr(cls, "__iter__", before) if own else delattr(cls, "__iter__"))


def dataloader_options(accelerator: Any) -> tuple[bool, bool]:
    """The Accelerator's ``split_batches`` and ``dispatch_batches`` (its ``dataloader_config`` from
    accelerate 0.28, its own attributes before)."""
    config = getattr(accelerator, "dataloader_config", None)
    source = config if config is not None else accelerator
    return bool(getattr(source, "split_batches", False)), bool(getattr(source, "dispatch_batches", False))
