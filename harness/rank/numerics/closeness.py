"""How close a rank's tensor is to the oracle's: an expected value with a per-element allowance
derived from the arithmetic, and the difference measured as assert_close measures it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

# What may legitimately differ, and so what a check allows (per element, never a fixed rtol):
#
# The oracle is anchored to the rank's real state after every check (harness/rank/judging/checks.py), so a check
# judges only the arithmetic since the last one: one backward, one reduction, one optimizer step.
# - A reduction whose order is reproduced (gloo: DDP's buckets, the sharded wrappers' layouts;
#   harness/rank/oracle/averaging.py, harness/rank/oracle/sharded_reduce.py): the same additions in the same order on
#   the same values, so nothing beyond the floor (``Reduction.reproduced``).
# - A reduction whose order is not known (nccl, a communication hook): DDP divides each rank's gradient
#   by N and sums (the backend picks the order);
#   the oracle sums, then divides. Each side's N-1 additions and one division round at most
#   (N-1+1)·u·Σ_r|g_r|/N, u = eps/2 the unit roundoff, to first order: together at most
#   N·eps·Σ_r|g_r|/N = eps·Σ_r|g_r|, with g_r each rank's gradient going into the reduction and eps
#   that of the dtype the reduction runs in (the gradient's: fp32 under bf16 autocast). The check
#   allows twice that (REDUCTION_FACTOR): the first-order bound drops terms of order (N·u)², and
#   the two sides' roundings may fall on opposite sides. Under a sharded wrapper the terms are each
#   rank's contributions since the last sync, which the wrapper reduces apart and adds to the gradient
#   it holds (as the oracle does), never the size of a sum that cancellation can make small.
# - A local backward, an accumulation, a clip or an optimizer step: the same operations on the same
#   inputs on both sides; ROUNDING_ULPS ulps of the result allow a kernel that orders them
#   differently (a vectorised or fused path), nothing more. Under a sharded wrapper (fp32 or bf16)
#   the replica takes each backward's gradients as the wrapper takes them (harness/rank/oracle/replica.py,
#   ``ShardedMixedReplica``): the same kernels on the same values, so nothing for the backward.
# - Exact zeros: below the dtype's smallest normal number rounding is absolute, not relative, so
#   that much is allowed everywhere (FLOOR).
# - A clip's coefficient max_norm / (norm + 1e-6): the rank's total norm sums the squares of the
#   gradients in an order of its own (FSDP's and ZeRO's over each rank's shard, then across the
#   ranks; DDP's foreach kernel), the oracle's in another. n squares and n-1 additions of
#   non-negative terms in any order round the sum by at most n·u relative (first order); the square
#   root halves that and rounds once, the +1e-6 and the division round once each: each side's
#   coefficient is within n·u/2 + 3u of the exact one, the two within (n + 6)·u relative
#   (norm_rounding), which scales every clipped gradient.
# Under bf16 autocast the forward rounds to bf16, but it does so identically on both sides (same
# inputs, same anchored parameters): only the fp32 arithmetic above differs.
REDUCTION_FACTOR = 2.0
ROUNDING_ULPS = 2.0

# Synced and local gradients must differ by this many allowances for a check to tell them apart.
MARGIN = 10.0

# How the checks run on models of 1e7 parameters and more at close to the step's own cost
# (bench/README.md, "Against model size"): an allowance is a bound, held in fp32 (float64 only for
# float64 gradients: ``allowance_dtype``), which its own rounding moves by a few parts in 1e8; the
# comparisons run in the gradient's dtype, chunk by chunk, with float64 only where an fp32 difference
# could decide otherwise (``all_close``), and a zero allowance is a 0-dim tensor, not a model's worth
# of zeros.
CHUNK = 1 << 20  # elements a comparison takes at a time: its temporaries stay small
_SMALL = 1 << 16  # tensors below this many elements are compared together, in one concatenation
# An fp32 difference d = fl(|a - v|) is within one rounding of the exact one, so d <= A·(1 - 2^-21)
# proves |a - v| <= A (the float64 test, as before) with a margin for that rounding and the
# threshold's own; an element where it does not is measured again in float64. Likewise, d·(1 - 2^-20)
# above a threshold T computed in fp32 proves the exact gap above the exact T.
_SURE = 2.0 ** -21


def allowance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an allowance for values of ``dtype`` is held in: float64 for float64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def no_allowance(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero allowance: a 0-dim tensor, broadcast against the value it goes with."""
    return torch.zeros((), dtype=allowance_dtype(dtype))


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def floor(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny if dtype.is_floating_point else 0.0


def _magnitude(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|value| as a new tensor of ``dtype``."""
    value = value.detach()
    return value.abs() if value.dtype == dtype else value.to(dtype).abs_()


def rounding_allowance(value: torch.Tensor, *others: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """ROUNDING_ULPS ulps (of ``dtype``, default the value's) of the largest of the values, element by
    element, plus the floor: in the allowance dtype of the values."""
    dtype = dtype or value.dtype
    held = allowance_dtype(value.dtype)
    largest = _magnitude(value, held)
    for other in others:
        torch.maximum(largest, _magnitude(other, held), out=largest)
    return largest.mul_(ROUNDING_ULPS * eps(dtype)).add_(floor(dtype))


def norm_rounding(count: int, dtype: torch.dtype) -> float:
    """How far two computations of a clip coefficient from the same ``count`` gradient elements of
    ``dtype`` may differ, relative, when they sum the squares in different orders: (n + 6)·u."""
    return (count + 6) * eps(dtype) / 2


def reduction_allowance(magnitude: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The bound of a sum-then-divide against a divide-then-sum over the ranks, per element, from
    ``magnitude`` = Σ_r |g_r| (the absolute values of every rank's contribution, summed)."""
    held = allowance_dtype(magnitude.dtype)
    return magnitude.detach().to(held).mul(REDUCTION_FACTOR * eps(dtype)).add_(floor(dtype))


@dataclass(frozen=True)
class Expectation:
    """A value and how far from it an element may legitimately be (a tensor of the same shape, or a
    0-dim one for every element alike: ``no_allowance``)."""

    value: torch.Tensor
    allowed: torch.Tensor

    @classmethod
    def rounded(cls, value: torch.Tensor) -> "Expectation":
        return cls(value, rounding_allowance(value))

    def scaled(self, factor: float) -> "Expectation":
        value = self.value * factor
        return Expectation(value, abs(factor) * self.allowed + rounding_allowance(value))

    def plus(self, other: "Expectation") -> "Expectation":
        value = self.value + other.value
        return Expectation(value, self.allowed + other.allowed + rounding_allowance(value))


@dataclass(frozen=True)
class Difference:
    """How far ``actual`` is from ``expected``, in assert_close's terms, with the allowance where
    the greatest differences are."""

    mismatched: int
    numel: int
    max_abs: float
    max_abs_index: tuple[int, ...]
    allowed_abs: float
    max_rel: float
    max_rel_index: tuple[int, ...]
    allowed_rel: float

    @property
    def close(self) -> bool:
        return self.mismatched == 0


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _abs_diff(actual: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """|actual - value| in float64, infinite where either is not finite and they differ."""
    abs_diff = (actual - value).abs()
    if bool(torch.isfinite(abs_diff).all()):  # then both are finite everywhere (inf - inf is nan)
        return abs_diff
    nonfinite = ~torch.isfinite(actual) | ~torch.isfinite(value)
    abs_diff = torch.where(nonfinite & (actual != value), torch.full_like(abs_diff, math.inf), abs_diff)
    return torch.nan_to_num(abs_diff, nan=math.inf)


def _flat(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``t`` flat, or a 0-dim allowance left 0-dim (broadcast against ``n`` elements); None stays None
    (an allowance its consumer makes)."""
    if t is None:
        return None
    t = t.detach()
    return t.reshape(-1) if t.numel() == n else t.reshape(())


def _item_chunks(item: Sequence[torch.Tensor], n: int) -> Iterator[list[torch.Tensor]]:
    flats = [_flat(t, n) for t in item]
    for start in range(0, n, CHUNK):
        yield [f[start:start + CHUNK] if f is not None and f.dim() else f for f in flats]


def _aligned(items: Iterable[Sequence[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    """The items' tensors (each item: tensors of one numel, or 0-dim allowances) as aligned flat chunks
    of at most about CHUNK elements: small items concatenated, large ones cut."""
    pending: list[tuple[Sequence[torch.Tensor], int]] = []
    size = 0

    def joined() -> list[torch.Tensor]:
        if len(pending) == 1:
            return next(_item_chunks(*pending[0]))
        return [None if column[0] is None else
                torch.cat([_flat(t, n).expand(n) for t, (_, n) in zip(column, pending)])
                for column in zip(*(i for i, _ in pending))]

    for item in items:
        n = item[0].numel()
        if n == 0:
            continue
        if n >= _SMALL:
            if pending:
                yield joined()
                pending, size = [], 0
            yield from _item_chunks(item, n)
            continue
        pending.append((item, n))
        size += n
        if size >= CHUNK:
            yield joined()
            pending, size = [], 0
    if pending:
        yield joined()


def _exact(a: torch.Tensor, v: torch.Tensor, base: torch.Tensor | None, at: torch.Tensor) -> torch.Tensor:
    """The float64 difference at ``at`` (a mask): |a - v|, or |(a - base) - (v - base)| for an update."""
    a, v = a[at].double(), v[at].double()
    if base is not None:
        b = base[at].double()
        a, v = a - b, v - b
    return _abs_diff(a, v)


def _at(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t.expand_as(mask)[mask] if t.dim() else t


def chunk_close(a: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | Callable[[], torch.Tensor],
                base: torch.Tensor | None = None) -> tuple[bool, float]:
    """Whether no element's difference exceeds its allowance, and the greatest difference, of one
    chunk: as in float64, computed in fp32 where that cannot decide otherwise (``_SURE``). Equal
    values need no allowance: ``allowed`` may be a function that makes it, called only if they differ."""
    if a.dtype == v.dtype and torch.equal(a, v):
        return True, 0.0
    allowed = allowed() if callable(allowed) else allowed
    wide = torch.promote_types(torch.promote_types(a.dtype, v.dtype), torch.float32)
    if wide == torch.float64 or allowed.dtype == torch.float64:
        everything = torch.ones(a.shape, dtype=torch.bool)
        abs_diff = _exact(a, v, base, everything)
        return not bool((abs_diff > allowed.double()).any()), float(abs_diff.max())
    d = torch.sub(a.to(wide), v.to(wide)).abs_()
    sure = d <= allowed * (1 - _SURE)
    if bool(sure.all()):
        close, best, unsure = True, 0.0, None
    else:
        unsure = ~sure
        exact = _exact(a, v, base, unsure)
        close = not bool((exact > _at(allowed, unsure).double()).any())
        best = float(exact.max())
        d = d.masked_fill_(unsure, 0.0)
    top = float(d.max())
    if top > 0.0:  # the exact greatest difference is among the fp32 ones within a rounding of the top
        candidates = d >= top * (1 - 2.0 ** -20)
        if unsure is not None:
            candidates &= sure
        best = max(best, float(_exact(a, v, base, candidates).max()))
    return close, best


def all_close(pairs: Sequence[tuple[torch.Tensor, Expectation]]) -> tuple[bool, float]:
    """Whether ``difference(actual, expected).close`` for every pair, and the largest of their
    ``max_abs``: one pass over every element, chunk by chunk (a check asks this first, and measures
    each tensor apart only when one is not close)."""
    close, best = True, 0.0
    for a, v, allowed in _aligned((a, e.value, e.allowed) for a, e in pairs):
        ok, top = chunk_close(a, v, allowed)
        close, best = close and ok, max(best, top)
    return close, best


def all_close_made(actual: torch.Tensor, value: torch.Tensor,
                   make_allowed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[bool, float]:
    """``all_close`` of one tensor against ``value`` whose allowance ``make_allowed`` makes from each
    chunk of ``value``, only for a chunk that differs (its temporaries a chunk's, never the whole's)."""
    close, best = True, 0.0
    for a, v in _aligned([(actual, value)]):
        ok, top = chunk_close(a, v, lambda v=v: make_allowed(v))
        close, best = close and ok, max(best, top)
    return close, best


def all_close_updates(triples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[bool, float]:
    """``all_close`` of parameter updates: each triple is (the rank's parameter after the step, the
    oracle's after, before), the rank's update ``actual - before`` against the oracle's ``after -
    before``, allowed ``rounding_allowance(after, before)``, as ``Checks.params`` judges them."""
    close, best = True, 0.0
    for actual, after, before in _aligned(triples):
        ok, top = chunk_close(actual, after, lambda after=after, before=before: rounding_allowance(after, before),
                              base=before)
        close, best = close and ok, max(best, top)
    return close, best


def difference(actual: torch.Tensor, expected: Expectation) -> Difference:
    actual = actual.detach().double()
    value = expected.value.detach().double()
    allowed = expected.allowed.double().expand_as(value)
    abs_diff = _abs_diff(actual, value)
    scale = value.abs().clamp_min(torch.finfo(torch.float64).tiny)
    rel_diff = abs_diff / scale
    bad = abs_diff > allowed
    numel = abs_diff.numel()
    if numel == 0:
        return Difference(0, 0, 0.0, (), 0.0, 0.0, (), 0.0)
    abs_at = int(abs_diff.reshape(-1).argmax())
    rel_at = int(rel_diff.reshape(-1).argmax())
    return Difference(
        mismatched=int(bad.sum()),
        numel=numel,
        max_abs=float(abs_diff.reshape(-1)[abs_at]),
        max_abs_index=_unravel(abs_at, abs_diff.shape),
        allowed_abs=float(allowed.reshape(-1)[abs_at]),
        max_rel=float(rel_diff.reshape(-1)[rel_at]),
        max_rel_index=_unravel(rel_at, rel_diff.shape),
        allowed_rel=float(allowed.reshape(-1)[rel_at] / scale.reshape(-1)[rel_at]),
    )


def distinguishable(a: Expectation, b: Expectation) -> bool:
    """Whether two hypotheses differ somewhere by far more than both allowances together."""
    return any_distinguishable([(a, b)])


def any_distinguishable(pairs: Iterable[tuple[Expectation | torch.Tensor, Expectation]]) -> bool:
    """Whether, in any pair, the two hypotheses differ somewhere by more than MARGIN times both
    allowances together (as in float64; in fp32 where that cannot decide otherwise), stopping at the
    first element that does. A bare tensor first in a pair is ``Expectation.rounded`` of it, its
    allowance made chunk by chunk."""
    items = ((x, y.value, None, y.allowed) if isinstance(x, torch.Tensor) else (x.value, y.value, x.allowed, y.allowed)
             for x, y in pairs)
    for a, b, allowed_a, allowed_b in _aligned(items):
        if allowed_a is None:
            allowed_a = rounding_allowance(a)
        wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        if wide == torch.float64 or torch.float64 in (allowed_a.dtype, allowed_b.dtype):
            if bool(((a.double() - b.double()).abs() > MARGIN * (allowed_a.double() + allowed_b.double())).any()):
                return True
            continue
        gap = torch.sub(a.to(wide), b.to(wide)).abs_()
        threshold = (allowed_a + allowed_b).mul_(MARGIN)
        if bool((gap > threshold + threshold * 2.0 ** -19).any()):
            return True
        maybe = gap > threshold - threshold * 2.0 ** -19
        if bool(maybe.any()):
            exact = (a[maybe].double() - b[maybe].double()).abs()
            if bool((exact > MARGIN * (_at(allowed_a, maybe).double() + _at(allowed_b, maybe).double())).any()):
                return True
    return False
