"""The oracle: plain replicas that compute, from the documented contract alone, what every rank must hold."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from harness.catalogue import PRECISIONS
from harness.compare import (
    Expectation,
    Hypotheses,
    diagnose,
    difference,
    distinguishable,
    make_failure,
    reduction_allowance,
    rounding_allowance,
)
from harness.matrix import Failure
from harness.replica import forward_as, unwrap
from harness.schedule import MicroStep

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

# Failures kept per rank; the rest are counted. The first ones in step order say the most.
MAX_FAILURES = 64


@dataclass
class Recorder:
    """Failures and check counts of one rank in one cell."""

    rank: int
    failures: list[Failure] = field(default_factory=list)
    omitted: int = 0
    checks: int = 0  # every comparison: gradients, parameters, flags, learning rates
    grad_checks: int = 0
    vacuous_checks: int = 0  # gradient checks where synced and local could not be told apart
    max_abs_diff: float = 0.0

    def add(self, failure: Failure) -> None:
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(failure)
        else:
            self.omitted += 1

    def observe(self, max_abs: float) -> None:
        self.max_abs_diff = max(self.max_abs_diff, max_abs)


def _where(step: MicroStep | int) -> tuple[int, str]:
    if isinstance(step, MicroStep):
        return step.index, step.where()
    return step, f"step {step}"


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _joined(expectations: Mapping[str, Expectation]) -> Expectation:
    """One flat expectation of a model's parameters, for a model-wide question."""
    return Expectation(_flat(e.value for e in expectations.values()), _flat(e.allowed for e in expectations.values()))


