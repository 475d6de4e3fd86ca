"""What the oracle takes and gives: the factories a case passes it, the options and models it refuses,
its replicas of the models, the norm it reports at a clip, and the checks a case calls on it, judged by
the checks attached from above (``OracleChecks``, harness/rank/judging/checks.py; the oracle as those
checks read it is theirs: ``JudgedOracle``, harness/rank/judging/oracle_view.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Mapping, Protocol, Sequence, Union

import torch
from torch import nn

from harness.decorator import ALL_PRECISIONS
from harness.rank.numerics.closeness import norm_rounding
from harness.rank.numerics.collectives import Collectives
from harness.rank.oracle.replica import as_optimizers
from harness.rank.oracle.schedule import CONTRACTS, MicroStep
from harness.wrappers.prepared import unwrap

# ``optimizer=``: called with a replica's parameters, as ``torch.optim.SGD(params, lr=...)`` is.
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
# ``optimizers=``: the user's own factory, called with the replica module; one optimizer or several.
ModelOptimizers = Callable[[nn.Module], Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
# What ``backward(rng=key)`` replays: the RNG state the case's own forward ran under for that key.
RngReplay = Callable[[Hashable], ContextManager[None]]


class OracleChecks(Protocol):
    """The checks a case calls through the oracle, judged above it (harness/rank/judging/checks.py,
    attached by ``checked``)."""

    def grads(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None: ...
    def params(self, step: MicroStep | int, models: Mapping[str, nn.Module],
               optimizers: Mapping[str, Any] | None) -> None: ...
    def grad_norm(self, step: MicroStep | int, name: str, reported: float, norm: ClipNorm, *,
                  who: str = ...) -> None: ...
    def sync_flag(self, step: MicroStep, flag: bool) -> None: ...
    def lr(self, step: MicroStep | int, optimizers: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class ClipNorm:
    """The oracle's total gradient norm of one model at a clip, before clipping: ``value``; ``carried``,
    the norm of the gradients' allowances then; ``numel`` and ``dtype``, of the gradients summed."""

    value: float
    carried: float
    numel: int
    dtype: torch.dtype

    @property
    def allowed(self) -> float:
        """How far another computation of the same norm may be from ``value``: by the norm of the
        gradients' allowances (|‖a‖ - ‖b‖| <= ‖a - b‖) and by the rounding of a sum of the same squares
        in another order (closeness.norm_rounding)."""
        return self.carried + self.value * norm_rounding(self.numel, self.dtype)


def refuse_options(models: Mapping[str, nn.Module], *, precision: str, both_optimizers: bool, num_steps: int,
                   contract: str, window_length: Callable[[], int] | None, scheduler_steps: int) -> None:
    """The oracle's options that make no oracle, each refused in one line naming it."""
    if not models:
        raise ValueError("the oracle needs at least one model")
    if precision not in ALL_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(ALL_PRECISIONS)}")
    if both_optimizers:
        raise TypeError("give the oracle optimizer= (called with parameters) or optimizers= "
                        "(called with the model), not both")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if contract not in CONTRACTS:
        raise ValueError(f"unknown contract {contract!r}; known: {', '.join(CONTRACTS)}")
    if contract == "full_batch" and window_length is None:
        raise ValueError("contract='full_batch' needs window_length (the micro-batches of the current "
                         "backward's window); ctx.oracle gives it from the schedule")
    if scheduler_steps < 1:
        raise ValueError(f"scheduler_steps must be >= 1, got {scheduler_steps}")


def make_optimizers(replicas: Mapping[str, nn.Module],
                    optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None,
                    optimizers: ModelOptimizers | Mapping[str, ModelOptimizers] | None,
                    ) -> dict[str, tuple[torch.optim.Optimizer, ...]]:
    """Each replica's optimizers, made by the case's own factory: ``optimizer`` called with its
    parameters, or ``optimizers`` with the replica (one optimizer or several)."""
    made: dict[str, tuple[torch.optim.Optimizer, ...]] = {}
    for name, replica in replicas.items():
        if optimizer is not None:
            factory = optimizer[name] if isinstance(optimizer, Mapping) else optimizer
            made[name] = (factory(replica.parameters()),)
        elif optimizers is not None:
            make = optimizers.get(name) if isinstance(optimizers, Mapping) else optimizers
            if make is not None:
                made[name] = as_optimizers(make(replica))
    return made


