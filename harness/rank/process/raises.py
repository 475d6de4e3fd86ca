"""A raise that a case declares: torch, accelerate or a wrapper's library raising in a loop its
contract takes (pytorch #196996: FSDP2 asserts "uniform gradient dtype" where a parameter is first
used on the synced micro-batch). A case says so with ``Diagnosis("raised", match=...)`` among its
``defects=`` (or a canary's diagnoses); such an exception becomes one failure of kind ``raised`` on the
rank, and the cell is judged as declared (``detected``; ``missed`` the day a release stops raising
and something else is found; an ordinary verdict where the declaration is ``fixed_in`` the installed
release). Every other exception stays what it was: the cell's ``error``, with its traceback.

An exception counts only where it was raised in one of ``LIBRARIES`` (its innermost frame is in that
package's directory) and its ``Type: message`` contains the declared ``match``: a bug in the case or
the harness, or another library error, is never taken for the declared defect.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Iterable

from harness.records import Failure, FailureKind

LIBRARIES = ("torch", "accelerate", "deepspeed", "transformers")


def raised_in(exc: BaseException) -> tuple[str, traceback.FrameSummary] | None:
    """The library among ``LIBRARIES`` whose code raised ``exc`` (its innermost frame), with that frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    library = _library(frames[-1])
    if library is None:
        return None
    # a helper that only raises (torch's _raise_assert_with_print) is not where the check is: name
    # the innermost frame of the same library that is not one
    inner = [f for f in frames if _library(f) == library and not f.name.lstrip("_").startswith("raise")]
    return library, (inner or frames)[-1]


def _library(frame: traceback.FrameSummary) -> str | None:
    path = os.path.realpath(frame.filename)
    for name in LIBRARIES:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where and path.startswith(os.path.dirname(os.path.realpath(where)) + os.sep):
            return name
    return None


def exception_text(exc: BaseException) -> str:
    """``Type: first line of the message``, as a summary shows it."""
    lines = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {lines[0].strip()}" if lines else "")


def declared_raise(declared: Iterable[object], exc: BaseException, *, rank: int, step: int) -> Failure | None:
    """The failure of kind ``raised`` for ``exc`` when one of the ``declared`` diagnoses (Diagnosis
    objects of the cell) is ``raised`` and matches it, else None."""
    found = raised_in(exc)
    if found is None:
        return None
    library, frame = found
    text = f"{type(exc).__name__}: {exc}"
    for diagnosis in declared:
        if getattr(diagnosis, "kind", None) != FailureKind.RAISED or not re.search(diagnosis.match, text):
            continue
        module = sys.modules[library].__file__ or ""
        relative = os.path.relpath(os.path.realpath(frame.filename), os.path.dirname(os.path.dirname(module)))
        return Failure(
            rank=rank, step=step, model=diagnosis.model or "", param="", kind=FailureKind.RAISED,
            max_abs_diff=0.0, checked="raise",
            message=f"{library} raised {exception_text(exc)} ({relative}:{frame.lineno}, in {frame.name})",
        )
    return None
