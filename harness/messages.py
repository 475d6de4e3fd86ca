"""Typed messages between the controller and its ranks; both sides import this and nothing of each other."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from harness.records import Failure, RankFault, RankOutcome
from harness.timeline import TimelineRecorder


# What ``python -m harness watch SCRIPT`` asks of every process of its run, ranks included: the script,
# its arguments and the specification's options, as JSON in this environment variable
# (harness/launch/watch_command.py writes it; harness/rank/script/cells.py and harness/controller/script.py read it).
WATCH_ENVIRONMENT = "GRADSYNC_WATCH"


def watched() -> dict[str, Any] | None:
    """What the running ``watch`` command asked for (the script, its arguments, the specification's
    options), or None outside one."""
    raw = os.environ.get(WATCH_ENVIRONMENT)
    return dict(json.loads(raw)) if raw else None


class ProtocolError(RuntimeError):
    """A message of a type the receiver does not accept at this point."""


@dataclass(frozen=True)
class CellSpec:
    """Everything a rank needs to run one cell."""

    case: str
    variant: str
    variant_params: dict[str, Any]
    world_size: int
    seed: int
    backend: str
    case_file: str
    case_attr: str
    fault: str | None = None
    cell_id: str = ""  # names the cell in its results, so a result can never be taken for another cell's
    # the case file as a rank on another host finds it: relative to the working directory or to the
    # installed catalogue (harness.catalogue.portable_location); case_file is the sender's own path
    case_anchor: str = ""
    case_relpath: str = ""


# controller -> rank


@dataclass(frozen=True)
class RunCell:
    spec: CellSpec


@dataclass(frozen=True)
class Shutdown:
    exit_status: int = 0  # under a launcher, every rank exits with the run's status


@dataclass(frozen=True)
class Rejoin:
    """Under a launcher, after a rank raised: leave the process group, which the ranks no longer agree
    on (the raising rank skipped collectives the others issued), and join generation ``generation``."""

    generation: int


# rank -> controller


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class StartupFailed:
    rank: int
    traceback: str


@dataclass(frozen=True)
class RankResult:
    rank: int
    outcome: RankOutcome
    cell_id: str = ""
    detail: str = ""
    failures: list[Failure] = field(default_factory=list)
    omitted_failures: int = 0
    checks: int = 0
    grad_checks: int = 0
    vacuous_checks: int = 0
    comm_checks: int = 0
    max_abs_diff: float = 0.0
    duration_s: float = 0.0
    timeline: TimelineRecorder | None = None  # every check by micro-step (harness/timeline.py)
    unchecked: dict[str, str] = field(default_factory=dict)  # checks that could not run here: their reasons
    forced: dict[str, str] = field(default_factory=dict)  # the user's settings the harness changed: was -> now
    said: dict[str, str] = field(default_factory=dict)  # what the harness chose or noticed, by topic: said
    wrapper: str = ""  # the wrapper a script's own plugin asked for (``python -m harness watch``), or ""
    # the backend's probed defects (``PROBED``, harness/decorator.py) that the cell went through on this rank
    defects: list[str] = field(default_factory=list)


def expect(message: Any, *types: type) -> Any:
    """Return the message if it is one of the types, else raise ProtocolError naming both."""
    if isinstance(message, types):
        return message
    wanted = ", ".join(t.__name__ for t in types)
    raise ProtocolError(f"unexpected message {type(message).__name__} (expected {wanted})")


@dataclass
class CellOutcome:
    """The ranks' results for one cell, or the faults that kept them from reporting."""

    results: dict[int, RankResult] = field(default_factory=dict)
    faults: list[RankFault] = field(default_factory=list)
