"""Naming what is wrong with a gradient that does not match: each diagnosis is a hypothesis of how it
could be wrong (not synced, synced early, stale, scaled), tried before the generic ``mismatch``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.closeness import Expectation, difference, distinguishable
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
    factor = fitted_scale(actual, hyp.expected.value)
    if factor is not None and not _matches(actual, hyp.expected) and _matches(actual, hyp.expected.scaled(factor)):
        return FailureKind.WRONG_SCALE, factor
    return FailureKind.MISMATCH, None
