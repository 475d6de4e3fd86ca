"""The oracle: plain replicas that compute, from the documented contract alone, what every rank must hold."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from harness.compare import Hypotheses, Tolerance, diagnose, difference, distinguishable, make_failure
from harness.matrix import Failure
from harness.schedule import MicroStep

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

# Failures kept per rank; the rest are counted. The first ones in step order say the most.
MAX_FAILURES = 64


class MixedPrecisionReplica(nn.Module):
    """A replica whose forward runs as ``mixed_precision="bf16"`` documents: under autocast, with
    low-precision floating outputs returned as fp32."""

    def __init__(self, inner: nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            out = self.inner(*args, **kwargs)
        return _to_fp32(out)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel (or similar) wrapper."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


@dataclass
class Recorder:
    """Failures and check counts of one rank in one cell."""

    rank: int
    failures: list[Failure] = field(default_factory=list)
    omitted: int = 0
    checks: int = 0
    vacuous_checks: int = 0
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


class Oracle:
    """Replicas of the user's models, with no DDP and no accelerate, on this rank.

    The case tells the oracle each micro-batch (as a closure over the replicas) and whether the
    contract of the API it used says that backward must average across ranks; the oracle then
    averages with an explicit ``all_reduce(SUM) / world_size``. It never reads accelerate's state.
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
        self.recorder = recorder
        self.rank = rank
        self.world_size = world_size
        self.num_steps = num_steps
        self.tol = Tolerance.for_precision(precision)
        self.replicas = {name: copy.deepcopy(unwrap(m)) for name, m in models.items()}
        device_type = next(iter(self.replicas.values())).parameters().__next__().device.type
        if precision == "bf16":
            self.models: dict[str, nn.Module] = {
                name: MixedPrecisionReplica(r, device_type) for name, r in self.replicas.items()
            }
        else:
            self.models = dict(self.replicas)
        self.params = {name: dict(r.named_parameters()) for name, r in self.replicas.items()}
        self.local = {name: {p: torch.zeros_like(t) for p, t in ps.items()} for name, ps in self.params.items()}
        self.previous: dict[str, dict[str, torch.Tensor]] | None = None
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
        self.last_sync = sync
        if sync:
            self._average_grads()

    def _average_grads(self) -> None:
        for name, ps in self.params.items():
            for pname, p in ps.items():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in ps.values()])
            if self.world_size > 1:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= self.world_size
            self._scatter(flat, ps, into_grad=True)

    @staticmethod
    def _scatter(flat: torch.Tensor, ps: Mapping[str, torch.Tensor], *, into_grad: bool) -> dict[str, torch.Tensor]:
        out = {}
        offset = 0
        for pname, p in ps.items():
            piece = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
            if into_grad:
                p.grad = piece
            out[pname] = piece
        return out

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> dict[str, float]:
        """Clip each model's replica gradients, as ``clip_grad_norm_`` on synced gradients does;
        the total norm of each model's gradients before clipping."""
        norms = {}
        for name, replica in self.replicas.items():
            norms[name] = float(torch.nn.utils.clip_grad_norm_(replica.parameters(), max_norm, norm_type=norm_type))
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
            name: {p: (t.grad.detach().clone() if t.grad is not None else torch.zeros_like(t)) for p, t in ps.items()}
            for name, ps in self.params.items()
        }
        for name, ps in self.params.items():
            for pname, p in ps.items():
                p.grad = None
                self.local[name][pname].zero_()

    # checks

    def _synced_local(self, name: str) -> dict[str, torch.Tensor]:
        """The all-rank average of the purely local accumulation: what a sync now would give."""
        ps = self.local[name]
        flat = torch.cat([t.reshape(-1) for t in ps.values()])
        if self.world_size > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat = flat / self.world_size
        return self._scatter(flat, ps, into_grad=False)

    def check_grads(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None:
        """Compare every parameter's gradient on this rank with the oracle's (after a backward)."""
        index, where = _where(step)
        for name, model in models.items():
            actual_params = dict(unwrap(model).named_parameters())
            synced_alt = self._synced_local(name)
            local = self.local[name]
            self.recorder.checks += 1
            flat_local = torch.cat([t.reshape(-1) for t in local.values()])
            flat_synced = torch.cat([t.reshape(-1) for t in synced_alt.values()])
            if not distinguishable(flat_local, flat_synced, self.tol):
                self.recorder.vacuous_checks += 1
            failed = False
            for pname, expected_param in self.params[name].items():
                expected = expected_param.grad if expected_param.grad is not None else torch.zeros_like(expected_param)
                actual_param = actual_params.get(pname)
                if actual_param is None:
                    raise KeyError(f"model {name!r} has no parameter {pname!r} on rank {self.rank}")
                actual = actual_param.grad if actual_param.grad is not None else torch.zeros_like(actual_param)
                diff = difference(actual, expected, self.tol)
                self.recorder.observe(diff.max_abs)
                if diff.close:
                    continue
                previous = self.previous[name][pname] if self.previous is not None else None
                kind, factor = diagnose(
                    actual,
                    Hypotheses(
                        expected=expected,
                        local=local[pname],
                        synced=synced_alt[pname],
                        previous=previous,
                        expected_sync=self.last_sync,
                    ),
                    self.tol,
                )
                failed = True
                self.recorder.add(
                    make_failure(
                        rank=self.rank, step=index, where=where, model=name, param=pname,
                        checked="grad", kind=kind, factor=factor, diff=diff, tol=self.tol,
                    )
                )
            if failed:
                self._anchor(name, actual_params, grads=True)

    def check_params(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None:
        """Compare every parameter with the oracle's replica, and with rank 0's copy."""
        index, where = _where(step)
        for name, model in models.items():
            actual_params = dict(unwrap(model).named_parameters())
            flat_actual = torch.cat([actual_params[p].detach().reshape(-1) for p in self.params[name]])
            reference = flat_actual.clone()
            if self.world_size > 1:
                dist.broadcast(reference, src=0)
            rank0 = self._scatter(reference, self.params[name], into_grad=False)
            failed = False
            for pname, expected in self.params[name].items():
                actual = actual_params[pname].detach()
                diff = difference(actual, expected.detach(), self.tol)
                self.recorder.observe(diff.max_abs)
                if diff.close:
                    self._check_equal_to_rank0(index, where, name, pname, actual, rank0[pname])
                    continue
                failed = True
                self.recorder.add(
                    make_failure(
                        rank=self.rank, step=index, where=where, model=name, param=pname, checked="param",
                        kind=self._param_kind(name, pname, actual, rank0[pname]), factor=None, diff=diff,
                        tol=self.tol,
                    )
                )
            if failed:
                self._anchor(name, actual_params, grads=False)

    def _check_equal_to_rank0(
        self, index: int, where: str, name: str, pname: str, actual: torch.Tensor, rank0: torch.Tensor
    ) -> None:
        """DDP keeps every rank's parameters equal; report the step where they first part (once)."""
        key = (name, pname)
        if key in self.diverged:
            return
        diff = difference(actual, rank0, self.tol)
        if diff.close:
            return
        self.diverged.add(key)
        self.recorder.add(
            make_failure(
                rank=self.rank, step=index, where=where, model=name, param=pname, checked="param",
                kind="params_diverged", factor=None, diff=diff, tol=self.tol,
            )
        )

    def _param_kind(self, name: str, pname: str, actual: torch.Tensor, rank0: torch.Tensor) -> str:
        if not difference(actual, rank0, self.tol).close:
            return "params_diverged"
        if self.before_step is not None:
            unmoved = difference(actual, self.before_step[name][pname], self.tol).close
            if self.stepped and unmoved:
                return "step_skipped"
            if not self.stepped and not unmoved:
                return "stepped_early"
        return "mismatch"

    def _anchor(self, name: str, actual_params: Mapping[str, torch.Tensor], *, grads: bool) -> None:
        """After a mismatch, carry on from the state the rank is really in, so that each later
        step is judged on its own and one early fault does not turn every later check into noise."""
        with torch.no_grad():
            for pname, replica_param in self.params[name].items():
                actual = actual_params[pname]
                cleared = actual.grad is None or not bool(actual.grad.any())
                if not grads:
                    replica_param.copy_(actual.detach())
                    if cleared:  # the rank zeroed its gradients: its next window starts here
                        self.local[name][pname].zero_()
                replica_param.grad = None if actual.grad is None else actual.grad.detach().clone()

    def check_sync_flag(self, step: MicroStep, flag: bool) -> None:
        """Report where ``accelerator.sync_gradients`` disagrees with the schedule (its own kind)."""
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

