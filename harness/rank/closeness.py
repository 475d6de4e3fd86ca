"""How close a rank's tensor is to the oracle's: an expected value with a per-element allowance
derived from the arithmetic, and the difference measured as assert_close measures it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# What may legitimately differ, and so what a check allows (per element, never a fixed rtol):
#
# The oracle is anchored to the rank's real state after every check (harness/rank/checks.py), so a check
# judges only the arithmetic since the last one: one backward, one reduction, one optimizer step.
# - A reduction. DDP divides each rank's gradient by N and sums (the backend picks the order);
#   the oracle sums, then divides. Each side's N-1 additions and one division round at most
#   (N-1+1)·u·Σ_r|g_r|/N, u = eps/2 the unit roundoff, to first order: together at most
#   N·eps·Σ_r|g_r|/N = eps·Σ_r|g_r|, with g_r each rank's gradient going into the reduction and eps
#   that of the dtype the reduction runs in (the gradient's: fp32 under bf16 autocast). The check
#   allows twice that (REDUCTION_FACTOR): the first-order bound drops terms of order (N·u)², and
#   the two sides' roundings may fall on opposite sides.
# - A local backward, an accumulation, a clip or an optimizer step: the same operations on the same
#   inputs on both sides; ROUNDING_ULPS ulps of the result allow a kernel that orders them
#   differently (a vectorised or fused path), nothing more.
# - Exact zeros: below the dtype's smallest normal number rounding is absolute, not relative, so
#   that much is allowed everywhere (FLOOR).
# - A sync under a wrapper that reduces terms apart and adds them (FSDP after an earlier sync,
#   ZeRO-2/3 every micro-batch; harness/wrappers/names.py ADDS_AFTER_REDUCING): the reduction's bound from
#   the sizes of the terms (|adopted gradient| + each |backward's contribution|), not of their sum.
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


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def floor(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny if dtype.is_floating_point else 0.0


def rounding_allowance(value: torch.Tensor, *others: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """ROUNDING_ULPS ulps of the largest of the values, element by element, plus the floor."""
    dtype = dtype or value.dtype
    largest = value.detach().double().abs()
    for other in others:
        largest = torch.maximum(largest, other.detach().double().abs())
    return ROUNDING_ULPS * eps(dtype) * largest + floor(dtype)


def norm_rounding(count: int, dtype: torch.dtype) -> float:
    """How far two computations of a clip coefficient from the same ``count`` gradient elements of
    ``dtype`` may differ, relative, when they sum the squares in different orders: (n + 6)·u."""
    return (count + 6) * eps(dtype) / 2


def reduction_allowance(magnitude: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """The bound of a sum-then-divide against a divide-then-sum over the ranks, per element, from
    ``magnitude`` = Σ_r |g_r| (the absolute values of every rank's contribution, summed)."""
    return REDUCTION_FACTOR * eps(dtype) * magnitude.detach().double() + floor(dtype)


@dataclass(frozen=True)
class Expectation:
    """A value and how far from it an element may legitimately be (a tensor of the same shape)."""

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


def all_close(pairs: list[tuple[torch.Tensor, Expectation]]) -> tuple[bool, float]:
    """Whether ``difference(actual, expected).close`` for every pair, and the largest of their
    ``max_abs``: the same arithmetic on every element, in one pass over all of them (a check of a
    model's parameters asks this first, and measures each parameter apart only when one is not)."""
    if not pairs:
        return True, 0.0
    actual = torch.cat([a.detach().double().reshape(-1) for a, _ in pairs])
    value = torch.cat([e.value.detach().double().reshape(-1) for _, e in pairs])
    allowed = torch.cat([e.allowed.double().expand_as(e.value).reshape(-1) for _, e in pairs])
    abs_diff = _abs_diff(actual, value)
    if abs_diff.numel() == 0:
        return True, 0.0
    return not bool((abs_diff > allowed).any()), float(abs_diff.max())


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
    gap = (a.value.double() - b.value.double()).abs()
    return bool((gap > MARGIN * (a.allowed + b.allowed)).any())
