"""Naming what is wrong with a gradient that does not match: each diagnosis is a hypothesis of how it
could be wrong (not synced, synced early, stale, scaled, misweighted), tried before the generic
``mismatch``.

The scale-shaped hypotheses (``wrong_scale``, ``misweighted``) are fitted to a model's whole
gradient (``Scaling``, ``Reweighing``), not a tensor at a time: one constant fits any single-element
tensor, so a tensor's own fit names nothing. A fitted hypothesis is made again by the rank's own
arithmetic only up to rounding: a backward seeded with another factor rounds every product of its
sums anew, and where the terms cancel that rounding is bounded by the size of the terms, not of the
result (which the allowances of the contract's expectation are made of). So a fitted hypothesis
explains a gradient when it is within its allowance, or when it is MARGIN times closer to it, in the
2-norm of the model, than the contract's expectation is (``explains``): the margin that telling any
two hypotheses apart takes (harness/rank/numerics/closeness.py). A re-rounding leaves the fitted hypothesis a
residual of the order of the unit roundoff times the terms (under autocast, bf16's or fp16's, of its
low-precision intermediates), while the contract's expectation is off by the whole error, |c - 1|
times the gradient for a scale: for any factor that is a large gap, which a difference the
hypothesis does not have the shape of (a bf16 rounding of the reduction, noise) does not make."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import torch

from harness.rank.numerics.closeness import (
    MARGIN,
    Expectation,
    any_distinguishable,
    difference,
    distinguishable,
    no_allowance,
    rounding_allowance,
)
from harness.records import FailureKind

if TYPE_CHECKING:
    from harness.wrappers.observed import Observed


def _matches(actual: torch.Tensor, hypothesis: Expectation | None) -> bool:
    return hypothesis is not None and difference(actual, hypothesis).close


def fitted_scale(actual: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The constant c minimising |actual - c * expected|, or None when expected is zero."""
    return _scale_of([(actual, expected)])


def _scale_of(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    """The one constant c minimising the summed |actual - c * expected|^2 over the pairs (float64, a
    tensor at a time: no model's worth of float64 made at once), or None when every expected is zero."""
    num = den = 0.0
    for actual, expected in pairs:
        e = expected.detach().double().reshape(-1)
        num += float(actual.detach().double().reshape(-1) @ e)
        den += float(e @ e)
    return num / den if den > 0.0 else None


def _norm2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.sum((a.detach().double() - b.detach().double()) ** 2))


def explains(pairs: Sequence[tuple[torch.Tensor, Expectation, Expectation]], *, margin: float = MARGIN) -> bool:
    """Whether a fitted hypothesis explains the actual gradients: each triple is (actual, the
    hypothesis, the contract's expectation), of one tensor or of every tensor of a model. Every
    element within the hypothesis's allowance, or the hypothesis ``margin`` times closer to them in
    the 2-norm than the contract's expectation (the module's docstring says why). A tensor of a model
    that a hypothesis explains as a whole needs only to be closer to it (``margin=1``): a tensor of a
    few elements is too little evidence for a margin of its own."""
    return all(_matches(actual, hypothesis) for actual, hypothesis, _ in pairs) or closer(pairs, margin=margin)


def closer(pairs: Sequence[tuple[torch.Tensor, Expectation, Expectation]], *, margin: float = MARGIN) -> bool:
    """Whether the hypothesis is ``margin`` times closer to the actual gradients than the contract's
    expectation, in the 2-norm over every pair (``explains``)."""
    left = math.sqrt(sum(_norm2(actual, hypothesis.value) for actual, hypothesis, _ in pairs))
    deviation = math.sqrt(sum(_norm2(actual, expected.value) for actual, _, expected in pairs))
    return left * margin < deviation


