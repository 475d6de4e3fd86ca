"""What a planted fault is, and the registry of named ones (harness/selfcheck/faults.py and the
faults_* modules beside it register theirs here).

A fault patches the installed library, never a case: ``patch(rank)`` is a context manager that
swaps attributes of accelerate's (or torch's) classes for a broken version and puts the originals
back on exit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

_ABSENT = object()


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    patch: Callable[[int], ContextManager[None]]
    # the wrappers whose cells the self-check runs it on (a fault of accelerate's own logic is
    # caught on DDP cells; one of FSDP2's needs FSDP2 cells)
    wrappers: tuple[str, ...] = ("ddp",)
    # a variant parameter its path needs (``reduce=fp32``: a fault of the reduce dtype asked for):
    # the self-check runs it only on cells of variants that have it
    needs: str = ""
    # the failure kinds that name it: a cell that catches it names it when its diagnoses at its first
    # failing step include one of them (the self-check's diagnosis accuracy); ``kind:checked`` is a kind
    # found by that check only (``mismatch:lr``: the learning rate check's)
    diagnoses: tuple[str, ...] = ()
    # every cell it runs on can show it (one rank's gradients scaled): the report names each that let it
    # through, where for a fault of one API the cells of the others pass by design
    every_cell: bool = False


@contextlib.contextmanager
def _on_instance(obj: object, attribute: str, value: object) -> Iterator[None]:
    """``obj.attribute`` set in ``obj``'s own namespace for the duration (an instance's, or a class's),
    what it inherits left alone; what it held of its own before is put back exactly (a staticmethod or
    property object stays one), or the attribute removed (looked up where it is inherited from again)."""
    own = vars(obj).get(attribute, _ABSENT)
    setattr(obj, attribute, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(obj, attribute)
        else:
            setattr(obj, attribute, own)


@contextlib.contextmanager
def _patched(owner: object, attribute: str, replacement: object) -> Iterator[None]:
    """``_on_instance`` for an attribute the owner has (its own or inherited): a fault replaces what is
    there, and a name that is not (a release that renamed it) fails here rather than patch nothing."""
    if attribute not in vars(owner) and not hasattr(owner, attribute):
        raise AttributeError(f"{getattr(owner, '__qualname__', owner)!r} has no attribute {attribute!r} to patch")
    with _on_instance(owner, attribute, replacement):
        yield


FAULTS: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    if fault.name in FAULTS:
        raise ValueError(f"fault {fault.name!r} is registered twice")
    FAULTS[fault.name] = fault
    return fault
