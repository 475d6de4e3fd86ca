"""Who caused a stuck cell: of the ranks that gave no result, which hung and which were only blocked
waiting for them. Shared by local pools and launches; no torch here.

Progress decides first. Each rank says how many collectives its process group has issued (torch's
per-group sequence number, which counts DDP's own all-reduces too, and counts a collective when it is
issued, not when it completes). Every rank issues the same collectives, so the ranks that issued the
fewest are the ones the others wait for: they hung, the rest are blocked. This holds where Python
stacks mislead: an nccl collective is asynchronous, so a rank blocked by a dead peer may sit in
``.item()`` or a later synchronisation, far from any collective. Only when progress cannot tell (the
counts are equal, or a rank could not say) do the stacks decide: a rank waiting inside a collective,
while another is not, is blocked.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from harness.messages import CellOutcome, ProtocolError, RankResult, expect
from harness.records import FaultKind, RankFault, RankOutcome


def in_collective(stack: str) -> bool:
    return "distributed_c10d" in stack or "torch/nn/parallel/distributed" in stack


# How a collective fails on the ranks that survive a peer's death: they are its victims, not its cause.
_COLLECTIVE_ERRORS = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
                      "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator was aborted",
                      "Default process group has not been initialized", "/gloo/transport/", "Timed out waiting")


def collective_error(detail: str) -> bool:
    return any(marker in detail for marker in _COLLECTIVE_ERRORS)


def protocol_fault(rank: int, message: Any, cell_id: str) -> RankFault | None:
    """None when ``message`` is a result for the cell ``cell_id``; else the fault it is (anything else,
    or a late result of an earlier cell, is never taken for this cell's)."""
    try:
        result = expect(message, RankResult)
    except ProtocolError as exc:
        return RankFault(rank, FaultKind.RAISED, f"protocol error: {exc}")
    if result.cell_id != cell_id:
        return RankFault(rank, FaultKind.RAISED,
                         f"protocol error: a result for cell {result.cell_id!r} arrived for {cell_id!r}")
    return None


def take_result(outcome: CellOutcome, rank: int, message: Any, cell_id: str) -> bool:
    """A message a rank sent during the cell ``cell_id``: its result kept in ``outcome`` (a raise a fault
    too), or the protocol fault it is; whether it made a fault. The one place a local pool and a launch
    accept a rank's message."""
    wrong = protocol_fault(rank, message, cell_id)
    if wrong is not None:
        outcome.faults.append(wrong)
        return True
    outcome.results[rank] = message
    if message.outcome == RankOutcome.RAISED:
        outcome.faults.append(RankFault(rank, FaultKind.RAISED, message.detail))
        return True
    return False


def stuck_kinds(pending: Sequence[int], *, after_fault: bool, progress: Mapping[int, int | None],
                stacks: Mapping[int, str]) -> dict[int, FaultKind]:
    """HUNG or BLOCKED for each rank that gave no result in time. ``after_fault``: another rank
    raised or died first, so these only waited for it. ``progress``: each rank's count of issued
    collectives (None where it could not say)."""
    if after_fault:
        return {rank: FaultKind.BLOCKED for rank in pending}
    counts = {rank: progress.get(rank) for rank in pending}
    if len(pending) > 1 and None not in counts.values() and len(set(counts.values())) > 1:
        fewest = min(c for c in counts.values() if c is not None)
        return {rank: FaultKind.HUNG if counts[rank] == fewest else FaultKind.BLOCKED for rank in pending}
    kinds = {}
    for rank in pending:
        waiting = in_collective(stacks.get(rank, ""))
        others_outside = any(not in_collective(stacks.get(r, "")) for r in pending if r != rank)
        kinds[rank] = FaultKind.BLOCKED if waiting and others_outside else FaultKind.HUNG
    return kinds


def mark_victims(faults: list[RankFault]) -> None:
    """A rank whose collective failed because a peer died or raised is that peer's victim: blocked."""
    victims = [f for f in faults if f.what == FaultKind.RAISED and collective_error(f.detail)]
    if any(f.what != FaultKind.BLOCKED and f not in victims for f in faults):
        for fault in victims:
            fault.what = FaultKind.BLOCKED