class CheckCalls:
    """The checks a case calls on the oracle, judged by the checks attached to it (``checks``,
    harness/rank/judging/checks.py) against the norms it took at its clips (``norms``)."""

    checks: OracleChecks | None
    norms: dict[str, ClipNorm]

    def _checks(self) -> OracleChecks:
        if self.checks is None:
            raise RuntimeError("this oracle has no checks attached: make it with ctx.oracle(...), or attach them "
                               "with harness.rank.judging.checks.checked(oracle)")
        return self.checks

    def check_grads(self, step: MicroStep | int, models: Mapping[str, nn.Module]) -> None:
        """Compare every parameter's gradient on this rank with the oracle's (after a backward)."""
        self._checks().grads(step, models)

    def check_params(self, step: MicroStep | int, models: Mapping[str, nn.Module],
                     optimizers: Mapping[str, Any] | None = None) -> None:
        """Compare every parameter's update since the last optimizer step with the oracle's, and
        with rank 0's copy (after ``step``). ``optimizers``: the case's own, by model name (one
        optimizer or a list), whose state the oracle adopts after a mismatch."""
        self._checks().params(step, models, optimizers)

    def check_grad_norm(self, step: MicroStep | int, norms: Mapping[str, Any]) -> None:
        """Compare the total norm the library reported for each model (by name: what
        ``accelerator.clip_grad_norm_`` returned, a tensor, a DTensor or a number) with the oracle's at
        its last ``clip_grad_norm``, before the clip."""
        for name, reported in norms.items():
            if name not in self.norms:
                raise ValueError(f"check_grad_norm: no oracle.clip_grad_norm for {name!r} before it")
            self._checks().grad_norm(step, name, as_float(reported), self.norms[name])

    def check_sync_flag(self, step: MicroStep, flag: bool) -> None:
        """Compare ``accelerator.sync_gradients`` with the schedule."""
        self._checks().sync_flag(step, flag)

    def check_lr(self, step: MicroStep | int, optimizers: Mapping[str, Any]) -> None:
        """Compare each optimizer's learning rates with the oracle's schedulers' (``optimizers`` by
        model name, one optimizer or a list)."""
        self._checks().lr(step, optimizers)


def as_float(value: Any) -> float:
    """A reported norm as a number: a DTensor's full value (a replicated norm is the same on every
    rank; a Partial one is reduced), a tensor's item, or the number itself."""
    full = getattr(value, "full_tensor", None)
    if callable(full):
        value = full()
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def refuse_unequal_models(collectives: Collectives, replicas: Mapping[str, nn.Module]) -> None:
    """The replicas start from this rank's models; DDP starts from rank 0's. A model built
    differently on each rank (``MyNet()`` under a per-rank seed) would fail every rank but 0
    with no visible cause, so it is refused here, on every rank, with the remedy."""
    # every rank learns which ranks differ, and says the same
    ranks = collectives.same_everywhere(p for r in replicas.values() for p in r.parameters())
    if ranks:
        names = ", ".join(repr(n) for n in replicas)
        raise ValueError(
            f"the models ({names}) do not have the same weights on every rank when the oracle is made "
            f"({'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} "
            f"{'differ' if len(ranks) > 1 else 'differs'} from rank 0); "
            "DDP would start every rank from rank 0's weights and the oracle from each rank's own. "
            "Build each model with ctx.model(YourModel, ...) (seeded the same on every rank), and make "
            "the oracle before accelerator.prepare"
        )


def replicate(models: Mapping[str, nn.Module], mesh: Any) -> dict[str, nn.Module]:
    """A copy of each user's module, out of its wrapper; under a tensor-parallel mesh, its layers split
    as the mesh splits them."""
    replicas = {name: copy.deepcopy(unwrap(m)) for name, m in models.items()}
    if mesh is not None and mesh.size("tp") > 1:
        from harness.wrappers.mesh import split_like_tensor_parallel

        for replica in replicas.values():
            split_like_tensor_parallel(replica, mesh.size("tp"))
    return replicas


def round_through(params: Mapping[str, Mapping[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Each parameter rounded to ``dtype`` and back, in place."""
    with torch.no_grad():
        for ps in params.values():
            for p in ps.values():
                p.copy_(p.to(dtype))
