"""A cell's verdict: its status from the ranks' results (the words come from harness.wording)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from harness import wording
from harness.decorator import Diagnosis, probed
from harness.matrix.schema import Cell
from harness.messages import CellOutcome
from harness.records import UNCHECKED_KINDS, Failure, FailureKind, RankOutcome, Status
from harness.timeline import Timeline

if TYPE_CHECKING:
    from harness.messages import RankResult


def _judge_canary(cell: Cell, detects: Sequence[Diagnosis], omitted: int) -> Cell:
    """A canary is detected when every declared diagnosis that this world size can show was found.
    One that must show a kind only a check that could not run here gives is ``skip``, saying why."""
    required = [d for d in detects if d.observable(cell.world_size)]
    if not required:
        cell.status = Status.SKIP
        cell.summary = wording.canary_unobservable_summary(detects, cell.world_size)
        return cell
    blind = {check: reason for check, reason in cell.unchecked.items()
             if any(d.kind in UNCHECKED_KINDS.get(check, ()) for d in required)}
    if blind:
        cell.status = Status.SKIP
        cell.summary = wording.canary_unchecked_summary(required, blind)
        return cell
    found = [d for d in required if any(d.matches(f.kind, f.model) for f in cell.failures)]
    if len(found) == len(required):
        cell.status = Status.DETECTED
        cell.summary = (wording.canary_detected_summary(required, cell.failures, omitted)
                        + wording.unchecked_suffix(cell.unchecked))
        return cell
    cell.status = Status.MISSED
    cell.summary = (wording.canary_missed_summary([d for d in required if d not in found], cell.failures, omitted)
                    + wording.unchecked_suffix(cell.unchecked))
    return cell


def judge(
    *,
    case: str,
    variant: str,
    world_size: int,
    detects: Sequence[Diagnosis] = (),
    outcome: CellOutcome | None,
    timeout_s: float,
    duration_s: float,
    nodeid: str = "",
    rerun: str = "",
    start_error: str = "",
    controller_error: str = "",
) -> Cell:
    """One cell from the pool's outcome (None when the pool could not start, or when the controller
    failed while waiting: ``controller_error`` is then its traceback). ``detects``: a canary's
    declared diagnoses (empty for an ordinary case)."""
    cell = Cell(case=case, variant=variant, world_size=world_size, status=Status.ERROR,
                duration_s=round(duration_s, 4), nodeid=nodeid, rerun=rerun)
    if controller_error:
        cell.summary = wording.controller_error_summary(controller_error)
        cell.detail = controller_error
        return cell
    if outcome is None:
        cell.summary = wording.start_error_summary(world_size, start_error)
        cell.detail = start_error
        return cell
    if outcome.faults:
        cell.summary = wording.faults_summary(outcome.faults, timeout_s=timeout_s)
        cell.detail = wording.faults_detail(outcome.faults, timeout_s=timeout_s)
        # what the ranks that reported had judged before the fault: kept, and said after it
        judged, omitted = _failures(outcome.results.values())
        if judged:
            cell.failures = judged
            cell.summary += "; before it, " + wording.failures_summary(judged, omitted)
        return cell
    results = [outcome.results[r] for r in sorted(outcome.results)]
    outcomes = {r.outcome for r in results}
    if len(outcomes) > 1:
        # one rank skipping while another ran (and maybe failed) would hide that failure
        cell.summary = wording.disagreement_summary(results)
        return cell
    if outcomes == {RankOutcome.UNSUPPORTED}:
        cell.status = Status.UNSUPPORTED
        cell.summary = results[0].detail
        return cell
    if outcomes == {RankOutcome.SKIPPED}:
        cell.status = Status.SKIP
        cell.summary = results[0].detail
        return cell
    assert outcomes <= {RankOutcome.OK}, outcomes  # RAISED arrives as a fault
    cell.forced = dict(sorted({k: v for r in results for k, v in r.forced.items()}.items()))
    cell.wrapper = results[0].wrapper
    cell = _judge_checks(cell, results, detects)
    said = dict(sorted({k: v for r in results for k, v in r.said.items()}.items()))
    cell.summary += (wording.said_suffix(said) + wording.wrapper_suffix(cell.wrapper)
                     + wording.forced_suffix(cell.forced))
    return cell


def _failures(results: Iterable[RankResult]) -> tuple[list[Failure], int]:
    """The ranks' failures in step order (then rank), and how many they left out."""
    results = list(results)
    failures = sorted((f for r in results for f in r.failures), key=lambda f: (f.step, f.rank))
    return failures, sum(r.omitted_failures for r in results)


def _judge_checks(cell: Cell, results: Sequence[RankResult], detects: Sequence[Diagnosis]) -> Cell:
    """A cell whose ranks all ran the case to its end, judged on their checks."""
    world_size = cell.world_size
    failures, omitted = _failures(results)
    cell.checks = sum(r.checks for r in results)
    cell.grad_checks = sum(r.grad_checks for r in results)
    cell.vacuous_checks = sum(r.vacuous_checks for r in results)
    cell.comm_checks = sum(r.comm_checks for r in results)
    cell.max_abs_diff = max((r.max_abs_diff for r in results), default=0.0)
    cell.failures = failures
    cell.unchecked = dict(sorted({k: v for r in results for k, v in r.unchecked.items()}.items()))
    if failures or omitted:  # where the ranks parted from the oracle, drawn by the HTML report
        cell.timeline = Timeline.join(r.timeline for r in results if r.timeline is not None)
    # a declared defect that raises (harness/rank/process/raises.py) can raise before any check: the exception,
    # matched on every rank, is the evidence
    raised = any(f.kind == FailureKind.RAISED for f in failures)
    if cell.grad_checks == 0 and not raised:
        cell.status = Status.MISSED if detects else Status.ERROR
        cell.summary = wording.NO_GRADIENT_CHECK
        return cell
    if world_size >= 2 and cell.vacuous_checks == cell.grad_checks and not raised:
        cell.summary = wording.all_vacuous_summary(cell)
        return cell
    # a probed defect of the backend the cell went through (``PROBED``, harness/decorator.py), declared as
    # the case's own are
    detects = tuple(detects) + probed(sorted({name for r in results for name in r.defects}))
    if detects:
        return _judge_canary(cell, detects, omitted)
    if failures:
        cell.status = Status.FAIL
        cell.summary = wording.failures_summary(failures, omitted) + wording.unchecked_suffix(cell.unchecked)
        return cell
    cell.status = Status.PASS
    cell.summary = wording.evidence_summary(cell)
    return cell