def _pieces(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flat`` cut back into tensors shaped like ``like``'s, by name."""
    out = {}
    offset = 0
    for pname, t in like.items():
        out[pname] = flat[offset : offset + t.numel()].view_as(t).clone()
        offset += t.numel()
    return out


class Oracle:
    """Replicas of the user's models, with no DDP and no accelerate, on this rank.

    The case tells the oracle each micro-batch (as a closure over the replicas) and whether the
    contract of the API it used says that backward must average across ranks; the oracle then
    averages with an explicit ``all_reduce(SUM) / world_size``. It never reads accelerate's state.

    After every check the replicas are anchored to the rank's real state (its parameters, and its
    gradients after a gradient check), so each check judges only the arithmetic since the last one:
    an error is reported where it happens, and the allowance stays at the floating-point limit of
    one step (harness/compare.py) instead of growing with every step the replicas run on their own.
    """

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        *,
        recorder: Recorder,
        rank: int,
        world_size: int,
        precision: str,
        num_steps: int = 1,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_steps: int = 1,
    ) -> None:
        if not models:
            raise ValueError("the oracle needs at least one model")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
        self.recorder = recorder
        self.rank = rank
        self.world_size = world_size
        self.num_steps = num_steps
        self.replicas = {name: copy.deepcopy(unwrap(m)) for name, m in models.items()}
        self.models = forward_as(self.replicas, precision)
        self.params = {name: dict(r.named_parameters()) for name, r in self.replicas.items()}
        self.local = {name: {p: torch.zeros_like(t) for p, t in ps.items()} for name, ps in self.params.items()}
        # how far each replica gradient may legitimately be from the rank's (harness/compare.py)
        self.allowed = {name: self._no_allowance(name) for name in self.params}
        self.previous: dict[str, dict[str, Expectation]] | None = None
        self.last_sync = False
        self.stepped = False
        self.diverged: set[tuple[str, str]] = set()
        self.before_step: dict[str, dict[str, torch.Tensor]] | None = None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        if optimizer is not None:
            for name, replica in self.replicas.items():
                factory = optimizer[name] if isinstance(optimizer, Mapping) else optimizer
                self.optimizers[name] = factory(replica.parameters())
        self.schedulers = [scheduler(opt) for opt in self.optimizers.values()] if scheduler else []
        if scheduler_steps < 1:
            raise ValueError(f"scheduler_steps must be >= 1, got {scheduler_steps}")
        self.scheduler_steps = scheduler_steps

    def _no_allowance(self, name: str) -> dict[str, torch.Tensor]:
        return {p: torch.zeros_like(t, dtype=torch.float64) for p, t in self.params[name].items()}

    # the contract, step by step

    def backward(self, closure: Callable[[dict[str, nn.Module]], torch.Tensor], *, sync: bool) -> None:
        """Run one micro-batch's loss (scaled by 1/num_steps, as ``Accelerator.backward`` documents)
        into the replicas' gradients; average across ranks when the contract says this backward syncs."""
        loss = closure(self.models) / self.num_steps
        flat = [(name, pname, p) for name, ps in self.params.items() for pname, p in ps.items() if p.requires_grad]
        grads = torch.autograd.grad(loss, [p for _, _, p in flat], allow_unused=True)
        for (name, pname, p), g in zip(flat, grads):
            if g is None:
                continue
            p.grad = g.detach().clone() if p.grad is None else p.grad + g.detach()
            self.local[name][pname] += g.detach()
            self.allowed[name][pname] = self.allowed[name][pname] + rounding_allowance(p.grad)
        self.last_sync = sync
        if sync:
            self._average_grads()

    def _reduce(self, tensors: Mapping[str, torch.Tensor], carried: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, Expectation]:
        """The explicit all-rank average of ``tensors``, each with its allowance: the reduction's
        bound from every rank's |contribution|, plus the allowances the ranks carried into it
        (averaged). One collective for values, magnitudes and allowances together."""
        values = _flat(tensors.values())
        parts = [values, values.abs()] + ([_flat(carried.values()).to(values.dtype)] if carried is not None else [])
        buffer = torch.cat(parts)
        if self.world_size > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        n = values.numel()
        average = buffer[:n] / self.world_size
        allowed = reduction_allowance(buffer[n : 2 * n], dtype=values.dtype)
        if carried is not None:
            allowed = allowed + buffer[2 * n :].double() / self.world_size
        averages, allowances = _pieces(average, tensors), _pieces(allowed, tensors)
        return {pname: Expectation(averages[pname], allowances[pname]) for pname in tensors}

    def _average_grads(self) -> None:
        for name, ps in self.params.items():
            for p in ps.values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            reduced = self._reduce({pname: p.grad for pname, p in ps.items()}, self.allowed[name])
            for pname, p in ps.items():
                p.grad = reduced[pname].value
                self.allowed[name][pname] = reduced[pname].allowed

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> dict[str, float]:
        """Clip each model's replica gradients, as ``clip_grad_norm_`` on synced gradients does;
        the total norm of each model's gradients before clipping."""
        norms = {}
        for name, replica in self.replicas.items():
            ps = self.params[name]
            before = {pname: p.grad.detach().double().abs() for pname, p in ps.items() if p.grad is not None}
            norm = float(torch.nn.utils.clip_grad_norm_(replica.parameters(), max_norm, norm_type=norm_type))
            norms[name] = norm
            coefficient = min(1.0, max_norm / (norm + 1e-6))
            # the norm is off by at most the norm of the allowances, and the coefficient with it
            carried = float(torch.linalg.vector_norm(_flat(self.allowed[name].values()), norm_type))
            relative = carried / norm if norm > 0 else 0.0
            for pname, magnitude in before.items():
                grad = ps[pname].grad
                self.allowed[name][pname] = (
                    coefficient * (self.allowed[name][pname] + magnitude * relative) + rounding_allowance(grad)
                )
        return norms

    def step(self, point: MicroStep | bool) -> None:
        """At an optimizer step of the schedule: step, advance the schedulers, clear the gradients."""
        due = point.optimizer_step if isinstance(point, MicroStep) else bool(point)
        self.stepped = due
        self.before_step = {name: {p: t.detach().clone() for p, t in ps.items()} for name, ps in self.params.items()}
        if not due:
            return
        for optimizer in self.optimizers.values():
            optimizer.step()
        for scheduler in self.schedulers:
            for _ in range(self.scheduler_steps):
                scheduler.step()
        self.previous = {
            name: {
                p: Expectation(t.grad.detach().clone() if t.grad is not None else torch.zeros_like(t),
                               self.allowed[name][p].clone())
                for p, t in ps.items()
            }
            for name, ps in self.params.items()
        }
        for name, ps in self.params.items():
            for pname, p in ps.items():
                p.grad = None
                self.local[name][pname].zero_()
            self.allowed[name] = self._no_allowance(name)

    # checks

    def check_grads(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None:
        """Compare every parameter's gradient on this rank with the oracle's (after a backward),
        then carry on from the rank's gradients."""
        index, where = _where(step)
        for name, model in models.items():
            actual_params = self._actual_params(name, model)
            local = {pname: Expectation(t.clone(), rounding_allowance(t)) for pname, t in self.local[name].items()}
            synced = self._reduce(self.local[name])  # what a sync now would give: the other hypothesis
            self.recorder.checks += 1
            self.recorder.grad_checks += 1
            if not distinguishable(_joined(local), _joined(synced)):
                self.recorder.vacuous_checks += 1
            failed = False
            for pname, replica_param in self.params[name].items():
                expected = Expectation(
                    replica_param.grad if replica_param.grad is not None else torch.zeros_like(replica_param),
                    self.allowed[name][pname],
                )
                actual_param = actual_params[pname]
                actual = actual_param.grad if actual_param.grad is not None else torch.zeros_like(actual_param)
                diff = difference(actual, expected)
                self.recorder.observe(diff.max_abs)
                if diff.close:
                    continue
                previous = self.previous[name][pname] if self.previous is not None else None
                kind, factor = diagnose(
                    actual,
                    Hypotheses(expected=expected, local=local[pname], synced=synced[pname], previous=previous,
                               expected_sync=self.last_sync),
                )
                failed = True
                self.recorder.add(
                    make_failure(rank=self.rank, step=index, where=where, model=name, param=pname,
                                 checked="grad", kind=kind, factor=factor, diff=diff)
                )
            self._anchor(name, actual_params, params=False)
            if failed:
                self._anchor_local(name, actual_params)

    def check_params(
        self,
        step: MicroStep | int,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, Any] | None = None,
    ) -> None:
        """Compare every parameter's update since the last optimizer step of the schedule
        (``p_after - p_before``) with the oracle's, and every parameter with rank 0's copy.

        ``optimizers`` (by model name, the case's own optimizers): after a mismatch, the oracle's
        optimizer takes over their state (moments, step counts), so that the next steps are judged
        on their own. Without them a stateful optimizer's later steps are judged against the
        oracle's own state."""
        index, where = _where(step)
        stepped = self.stepped and self.before_step is not None
        for name, model in models.items():
            actual_params = self._actual_params(name, model)
            reference = _flat(actual_params[p].detach() for p in self.params[name])
            if self.world_size > 1:
                dist.broadcast(reference, src=0)
            rank0 = _pieces(reference, self.params[name])
            self.recorder.checks += 1
            failed = False
            for pname, replica_param in self.params[name].items():
                after = replica_param.detach()
                before = self.before_step[name][pname] if self.before_step is not None else after
                actual = actual_params[pname].detach()
                allowed = rounding_allowance(after, before)
                expected = Expectation(after.double() - before.double(), allowed)
                update = actual.double() - before.double()
                diff = difference(update, expected)
                self.recorder.observe(diff.max_abs)
                if diff.close:
                    self._check_equal_to_rank0(index, where, name, pname, actual, rank0[pname])
                    continue
                failed = True
                moved = bool((update.abs() > allowed).any())
                due = stepped and bool((expected.value.abs() > allowed).any())
                kind = self._param_kind(actual, rank0[pname], moved=moved, due=due)
                self.recorder.add(
                    make_failure(rank=self.rank, step=index, where=where, model=name, param=pname,
                                 checked="param", kind=kind, factor=None, diff=diff)
                )
            self._anchor(name, actual_params, params=True)
            if failed:
                self._anchor_local(name, actual_params)
                self._anchor(name, actual_params, params=False)  # a rank that stepped wrongly: its gradients too
                if optimizers is not None and name in optimizers and name in self.optimizers:
                    self.optimizers[name].load_state_dict(copy.deepcopy(optimizers[name].state_dict()))
        self.before_step = None
        self.stepped = False

    def _actual_params(self, name: str, model: nn.Module) -> dict[str, torch.Tensor]:
        actual = dict(unwrap(model).named_parameters())
        missing = [p for p in self.params[name] if p not in actual]
        if missing:
            raise KeyError(f"model {name!r} has no parameter {missing[0]!r} on rank {self.rank}")
        return actual

    def _check_equal_to_rank0(
        self, index: int, where: str, name: str, pname: str, actual: torch.Tensor, rank0: torch.Tensor
    ) -> None:
        """DDP keeps every rank's parameters equal; report the step where they first part (once)."""
        key = (name, pname)
        if key in self.diverged:
            return
        diff = difference(actual, Expectation.rounded(rank0))
        if diff.close:
            return
        self.diverged.add(key)
        self.recorder.add(
            make_failure(rank=self.rank, step=index, where=where, model=name, param=pname, checked="param",
                         kind="params_diverged", factor=None, diff=diff, noun="parameter")
        )

    @staticmethod
    def _param_kind(actual: torch.Tensor, rank0: torch.Tensor, *, moved: bool, due: bool) -> str:
        if not difference(actual, Expectation.rounded(rank0)).close:
            return "params_diverged"
        if due and not moved:
            return "step_skipped"
        if moved and not due:
            return "stepped_early"
        return "mismatch"

    def _anchor(self, name: str, actual_params: Mapping[str, torch.Tensor], *, params: bool) -> None:
        """Carry on from the state the rank is really in: its parameters (after a parameter check)
        or its gradients (after a gradient check), with nothing left to allow for."""
        with torch.no_grad():
            for pname, replica_param in self.params[name].items():
                actual = actual_params[pname]
                if params:
                    replica_param.copy_(actual.detach())
                else:
                    replica_param.grad = None if actual.grad is None else actual.grad.detach().clone()
        if not params:
            self.allowed[name] = self._no_allowance(name)

    def _anchor_local(self, name: str, actual_params: Mapping[str, torch.Tensor]) -> None:
        """After a mismatch: a rank that cleared its gradients starts its next window here."""
        for pname, actual in actual_params.items():
            if actual.grad is None or not bool(actual.grad.any()):
                self.local[name][pname].zero_()

    def check_sync_flag(self, step: MicroStep, flag: bool) -> None:
        """Report where ``accelerator.sync_gradients`` disagrees with the schedule (its own kind)."""
        self.recorder.checks += 1
        if bool(flag) == step.optimizer_step:
            return
        self.recorder.add(
            Failure(
                rank=self.rank, step=step.index, model="accelerator", param="sync_gradients",
                kind="sync_flag", max_abs_diff=0.0, checked="flag",
                message=(
                    f"accelerator.sync_gradients on rank {self.rank} at {step.where()}: "
                    f"is {bool(flag)}, the schedule says {step.optimizer_step}"
                ),
            )
        )

    def check_lr(self, step: MicroStep | int, optimizers: Mapping[str, Any]) -> None:
        """Compare each optimizer's learning rates with the oracle's (whose schedulers advanced only
        at the schedule's optimizer steps, ``scheduler_steps`` times each)."""
        index, where = _where(step)
        for name, optimizer in optimizers.items():
            self.recorder.checks += 1
            expected_groups = self.optimizers[name].param_groups
            for group, (actual, expected) in enumerate(zip(optimizer.param_groups, expected_groups)):
                gap = abs(float(actual["lr"]) - float(expected["lr"]))
                if gap <= 1e-12 + 1e-6 * abs(float(expected["lr"])):
                    continue
                self.recorder.add(
                    Failure(
                        rank=self.rank, step=index, model=name, param=f"param_groups[{group}].lr",
                        kind="mismatch", max_abs_diff=gap, checked="lr",
                        message=(
                            f"learning rate of optimizer '{name}' (param group {group}) on rank {self.rank} at "
                            f"{where}: is {float(actual['lr']):.6g}, the contract says {float(expected['lr']):.6g}"
                        ),
                    )
                )

