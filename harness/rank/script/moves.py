"""What moves a script's parameters outside an optimizer step (``python -m harness watch``): an
optimizer's own documented mode switch is made on the oracle's copy too; a load of a state the
oracle cannot follow is refused, naming it. Never a ``fail`` for a move the oracle does not model.

Schedule-free optimizers (``schedulefree.AdamWScheduleFree`` and its kin) keep two points and put the
model's parameters at one of them: ``optimizer.train()`` before training, ``optimizer.eval()`` before
evaluating (accelerate's ``examples/by_feature/schedule_free.py`` calls both every epoch). Each switch
moves every parameter by the optimizer's own state; the oracle's copy of the optimizer, over the
replicas, switches with it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from torch import nn

from harness.rank.script.loss import WHO
from harness.rank.watch import LoopRefused

# the methods an optimizer with modes switches by (schedule-free's); torch's own optimizers have neither
MODES = ("train", "eval")

Patch = Callable[[Any, str, Any], None]  # sets an attribute for as long as the watch lasts


def has_modes(optimizer: Any) -> bool:
    """Whether ``optimizer`` switches modes (``train()``/``eval()``) that move the parameters."""
    return all(callable(getattr(optimizer, mode, None)) for mode in MODES)


def mirror_modes(raw: Any, copies: Iterable[Any], *, before: Callable[[], None], patch: Patch,
                 following: Callable[[], bool]) -> None:
    """Make each ``train()``/``eval()`` of the script's optimizer ``raw`` on ``copies`` (the oracle's)
    too, after ``before()`` (the last micro-step judged, with the parameters where its step left them),
    while ``following()``."""
    copies = list(copies)
    for mode in MODES:
        original = getattr(raw, mode)

        @functools.wraps(original)
        def switch(*args: Any, _original: Any = original, _mode: str = mode, **kwargs: Any) -> Any:
            if not following():
                return _original(*args, **kwargs)
            before()
            result = _original(*args, **kwargs)
            for copy in copies:
                getattr(copy, _mode)()
            return result

        patch(raw, mode, switch)


def refuse_loads(models: Iterable[nn.Module], optimizers: Iterable[Any], *, patch: Patch,
                 following: Callable[[], bool]) -> None:
    """A ``load_state_dict`` of a followed model or optimizer once training has begun: the oracle's copy
    cannot follow it (a checkpoint, an EMA's weights swapped in), so it is refused, naming it."""
    for owner in [*models, *optimizers]:
        original = owner.load_state_dict

        @functools.wraps(original)
        def load_state_dict(*args: Any, _original: Any = original, _owner: Any = owner, **kwargs: Any) -> Any:
            if following():
                raise LoopRefused(f"{WHO}: the script loads a state into its {type(_owner).__name__} "
                                  "(load_state_dict) after its first batch, which moves what the oracle's copy "
                                  "holds outside an optimizer step; the harness follows a script's training from "
                                  "what was prepared before it, and an optimizer's own mode switch "
                                  "(schedule-free's train()/eval())")
            return _original(*args, **kwargs)

        patch(owner, "load_state_dict", load_state_dict)
