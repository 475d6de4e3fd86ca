"""Naming what is wrong with a gradient that does not match: each diagnosis is a hypothesis of how it
could be wrong (not synced, synced early, stale, scaled, misweighted), tried before the generic
``mismatch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from harness.rank.closeness import MARGIN, Expectation, difference, distinguishable, rounding_allowance
from harness.records import FailureKind


def _matches(actual: torch.Tensor, hypothesis: Expectation | None) -> bool:
    return hypothesis is not None and difference(actual, hypothesis).close


def fitted_scale(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The constant c minimising |actual - c * expected|, or None when expected is zero."""
    e = expected.double().reshape(-1)
    denom = float(e @ e)
    if denom == 0.0:
        return None
    return float(actual.double().reshape(-1) @ e) / denom


@dataclass(frozen=True)
class Hypotheses:
    """What a wrong gradient could be instead: each a named way of being wrong."""

    expected: Expectation
    local: Expectation | None = None  # this rank's own accumulated gradient
    synced: Expectation | None = None  # the all-rank average of the local gradients
    previous: Expectation | None = None  # the last window's final gradient
    expected_sync: bool = True
    # token weighting: the expectation with its contributions since the last check weighted by the
    # fitted weights instead of the token mean's (reweighted), and this rank's fitted weight
    reweighted: Expectation | None = None
    weight: float | None = None


def fitted_weights(actual: torch.Tensor, base: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[float] | None:
    """The weights w_j minimising |actual - base - sum_j w_j * parts_j| (least squares, in float64),
    or None when every part is zero. The contract's weights are all 1."""
    columns = torch.stack([p.double().reshape(-1) for p in parts], dim=1)
    if not bool(columns.any()):
        return None
    target = (actual.double() - base.double()).reshape(-1, 1)
    return [float(w) for w in torch.linalg.lstsq(columns, target).solution.reshape(-1)]


def diagnose(actual: torch.Tensor, hyp: Hypotheses) -> tuple[FailureKind, float | None]:
    """Name what is wrong with ``actual``, trying the specific diagnoses before the generic one."""
    if hyp.local is not None and hyp.synced is not None and distinguishable(hyp.local, hyp.synced):
        if hyp.expected_sync and _matches(actual, hyp.local):
            return FailureKind.NOT_SYNCED, None
        if not hyp.expected_sync and _matches(actual, hyp.synced):
            return FailureKind.SYNCED_EARLY, None
    if hyp.previous is not None:
        if _matches(actual, hyp.expected.plus(hyp.previous)):
            return FailureKind.STALE, None
        if _matches(actual, hyp.previous) and distinguishable(hyp.previous, hyp.expected):
            return FailureKind.STALE, None
    if hyp.reweighted is not None:
        # token weighting: a wrong weight is misweighted, a uniform one (one part) included
        if distinguishable(hyp.reweighted, hyp.expected) and _explains(actual, hyp.reweighted, hyp.expected):
            return FailureKind.MISWEIGHTED, hyp.weight
        return FailureKind.MISMATCH, None
    factor = fitted_scale(actual, hyp.expected.value)
    if factor is not None and not _matches(actual, hyp.expected) and _matches(actual, hyp.expected.scaled(factor)):
        return FailureKind.WRONG_SCALE, factor
    return FailureKind.MISMATCH, None


def _explains(actual: torch.Tensor, hypothesis: Expectation, expected: Expectation) -> bool:
    """Whether a fitted hypothesis explains ``actual``: within its allowance, or MARGIN times closer to
    it (in the 2-norm) than the contract's expectation is. A backward seeded with another weight
    rounds every term of its sums anew, and where they cancel that rounding is not bounded by the
    result's own ulps; telling the fitted hypothesis from the contract's takes the margin that
    telling any two hypotheses apart takes (harness/rank/closeness.py)."""
    if _matches(actual, hypothesis):
        return True
    left = float(torch.linalg.vector_norm(actual.double() - hypothesis.value.double()))
    deviation = float(torch.linalg.vector_norm(actual.double() - expected.value.double()))
    return left * MARGIN <= deviation


@dataclass(frozen=True)
class Reweighing:
    """A token-weighted gradient explained with other weights: the contributions since the last check
    (``TokenWeighting.parts``, harness/rank/weighting.py: this rank's own, or after a sync every rank's share, by rank) fitted
    to the rank's whole gradient over the model, with the contract's weights all 1. ``expectations``:
    the expected gradients with the fitted weights instead, by parameter, each allowed the
    expectation's allowance scaled by the largest weight plus its own rounding; under autocast
    (``low``: bf16, fp16) plus that dtype's rounding of every term: a backward seeded with another
    weight rounds its low-precision intermediates differently."""

    weights: list[float]
    expectations: dict[str, Expectation]

    @classmethod
    def fit(cls, expected: Mapping[str, Expectation], grads: Mapping[str, torch.Tensor | None],
            parts: list[dict[str, torch.Tensor]], low: torch.dtype | None = None) -> Reweighing | None:
        names = list(expected)
        summed = {p: sum(part[p] for part in parts) for p in names}
        base = {p: expected[p].value - summed[p] for p in names}
        actual = torch.cat([(grads.get(p) if grads.get(p) is not None else torch.zeros_like(base[p])).reshape(-1)
                            for p in names])
        weights = fitted_weights(actual, torch.cat([base[p].reshape(-1) for p in names]),
                                 [torch.cat([part[p].reshape(-1) for p in names]) for part in parts])
        if weights is None:
            return None
        largest = max(1.0, max(abs(w) for w in weights))
        expectations = {}
        for p in names:
            value = base[p] + sum(w * part[p] for w, part in zip(weights, parts))
            allowed = largest * expected[p].allowed + rounding_allowance(value)
            if low is not None:
                terms = base[p].abs() + sum(abs(w) * part[p].abs() for w, part in zip(weights, parts))
                allowed = allowed + rounding_allowance(terms, dtype=low)
            expectations[p] = Expectation(value, allowed)
        return cls(weights, expectations)

    def weight_of(self, rank: int) -> float:
        """This rank's weight: its own part's (one part), or its share's among every rank's."""
        return self.weights[rank] if len(self.weights) > 1 else self.weights[0]
