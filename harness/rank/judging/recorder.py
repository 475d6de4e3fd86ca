"""What one rank records in one cell: its failures (each with the message a user reads first) and
its check counts, and the marks of its timeline; harness/rank/judging/checks.py judges, this keeps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness import wording
from harness.messages import RankResult
from harness.rank.numerics.closeness import Difference
from harness.rank.oracle.schedule import MicroStep
from harness.records import Failure, FailureKind, RankOutcome
from harness.timeline import TimelineRecorder

# Failures kept per rank; the rest are counted. The first ones in step order say the most.
MAX_FAILURES = 64


@dataclass
class Recorder:
    """Failures and check counts of one rank in one cell."""

    rank: int
    failures: list[Failure] = field(default_factory=list)
    omitted: int = 0
    checks: int = 0  # every comparison: gradients, parameters, flags, learning rates
    grad_checks: int = 0
    vacuous_checks: int = 0  # gradient checks where synced and local could not be told apart
    comm_checks: int = 0  # backwards whose collectives were judged (harness/rank/numerics/accounting.py)
    max_abs_diff: float = 0.0
    # the checks that could not run here, by name, each with its reason (docs/upgrade-checks.md):
    # recorded where one would have run, so that the cell says so
    unchecked: dict[str, str] = field(default_factory=dict)
    # what the harness changed of the user's own settings to run the cell (a script's Accelerator
    # arguments: harness/rank/script/run.py), by setting, each as ``was -> now``; said in the summary
    forced: dict[str, str] = field(default_factory=dict)
    # what the harness chose or noticed that changes no verdict (a script's contract chosen from what the
    # script shows, syncs the loop never suppressed), by topic; said in the summary
    said: dict[str, str] = field(default_factory=dict)
    # the wrapper a script's own Accelerator asked for (harness/rank/script/plugins.py), or ""
    wrapper: str = ""
    # the backend's probed defects (``PROBED``, harness/decorator.py) the cell's syncs went through
    defects: set[str] = field(default_factory=set)
    timeline: TimelineRecorder = field(init=False)

    def __post_init__(self) -> None:
        self.timeline = TimelineRecorder(rank=self.rank)

    def add(self, failure: Failure) -> None:
        self.timeline.mark(failure.step, failure.checked, failure.kind)
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(failure)
        else:
            self.omitted += 1

    def result(self, *, outcome: RankOutcome, cell_id: str, detail: str, duration_s: float) -> RankResult:
        """This rank's result of the cell: what it recorded, with the cell's ``outcome``."""
        return RankResult(rank=self.rank, outcome=outcome, cell_id=cell_id, detail=detail, failures=list(self.failures),
                          omitted_failures=self.omitted, checks=self.checks, grad_checks=self.grad_checks,
                          vacuous_checks=self.vacuous_checks, comm_checks=self.comm_checks,
                          max_abs_diff=self.max_abs_diff, timeline=self.timeline, unchecked=dict(self.unchecked),
                          forced=dict(self.forced), said=dict(self.said), wrapper=self.wrapper,
                          defects=sorted(self.defects), duration_s=duration_s)

    def observe(self, max_abs: float) -> None:
        self.max_abs_diff = max(self.max_abs_diff, max_abs)

    def batch_count(self, *, what: str, epoch: int, seen: int, expected: int) -> bool:
        """The batches ``what`` yielded in ``epoch`` against the contract's count: a failure of kind
        ``schedule`` where they differ. Whether they agree."""
        self.timeline.mark(0, "schedule")
        if seen == expected:
            return True
        self.add(Failure(
            rank=self.rank, step=0, model="dataloader", param="len", kind=FailureKind.SCHEDULE,
            max_abs_diff=float(abs(seen - expected)), checked="schedule",
            message=wording.batch_count_text(rank=self.rank, what=what, epoch=epoch, seen=seen, expected=expected),
        ))
        return False


def where(step: MicroStep | int) -> tuple[int, str]:
    """A failure's step number and the words for where it is."""
    if isinstance(step, MicroStep):
        return step.index, step.where()
    return step, f"step {step}"


def mark_point(recorder: Recorder, step: MicroStep | int, *, sync: bool | None = None,
               optimizer_step: bool | None = None) -> None:
    """The schedule's micro-step for the timeline: all of it from a MicroStep, else what the oracle
    knows at this check (the last backward's sync, whether the optimizer was due)."""
    if isinstance(step, MicroStep):
        recorder.timeline.at(step.index, epoch=step.epoch, batch=step.batch, sync=step.sync,
                             optimizer_step=step.optimizer_step)
    else:
        recorder.timeline.at(step, sync=sync, optimizer_step=optimizer_step)


def make_failure(
    *,
    rank: int,
    step: int,
    where: str,
    model: str,
    param: str,
    checked: str,
    kind: FailureKind,
    factor: float | None,
    diff: Difference,
    noun: str | None = None,
    weights: list[float] | None = None,
    earlier: float | Sequence[float] | None = None,
    backwards: int = 1,
    unit: str = "tokens",
    shards: list[list[int]] | None = None,
) -> Failure:
    """A failure of a gradient check (``checked="grad"``) or a parameter check (``"param"``), where
    ``diff`` compared the gradients or the updates; ``noun`` names what was compared otherwise;
    ``weights``: a misweighted gradient's fitted weights (by rank, after a sync; under a mesh by data
    shard, ``shards`` the ranks of each); ``earlier``: the fitted weight of the gradient held before
    them, where that was fitted too (after a sync, by rank or data shard); ``backwards``: how many
    micro-batches since the last check the weights are of (each by rank after a sync)."""
    noun = noun or ("gradient of" if checked == "grad" else "update of parameter")
    what = f"{noun} '{model}.{param}'"
    return Failure(
        rank=rank,
        step=step,
        model=model,
        param=param,
        kind=kind,
        max_abs_diff=diff.max_abs,
        max_rel_diff=diff.max_rel if math.isfinite(diff.max_rel) else 1e308,
        index=list(diff.max_abs_index),
        checked=checked,
        factor=factor,
        mismatched=diff.mismatched,
        numel=diff.numel,
        atol=diff.allowed_abs,
        rtol=diff.allowed_rel if math.isfinite(diff.allowed_rel) else 1e308,
        message=wording.mismatch_text(what=what, where=f"on rank {rank} at {where}", kind=kind, factor=factor,
                                      diff=diff, weights=weights, earlier=earlier, backwards=backwards,
                                      unit=unit, shards=shards),
    )
