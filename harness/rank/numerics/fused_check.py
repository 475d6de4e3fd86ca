"""A large model's gradient check fused with the average of its sync: the oracle's all-reduce and the
comparison with the rank's gradients in one pass, a buffer at a time, so that neither the average's
allowance nor the synced hypothesis is ever held whole.

Under DDP the oracle's sync (``Oracle.backward(sync=True)``) leaves the average pending when the
model is large (``Averaging.FUSED_FROM`` elements or more, harness/rank/oracle/averaging.py), and the
gradient check that follows makes it here: each rank sends its values and its share of the allowance
(as ``Collectives.reduce_all`` does), and each reduced buffer is judged against the rank's gradients
at once, the average written where the adopted gradient will be. What a check needs and this pass does not keep (the allowance, a
synced hypothesis of its own) is needed only to diagnose a failure: the ranks learn together whether
any rank's check failed (one small all-reduce), and then the oracle makes the average as it does for
a small model and the check runs as it always does, with every hypothesis.

The synced hypothesis (what a sync now would give) is the average of the local gradients; where the
local gradient is the one averaged (no sync since the window began) it is the average itself, with
the average's allowance, which bounds this rank's accumulation too (a small model's synced
hypothesis leaves that part out: the two can differ in whether a check is vacuous only where local
and synced differ by 10 to 15 allowances, not the many thousands a cell's data gives).

Memory: the replica's parameters, its gradient before the sync (the local one), the average (which
becomes the adopted gradient) and one buffer of at most ``BUFFER_ELEMENTS``, judged CHUNK elements at
a time: three copies of the model beyond the case's own while it runs, four where a window syncs
twice before a step (local and averaged gradient then differ); the buffer and the chunks' temporaries
are not held after it (bench/README.md, "Against model size": 2.2 copies at the cell's peak).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet as Set
from typing import Mapping

import torch
import torch.distributed as dist

from harness.rank.numerics.closeness import (
    REDUCTION_FACTOR,
    ROUNDING_ULPS,
    Expectation,
    all_close,
    all_close_made,
    any_distinguishable,
    eps,
    floor,
    rounding_allowance,
)
from harness.rank.numerics.collectives import Collectives, batches

# Elements of each parameter at which the first pass sends the allowance too (evenly spaced): where
# local and synced hypotheses differ by more than MARGIN allowances at one of them, they can be told
# apart, as the whole pass would find.
SAMPLE = 256
# A's lower bound from the average alone (coefficient·N·|average| + floor, less this part for the
# roundings of the sums on both sides): the reduction's allowance is at least that much everywhere.
_LOWER = 1 - 2.0 ** -10


@dataclass
class _Unit:
    """One parameter's part in the pass: the oracle's values before the sync, the allowance carried
    into it, its local gradient where that differs, the rank's gradient, and where the average goes."""

    values: torch.Tensor
    carried: torch.Tensor
    rounded: bool  # the carried allowance is ``carried`` plus ``rounding_allowance(values)``
    local: torch.Tensor | None
    actual: torch.Tensor
    average: torch.Tensor
    sample: torch.Tensor  # indices
    # after the first pass: the sum over the ranks at the samples of the allowance shares (row 0) and,
    # where local differs, of local and its shares (rows 1 and 2)
    sampled: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.values.numel()

    def share(self, into: torch.Tensor, at: slice | torch.Tensor, coefficient: float, world_size: int) -> None:
        """This rank's share of the allowance of the elements ``at`` (a range, or indices), into
        ``into``: coefficient·|values| + the carried allowance / the world size."""
        values = self.values[at]
        torch.abs(values, out=into)
        held = self.carried if not self.carried.dim() else self.carried.reshape(-1)[at]
        dtype = values.dtype
        if self.rounded and not held.dim():
            # coefficient·|v| + (held + ROUNDING_ULPS·eps·|v| + floor) / N, as one product and one sum
            into.mul_(coefficient + ROUNDING_ULPS * eps(dtype) / world_size).add_((held + floor(dtype)) / world_size)
        else:
            into.mul_(coefficient).add_(held + rounding_allowance(values) if self.rounded else held,
                                        alpha=1.0 / world_size)


