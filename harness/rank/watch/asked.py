"""What a watched loop asks of its syncs and its optimizers (harness/rank/watch/loop.py): whether a
backward runs where the loop asked for no sync (inside ``accumulate``, or a ``no_sync`` of the
Accelerator's or of a prepared model's own), and the steps its optimizers really take."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from harness.wrappers.prepared import torch_optimizer


class Asked:
    """The loop's open ``accumulate`` and ``no_sync`` blocks, and its optimizers' steps by model."""

    def __init__(self, restore: list[Callable[[], None]]) -> None:
        self.restore = restore  # what puts back the hooks when the watch ends
        self.accumulating = 0  # depth of accelerator.accumulate(...) blocks open
        self.suppressing = 0  # depth of no_sync blocks open
        self.stepped: dict[str, int] = {}  # each model's optimizer steps since ``take_steps``

    def no_sync_asked(self) -> bool:
        """Whether the backward about to run is one the loop asked not to sync, or left to accelerate."""
        return bool(self.accumulating or self.suppressing)

    def accumulate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``accelerator.accumulate``, telling while it is open."""
        return self._counting(original, "accumulating")

    def no_sync(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A ``no_sync`` (the Accelerator's, or a prepared model's own), telling while it is open."""
        return self._counting(original, "suppressing")

    def _counting(self, original: Callable[..., Any], depth: str) -> Callable[..., Any]:
        @functools.wraps(original)
        @contextlib.contextmanager
        def block(*args: Any, **kwargs: Any) -> Iterator[None]:
            with original(*args, **kwargs):
                setattr(self, depth, getattr(self, depth) + 1)
                try:
                    yield
                finally:
                    setattr(self, depth, getattr(self, depth) - 1)

        return block

    def count_steps(self, name: str, optimizer: Any) -> None:
        """Count the steps the torch optimizer inside ``optimizer`` (accelerate's wrapper, ZeRO's)
        really takes, as ``name``'s: a step the schedule has not is named from them even where it
        moved no parameter (a learning rate of 0)."""
        inner = torch_optimizer(optimizer)
        if isinstance(inner, torch.optim.Optimizer):
            handle = inner.register_step_post_hook(lambda *_: self._stepped(name))
            self.restore.append(handle.remove)

    def _stepped(self, name: str) -> None:
        self.stepped[name] = self.stepped.get(name, 0) + 1

    def take_steps(self) -> dict[str, int]:
        """The steps each model's optimizers took since the last call."""
        stepped, self.stepped = self.stepped, {}
        return stepped
