"""Which drawn batch each training forward of a watched loop was given (harness/rank/watch/loop.py).

A loop that draws a window's micro-batches first (to count their tokens: transformers' Trainer,
TRL's trainers, accelerate's ``gradient_accumulation_for_autoregressive_models.py``) runs each forward
and backward after all of them are drawn, so "the batch drawn last" does not say which one a backward
belongs to. Its forward does: the model is called with the batch's own tensors (``model(**batch)``,
the prepared loader having placed them). A forward pre-hook on each prepared model finds the drawn
batch holding one of the tensors it was given, and keeps what else the loop passed (``use_cache``,
``num_items_in_batch``) for the oracle to call its replica the same way, and the RNG state the
forward ran under (dropout's masks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from harness.rank.watch.loaders import Drawn
from harness.rank.numerics.rng import rng_state

# the keyword transformers models take a window's count of valid label tokens by (since 4.46)
NUM_ITEMS = "num_items_in_batch"


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a batch or a call's arguments: in mappings (a tokenizer's ``BatchEncoding``
    too), lists and tuples, at any depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


@dataclass
class Forward:
    """A training forward of the loop, paired with the drawn batch it was given."""

    drawn: Drawn
    rng: Any  # the RNG state it ran under
    # what the loop passed beside the batch's own tensors, by keyword (tensors copied)
    keywords: dict[str, Any] = field(default_factory=dict)

    def replayed(self, *, tokens: bool) -> dict[str, Any]:
        """The keywords to call a replica with as the loop called its model, over the batch's own (what
        the loop passed in place of one of the batch's keys too): under a token contract
        ``num_items_in_batch`` is 1, so that a transformers loss returns its sum over the batch's
        tokens (the oracle divides by the window's count it makes itself); otherwise the count the
        loop passed is left out, and the loss is the model's own mean."""
        keywords = {k: v for k, v in self.keywords.items() if k != NUM_ITEMS}
        if tokens:
            keywords[NUM_ITEMS] = 1
        return keywords


class Forwards:
    """The forward pre-hooks on a loop's prepared models, and the last training forward they saw."""

    def __init__(self, device: torch.device, drawn: Callable[[], Iterable[Drawn]],
                 restore: list[Callable[[], None]]) -> None:
        self.device = device
        self.drawn = drawn  # the batches drawn that no backward has taken yet
        self.restore = restore
        self.last: Forward | None = None  # since the last backward took one
        self.counted = False  # the loop passed num_items_in_batch to a forward
        self._followed: set[int] = set()

    def follow(self, model: nn.Module) -> None:
        """Pair the training forwards of ``model`` (the module a wrapper calls: its inputs are the
        loop's) with the batches drawn."""
        if id(model) in self._followed:
            return
        self._followed.add(id(model))
        handle = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.restore.append(handle.remove)

    def take(self) -> Forward | None:
        """The forward the backward about to run belongs to (None where no forward was paired)."""
        last, self.last = self.last, None
        return last

    def _forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        drawn = self._paired(args, kwargs)
        if drawn is None:
            return
        keywords = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
                    if not _of_the_batch(drawn, k, v)}
        self.counted = self.counted or keywords.get(NUM_ITEMS) is not None
        self.last = Forward(drawn, rng_state(self.device), keywords)

    def _paired(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Drawn | None:
        """The drawn batch a forward (``args``, ``kwargs``) was given: the one holding one of its tensors,
        else the first whose tensors it was given copies of, equal in shape, dtype and value, key by key (a
        loop, or Trainer's ``_prepare_inputs``, may copy a batch's tensors on their way to the device)."""
        given = tensors_of((args, kwargs))
        ids = {id(t) for t in given}
        pending = list(self.drawn())
        held = next((d for d in pending if d.holds(ids)), None)
        if held is not None:
            return held
        return next((d for d in pending if _copied(d.batch, given, kwargs)), None)


def _of_the_batch(drawn: Drawn, key: str, value: Any) -> bool:
    """Whether a forward's keyword ``key=value`` is the drawn batch's own (one of its tensors, or a copy
    of the one under that key); what is not (``num_items_in_batch``, labels the loop made itself) is
    replayed over the batch."""
    if isinstance(value, torch.Tensor) and any(value is t for t in drawn.tensors):
        return True
    batch = drawn.batch
    if not isinstance(batch, Mapping) or key not in batch:
        return False
    mine = batch[key]
    if isinstance(value, torch.Tensor) or isinstance(mine, torch.Tensor):
        return isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and _equal(value, mine)
    return True  # a value of the batch's that is no tensor: the batch's, as drawn


def _copied(batch: Any, given: list[torch.Tensor], kwargs: dict[str, Any]) -> bool:
    """Whether a forward was given copies of ``batch``'s tensors: each of a mapping's under its own key,
    else all of them in order."""
    if isinstance(batch, Mapping):
        shared = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and isinstance(kwargs.get(k), torch.Tensor)]
        return bool(shared) and all(_equal(kwargs[k], batch[k]) for k in shared)
    own = tensors_of(batch)
    return bool(own) and len(own) == len(given) and all(_equal(a, b) for a, b in zip(given, own))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values, of the same shape and dtype (on any devices)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.cpu())
