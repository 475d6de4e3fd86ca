"""What the oracle holds between the calls of a case (harness/rank/oracle/core.py): one parameter's
state in one object (``ParamState``, as FSDP2's ``FSDPParam`` holds one parameter's), one model's
(``ModelState``), and the whole of it with what the window so far did (``OracleState``), which the
oracle's contract steps, its sync (harness/rank/oracle/averaging.py) and its anchoring to the rank's
real state (harness/rank/oracle/anchoring.py) share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol

import torch

from harness.rank.numerics.closeness import Expectation, no_allowance, rounding_allowance

if TYPE_CHECKING:
    from harness.rank.numerics.collectives import Collectives
    from harness.rank.oracle.sharded_reduce import ShardedReduce
    from harness.rank.oracle.weighting import TokenWeighting


class ParamState:
    """One replica parameter's state: its own gradient since the window began, the allowance of its
    replica gradient, and what the last step left of it."""

    __slots__ = ("param", "local", "allowed", "rounded", "reusable", "previous", "before_step")

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        # this rank's own gradient since the window began; None is zero. Until a sync or a check's
        # adoption parts them it is the replica's p.grad itself, the same tensor (``local is
        # param.grad``): nothing changes either in place without parting them first (``part_local``)
        self.local: torch.Tensor | None = None
        # how far the replica gradient may legitimately be from the rank's (harness/rank/numerics/closeness.py)
        self.allowed: torch.Tensor = no_allowance(param.dtype)
        # the allowance is held as its 0-dim part plus ``rounding_allowance(param.grad)``, made whole
        # only when read (``OracleState.allowance_of``): after one backward from none, that is all of it,
        # and a model's worth less
        self.rounded = False
        # the local gradient a fused check left the oracle's own (p.grad holds the adopted one): the step
        # copies the parameter before it into it rather than into a tensor more
        self.reusable = False
        # the last window's final gradient, which a missed zero_grad would leave behind (None: none kept)
        self.previous: Expectation | None = None
        # the parameter before the last ``step``, until the parameter check that judges the step
        self.before_step: torch.Tensor | None = None

    def reset_allowance(self) -> None:
        """Nothing left to allow for (a fresh window, or the rank's gradient adopted)."""
        self.rounded = False
        self.allowed = no_allowance(self.param.dtype)

    def materialize(self) -> None:
        """The allowance made whole where it is held as its 0-dim part and p.grad's rounding."""
        if self.rounded:
            self.rounded = False
            self.allowed = self.allowed + rounding_allowance(self.param.grad)


class ModelState:
    """One model's state: its parameters', and what holds for the model as a whole."""

    __slots__ = ("params", "uncertain", "pending", "synced")

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = {pname: ParamState(p) for pname, p in params.items()}
        # whether its gradients since their allowances were last reset came of a backward run with two
        # seeds (a token window's weight, which the documented loops round apart): every rank's inputs
        # to a reduction are then known only within their allowance, so the reduction is judged within
        # its bound, not reproduced (harness/rank/oracle/averaging.py); cleared with the allowances
        self.uncertain = False
        # whether the next gradient check makes its sync's average (``Averaging.settle``)
        self.pending = False
        # the all-rank average of the local gradients as they are now: made with a sync's average, in
        # the same all-reduce, and forgotten (None) whenever a local gradient changes
        self.synced: dict[str, Expectation] | None = None


class OracleState:
    """What the oracle holds between the calls of a case, from none: each model's state by name, and
    the window's backwards and whether the last synced and the last step was due."""

    def __init__(self, params: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self.models = {name: ModelState(ps) for name, ps in params.items()}
        self.last_sync = False  # the last backward synced
        self.stepped = False  # the last ``step`` was an optimizer step (until the parameter check)
        # each backward since the last gradient check: whether it syncs, and how many gradient
        # elements it produced (what a sync must reduce; harness/rank/numerics/accounting.py)
        self.backward_syncs: list[tuple[bool, int]] = []

    def params(self, name: str) -> dict[str, ParamState]:
        """The states of ``name``'s parameters, by parameter name."""
        return self.models[name].params

    def reset_allowance(self, name: str) -> None:
        """Nothing left to allow for in ``name``'s gradients."""
        model = self.models[name]
        model.uncertain = False
        for state in model.params.values():
            state.reset_allowance()

    def allowance_of(self, name: str) -> dict[str, torch.Tensor]:
        """Each replica gradient's allowance, by parameter, made whole where it was held as its 0-dim
        part and p.grad's rounding (``ParamState.rounded``)."""
        states = self.params(name)
        for state in states.values():
            state.materialize()
        return {pname: state.allowed for pname, state in states.items()}

    def local_of(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's own gradients of ``name`` since the window began, a zero one made whole."""
        return {pname: torch.zeros_like(state.param) if state.local is None else state.local
                for pname, state in self.params(name).items()}

    def part_local(self, name: str | None = None) -> None:
        """Give every local gradient that is its replica's p.grad a tensor of its own, before p.grad
        changes in place (a clip, the gradient scaler)."""
        for model in [name] if name is not None else list(self.models):
            for state in self.params(model).values():
                if state.local is not None and state.local is state.param.grad:
                    state.local = state.local.clone()

    def forget_synced(self) -> None:
        """Every model's synced hypothesis goes (a local gradient changed)."""
        for model in self.models.values():
            model.synced = None

    def any_uncertain(self) -> bool:
        return any(model.uncertain for model in self.models.values())

    def take_backward_syncs(self) -> list[tuple[bool, int]]:
        """The backwards since the last gradient check (``backward_syncs``), the list started anew."""
        syncs, self.backward_syncs = self.backward_syncs, []
        return syncs


class Notes(Protocol):
    """Where the oracle says what it could not check exactly, and the backend's defects its
    reductions went through: the cell's recorder (harness/rank/judging/recorder.py)."""

    unchecked: dict[str, str]
    defects: set[str]


class OraclePart:
    """A part of the oracle (its sync, its anchoring): what it acts on, shared with the oracle itself:
    its state, the replicas' parameters (by model and name), its collectives, its token weights, and
    under FSDP and DeepSpeed the wrapper's reduction it reproduces (None under DDP)."""

    def __init__(self, state: OracleState, params: Mapping[str, Mapping[str, torch.Tensor]], *,
                 collectives: Collectives, weighting: TokenWeighting, sharded_reduce: ShardedReduce | None) -> None:
        self.state = state
        self.params = params
        self.collectives = collectives
        self.weighting = weighting
        self.sharded_reduce = sharded_reduce
