"""How a rank's state is judged against the oracle: the checks a case calls, the diagnosis of a
mismatch (the failures go to the rank's ``Recorder``, harness/rank/judging/recorder.py), and the oracle
anchored to the rank's real state afterwards.

After every check the oracle carries on from the state the rank is really in (its parameters, and
its gradients after a gradient check), so each check judges only the arithmetic since the last
one: an error is reported where it happens, and the allowance stays at the floating-point limit of
one step (harness/rank/numerics/closeness.py) instead of growing with every step the replicas run on their own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from harness import wording
from harness.rank.judging.diagnosis import REBASED, ModelFits, owned_cut
from harness.rank.judging.recorder import Recorder, make_failure, mark_point, where
from harness.rank.judging.reductions import judge
from harness.rank.numerics.accounting import CHECK, Accounting
from harness.rank.numerics.accounting import unavailable as accounting_unavailable
from harness.rank.numerics.closeness import (
    CHUNK,
    Difference,
    Expectation,
    all_close,
    all_close_updates,
    any_distinguishable,
    difference,
    rounding_allowance,
)
from harness.rank.oracle.replica import AUTOCAST_DTYPES, as_optimizers
from harness.rank.oracle.schedule import MicroStep
from harness.records import Failure, FailureKind
from harness.wrappers.observed import Observed
from harness.wrappers.prepare import verify
from harness.wrappers.sharding import observe, tensor_parallel_share

if TYPE_CHECKING:
    from harness.rank.oracle.core import Oracle
    from harness.rank.judging.oracle_view import JudgedOracle
    from harness.rank.oracle.interfaces import ClipNorm


def _grad_or_zeros(observed: Observed, pname: str) -> torch.Tensor:
    grad = observed.grads[pname]
    return grad if grad is not None else torch.zeros_like(observed.params[pname])


def _update(actual: torch.Tensor, after: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, Expectation]:
    """A parameter's update on the rank and the oracle's, in float64, as a parameter check measures them
    apart (``closeness.all_close_updates`` judges them all at once)."""
    return (actual.double() - before.double(),
            Expectation(after.double() - before.double(), rounding_allowance(after, before)))


def _param_kind(actual: torch.Tensor, rank0: torch.Tensor, *, moved: bool, due: bool) -> FailureKind:
    if not difference(actual, Expectation.rounded(rank0)).close:
        return FailureKind.PARAMS_DIVERGED
    if due and not moved:
        return FailureKind.STEP_SKIPPED
    if moved and not due:
        return FailureKind.STEPPED_EARLY
    return FailureKind.MISMATCH


@dataclass(frozen=True)
class WrongUpdate:
    """A parameter's update that is not the oracle's: how far off, whether it moved at all, and
    whether a step was due."""

    diff: Difference
    moved: bool
    due: bool


def checked(oracle: Oracle, accounting: Accounting | None = None) -> Oracle:
    """``oracle`` with the checks its ``check_*`` methods call attached, recorded in its recorder (the
    cell's ``Recorder``, which the oracle holds as the ``Notes`` it writes)."""
    recorder = oracle.recorder
    if not isinstance(recorder, Recorder):
        raise TypeError(f"checked: the oracle's recorder is a {type(recorder).__name__}; the checks record in a "
                        "harness.rank.judging.recorder.Recorder")
    oracle.checks = Checks(oracle, recorder, accounting)
    return oracle


class Checks:
    """The checks of one rank's state against one oracle, recorded in the oracle's recorder."""

    def __init__(self, oracle: JudgedOracle, recorder: Recorder, accounting: Accounting | None = None) -> None:
        self.oracle = oracle
        self.recorder = recorder
        self.accounting = accounting
        self.rank = oracle.config.rank
        self.diverged: set[tuple[str, str]] = set()
        self.verified: set[str] = set()

    def _observe(self, name: str, model: nn.Module, *, sync: bool) -> Observed:
        """The model as its wrapper keeps it, after making sure it is the wrapper the cell names."""
        if name not in self.verified:
            verify(self.oracle.config.wrapper, model, name=name, world_size=self.oracle.config.world_size)
            self.verified.add(name)
        observed = observe(model, list(self.oracle.params[name]), sync=sync)
        missing = [p for p in self.oracle.params[name] if p not in observed.params]
        if missing:
            raise KeyError(f"model {name!r} has no parameter {missing[0]!r} on rank {self.rank}")
        return observed

    def grads(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None:
        """Compare every parameter's gradient on this rank with the oracle's (after a backward),
        then carry on from the rank's gradients; and the collectives of the backwards since the
        last check with the contract (harness/rank/numerics/accounting.py)."""
        oracle = self.oracle
        anchoring = oracle.anchoring
        index, at = where(step)
        mark_point(self.recorder, step, sync=oracle.state.last_sync)
        self._collectives(index, at, models)
        last_sync = oracle.state.last_sync
        seen = {name: self._observe(name, model, sync=last_sync) for name, model in models.items()}
        shown = {name: not (o.hidden or o.sharded and not last_sync or o.shards_shown) for name, o in seen.items()}
        # a large model's sync is made as its check judges it (harness/rank/numerics/fused_check.py); the others' now
        pending = {name for name, model in oracle.state.models.items() if model.pending}
        fused = {name for name in models if name in pending and shown[name] and seen[name].plain}
        oracle.averaging.settle(name for name in models if name not in fused)
        # what a sync now would give, the other hypothesis: every model's in one collective
        anchoring.prepare_synced(name for name in models if shown[name] and name not in fused)
        for name, observed in seen.items():
            self.recorder.timeline.mark(index, "grad")
            if not shown[name]:
                self._hidden(index, at, name, observed)
            elif name not in fused or not self._fused_passed(name, observed):
                # (a rank's fused check failed: every rank made the average as for a small model; judged as one)
                self._judge_grads(index, at, name, observed)

    def _counted(self, *, vacuous: bool, max_abs: float | None = None) -> None:
        """One gradient check counted (``vacuous``: synced and local could not be told apart)."""
        self.recorder.checks += 1
        self.recorder.grad_checks += 1
        self.recorder.vacuous_checks += vacuous
        if max_abs is not None:
            self.recorder.observe(max_abs)

    def _fused_passed(self, name: str, observed: Observed) -> bool:
        """A large model's gradients judged as its sync is made (harness/rank/numerics/fused_check.py):
        whether they passed on every rank (counted then)."""
        outcome = self.oracle.averaging.fused_grads(name, observed.grads)
        if outcome.passed:
            self._counted(vacuous=not outcome.distinguishable, max_abs=outcome.max_abs)
        return outcome.passed

    def _judge_grads(self, index: int, at: str, name: str, observed: Observed) -> None:
        """``name``'s gradients against the oracle's, each that is not diagnosed; then the oracle carries on
        from the rank's."""
        oracle, anchoring = self.oracle, self.oracle.anchoring
        synced = anchoring.synced_grads(name)
        local_now = oracle.state.local_of(name)
        self._counted(vacuous=not any_distinguishable((local_now[p], synced[p]) for p in synced))
        del local_now
        local: dict[str, Expectation] | None = None  # the local hypotheses, made for a diagnosis
        failed = False
        grads = observed.full_grads()  # a collective when sharded: every rank, before any diagnosis
        expectations = anchoring.expected_grads(name)
        parts = oracle.weighting.parts(name)
        fits: dict[bool, ModelFits] = {}  # by whether fitted to this rank's own partition (``Observed.owned``)
        pairs = {pname: (_grad_or_zeros(observed, pname), observed.piece_of(pname, full))
                 for pname, full in expectations.items()}
        close, max_abs = all_close(list(pairs.values()))
        self.recorder.observe(max_abs)
        for pname, (actual, expected) in ({} if close else pairs).items():
            diff = difference(actual, expected)
            if diff.close:
                continue
            # fitted to the whole model, once, at its first failing tensor; where each rank's partition
            # holds what that rank reduced (ZeRO-1/2), to this rank's partition of it
            owned = pname in observed.owned
            if owned not in fits:
                fits[owned] = ModelFits.make(
                    expectations, grads, parts, low=AUTOCAST_DTYPES.get(oracle.config.precision),
                    backwards=oracle.weighting.backwards.get(name, 1), held=oracle.weighting.held(name),
                    partition=owned_cut(observed) if owned else None, owned=observed.owned)
            local = local if local is not None else anchoring.local_grads(name)
            self._grad_failure(index, at, name, pname, observed, actual, expected, diff, fits[owned],
                               local=local[pname], synced=synced[pname])
            failed = True
        del pairs, expectations, local, synced  # the oracle's gradients go as the rank's are adopted
        anchoring.adopt_grads(name, grads)
        if failed:
            anchoring.restart_window(name, grads)

    def _grad_failure(self, index: int, at: str, name: str, pname: str, observed: Observed, actual: torch.Tensor,
                      expected: Expectation, diff: Difference, fit_set: ModelFits, *, local: Expectation,
                      synced: Expectation) -> None:
        """A parameter's gradient that is not the oracle's, recorded with its diagnosis: fitted to the
        model's whole gradient (``fit_set``), with this rank's own and the synced hypotheses beside."""
        oracle, config = self.oracle, self.oracle.config
        kind, factor, which = fit_set.diagnose(
            pname, observed, actual, expected=expected, local=local, synced=synced,
            previous=oracle.anchoring.previous_grad(name, pname), expected_sync=oracle.state.last_sync,
            weighed=oracle.weighting.tokens is not None or config.contract == "full_batch", rank=config.data_rank)
        fit = fit_set.rebasing if which == REBASED else fit_set.reweighing
        misweighted = kind is FailureKind.MISWEIGHTED and fit is not None
        unit = "tokens" if oracle.weighting.tokens is not None else "micro-batches"
        shards = None if config.mesh is None else config.mesh.shard_ranks()
        self.recorder.add(make_failure(rank=self.rank, step=index, where=at, model=name, param=pname,
                                       checked="grad", kind=kind, factor=factor, diff=diff,
                                       weights=fit.weights if misweighted else None,
                                       earlier=fit.earlier if misweighted else None,
                                       backwards=fit.backwards if misweighted else 1,
                                       unit=unit, shards=shards))

    def grad_norm(self, step: MicroStep | int, name: str, reported: float, norm: ClipNorm, *,
                  who: str = "returned by accelerator.clip_grad_norm_") -> None:
        """A gradient norm the library reported (``who``: what reported it) against the oracle's norm of
        the same gradients before the clip (``norm``, from ``Oracle.clip_grad_norm``): a loss scaled wrong
        is invisible in the update once the clip scales it back, but not here. The two may be apart
        by the norm of the gradients' allowances (|‖a‖ - ‖b‖| <= ‖a - b‖) and by the rounding of two
        sums of the same squares in other orders (closeness.norm_rounding)."""
        index, at = where(step)
        self.recorder.checks += 1
        self.recorder.timeline.mark(index, "grad_norm")
        allowed = norm.allowed
        if math.isfinite(reported) and abs(reported - norm.value) <= allowed:
            return
        factor = reported / norm.value if norm.value > 0 and math.isfinite(reported) else None
        self.recorder.add(Failure(
            rank=self.rank, step=index, model=name, param="grad_norm",
            kind=FailureKind.WRONG_SCALE if factor is not None else FailureKind.MISMATCH,
            max_abs_diff=abs(reported - norm.value) if math.isfinite(reported) else math.inf,
            checked="grad_norm", factor=factor,
            message=wording.grad_norm_text(who=f"grad_norm {who}", rank=self.rank, where=at, logged=reported,
                                           expected=norm.value, allowed=allowed),
        ))

    def _hidden(self, index: int, at: str, name: str, observed: Observed) -> None:
        """FSDP2 between sync points: the unsharded gradients accumulate inside FSDP and no shard is
        shown (``p.grad`` stays None), so there is nothing to compare (the collectives say whether
        it kept from syncing). A shard that is shown (by FSDP2, or by FSDP1 where its full local
        gradient was due) was reduce-scattered: synced early. No collective here: whether a rank
        shows one is its own."""
        self.recorder.checks += 1
        self.recorder.grad_checks += 1
        shown = observed.shards_shown or [p for p, g in observed.grads.items() if g is not None]
        if not shown:
            return
        self.recorder.add(Failure(
            rank=self.rank, step=index, model=name, param=shown[0], kind=FailureKind.SYNCED_EARLY,
            max_abs_diff=0.0, checked="grad",
            message=wording.hidden_grad_text(rank=self.rank, where=at, what=f"{name}.{shown[0]}", shown=len(shown)),
        ))

    def _collectives(self, index: int, at: str, models: Mapping[str, nn.Module]) -> None:
        """The gradient reductions of the backwards since the last check, against the contract."""
        config = self.oracle.config
        syncs = self.oracle.state.take_backward_syncs()
        if self.accounting is None:
            return
        backwards = self.accounting.take()
        if config.world_size < 2:
            return
        if not self.accounting.available:
            self.recorder.unchecked.setdefault(CHECK, accounting_unavailable() or "the flight recorder is off")
            return
        if config.mesh is not None:
            syncs = [(sync, tensor_parallel_share(models, needed)) for sync, needed in syncs]
        for verdict in judge(backwards, syncs, reduces_every_micro_batch=config.spec.reduces_every_micro_batch,
                             mesh=config.mesh, rank=self.rank):
            self.recorder.comm_checks += 1
            self.recorder.timeline.mark(index, "comm")
            if verdict.kind is None:
                continue
            self.recorder.add(Failure(
                rank=self.rank, step=index, model="+".join(models), param="collectives", kind=verdict.kind,
                max_abs_diff=float(len(verdict.backward.reductions)), checked="comm",
                message=wording.comm_text(rank=self.rank, where=at, issued=verdict.backward.describe(),
                                          syncs=verdict.syncs, needed=verdict.needed, why=verdict.why),
            ))

    def params(self, step: MicroStep | int, models: Mapping[str, nn.Module],
               optimizers: Mapping[str, Any] | None = None) -> None:
        """Compare every parameter's update since the last optimizer step of the schedule
        (``p_after - p_before``) with the oracle's, and every parameter with rank 0's copy.

        ``optimizers`` (by model name, the case's own optimizers): after a mismatch, the oracle's
        optimizer takes over their state (moments, step counts), so that the next steps are judged
        on their own. Without them a stateful optimizer's later steps are judged against the
        oracle's own state."""
        oracle = self.oracle
        anchoring = oracle.anchoring
        index, at = where(step)
        oracle.averaging.settle()  # every rank, before any rank-specific adoption below
        stepped = oracle.state.stepped
        mark_point(self.recorder, step, optimizer_step=oracle.state.stepped)
        for name, model in models.items():
            self.recorder.timeline.mark(index, "param")
            observed = self._observe(name, model, sync=oracle.state.last_sync)
            self.recorder.checks += 1
            triples = {}
            befores = anchoring.before_step(name)
            for pname, replica_param in oracle.params[name].items():
                after = observed.piece(pname, replica_param.detach())
                before = observed.piece(pname, befores[pname]) if befores is not None else after
                triples[pname] = (observed.params[pname], after, before)
            close, max_abs = all_close_updates(list(triples.values()))
            self.recorder.observe(max_abs)
            # the parameters that moved wrongly, their kind judged against rank 0's copy
            wrong = {} if close else {p: self._wrong_update(*_update(*t), stepped) for p, t in triples.items()}
            wrong = {p: w for p, w in wrong.items() if w is not None}
            del triples
            judge = functools.partial(self._judge_updates, index, at, name, wrong)
            if observed.sharded:  # each rank holds another part: there is no copy to compare with rank 0's
                judge({p: observed.params[p] for p in oracle.params[name]}, None)
            elif sum(p.numel() for p in oracle.params[name].values()) >= CHUNK:
                # a large model: whether its parameters are rank 0's bit for bit, from digests (rank 0's
                # copy itself only where they are not), rather than riding a copy of it along
                actual = {p: observed.params[p] for p in oracle.params[name]}
                judge(actual, anchoring.rank0_params(actual))
            else:
                actual = {p: observed.params[p].detach().clone() for p in oracle.params[name]}
                anchoring.rank0_copy(step, name, actual, functools.partial(judge, actual))
            anchoring.adopt_params(name, observed.full_params())
            # a sharded model's full gradients are a collective: every rank reads them, or none
            grads = observed.full_grads() if wrong or observed.sharded else {}
            if wrong:
                anchoring.restart_window(name, grads)
                anchoring.adopt_grads(name, grads)  # a rank that stepped wrongly: its gradients too
                if optimizers is not None and name in optimizers:
                    anchoring.adopt_optimizer_state(name, optimizers[name])
            elif not observed.sharded and not observed.hidden and oracle.state.stepped and all(
                    g is None or not bool(g.any()) for g in observed.grads.values()):
                anchoring.forget_previous(name)  # the rank cleared its gradients: nothing of them can linger
        anchoring.end_step()

    def stepped_early(self, step: MicroStep, name: str, optimizers: Any) -> None:
        """``name``'s optimizer stepped at ``step``, where the schedule has no step (its step hook says
        so): named ``stepped_early`` from the step itself, so that a step that moved no parameter (a
        learning rate of 0 in a warm-up) is named too, and the oracle takes over the optimizer's state,
        so that its later steps are judged on their own."""
        self.recorder.add(Failure(rank=self.rank, step=step.index, model=name, param="optimizer",
                                  kind=FailureKind.STEPPED_EARLY, max_abs_diff=0.0, checked="param",
                                  message=wording.optimizer_stepped_text(rank=self.rank, model=name,
                                                                       where=step.where())))
        if optimizers:
            self.oracle.anchoring.adopt_optimizer_state(name, optimizers)

    @staticmethod
    def _wrong_update(update: torch.Tensor, expected: Expectation, stepped: bool) -> WrongUpdate | None:
        """None when the update is the oracle's."""
        diff = difference(update, expected)
        if diff.close:
            return None
        moved = bool((update.abs() > expected.allowed).any())
        due = stepped and bool((expected.value.abs() > expected.allowed).any())
        return WrongUpdate(diff, moved, due)

    def _judge_updates(self, index: int, at: str, name: str, wrong: Mapping[str, WrongUpdate],
                       actual: Mapping[str, torch.Tensor], rank0: Mapping[str, torch.Tensor] | None) -> None:
        """The failures of a parameter check, once rank 0's copy is known (None: sharded, none)."""
        if rank0 is not None and not wrong and all(rank0[p] is actual[p] or torch.equal(rank0[p], actual[p])
                                                   for p in actual):
            return  # rank 0's bit for bit
        if rank0 is not None and not wrong and all_close(
                [(actual[p], Expectation.rounded(rank0[p])) for p in actual])[0]:
            return
        for pname in actual:
            if pname not in wrong:
                if rank0 is not None:
                    self._equal_to_rank0(index, at, name, pname, actual[pname], rank0[pname])
                continue
            update = wrong[pname]
            kind = _param_kind(actual[pname], rank0[pname] if rank0 is not None else actual[pname], moved=update.moved,
                               due=update.due)
            self.recorder.add(make_failure(rank=self.rank, step=index, where=at, model=name, param=pname,
                                           checked="param", kind=kind, factor=None, diff=update.diff))

    def _equal_to_rank0(self, index: int, at: str, name: str, pname: str, actual: torch.Tensor,
                        rank0: torch.Tensor) -> None:
        """DDP keeps every rank's parameters equal; report the step where they first part (once)."""
        key = (name, pname)
        if key in self.diverged:
            return
        diff = difference(actual, Expectation.rounded(rank0))
        if diff.close:
            return
        self.diverged.add(key)
        self.recorder.add(make_failure(rank=self.rank, step=index, where=at, model=name, param=pname,
                                       checked="param", kind=FailureKind.PARAMS_DIVERGED, factor=None, diff=diff,
                                       noun="parameter"))

    def sync_flag(self, step: MicroStep, flag: bool) -> None:
        """Report where ``accelerator.sync_gradients`` disagrees with the schedule (its own kind)."""
        self.recorder.checks += 1
        mark_point(self.recorder, step)
        self.recorder.timeline.mark(step.index, "flag")
        if bool(flag) == step.optimizer_step:
            return
        self.recorder.add(Failure(
            rank=self.rank, step=step.index, model="accelerator", param="sync_gradients",
            kind=FailureKind.SYNC_FLAG, max_abs_diff=0.0, checked="flag",
            message=wording.sync_flag_text(rank=self.rank, where=step.where(), flag=bool(flag),
                                           due=step.optimizer_step),
        ))

    def lr(self, step: MicroStep | int, optimizers: Mapping[str, Any]) -> None:
        """Compare each optimizer's learning rates with the oracle's (whose schedulers advanced only
        at the schedule's optimizer steps)."""
        index, at = where(step)
        mark_point(self.recorder, step)
        for name, optimizer in optimizers.items():
            self.recorder.checks += 1
            self.recorder.timeline.mark(index, "lr")
            actual_groups = [g for opt in as_optimizers(optimizer) for g in opt.param_groups]
            expected_groups = [g for opt in self.oracle.optimizers[name] for g in opt.param_groups]
            for group, (actual, expected) in enumerate(zip(actual_groups, expected_groups)):
                gap = abs(float(actual["lr"]) - float(expected["lr"]))
                if gap <= 1e-12 + 1e-6 * abs(float(expected["lr"])):
                    continue
                self.recorder.add(Failure(
                    rank=self.rank, step=index, model=name, param=f"param_groups[{group}].lr",
                    kind=FailureKind.MISMATCH, max_abs_diff=gap, checked="lr",
                    message=wording.lr_text(rank=self.rank, where=at, optimizer=name, group=group,
                                            actual=float(actual["lr"]), expected=float(expected["lr"])),
                ))

