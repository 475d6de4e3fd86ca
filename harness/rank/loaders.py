"""The prepared dataloaders a watch follows (harness/rank/watch.py): each one's count of batches
against accelerate's sharding contract, and its class's iteration patched to tell the watch."""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
    pending: int = 0  # batches drawn since the last backward
    batch: Any = None  # a copy of the last batch drawn, as drawn
    rng: Any = None  # the RNG state when it was drawn (the loop's forward runs under it)
    trained: bool = False  # a backward has taken one of its batches

    def name(self) -> str:
        return f"prepared dataloader {self.number}"


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