@dataclass(frozen=True)
class Hypotheses:
    """What a wrong gradient could be instead: each a named way of being wrong."""

    expected: Expectation
    local: Expectation | None = None  # this rank's own accumulated gradient
    synced: Expectation | None = None  # the all-rank average of the local gradients
    previous: Expectation | None = None  # the last window's final gradient
    expected_sync: bool = True
    # the expectation with its contributions since the last check weighted by the fitted weights
    # (reweighted), and this rank's fitted weight; ``rebased``: also the gradient held before them,
    # with its own fitted weight (``Reweighing.fit(free_base=True)``)
    reweighted: Expectation | None = None
    weight: float | None = None
    rebased: Expectation | None = None
    rebased_weight: float | None = None
    # the expectation times the factor fitted to the whole model (``Scaling``); without it the tensor's
    # own fit (a model of one tensor)
    scaled: Expectation | None = None
    factor: float | None = None
    # a window weighed by tokens or by its micro-batches (``token_window``, ``contract="full_batch"``):
    # its weight is the contract, so a wrong one, a uniform one included, is ``misweighted``
    weighed: bool = False
    # whether each fitted hypothesis explains the model's whole gradient, when they were fitted to the
    # model (then the tensor need only be closer to it than to the contract's): (scaled, reweighted,
    # rebased); None: fitted to this tensor alone, which must then be explained with the margin, and a
    # reweighing told apart from the contract's weights on it
    model_explained: tuple[bool, bool, bool] | None = None


