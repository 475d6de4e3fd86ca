"""The reductions each backward issued (harness/rank/numerics/accounting.py records them) judged
against the contract: a backward that does not sync issues none (except under ZeRO >= 2, which
reduces every micro-batch by design), one that syncs reduces at least every element that got a
gradient, and under a mesh each runs within the rank's data-parallel peers (docs/matrix-schema.md,
failure kinds ``comm_unexpected`` and ``comm_missing``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.rank.numerics.accounting import Backward
from harness.wrappers.mesh import AVERAGED


@dataclass(frozen=True)
class Verdict:
    """One backward judged against the contract: ``kind`` is None when it kept it."""

    kind: str | None
    backward: Backward
    syncs: bool
    needed: int
    why: str = ""  # under a mesh: which group was wrong or missing


def judge(backwards: list[Backward], syncs: list[tuple[bool, int]], *, reduces_every_micro_batch: bool,
          mesh: Any = None, rank: int = 0) -> list[Verdict]:
    """The backwards since the last check against what the oracle's backwards say of them:
    ``syncs`` holds, per oracle backward, whether it syncs and how many elements got a gradient.

    Paired one to one when the counts agree (a case runs one oracle backward per backward); else
    judged together: any reduction where none syncs is unexpected, too few where one syncs missing.
    A backward whose records the ring lost is not judged.

    Under a ``mesh`` (harness/wrappers/mesh.py) on ``rank``, per mesh dimension: a reduction over the
    rank's tensor-parallel group is the layers' own (their partial sums), not a gradient sync, and is
    not counted; any other must run within the rank's data-parallel and context peers
    (``comm_unexpected`` otherwise, naming the group), and at a sync the groups reduced over must
    together reach every one of those peers (``comm_missing`` otherwise, naming whom they missed)."""
    if not backwards or not syncs:
        return []
    if mesh is not None:
        backwards = [_without_tensor_parallel(b, tuple(mesh.tensor_parallel_group(rank))) for b in backwards]
    if len(backwards) == len(syncs):
        pairs = list(zip(backwards, syncs))
    else:
        joined = Backward([r for b in backwards for r in b.reductions], all(b.complete for b in backwards),
                          [g for b in backwards for g in b.groups])
        pairs = [(joined, (any(s for s, _ in syncs), sum(n for s, n in syncs if s)))]
    verdicts = []
    for backward, (sync, needed) in pairs:
        if not backward.complete:
            continue
        kind, why = None, ""
        if sync and backward.reduced < needed:
            kind = "comm_missing"
        elif not sync and backward.reductions and not reduces_every_micro_batch:
            kind = "comm_unexpected"
        elif mesh is not None:
            kind, why = _judge_groups(backward, sync, mesh, rank)
        verdicts.append(Verdict(kind, backward, sync, needed, why))
    return verdicts


def _without_tensor_parallel(backward: Backward, tensor_parallel: tuple[int, ...]) -> Backward:
    if len(tensor_parallel) < 2:
        return backward
    kept = [(r, g) for r, g in zip(backward.reductions, backward.groups or [None] * len(backward.reductions))
            if g != tensor_parallel]
    return Backward([r for r, _ in kept], backward.complete, [g for _, g in kept])


def _judge_groups(backward: Backward, sync: bool, mesh: Any, rank: int) -> tuple[str | None, str]:
    """Under a mesh: a reduction over ranks that are not all data-parallel (or context) peers of
    ``rank`` is unexpected; at a sync, the reductions must together cover every such mesh dimension,
    each group counting for the dimensions it spans (HSDP's reduce-scatter over dp_shard, then its
    all-reduce over dp_replicate, reach every peer between them)."""
    groups = backward.groups or [None] * len(backward.reductions)
    if any(g is None for g in groups):
        return None, ""  # a group that cannot be named: judged by the element count alone
    peers = set(mesh.averaging_group(rank))
    covered: set[str] = set()
    for (op, n), group in zip(backward.reductions, groups):
        outside = sorted(set(group or ()) - peers)
        if outside:
            return "comm_unexpected", (f"{op} of {n} elements over ranks {list(group or ())}: ranks {outside} are "
                                       f"not among rank {rank}'s data-parallel peers {sorted(peers)}")
        covered |= mesh.dimensions_of(sorted(group or ()), rank)
    needed = {d for d, size in mesh.active if d in AVERAGED}
    if sync and needed - covered:
        missing = sorted(needed - covered)
        return "comm_missing", (f"no gradient reduction over mesh dimension {', '.join(missing)} (the groups "
                                f"reduced over span {', '.join(sorted(covered)) or 'none'}), so rank {rank}'s "
                                f"gradient is not averaged over all of its data-parallel peers {sorted(peers)}")
    return None, ""
