"""Comparison of a rank's tensors with the oracle's, and the diagnosis of a mismatch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.matrix import Failure

# Tolerances by the precision of the forward pass, not tuned to pass:
# - fp32: the oracle and the rank compute each local gradient with the same kernels on the same
#   inputs, so they differ only where the reduction differs: DDP divides by the world size before
#   the all-reduce, the oracle after, and gloo may sum in any order. That is a few ulps (fp32 eps
#   is 1.2e-7) per reduction, growing slowly through optimizer steps; rtol 1e-5 is about 80 ulps.
# - bf16 (autocast): weights and activations are rounded to bf16 (eps 7.8e-3) in the forward. A
#   one-ulp fp32 difference in a parameter can flip a bf16 rounding and move a gradient element
#   by a bf16 ulp; rtol 1.6e-2 (two bf16 ulps, torch.testing's bf16 default) covers that and the
#   fp32 reduction above.
# atol covers elements near zero, where a relative bound means nothing.
TOLERANCES = {
    "fp32": (1e-6, 1e-5),
    "bf16": (1e-4, 1.6e-2),
}

# Synced and local gradients must differ by this many tolerances for a check to tell them apart.
MARGIN = 10.0


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    @classmethod
    def for_precision(cls, precision: str) -> "Tolerance":
        try:
            atol, rtol = TOLERANCES[precision]
        except KeyError:
            raise ValueError(f"no tolerance for precision {precision!r}; known: {', '.join(TOLERANCES)}") from None
        return cls(atol, rtol)


@dataclass(frozen=True)
class Difference:
    """How far ``actual`` is from ``expected``, in assert_close's terms."""

    mismatched: int
    numel: int
    max_abs: float
    max_abs_index: tuple[int, ...]
    max_rel: float
    max_rel_index: tuple[int, ...]

    @property
    def close(self) -> bool:
        return self.mismatched == 0


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def difference(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> Difference:
    actual = actual.detach().double()
    expected = expected.detach().double()
    abs_diff = (actual - expected).abs()
    nonfinite = ~torch.isfinite(actual) | ~torch.isfinite(expected)
    abs_diff = torch.where(nonfinite & (actual != expected), torch.full_like(abs_diff, math.inf), abs_diff)
    abs_diff = torch.nan_to_num(abs_diff, nan=math.inf)
    rel_diff = abs_diff / expected.abs().clamp_min(torch.finfo(torch.float64).tiny)
    bad = abs_diff > tol.atol + tol.rtol * expected.abs()
    numel = abs_diff.numel()
    if numel == 0:
        return Difference(0, 0, 0.0, (), 0.0, ())
    abs_at = int(abs_diff.reshape(-1).argmax())
    rel_at = int(rel_diff.reshape(-1).argmax())
    return Difference(
        mismatched=int(bad.sum()),
        numel=numel,
        max_abs=float(abs_diff.reshape(-1)[abs_at]),
        max_abs_index=_unravel(abs_at, abs_diff.shape),
        max_rel=float(rel_diff.reshape(-1)[rel_at]),
        max_rel_index=_unravel(rel_at, rel_diff.shape),
    )


def distinguishable(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    """Whether two hypotheses differ by far more than the tolerance somewhere."""
    gap = (a.double() - b.double()).abs()
    allowed = tol.atol + tol.rtol * torch.maximum(a.double().abs(), b.double().abs())
    return bool((gap > MARGIN * allowed).any())


def _matches(actual: torch.Tensor, hypothesis: torch.Tensor | None, tol: Tolerance) -> bool:
    return hypothesis is not None and difference(actual, hypothesis, tol).close


def fitted_scale(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The constant c minimising |actual - c * expected|, or None when expected is zero."""
    e = expected.double().reshape(-1)
    denom = float(e @ e)
    if denom == 0.0:
        return None
    return float(actual.double().reshape(-1) @ e) / denom


KIND_TEXT = {
    "not_synced": "not synced (the rank's local gradient where the average of all ranks was due)",
    "synced_early": "synced when it should be local (the average of all ranks where this rank's own gradient was due)",
    "stale": "stale from the last window (the gradient was not cleared after the optimizer step)",
    "wrong_scale": "scaled by {factor:.4g}",
    "params_diverged": "parameters diverged across ranks (replicas are no longer equal)",
    "stepped_early": "the optimizer stepped where the schedule has no step",
    "step_skipped": "the optimizer did not step where the schedule has one",
    "mismatch": "does not match the oracle",
}


@dataclass(frozen=True)
class Hypotheses:
    """What a wrong gradient could be instead: each a named way of being wrong."""

    expected: torch.Tensor
    local: torch.Tensor | None = None  # this rank's own accumulated gradient
    synced: torch.Tensor | None = None  # the all-rank average of the local gradients
    previous: torch.Tensor | None = None  # the last window's final gradient
    expected_sync: bool = True


def diagnose(actual: torch.Tensor, hyp: Hypotheses, tol: Tolerance) -> tuple[str, float | None]:
    """Name what is wrong with ``actual``, trying the specific diagnoses before the generic one."""
    if hyp.expected_sync and _matches(actual, hyp.local, tol) and hyp.local is not None and hyp.synced is not None:
        if distinguishable(hyp.local, hyp.synced, tol):
            return "not_synced", None
    if not hyp.expected_sync and _matches(actual, hyp.synced, tol) and hyp.synced is not None:
        if hyp.local is not None and distinguishable(hyp.local, hyp.synced, tol):
            return "synced_early", None
    if hyp.previous is not None and _matches(actual, hyp.expected + hyp.previous, tol):
        return "stale", None
    if hyp.previous is not None and _matches(actual, hyp.previous, tol) and distinguishable(hyp.previous, hyp.expected, tol):
        return "stale", None
    factor = fitted_scale(actual, hyp.expected)
    if factor is not None and abs(factor - 1.0) > 1e-3 and _matches(actual, hyp.expected * factor, tol):
        return "wrong_scale", factor
    return "mismatch", None


def _fmt_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ("," if len(index) == 1 else "") + ")"


def describe(
    *,
    what: str,
    where: str,
    kind: str,
    factor: float | None,
    diff: Difference,
    tol: Tolerance,
) -> str:
    """The assert_close-style block for one mismatch, headed by where and what."""
    text = KIND_TEXT[kind].format(factor=factor or 0.0)
    share = 100.0 * diff.mismatched / max(diff.numel, 1)
    return (
        f"{what} {where}: {text}\n"
        f"Mismatched elements: {diff.mismatched} / {diff.numel} ({share:.1f}%)\n"
        f"Greatest absolute difference: {diff.max_abs:.6g} at index {_fmt_index(diff.max_abs_index)} "
        f"(up to {tol.atol:g} allowed)\n"
        f"Greatest relative difference: {diff.max_rel:.6g} at index {_fmt_index(diff.max_rel_index)} "
        f"(up to {tol.rtol:g} allowed)"
    )


def make_failure(
    *,
    rank: int,
    step: int,
    where: str,
    model: str,
    param: str,
    checked: str,
    kind: str,
    factor: float | None,
    diff: Difference,
    tol: Tolerance,
) -> Failure:
    noun = "gradient of" if checked == "grad" else "parameter"
    what = f"{noun} '{model}.{param}'"
    return Failure(
        rank=rank,
        step=step,
        model=model,
        param=param,
        kind=kind,
        max_abs_diff=diff.max_abs,
        max_rel_diff=diff.max_rel if math.isfinite(diff.max_rel) else 1e308,
        index=list(diff.max_abs_index),
        checked=checked,
        factor=factor,
        mismatched=diff.mismatched,
        numel=diff.numel,
        atol=tol.atol,
        rtol=tol.rtol,
        message=describe(what=what, where=f"on rank {rank} at {where}", kind=kind, factor=factor, diff=diff, tol=tol),
    )
