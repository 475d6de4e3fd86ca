"""The report schema: a judged cell, a whole run's matrix of them, and their schema-1 dict form."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from harness.records import STATUSES, Failure, Status
from harness.timeline import Timeline

SCHEMA_VERSION = 1


class MatrixError(ValueError):
    """A file is not a usable schema-1 matrix; the message is one line."""


@dataclass
class Cell:
    """The judged outcome of one (case, variant, world_size)."""

    case: str
    variant: str
    world_size: int
    status: Status  # read from a file: one of STATUSES as a plain str
    summary: str = ""
    max_abs_diff: float = 0.0
    duration_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)
    checks: int = 0  # every comparison with the oracle: gradients, parameters, flags, learning rates
    grad_checks: int = 0  # the gradient comparisons among them (the ones that can test sync)
    vacuous_checks: int = 0  # gradient comparisons where synced and local could not be told apart
    comm_checks: int = 0  # backwards whose gradient collectives were judged against the contract
    nodeid: str = ""
    rerun: str = ""
    detail: str = ""  # an error cell's tracebacks or stack dumps, rank by rank
    # every check by rank and micro-step, kept for a cell with failures (harness/timeline.py);
    # written only where present, so that the JSON of every other cell is as before
    timeline: Timeline | None = None
    # the checks that could not run in this cell, by name (``collective_accounting``), each with its
    # reason (docs/upgrade-checks.md); written only where there is one
    unchecked: dict[str, str] = field(default_factory=dict)
    # the user's own settings the harness changed to run the cell (a script's Accelerator arguments,
    # ``python -m harness watch``), by setting, each ``was -> now``; written only where there is one
    forced: dict[str, str] = field(default_factory=dict)
    # the wrapper a script's own Accelerator asked for (its FSDP or DeepSpeed plugin), which the cell
    # ran under (``python -m harness watch``); written only where there is one
    wrapper: str = ""

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.case, self.variant, self.world_size)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = str(self.status)  # plain data: execnet carries no enum between xdist workers
        data["failures"] = [f.to_dict() for f in self.failures]
        if self.timeline is None:
            del data["timeline"]
        else:
            data["timeline"] = self.timeline.to_dict()
        if not self.unchecked:
            del data["unchecked"]
        if not self.forced:
            del data["forced"]
        if not self.wrapper:
            del data["wrapper"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cell":
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["failures"] = [Failure.from_dict(f) for f in data.get("failures", [])]
        if data.get("timeline") is not None:
            kwargs["timeline"] = Timeline.from_dict(data["timeline"])
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

    def to_dict(self, *, with_cells: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "created": self.created,
            "complete": self.complete,
            "environment": self.environment,
        }
        if with_cells:
            data["cells"] = [c.to_dict() for c in self.sorted_cells()]
        return data


UNAVAILABLE_CHECKS = "unavailable_checks"  # the environment key (docs/upgrade-checks.md)


def unavailable_checks(environment: dict[str, Any]) -> dict[str, str]:
    """The checks a matrix's cells could not run, with the reasons (empty for a complete check)."""
    value = environment.get(UNAVAILABLE_CHECKS)
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def with_unavailable_checks(environment: dict[str, Any], cells: Iterable[Cell]) -> dict[str, Any]:
    """``environment`` with ``unavailable_checks``: each check some cell could not run, with the
    reason (the first cell's, in cell order), where there is one; the same dict otherwise."""
    unavailable: dict[str, str] = dict(environment.get(UNAVAILABLE_CHECKS) or {})
    for cell in sorted(cells, key=lambda c: c.key):
        for check, reason in cell.unchecked.items():
            unavailable.setdefault(check, reason)
    if not unavailable:
        return environment
    return {**environment, UNAVAILABLE_CHECKS: dict(sorted(unavailable.items()))}


def merge_cells(cells: Iterable[Cell]) -> list[Cell]:
    """One cell per key; a later result for the same key replaces an earlier one."""
    merged: dict[tuple[str, str, int], Cell] = {}
    for cell in cells:
        merged[cell.key] = cell
    return sorted(merged.values(), key=lambda c: (c.case, c.variant, c.world_size))