def fitted_weights(actual: torch.Tensor, base: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[float] | None:
    """The weights w_j minimising |actual - base - sum_j w_j * parts_j| (least squares, in float64),
    or None when every part is zero; where several do (parts alike: every rank holding the average a
    sync left), the least of them (an SVD's solution): equal weights on parts alike, not two that
    cancel each other out at any size. The contract's weights are all 1."""
    columns = torch.stack([p.double().reshape(-1) for p in parts], dim=1)
    if not bool(columns.any()):
        return None
    target = (actual.double() - base.double()).reshape(-1, 1)
    return [float(w) for w in torch.linalg.lstsq(columns, target, driver="gelsd").solution.reshape(-1)]


def is_a_scale(factor: float | None) -> bool:
    """Whether a fitted factor names a scale: one that reads as 1 where the failure prints it (to six
    digits, ``wording.KIND_TEXT``) says nothing, and the difference it leaves is a mismatch."""
    return factor is not None and f"{factor:.6g}" != "1"


# which fitted hypothesis a diagnosis took: its name, for the words of the failure
SCALED, REWEIGHTED, REBASED = "scaled", "reweighted", "rebased"


def diagnose(actual: torch.Tensor, hyp: Hypotheses) -> tuple[FailureKind, float | None]:
    """Name what is wrong with ``actual``, trying the specific diagnoses before the generic one."""
    kind, factor, _ = diagnose_with(actual, hyp)
    return kind, factor


def diagnose_with(actual: torch.Tensor, hyp: Hypotheses) -> tuple[FailureKind, float | None, str | None]:
    """``diagnose``, and which fitted hypothesis it took (SCALED, REWEIGHTED, REBASED, or None)."""
    if hyp.local is not None and hyp.synced is not None and distinguishable(hyp.local, hyp.synced):
        if hyp.expected_sync and _matches(actual, hyp.local):
            return FailureKind.NOT_SYNCED, None, None
        if not hyp.expected_sync and _matches(actual, hyp.synced):
            return FailureKind.SYNCED_EARLY, None, None
    if hyp.previous is not None:
        if _matches(actual, hyp.expected.plus(hyp.previous)):
            return FailureKind.STALE, None, None
        if _matches(actual, hyp.previous) and distinguishable(hyp.previous, hyp.expected):
            return FailureKind.STALE, None, None
    scaled_ok, reweighted_ok, rebased_ok = hyp.model_explained or (True, True, True)
    margin = MARGIN if hyp.model_explained is None else 1.0

    def reweighings() -> list[tuple[Expectation, float | None, str]]:
        found = []
        for hypothesis, weight, ok, which in ((hyp.reweighted, hyp.weight, reweighted_ok, REWEIGHTED),
                                              (hyp.rebased, hyp.rebased_weight, rebased_ok, REBASED)):
            if hypothesis is None or not ok:
                continue
            # weights that differ from the contract's by a rounding are no misweighting: told apart over
            # the model when fitted to it (``Reweighing.explained``), else over this tensor
            if hyp.model_explained is None and not distinguishable(hypothesis, hyp.expected):
                continue
            if explains([(actual, hypothesis, hyp.expected)], margin=margin):
                found.append((hypothesis, weight, which))
        return found

    if hyp.weighed and hyp.reweighted is not None:
        # a weighed window: a wrong weight is misweighted, a uniform one (one part) included; where no
        # weights explain it, a factor still may (one rank's gradient scaled after its backward, in bf16
        # autocast: the reweighing allows its low dtype's rounding, and a weight of 1.01 is within it)
        found = reweighings()
        if found:
            return FailureKind.MISWEIGHTED, found[0][1], found[0][2]
    candidates: list[tuple[FailureKind, Expectation, float | None, str]] = []
    scaled, factor = hyp.scaled, hyp.factor
    if scaled is None:
        factor = fitted_scale(actual, hyp.expected.value)
        scaled = None if factor is None else hyp.expected.scaled(factor)
    if (scaled is not None and scaled_ok and is_a_scale(factor) and not _matches(actual, hyp.expected)
            and explains([(actual, scaled, hyp.expected)], margin=margin)):
        candidates.append((FailureKind.WRONG_SCALE, scaled, factor, SCALED))
    candidates += [(FailureKind.MISWEIGHTED, h, w, which) for h, w, which in reweighings()]
    if not candidates and hyp.model_explained is not None and actual.numel() > 1:
        # the model's fits do not explain it: this tensor alone scaled (a hook of one parameter), told by
        # its own fit with the margin (never a tensor of one element: one factor fits any)
        own = fitted_scale(actual, hyp.expected.value)
        if is_a_scale(own) and explains([(actual, hyp.expected.scaled(own), hyp.expected)]):
            return FailureKind.WRONG_SCALE, own, SCALED
    if not candidates:
        return FailureKind.MISMATCH, None, None
    # the simplest that explains it (one factor, then the weights since the last check, then those and
    # the gradient held before them), unless one with more freedom is MARGIN times closer still (both
    # explain a window whose micro-batches are alike: the one that fits it exactly is the cause)
    best = candidates[0]
    for candidate in candidates[1:]:
        if math.sqrt(_norm2(actual, candidate[1].value)) * MARGIN < math.sqrt(_norm2(actual, best[1].value)):
            best = candidate
    return best[0], best[2], best[3]


def _with_low(value: torch.Tensor, allowed: torch.Tensor, terms: torch.Tensor,
              low: torch.dtype | None) -> tuple[Expectation, Expectation]:
    """A fitted hypothesis's expectation: ``allowed`` plus its own rounding; and the same where the rank's
    gradient may land, which under autocast (``low``: bf16, fp16) adds that dtype's rounding of every term
    (``terms``, their sizes): a backward seeded with another weight rounds its low-precision
    intermediates differently. The first tells the hypothesis apart from another; the second judges the
    rank's gradient against it."""
    own = Expectation(value, allowed + rounding_allowance(value))
    if low is None:
        return own, own
    return own, Expectation(value, own.allowed + rounding_allowance(terms, dtype=low))


@dataclass(frozen=True)
class Scaling:
    """A model's gradient explained as the contract's times one factor: ``expectations``, by parameter,
    the expected gradients times ``factor``, each allowed the expectation's allowance times |factor|
    plus its own rounding; ``explained``, whether that explains the model's whole gradient. No
    allowance for the low dtype's rounding under autocast: a factor within a rounding of 1 would then
    explain any difference of that size (a reduction rounded to bf16 where fp32 was asked); a backward
    seeded with the factor, which rounds its bf16 intermediates anew, is told by the margin instead."""

    factor: float
    expectations: dict[str, Expectation]
    explained: bool

    @classmethod
    def fit(cls, expected: Mapping[str, Expectation], grads: Mapping[str, torch.Tensor | None]) -> Scaling | None:
        actual = {p: _grad(grads, p, e.value) for p, e in expected.items()}
        factor = _scale_of((actual[p], e.value) for p, e in expected.items())
        if factor is None:
            return None
        expectations = {p: e.scaled(factor) for p, e in expected.items()}
        return cls(factor, expectations, explains([(actual[p], expectations[p], e) for p, e in expected.items()]))


def _apart(shares: list[dict[str, torch.Tensor]], names: list[str]) -> bool:
    """Whether the ranks' shares differ anywhere (after a sync in the window each holds the same average:
    one weight for it says all)."""
    return any(not torch.equal(share[p], shares[0][p]) for share in shares[1:] for p in names)


def _grad(grads: Mapping[str, torch.Tensor | None], pname: str, like: torch.Tensor) -> torch.Tensor:
    grad = grads.get(pname)
    return grad if grad is not None else torch.zeros_like(like)


@dataclass(frozen=True)
class Reweighing:
    """A gradient explained with other weights: the contributions since the last check
    (``TokenWeighting.parts``, harness/rank/oracle/weighting.py: each micro-batch's apart, this rank's own, or
    after a sync every rank's share, by rank) fitted to the rank's whole gradient over the model, with the contract's weights
    all 1; ``free_base``: the gradient held before them (the expectation less them: the window's earlier
    micro-batches, as the last check found them) fitted too, its weight ``earlier`` (a clip or a
    zero_grad inside the window scales it before the next backward adds to it); after a sync, where
    ``held`` gives every rank's share of it, by rank (``TokenWeighting.held``), one weight a rank, since
    each rank's clip scales by its own norm (``earlier`` then a list). ``expectations``: the
    expected gradients with the fitted weights instead, by parameter, each allowed the expectation's
    allowance scaled by the largest weight plus its own rounding; under autocast (``low``: bf16,
    fp16) plus that dtype's rounding of every term: a backward seeded with another weight rounds its
    low-precision intermediates differently. ``explained``: whether they explain the model's whole
    gradient."""

    weights: list[float]
    expectations: dict[str, Expectation]
    explained: bool = True
    earlier: float | list[float] | None = None
    backwards: int = 1  # the backwards since the last check the parts are of (each by rank after a sync)

    @classmethod
    def fit(cls, expected: Mapping[str, Expectation], grads: Mapping[str, torch.Tensor | None],
            parts: list[dict[str, torch.Tensor]], low: torch.dtype | None = None, *,
            free_base: bool = False, backwards: int = 1,
            held: list[dict[str, torch.Tensor]] | None = None) -> Reweighing | None:
        names = list(expected)
        summed = {p: sum(part[p] for part in parts) for p in names}
        base = {p: expected[p].value - summed[p] for p in names}
        actual = {p: _grad(grads, p, base[p]) for p in names}
        flat_base = torch.cat([base[p].reshape(-1) for p in names])
        columns = [torch.cat([part[p].reshape(-1) for p in names]) for part in parts]
        flat_actual = torch.cat([actual[p].reshape(-1) for p in names])
        earlier: float | list[float] | None = None
        # the held gradient's terms, each with its free weight: the whole (one weight), or every rank's
        # share (one a rank); ``fixed``: what of the base they do not make, weighing 1 (the rounding of
        # the sync's sum)
        bases, fixed = [base], {p: torch.zeros_like(base[p]) for p in names}
        if free_base and held is not None and _apart(held, names):
            bases = held
            fixed = {p: base[p] - sum(h[p] for h in held) for p in names}
        if free_base:
            if not bool(flat_base.any()):
                return None  # nothing held before them: the fit with the base fixed is this one
            flat_fixed = torch.cat([fixed[p].reshape(-1) for p in names])
            weights = fitted_weights(flat_actual, flat_fixed,
                                     [torch.cat([b[p].reshape(-1) for p in names]) for b in bases] + columns)
            if weights is None:
                return None
            earlier, weights = weights[:len(bases)], weights[len(bases):]
            scales = earlier
            if len(bases) == 1:
                earlier = earlier[0]
        else:
            weights = fitted_weights(flat_actual, flat_base, columns)
            if weights is None:
                return None
            scales = [1.0]
        largest = max(1.0, *(abs(e) for e in scales), *(abs(w) for w in weights))
        expectations, own = {}, {}
        for p in names:
            value = fixed[p] + sum(e * b[p] for e, b in zip(scales, bases)) + sum(
                w * part[p] for w, part in zip(weights, parts))
            # under autocast only the new contributions' backwards ran in the low dtype: the gradient held
            # before them is the rank's own, adopted at the last check, and scaled (if at all) in its own
            terms = sum(abs(w) * part[p].abs() for w, part in zip(weights, parts))
            own[p], expectations[p] = _with_low(value, largest * expected[p].allowed, terms, low)
        # explained, and told apart from the contract's weights somewhere in the model (weights that differ
        # by a rounding are no misweighting): where only the allowance of a re-rounded backward (the low
        # dtype's rounding of every term) holds the rank's gradient, by more than that; where the fit is
        # MARGIN times closer than the contract's expectation over the model, which no re-rounding makes,
        # by more than the rounding of either value: one rank's bf16-autocast gradient scaled by 1.001
        # after its backward, fitted to a part in 1e4, is a weight of 1.001, under a bf16 ulp of the terms
        pairs = [(actual[p], expectations[p], expected[p]) for p in names]
        explained = ((closer(pairs) and any_distinguishable((own[p], expected[p]) for p in names))
                     or (explains(pairs) and any_distinguishable((expectations[p], expected[p]) for p in names)))
        return cls(weights, expectations, explained, earlier, backwards)

    def weight_of(self, rank: int) -> float:
        """This rank's weight of its last backward: its own part's (one part a backward), or its share's
        among every rank's."""
        per = len(self.weights) // self.backwards
        last = self.weights[len(self.weights) - per:]
        return last[rank] if per > 1 else last[0]


# The fits of one model at a failing check (harness/rank/judging/checks.py), and the diagnosis of each of its tensors

Cut = Callable[[str, Expectation], Expectation]


def owned_cut(observed: Observed) -> Cut:
    """The part of a whole tensor that this rank's own partition holds (``Observed.owned``), flat."""
    def cut(pname: str, e: Expectation) -> Expectation:
        start, numel = observed.owned[pname]
        allowed = e.allowed.reshape(-1)[start:start + numel] if e.allowed.dim() else e.allowed
        return Expectation(e.value.reshape(-1)[start:start + numel], allowed)
    return cut


@dataclass(frozen=True)
class ModelFits:
    """The scale-shaped hypotheses fitted to one model's whole gradient at a failing check (``Scaling``,
    ``Reweighing``): one factor for all of it; the contributions since the last check
    reweighed; and those with the gradient held before them reweighed too (its weight free).
    ``partition``: fitted to this rank's own partition of each tensor it has one of (``owned_cut``)."""

    scaling: Scaling | None
    reweighing: Reweighing | None
    rebasing: Reweighing | None
    partition: Cut | None = None

    @classmethod
    def make(cls, expectations: Mapping[str, Expectation], grads: Mapping[str, torch.Tensor | None],
             parts: list[dict[str, torch.Tensor]] | None, *, low: torch.dtype | None, backwards: int,
             held: list[dict[str, torch.Tensor]] | None = None, partition: Cut | None = None,
             owned: Iterable[str] = ()) -> ModelFits:
        """``parts``: the contributions since the last check (``TokenWeighting.parts``); ``held``: after a
        sync, every rank's share of the gradient held before them (``TokenWeighting.held``)."""
        if partition is not None:
            names = [p for p in owned if p in expectations]
            grads = {p: partition(p, Expectation(_grad(grads, p, expectations[p].value), no_allowance())).value
                     for p in names}
            expectations = {p: partition(p, expectations[p]) for p in names}
            parts, held = ([{p: partition(p, Expectation(part[p], no_allowance())).value for p in names}
                            for part in pieces] if pieces is not None else None for pieces in (parts, held))
        return cls(Scaling.fit(expectations, grads),
                   Reweighing.fit(expectations, grads, parts, low=low, backwards=backwards) if parts else None,
                   Reweighing.fit(expectations, grads, parts, low=low, free_base=True, backwards=backwards, held=held)
                   if parts else None, partition)

    def diagnose(self, pname: str, observed: Observed, actual: torch.Tensor, *, expected: Expectation,
                 local: Expectation, synced: Expectation, previous: Expectation | None, expected_sync: bool,
                 weighed: bool, rank: int) -> tuple[FailureKind, float | None, str | None]:
        """The diagnosis of one tensor: ``actual`` and ``expected`` as the rank holds them (its shard
        when sharded), ``local``, ``synced`` and ``previous`` whole; judged on the part the fits were
        made of (the rank's shard, or its partition)."""
        if self.partition is not None:  # the tensors whole (ZeRO-1/2 show them so), cut to the partition
            cut = self.partition
            actual = cut(pname, Expectation(actual, no_allowance())).value
            expected = cut(pname, expected)
        else:
            cut = observed.piece_of

        def fitted(fit: Scaling | Reweighing | None) -> Expectation | None:
            if fit is None:
                return None
            return fit.expectations[pname] if self.partition is not None else cut(pname, fit.expectations[pname])

        return diagnose_with(actual, Hypotheses(
            expected=expected, local=cut(pname, local), synced=cut(pname, synced),
            previous=None if previous is None else cut(pname, previous), expected_sync=expected_sync,
            reweighted=fitted(self.reweighing), weight=self.reweighing.weight_of(rank) if self.reweighing else None,
            rebased=fitted(self.rebasing), rebased_weight=self.rebasing.weight_of(rank) if self.rebasing else None,
            scaled=fitted(self.scaling), factor=self.scaling.factor if self.scaling else None, weighed=weighed,
            model_explained=tuple(fit is None or fit.explained  # type: ignore[arg-type]
                                  for fit in (self.scaling, self.reweighing, self.rebasing)),
        ))
