"""The records both sides of a pool share: statuses, failure kinds, failures, rank faults, a cell's outcome.

Plain data with no dependency (not torch, not pytest, nothing of the harness): the rank side builds
them, the controller judges and reports them. The enums are ``str`` enums whose values are the
public names of the report schema (docs/matrix-schema.md), so a member is equal to, hashes like and prints as
its name, and matrices from any harness version keep comparing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

class _Name(str, Enum):
    """A public name: ``str(member)`` and ``f"{member}"`` are its value, on every Python."""

    __str__ = str.__str__
    __format__ = str.__format__


class Status(_Name):
    """A judged cell's status."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    SKIP = "skip"
    UNSUPPORTED = "unsupported"
    DETECTED = "detected"
    MISSED = "missed"


STATUSES = tuple(s.value for s in Status)
# A run is red when any cell has one of these.
BAD_STATUSES = frozenset({Status.FAIL, Status.ERROR, Status.MISSED})
# A cell "holds" when it shows the harness judging correctly; diff counts leaving these as regressions.
GOOD_STATUSES = frozenset({Status.PASS, Status.DETECTED})


class FailureKind(_Name):
    """What a failure was diagnosed as."""

    NOT_SYNCED = "not_synced"
    SYNCED_EARLY = "synced_early"
    WRONG_SCALE = "wrong_scale"
    STALE = "stale"
    PARAMS_DIVERGED = "params_diverged"
    STEPPED_EARLY = "stepped_early"
    STEP_SKIPPED = "step_skipped"
    SYNC_FLAG = "sync_flag"
    SCHEDULE = "schedule"
    MISMATCH = "mismatch"
    COMM_UNEXPECTED = "comm_unexpected"  # gradient reductions in a backward the contract has none in
    COMM_MISSING = "comm_missing"  # too few (or no) gradient reductions in a backward that syncs
    MISWEIGHTED = "misweighted"  # the contributions since the last check, weighted other than the token mean
    # torch, accelerate or the wrapper's library raised in a loop its contract takes, as a declared
    # defect says it does (``Diagnosis("raised", match=...)``, harness/rank/process/raises.py); an undeclared
    # raise stays the cell's ``error``
    RAISED = "raised"


# Diagnoses that compare a synced gradient with a local one: a single rank cannot produce them.
SYNC_KINDS = frozenset({FailureKind.NOT_SYNCED, FailureKind.SYNCED_EARLY, FailureKind.COMM_UNEXPECTED,
                        FailureKind.COMM_MISSING})


# The checks that can be unavailable on some installations (docs/upgrade-checks.md),
# by the name the reports give them, with the failure kinds only they can give: a cell where one
# did not run says so, and a canary that must show one of those kinds there is ``skip``.
UNCHECKED_KINDS: dict[str, frozenset[str]] = {
    "collective_accounting": frozenset({FailureKind.COMM_UNEXPECTED, FailureKind.COMM_MISSING}),
}
CHECK_TITLES = {"collective_accounting": "collective accounting (comm_unexpected, comm_missing)"}


class RankOutcome(_Name):
    """How a rank's part of a cell ended."""

    OK = "ok"
    RAISED = "raised"
    UNSUPPORTED = "unsupported"
    SKIPPED = "skipped"


class FaultKind(_Name):
    """What went wrong with a rank that kept it from reporting a result."""

    RAISED = "raised"
    EXITED = "exited"
    KILLED = "killed"
    HUNG = "hung"
    BLOCKED = "blocked"  # waiting in a collective for a rank that raised, died or hung
    LOST = "lost"  # a launched rank that stopped answering: its process or its host died


# The faults that are a cause; a blocked rank is the victim of one of them.
CAUSES = frozenset({FaultKind.RAISED, FaultKind.EXITED, FaultKind.KILLED, FaultKind.HUNG, FaultKind.LOST})


@dataclass
class Failure:
    """One disagreement between a rank and the oracle."""

    rank: int
    step: int
    model: str
    param: str
    kind: str  # a FailureKind; a matrix of another harness version may hold others
    max_abs_diff: float
    message: str
    max_rel_diff: float = 0.0
    index: list[int] | None = None
    checked: str = "grad"  # "grad", "param", "flag", "lr" or "schedule"
    factor: float | None = None
    mismatched: int = 0
    numel: int = 0
    atol: float = 0.0
    rtol: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kind"] = str(self.kind)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Failure":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class RankFault:
    """What went wrong with one rank during a cell."""

    rank: int
    what: FaultKind
    detail: str = ""
    host: str = ""  # under a launcher, the rank's host (the local pool's ranks share the controller's)