@dataclass(frozen=True)
class FusedOutcome:
    """What the pass found: whether every rank's check passed (then ``average`` holds the oracle's
    average, by parameter, in tensors the oracle may keep), this rank's greatest difference, and
    whether local and synced hypotheses could be told apart somewhere."""

    passed: bool
    max_abs: float
    distinguishable: bool
    average: dict[str, torch.Tensor]
    same: bool = False  # the rank's gradients are the average bit for bit


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def fusable(params: Mapping[str, torch.Tensor]) -> bool:
    """Whether a model's gradients can be checked in this pass: every parameter's dtype is its
    allowance's (fp32 or float64), so that values and allowances travel in one buffer."""
    return all(p.dtype in (torch.float32, torch.float64) for p in params.values()) and len(
        {p.dtype for p in params.values()}) == 1


def check_synced(collectives: Collectives, *, params: Mapping[str, torch.Tensor],
                 grads: Mapping[str, torch.Tensor | None], carried: Mapping[str, torch.Tensor], rounded: Set[str],
                 local: Mapping[str, torch.Tensor | None],
                 actual: Mapping[str, torch.Tensor | None], reproduced: bool = False) -> FusedOutcome:
    """Average ``grads`` over the ranks (the oracle's gradients before the sync; None is zero) with the
    allowances ``carried`` into the sync (for the parameters in ``rounded``, that plus the rounding
    allowance of their gradient, made a buffer at a time), and judge ``actual`` (the rank's gradients,
    None is zero) against the average within its allowance; ``local``: the local gradients (the same
    tensors as ``grads`` where nothing parted them). ``reproduced``: the all-reduce's average is the
    wrapper's bit for bit (DDP at one or two ranks: harness/rank/oracle/averaging.py), so the allowance has no
    part for the reduction, only the carried one. Every rank calls it, for the same parameters.

    First the values alone: a rank's gradient equal to the average, or within the allowance's lower
    bound from the average itself, is close (the allowance is at least that); the allowance at the
    sample says whether local and synced can be told apart. Only where some rank could not decide
    both so does every rank send the allowance of every element (``_exact``)."""
    world_size = collectives.world_size
    aliased = all(local[p] is grads[p] for p in params)
    units = []
    for pname, param in params.items():
        value = grads[pname] if grads[pname] is not None else torch.zeros_like(param)
        own = local[pname] if local[pname] is not None else torch.zeros_like(param)
        rank = actual[pname] if actual[pname] is not None else torch.zeros_like(param)
        n = param.numel()
        units.append(_Unit(_flat(value), carried[pname].detach(), pname in rounded, None if aliased else _flat(own),
                           _flat(rank), torch.empty_like(param),
                           torch.linspace(0, max(n - 1, 0), min(n, SAMPLE)).round().long()))
    reduction = 0.0 if reproduced else REDUCTION_FACTOR * eps(units[0].values.dtype)
    close, best, same = _values(collectives, units, aliased, reduction)
    told = _told_at_sample(units, world_size)
    if not _any(collectives, not (close and told)):
        return FusedOutcome(True, best, True, {p: u.average for p, u in zip(params, units)}, same=same)
    close, best, told = _exact(collectives, units, reduction)
    return FusedOutcome(not _any(collectives, not close), best, told, {p: u.average for p, u in zip(params, units)})


def _any(collectives: Collectives, mine: bool) -> bool:
    """Whether any rank's ``mine`` is true (one small all-reduce: every rank learns the same)."""
    flag = torch.tensor([1.0 if mine else 0.0])
    if collectives.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return float(flag) > 0


