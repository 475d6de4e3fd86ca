"""Turning the ranks' results into one judged cell, and a judged cell into the message a person reads."""

from __future__ import annotations

from collections import Counter, defaultdict

from harness.matrix import DETECTED, ERROR, FAIL, MISSED, PASS, SKIP, UNSUPPORTED, Cell, Failure
from harness.messages import OK, SKIPPED
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


def judge(
    *,
    case: str,
    variant: str,
    world_size: int,
    canary: bool,
    outcome: PoolOutcome | None,
    timeout_s: float,
    duration_s: float,
    nodeid: str = "",
    rerun: str = "",
    start_error: str = "",
) -> Cell:
    """One cell from the pool's outcome (None when the pool could not start)."""
    cell = Cell(case=case, variant=variant, world_size=world_size, status=ERROR,
                duration_s=round(duration_s, 4), nodeid=nodeid, rerun=rerun)
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
    if RANK_UNSUPPORTED in outcomes:
        cell.status = UNSUPPORTED
        cell.summary = next(r.detail for r in results if r.outcome == RANK_UNSUPPORTED)
        return cell
    if SKIPPED in outcomes:
        cell.status = SKIP
        cell.summary = next(r.detail for r in results if r.outcome == SKIPPED)
        return cell
    assert outcomes <= {OK}, outcomes  # RAISED arrives as a fault
    failures = sorted((Failure.from_dict(f) for r in results for f in r.failures), key=lambda f: (f.step, f.rank))
    omitted = sum(r.omitted_failures for r in results)
    cell.checks = sum(r.checks for r in results)
    cell.vacuous_checks = sum(r.vacuous_checks for r in results)
    cell.max_abs_diff = max((r.max_abs_diff for r in results), default=0.0)
    cell.failures = failures
    if failures:
        cell.status = DETECTED if canary else FAIL
        cell.summary = summarize_failures(failures, omitted)
        return cell
    if cell.checks == 0:
        cell.status = MISSED if canary else ERROR
        cell.summary = "the case compared nothing with the oracle (a check that cannot fail)"
        return cell
    cell.status = MISSED if canary else PASS
    evidence = f"{cell.checks} gradient checks on {world_size} rank{'s' if world_size > 1 else ''}"
    if cell.vacuous_checks == cell.checks:
        why = "world size 1 cannot tell synced from local" if world_size == 1 else "synced and local gradients were too alike"
        evidence += f", all vacuous for sync ({why})"
    elif cell.vacuous_checks:
        evidence += f", {cell.vacuous_checks} vacuous for sync"
    cell.summary = (
        f"{'the known-wrong pattern went unnoticed: ' if canary else ''}{evidence}; "
        f"max |diff| {cell.max_abs_diff:.3g}"
    )
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

