"""Sync faults injected into accelerate or DDP at run time, inside the ranks: each a plausible regression."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    patch: Callable[[int], ContextManager[None]]


@contextlib.contextmanager
def _patched(owner: object, attribute: str, replacement: object) -> Iterator[None]:
    original = owner.__dict__[attribute] if attribute in vars(owner) else getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def _perturb_rank(target_rank: int, relative: float) -> Callable[[int], ContextManager[None]]:
    """After every backward on ``target_rank``, scale that rank's gradients by ``1 + relative``."""

    @contextlib.contextmanager
    def patch(rank: int) -> Iterator[None]:
        from accelerate import Accelerator

        original = Accelerator.backward

        def backward(self, loss, **kwargs):
            result = original(self, loss, **kwargs)
            if rank == target_rank:
                for model in self._models:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(1.0 + relative)
            return result

        with _patched(Accelerator, "backward", backward):
            yield

    return patch


FAULTS: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    if fault.name in FAULTS:
        raise ValueError(f"fault {fault.name!r} is registered twice")
    FAULTS[fault.name] = fault
    return fault


register(Fault("perturb_rank1", "rank 1's gradients scaled by 1.01 after every backward", _perturb_rank(1, 0.01)))


def perturbation(relative: float, *, target_rank: int = 1) -> Fault:
    """A fault that scales one rank's gradients by ``1 + relative`` (sensitivity measurements)."""
    return Fault(f"perturb:{relative:g}", f"rank {target_rank}'s gradients scaled by {1 + relative:g}", _perturb_rank(target_rank, relative))


def resolve(name: str) -> Fault:
    if name.startswith("perturb:"):
        return perturbation(float(name.split(":", 1)[1]))
    try:
        return FAULTS[name]
    except KeyError:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}") from None


@contextlib.contextmanager
def apply_fault(name: str | None, *, rank: int) -> Iterator[None]:
    """Run the enclosed code with the named fault patched in (nothing when ``name`` is None)."""
    if name is None:
        yield
        return
    with resolve(name).patch(rank):
        yield
