"""Turning the ranks' results into one judged cell, and a judged cell into the message a person reads."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from harness.catalogue import Diagnosis
from harness.matrix import DETECTED, ERROR, FAIL, MISSED, PASS, SKIP, UNSUPPORTED, Cell, Failure
from harness.messages import OK, SKIPPED, RankResult
from harness.messages import UNSUPPORTED as RANK_UNSUPPORTED
from harness.pool import PoolOutcome, RankFault

_CAUSES = ("raised", "exited", "killed", "hung")
_MESSAGE_FAILURES = 6


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def describe_fault(fault: RankFault, *, timeout_s: float) -> str:
    if fault.what == "raised":
        return f"rank {fault.rank} raised {_last_line(fault.detail)}"
    if fault.what in ("exited", "killed"):
        return f"rank {fault.rank} {fault.detail.splitlines()[0] if fault.detail else fault.what}"
    if fault.what == "hung":
        return f"rank {fault.rank} hung (no result within {timeout_s:g} s)"
    return f"rank {fault.rank} was blocked waiting for the others"


def _fault_detail(faults: list[RankFault], *, timeout_s: float) -> str:
    parts = []
    for fault in sorted(faults, key=lambda f: (f.what not in _CAUSES, f.rank)):
        heading = describe_fault(fault, timeout_s=timeout_s)
        kind = "stack" if fault.what in ("hung", "blocked") else "output"
        parts.append(f"--- {heading} ---\n{fault.detail.strip() or f'(no {kind} captured)'}")
    return "\n\n".join(parts)


def summarize_failures(failures: list[Failure], omitted: int) -> str:
    total = len(failures) + omitted
    ranks = sorted({f.rank for f in failures})
    by_kind: dict[str, set[str]] = defaultdict(set)
    for failure in failures:
        by_kind[failure.kind].add(failure.model)
    kinds = "; ".join(f"{kind} in {', '.join(sorted(models))}" for kind, models in sorted(by_kind.items()))
    first = min(failures, key=lambda f: (f.step, f.rank))
    where = f"{first.model}.{first.param}" if first.checked in ("grad", "param") else first.model
    return (
        f"{total} mismatches on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {kinds}; "
        f"first: {where} on rank {first.rank} at step {first.step}"
    )


def _evidence(cell: Cell, world_size: int) -> str:
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    text = f"{cell.checks} checks on {ranks}, {cell.grad_checks} of them gradients"
    if cell.grad_checks and cell.vacuous_checks == cell.grad_checks:
        why = "world size 1 cannot tell synced from local" if world_size == 1 else "synced and local gradients were too alike"
        text += f", all vacuous for sync ({why})"
    elif cell.vacuous_checks:
        text += f", {cell.vacuous_checks} vacuous for sync"
    return f"{text}; max |diff| {cell.max_abs_diff:.3g}"


def _disagreement(results: list[RankResult]) -> str:
    parts = []
    for r in results:
        what = {OK: "ran it", SKIPPED: "skipped it", RANK_UNSUPPORTED: "found it unsupported"}.get(r.outcome, r.outcome)
        detail = f" ({_last_line(r.detail)})" if r.detail else ""
        found = f" with {len(r.failures) + r.omitted_failures} failures" if r.failures else ""
        parts.append(f"rank {r.rank} {what}{detail}{found}")
    return "the ranks disagree on whether the cell applies: " + "; ".join(parts)


def _judge_canary(cell: Cell, detects: Sequence[Diagnosis], omitted: int) -> Cell:
    """A canary is detected when every declared diagnosis that this world size can show was found."""
    required = [d for d in detects if d.observable(cell.world_size)]
    if not required:
        cell.status = SKIP
        cell.summary = (f"this canary shows only as {', '.join(map(str, detects))}, which world size "
                        f"{cell.world_size} cannot show (sync needs two ranks)")
        return cell
    found = [d for d in required if any(d.matches(f.kind, f.model) for f in cell.failures)]
    if len(found) == len(required):
        cell.status = DETECTED
        cell.summary = f"diagnosed as declared ({', '.join(map(str, required))}): " + summarize_failures(
            cell.failures, omitted)
        return cell
    cell.status = MISSED
    missing = ", ".join(str(d) for d in required if d not in found)
    seen = summarize_failures(cell.failures, omitted) if cell.failures else "no failure at all"
    cell.summary = f"the known-wrong pattern was not diagnosed as declared: no {missing}; found {seen}"
    return cell


def judge(
    *,
    case: str,
    variant: str,
    world_size: int,
    detects: Sequence[Diagnosis] = (),
    outcome: PoolOutcome | None,
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
    cell = Cell(case=case, variant=variant, world_size=world_size, status=ERROR,
                duration_s=round(duration_s, 4), nodeid=nodeid, rerun=rerun)
    if controller_error:
        cell.summary = f"the harness failed while waiting for the cell: {_last_line(controller_error)}"
        cell.detail = controller_error
        return cell
    if outcome is None:
        cell.summary = f"the pool of {world_size} ranks did not start: {_last_line(start_error)}"
        cell.detail = start_error
        return cell
    if outcome.faults:
        causes = [f for f in outcome.faults if f.what in _CAUSES] or outcome.faults
        blocked = sorted(f.rank for f in outcome.faults if f.what == "blocked" and f not in causes)
        cell.summary = "; ".join(describe_fault(f, timeout_s=timeout_s) for f in causes)
        if blocked:
            cell.summary += f" (rank{'s' if len(blocked) > 1 else ''} {', '.join(map(str, blocked))} blocked waiting for it)"
        cell.detail = _fault_detail(outcome.faults, timeout_s=timeout_s)
        return cell
    results = [outcome.results[r] for r in sorted(outcome.results)]
    outcomes = {r.outcome for r in results}
    if len(outcomes) > 1:
        # one rank skipping while another ran (and maybe failed) would hide that failure
        cell.summary = _disagreement(results)
        return cell
    if outcomes == {RANK_UNSUPPORTED}:
        cell.status = UNSUPPORTED
        cell.summary = results[0].detail
        return cell
    if outcomes == {SKIPPED}:
        cell.status = SKIP
        cell.summary = results[0].detail
        return cell
    assert outcomes <= {OK}, outcomes  # RAISED arrives as a fault
    failures = sorted((Failure.from_dict(f) for r in results for f in r.failures), key=lambda f: (f.step, f.rank))
    omitted = sum(r.omitted_failures for r in results)
    cell.checks = sum(r.checks for r in results)
    cell.grad_checks = sum(r.grad_checks for r in results)
    cell.vacuous_checks = sum(r.vacuous_checks for r in results)
    cell.max_abs_diff = max((r.max_abs_diff for r in results), default=0.0)
    cell.failures = failures
    if cell.grad_checks == 0:
        cell.status = MISSED if detects else ERROR
        cell.summary = "the case compared no gradient with the oracle (a check that cannot fail)"
        return cell
    if world_size >= 2 and cell.vacuous_checks == cell.grad_checks:
        cell.summary = (f"every gradient check was vacuous for sync: the ranks' data were too alike to tell "
                        f"a synced gradient from a local one (a harness defect); {_evidence(cell, world_size)}")
        return cell
    if detects:
        return _judge_canary(cell, detects, omitted)
    if failures:
        cell.status = FAIL
        cell.summary = summarize_failures(failures, omitted)
        return cell
    cell.status = PASS
    cell.summary = _evidence(cell, world_size)
    return cell


def format_message(cell: Cell) -> str:
    """The text pytest shows for a cell that is not pass/detected/skip/unsupported."""
    head = f"{cell.case}[{cell.variant}] at world size {cell.world_size}"
    if cell.status == ERROR:
        lines = [f"The cell could not be judged: {head}", "", cell.summary]
        if cell.detail:
            lines += ["", cell.detail]
    elif cell.status == MISSED:
        lines = [f"The harness missed a known-wrong pattern: {head}", "", cell.summary]
    else:
        counts = Counter(f.kind for f in cell.failures)
        lines = [f"Gradients are not right on every rank: {head}", "",
                 "Diagnoses: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items())), ""]
        for failure in cell.failures[:_MESSAGE_FAILURES]:
            lines += [failure.message, ""]
        hidden = len(cell.failures) - _MESSAGE_FAILURES
        if hidden > 0:
            lines += [f"... and {hidden} more (all in the cell's entry in matrix.json)", ""]
        lines.append(cell.summary)
    if cell.rerun:
        lines += ["", f"Rerun this cell: {cell.rerun}"]
    return "\n".join(lines)

