"""The oracle as its checks see it (harness/rank/judging/checks.py): what the contract expects of the rank
now, and how the oracle carries on from the rank's real state after each check. A part ``Oracle``
(harness/rank/oracle/core.py) composes, on the state it holds (harness/rank/oracle/state.py); kept
apart from the contract's arithmetic step by step because the two change for different reasons."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from harness.rank.numerics.closeness import Expectation, rounding_allowance
from harness.rank.numerics.collectives import Reduction
from harness.rank.oracle.replica import as_optimizers
from harness.rank.oracle.state import OraclePart
from harness.wrappers.sharding import dtensor_class

if TYPE_CHECKING:
    from harness.rank.numerics.collectives import Collectives
    from harness.rank.oracle.schedule import MicroStep
    from harness.rank.oracle.sharded_reduce import ShardedReduce
    from harness.rank.oracle.state import OracleState
    from harness.rank.oracle.weighting import TokenWeighting


class Anchoring(OraclePart):
    """What the oracle shows its checks, and how they anchor it (the ``adopt_*`` methods): a part of
    ``Oracle``, on the state it holds (``OracleState``), through its collectives."""

    def __init__(self, state: OracleState, params: Mapping[str, Mapping[str, torch.Tensor]], *,
                 collectives: Collectives, weighting: TokenWeighting, sharded_reduce: ShardedReduce | None,
                 optimizers: Mapping[str, tuple[torch.optim.Optimizer, ...]],
                 more_checks: Callable[[MicroStep | int], bool] | None) -> None:
        super().__init__(state, params, collectives=collectives, weighting=weighting, sharded_reduce=sharded_reduce)
        self.optimizers = optimizers
        # ``more_checks(step)``: whether another check surely follows this step's: rank 0's copies then
        # wait for the next all-reduce (harness/rank/numerics/collectives.py), and whoever made the oracle
        # calls ``finish`` when the case ends (RankContext does); without it each is sent at once
        self.more_checks = more_checks

    # collectives and what the contract expects now (read by harness/rank/judging/checks.py)

    def rank0_copy(self, step: MicroStep | int, name: str, actual_params: Mapping[str, torch.Tensor],
                   deliver: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Rank 0's copy of the model's parameters as they are now (DDP keeps every rank's equal to
        it), given to ``deliver`` by name: with the oracle's next all-reduce when another check
        surely follows ``step``'s, else now."""
        wait = self.more_checks is not None and self.more_checks(step)
        self.collectives.later({p: actual_params[p] for p in self.params[name]}, deliver,  # type: ignore[arg-type]
                               wait=wait)

    def rank0_params(self, actual_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0's copy of the parameters as they are now: ``actual_params`` themselves where every
        rank's digests match rank 0's (a small collective), else rank 0's (a broadcast)."""
        return self.collectives.rank0_values(actual_params)  # type: ignore[return-value]

    def finish(self) -> None:
        """The case has ended: judge the checks still waiting for rank 0's copies (a collective when
        any wait). Every rank calls it, after the case returned."""
        self.collectives.finish()

    def expected_grads(self, name: str) -> dict[str, Expectation]:
        """What the rank's gradients must be now: under FSDP in bf16 the gradient held plus what
        accumulated since the last sync (FSDP1 shows the latter between syncs; none after one)."""
        pending = self.sharded_reduce.pending[name] if self.sharded_reduce is not None else {}
        allowed = self.state.allowance_of(name)
        out = {}
        for pname, p in self.params[name].items():
            value = p.grad if p.grad is not None else torch.zeros_like(p)
            out[pname] = Expectation(value + pending[pname] if pname in pending else value, allowed[pname])
        return out

    def local_grads(self, name: str) -> dict[str, Expectation]:
        """This rank's own gradients since the window began: what a backward that did not sync leaves."""
        return {pname: Expectation(t.clone(), rounding_allowance(t)) for pname, t in self.state.local_of(name).items()}

    def synced_grads(self, name: str) -> dict[str, Expectation]:
        """The all-rank average of the local gradients: what a sync now would leave (a collective,
        unless a sync's average made it already; ``prepare_synced`` makes several models' in one)."""
        self.prepare_synced([name])
        return self.state.models[name].synced  # type: ignore[return-value]

    def prepare_synced(self, names: Iterable[str]) -> None:
        """The synced hypotheses of ``names``, those not made yet in one all-reduce."""
        models = self.state.models
        wanted = [name for name in dict.fromkeys(names) if models[name].synced is None]
        if wanted:
            reduced = self.collectives.reduce_all([Reduction(self.state.local_of(name)) for name in wanted])
            for name, synced in zip(wanted, reduced):
                models[name].synced = synced  # type: ignore[assignment]

    def previous_grad(self, name: str, pname: str) -> Expectation | None:
        """The last window's final gradient, which a missed zero_grad would leave behind."""
        return self.state.params(name)[pname].previous

    def forget_previous(self, name: str) -> None:
        """The rank cleared ``name``'s gradients after the step: nothing of the last window can linger in
        them, so its gradient need not be kept for a diagnosis."""
        for state in self.state.params(name).values():
            state.previous = None

    # carrying on from the rank's real state (when: harness/rank/judging/checks.py)

    def adopt_params(self, name: str, values: Mapping[str, torch.Tensor]) -> None:
        """The rank's parameters (whole), by name."""
        with torch.no_grad():
            for pname, replica_param in self.params[name].items():
                replica_param.copy_(values[pname].detach())

    def adopt_grads(self, name: str, grads: Mapping[str, torch.Tensor | None]) -> None:
        """The rank's gradients (whole), by name, with nothing left to allow for."""
        for pname, replica_param in self.params[name].items():
            grad = grads.get(pname)
            if grad is not None and grad.shape != replica_param.shape:
                # only this rank's shard is shown (FSDP1 after a sync the schedule did not expect,
                # reported as synced_early): the whole gradient cannot be read without a collective
                # the other ranks may not make, so the replica keeps its own
                continue
            unsynced = not self.state.last_sync or grad is not None and grad.dtype != replica_param.dtype
            if self.sharded_reduce is not None and grad is not None and unsynced:
                # FSDP1 and ZeRO-1 in bf16 show what they hold since the last sync between syncs (and
                # where one was due but did not happen): FSDP1 its unsharded gradient, ZeRO-1 param.grad
                # (bf16) or BF16_Optimizer's fp32 sum
                self.sharded_reduce.adopt(name, pname, grad)
                continue
            replica_param.grad = None  # the oracle's own goes before the copy is made
            replica_param.grad = None if grad is None else grad.detach().clone()
        self.state.reset_allowance(name)
        self.weighting.clear(name)

    def restart_window(self, name: str, grads: Mapping[str, torch.Tensor | None]) -> None:
        """After a mismatch: a rank that cleared its gradients starts its next window here."""
        model = self.state.models[name]
        for pname, grad in grads.items():
            if pname in model.params and (grad is None or not bool(grad.any())):
                model.params[pname].local = None
                model.params[pname].reusable = False
                model.synced = None

    def adopt_optimizer_state(self, name: str, optimizers: Any) -> None:
        """The case's optimizer state (moments, step counts), after a parameter mismatch:
        ``optimizers`` is one optimizer or several, in the order of the oracle's for that model."""
        for mine, theirs in zip(self.optimizers.get(name, ()), as_optimizers(optimizers)):
            state = theirs.state_dict()
            if not isinstance(state, dict) or set(state) != {"state", "param_groups"} or not _same_shapes(mine, state):
                # not a torch optimizer's state of whole tensors (DeepSpeed's ZeRO optimizer keeps its
                # own flat partitions; FSDP2's moments are DTensor shards, FSDP1's of its flat
                # parameters): there is nothing to adopt, and later steps are judged against the
                # oracle's own state
                continue
            mine.load_state_dict(copy.deepcopy(state))

    def end_step(self) -> None:
        """The parameters were checked: the next check judges the next optimizer step."""
        for model in self.state.models.values():
            for state in model.params.values():
                state.before_step = None
        self.state.stepped = False

    def before_step(self, name: str) -> dict[str, torch.Tensor] | None:
        """``name``'s parameters before the last ``step``, by name; None where no step came since the
        last parameter check."""
        befores = {pname: state.before_step for pname, state in self.state.params(name).items()}
        return None if any(before is None for before in befores.values()) else befores  # type: ignore[return-value]


def _same_shapes(mine: torch.optim.Optimizer, state: dict[str, Any]) -> bool:
    """Whether every tensor of the state another optimizer saved is a plain tensor of the shape of the
    parameter it belongs to in ``mine`` (or a scalar, a step count), in groups of ``mine``'s sizes: what
    ``load_state_dict`` can take (the torch optimizer inside ZeRO's holds one flat partition a group)."""
    dtensor = dtensor_class()
    params = [p for group in mine.param_groups for p in group["params"]]
    if [len(g["params"]) for g in state["param_groups"]] != [len(g["params"]) for g in mine.param_groups]:
        return False
    for index, entries in state["state"].items():
        if not isinstance(index, int) or index >= len(params):
            return False
        for value in entries.values():
            if dtensor is not None and isinstance(value, dtensor):
                return False
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                return False
    return True
