"""The result matrix: cells, their failures, and the schema-1 JSON form."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1

PASS = "pass"
FAIL = "fail"
ERROR = "error"
SKIP = "skip"
UNSUPPORTED = "unsupported"
DETECTED = "detected"
MISSED = "missed"

STATUSES = (PASS, FAIL, ERROR, SKIP, UNSUPPORTED, DETECTED, MISSED)
# A run is red when any cell has one of these.
BAD_STATUSES = frozenset({FAIL, ERROR, MISSED})
# A cell "holds" when it shows the harness judging correctly; diff counts leaving these as regressions.
GOOD_STATUSES = frozenset({PASS, DETECTED})

FAILURE_KINDS = (
    "not_synced",
    "synced_early",
    "wrong_scale",
    "stale",
    "params_diverged",
    "stepped_early",
    "step_skipped",
    "sync_flag",
    "schedule",
    "mismatch",
)


class MatrixError(ValueError):
    """A file is not a usable schema-1 matrix; the message is one line."""


def printable_line(text: object) -> str:
    """``text`` as one line that is safe to print on a terminal, in a log or in a report.

    Runs of whitespace (newlines, tabs, ...) become one space; any other character that does not
    print (control characters such as ANSI escapes and NUL, format characters such as bidi
    overrides, lone surrogates) is shown as its Python escape, e.g. ``\\x1b`` or ``\\u202e``.
    """
    return escape_unprintable(" ".join(str(text).split()))


def escape_unprintable(text: str) -> str:
    """``text`` with every character that does not print shown as its Python escape (``\\n``, ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@dataclass
class Failure:
    """One disagreement between a rank and the oracle."""

    rank: int
    step: int
    model: str
    param: str
    kind: str
    max_abs_diff: float
    message: str
    max_rel_diff: float = 0.0
    index: list[int] | None = None
    checked: str = "grad"  # "grad", "param" or "flag"
    factor: float | None = None
    mismatched: int = 0
    numel: int = 0
    atol: float = 0.0
    rtol: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Failure":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Cell:
    """The judged outcome of one (case, variant, world_size)."""

    case: str
    variant: str
    world_size: int
    status: str
    summary: str = ""
    max_abs_diff: float = 0.0
    duration_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    checks: int = 0  # every comparison with the oracle: gradients, parameters, flags, learning rates
    grad_checks: int = 0  # the gradient comparisons among them (the ones that can test sync)
    vacuous_checks: int = 0  # gradient comparisons where synced and local could not be told apart
    nodeid: str = ""
    rerun: str = ""
    detail: str = ""  # an error cell's tracebacks or stack dumps, rank by rank

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.case, self.variant, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["failures"] = [f.to_dict() for f in self.failures]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cell":
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["failures"] = [Failure.from_dict(f) for f in data.get("failures", [])]
        return cls(**kwargs)


@dataclass
class Matrix:
    """A whole run: its environment and its cells, sorted by key."""

    environment: dict[str, Any]
    cells: list[Cell]
    created: str = ""
    complete: bool = True

    def sorted_cells(self) -> list[Cell]:
        return sorted(self.cells, key=lambda c: (c.case, c.variant, c.world_size))

    def counts(self) -> dict[str, int]:
        counts = {status: 0 for status in STATUSES}
        for cell in self.cells:
            counts[cell.status] = counts.get(cell.status, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "complete": self.complete,
            "environment": self.environment,
            "cells": [c.to_dict() for c in self.sorted_cells()],
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "matrix") -> "Matrix":
        """A Matrix from parsed schema-1 JSON, every known field checked for its type (see
        harness.matrixfile); any problem is a MatrixError with a one-line message."""
        from harness.matrixfile import parse_matrix

        return parse_matrix(data, source=source)


def _current_umask() -> int:
    # The only way to read the umask is to set it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write through a temporary file and rename, so that a reader never sees half a file.

    The file gets the mode any new file would (0o666 less the umask), not mkstemp's 0o600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def merge_cells(cells: Iterable[Cell]) -> list[Cell]:
    """One cell per key; a later result for the same key replaces an earlier one."""
    merged: dict[tuple[str, str, int], Cell] = {}
    for cell in cells:
        merged[cell.key] = cell
    return sorted(merged.values(), key=lambda c: (c.case, c.variant, c.world_size))