def _values(collectives: Collectives, units: list[_Unit], aliased: bool,
            reduction: float) -> tuple[bool, float, bool]:
    """The first pass: the average of the values (into each unit's ``average``) and, riding with the
    first buffer, the allowance (``reduction``: its coefficient of every rank's |value|) and the
    synced hypothesis, where local differs, at the samples, in each unit's ``sampled``. Whether every
    element is surely close, the greatest difference, and whether the rank's gradients are the average
    bit for bit."""
    world_size = collectives.world_size
    dtype = units[0].values.dtype
    coefficient = REDUCTION_FACTOR * eps(dtype)
    lower = reduction * world_size * _LOWER
    lowest = floor(dtype)
    regions = 1 if aliased else 3
    counts = [u.sample.numel() for u in units]
    close, best, same = True, 0.0, True
    cut = batches(units)
    sizes = [sum(n for _, _, n in batch) for batch in cut]
    extras = [regions * sum(counts) if index == 0 else 0 for index in range(len(cut))]
    # one buffer for the pass, each batch in its front: a buffer this large is mapped fresh from the
    # kernel (above the heap's 32 MiB, harness/rank/process/environment.py), and each new one paid its
    # page faults again (a third of the pass's time at 2e7 parameters, three buffers a pass)
    whole = torch.empty(max(size + extra for size, extra in zip(sizes, extras)), dtype=dtype)
    for index, batch in enumerate(cut):
        size, extra = sizes[index], extras[index]
        buffer = whole[:size + extra]
        offset = 0
        for unit, start, n in batch:
            buffer[offset:offset + n] = unit.values[start:start + n]
            offset += n
        if extra:
            sampled = buffer[size:].view(regions, -1).split(counts, dim=1)
            for unit, region in zip(units, sampled):
                unit.share(region[0], unit.sample, reduction, world_size)
                if unit.local is not None:
                    region[1].copy_(unit.local[unit.sample])
                    torch.abs(region[1], out=region[2]).mul_(coefficient)
        if world_size > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        offset = 0
        for unit, start, n in batch:
            average = unit.average.reshape(-1)[start:start + n]
            torch.div(buffer[offset:offset + n], world_size, out=average)  # (one dtype: ``fusable``)
            rank = unit.actual[start:start + n]
            equal = torch.equal(rank, average)
            same = same and equal
            if not equal:
                ok, top = all_close_made(rank, average, lambda v: v.abs().mul_(lower).add_(lowest * _LOWER))
                close, best = close and ok, max(best, top)
            offset += n
        if extra:
            for unit, region in zip(units, buffer[size:].view(regions, -1).split(counts, dim=1)):
                unit.sampled = region.clone()
    return close, best, same


def _told_at_sample(units: list[_Unit], world_size: int) -> bool:
    """Whether local and synced hypotheses differ at a sample by more than MARGIN allowances (the
    synced: the average with its allowance where local is what was averaged, else local's average)."""
    pairs = []
    for unit in units:
        if unit.sampled is None or unit.sample.numel() == 0:
            continue
        lowest = floor(unit.values.dtype)
        if unit.local is None:
            synced = Expectation(unit.average.reshape(-1)[unit.sample], unit.sampled[0] + lowest)
            pairs.append((unit.values[unit.sample], synced))
        else:
            pairs.append((unit.local[unit.sample], Expectation(unit.sampled[1] / world_size, unit.sampled[2] + lowest)))
    return any_distinguishable(pairs)


def _exact(collectives: Collectives, units: list[_Unit], reduction: float) -> tuple[bool, float, bool]:
    """The whole pass: values and every element's allowance share (``reduction`` as in ``_values``;
    and local's, where it differs), the average into each unit's ``average``, each element judged
    within its allowance. Whether all are close, the greatest difference, and whether local and
    synced can be told apart."""
    world_size = collectives.world_size
    dtype = units[0].values.dtype
    coefficient = REDUCTION_FACTOR * eps(dtype)
    lowest = floor(dtype)
    regions = 2 if units[0].local is None else 4
    close, best, told = True, 0.0, False
    for batch in batches(units):
        size = sum(n for _, _, n in batch)
        buffer = torch.empty(regions * size, dtype=dtype)
        view = [buffer[r * size:(r + 1) * size] for r in range(regions)]
        offset = 0
        for unit, start, n in batch:
            part, at = slice(offset, offset + n), slice(start, start + n)
            view[0][part] = unit.values[at]
            unit.share(view[1][part], at, reduction, world_size)
            if unit.local is not None:
                view[2][part] = unit.local[at]
                torch.abs(unit.local[at], out=view[3][part]).mul_(coefficient)
            offset += n
        if world_size > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        offset = 0
        for unit, start, n in batch:
            part, at = slice(offset, offset + n), slice(start, start + n)
            average = unit.average.reshape(-1)[at]
            average.copy_(view[0][part]).div_(world_size)
            allowed = view[1][part].add_(lowest)
            ok, top = all_close([(unit.actual[at], Expectation(average, allowed))])
            close, best = close and ok, max(best, top)
            if not told:
                own = unit.values[at] if unit.local is None else unit.local[at]
                synced = (Expectation(average, allowed) if unit.local is None else
                          Expectation(view[2][part].div_(world_size), view[3][part].add_(lowest)))
                told = any_distinguishable([(own, synced)])
            offset += n
    return close, best, told
