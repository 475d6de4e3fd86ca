"""A cell's timeline: every check on every rank by micro-step, with the schedule's sync points and
optimizer steps, so that a report can draw where and when the ranks parted from the oracle.

Plain data, no torch: a rank records its own checks (``TimelineRecorder``, in harness/rank/judging/checks.py's
Recorder), the controller joins the ranks' into one ``Timeline`` (harness/controller/verdict.py), and the
matrix keeps it for a cell with failures (the ``timeline`` field of a cell in matrix.json).

A mark is one kind of check on one rank at one micro-step (``grad``, ``param``, ``flag``, ``lr``,
``comm``, ``schedule``), whatever the number of models and parameters it compared: ``kind`` is the
first diagnosis recorded there, or None where every comparison agreed with the oracle. The
failures keep the details; the marks are never cut short as the failures are (MAX_FAILURES), so a
timeline shows every step even when most failures were only counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

# The order checks are drawn in within a micro-step, and their words; another harness version may
# record others (drawn after these, under their own name).
CHECKS = ("schedule", "flag", "comm", "grad", "lr", "param", "raise", "grad_norm")
CHECK_WORDS = {
    "schedule": "batch count",
    "flag": "sync flag",
    "comm": "collectives",
    "grad": "gradients",
    "lr": "learning rate",
    "param": "parameters",
    "raise": "the library raised",
    "grad_norm": "Trainer's grad_norm",
}


@dataclass
class TimelineStep:
    """One micro-step as the schedule has it (None: the case's checks did not say)."""

    step: int
    epoch: int | None = None
    batch: int | None = None
    sync: bool | None = None
    optimizer_step: bool | None = None


@dataclass
class TimelineMark:
    """One kind of check on one rank at one micro-step; ``kind`` None where it agreed with the oracle."""

    rank: int
    step: int
    check: str
    kind: str | None = None


@dataclass
class Timeline:
    steps: list[TimelineStep] = field(default_factory=list)
    marks: list[TimelineMark] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({mark.rank for mark in self.marks})

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [vars(step).copy() for step in self.steps],
            "marks": [vars(mark).copy() for mark in self.marks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Timeline":
        return cls(
            steps=[TimelineStep(**_known(TimelineStep, s)) for s in data.get("steps", [])],
            marks=[TimelineMark(**_known(TimelineMark, m)) for m in data.get("marks", [])],
        )

    @classmethod
    def join(cls, recorders: Iterable["TimelineRecorder"]) -> "Timeline":
        """One timeline from the ranks' records; where ranks disagree on a step's schedule (they
        cannot: it is the contract's) the lowest rank's is kept."""
        steps: dict[int, TimelineStep] = {}
        marks: list[TimelineMark] = []
        for recorder in sorted(recorders, key=lambda r: r.rank):
            for number, point in recorder.steps.items():
                mine = steps.setdefault(number, TimelineStep(step=number))
                for name, value in vars(point).items():
                    if getattr(mine, name) is None:
                        setattr(mine, name, value)
            for (step, check), kind in recorder.marks.items():
                marks.append(TimelineMark(rank=recorder.rank, step=step, check=check, kind=kind or None))
                steps.setdefault(step, TimelineStep(step=step))
        order = {name: n for n, name in enumerate(CHECKS)}
        marks.sort(key=lambda m: (m.step, m.rank, order.get(m.check, len(order)), m.check))
        return cls(steps=[steps[n] for n in sorted(steps)], marks=marks)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = cls.__dataclass_fields__  # type: ignore[attr-defined]
    return {key: value for key, value in data.items() if key in names}


@dataclass
class TimelineRecorder:
    """One rank's checks in one cell, as they happen."""

    rank: int
    steps: dict[int, TimelineStep] = field(default_factory=dict)
    marks: dict[tuple[int, str], str] = field(default_factory=dict)  # (step, check) -> kind, "" agreed

    def at(self, step: int, *, epoch: int | None = None, batch: int | None = None, sync: bool | None = None,
           optimizer_step: bool | None = None) -> None:
        """What the schedule says of micro-step ``step``; what is not known stays None."""
        point = self.steps.setdefault(step, TimelineStep(step=step))
        for name, value in (("epoch", epoch), ("batch", batch), ("sync", sync), ("optimizer_step", optimizer_step)):
            if value is not None:
                setattr(point, name, value)

    def mark(self, step: int, check: str, kind: str | None = None) -> None:
        """A check ran at ``step``; ``kind``: what it found wrong (the first diagnosis there stays)."""
        if not self.marks.get((step, check)):
            self.marks[(step, check)] = str(kind) if kind else ""
