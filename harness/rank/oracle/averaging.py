"""The oracle's sync (a part ``Oracle``, harness/rank/oracle/core.py, composes): every rank's gradients
averaged by an explicit all-reduce, with their allowances, into the state the oracle holds
(harness/rank/oracle/state.py). A small model's sync is averaged when its backward ends; a large
model's under DDP is left pending for the gradient check that follows, which makes it as it judges the
rank's gradients (harness/rank/numerics/fused_check.py). Kept apart from the contract's steps (core.py)
and from what the checks read (anchoring.py): the reductions change with the wrappers' arithmetic, not
with the API."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Iterable, Mapping

import torch

from harness.rank.numerics.closeness import CHUNK, Expectation, rounding_allowance
from harness.rank.numerics.collectives import Collectives, Reduction
from harness.rank.numerics.fused_check import FusedOutcome, check_synced, fusable
from harness.rank.numerics.ring_order import all_reduce_order_holds, flat_segments
from harness.rank.oracle.state import Notes, OraclePart
from harness.wrappers import sharding

if TYPE_CHECKING:
    from harness.rank.oracle.sharded_reduce import ShardedReduce
    from harness.rank.oracle.state import OracleState
    from harness.rank.oracle.weighting import TokenWeighting
    from harness.wrappers.cell import CellConfig

FUSED_FROM_VARIABLE = "GRADSYNC_HARNESS_FUSED_FROM"


class Averaging(OraclePart):
    """How the oracle averages its gradients at a sync (a part of ``Oracle``, which calls ``average``
    after a backward that syncs): on the gradients and allowances it holds (``OracleState``), through
    its collectives, noting in its recorder what it could not check exactly."""

    # a model of this many elements or more is checked at a sync as it is averaged
    # (harness/rank/numerics/fused_check.py); the variable FUSED_FROM_VARIABLE overrides it for a run
    # (tests: 0, the pass on the catalogue's small models)
    FUSED_FROM = CHUNK

    def __init__(self, state: OracleState, params: Mapping[str, Mapping[str, torch.Tensor]], config: CellConfig, *,
                 collectives: Collectives, recorder: Notes, weighting: TokenWeighting, sharded_reduce: ShardedReduce | None,
                 user_models: Mapping[str, torch.nn.Module], scaled: bool) -> None:
        super().__init__(state, params, collectives=collectives, weighting=weighting, sharded_reduce=sharded_reduce)
        self.recorder = recorder
        # the user's modules, which prepare wraps: how their wrapper reduces is read off it at a sync
        # (DDP's buckets, harness/wrappers/sharding.py)
        self.user_models = user_models
        # the cell's wrapper, world size and mesh (harness/wrappers/cell.py) say how the sync reduces
        self.world_size = config.world_size
        self.spec = config.spec  # the wrapper's (harness/wrappers/registry.py): whether it shards
        self.mesh = config.mesh
        self.scaled = scaled  # fp16's gradient scaler scales the loss

    # the sync

    def average(self) -> None:
        """Every model's gradients averaged, and the average of its local gradients (the synced
        hypothesis a check asks for next), in one all-reduce; for a large model under DDP, left for
        the gradient check that follows to make as it judges (harness/rank/numerics/fused_check.py)."""
        if self.sharded_reduce is not None:
            self._average_pending()
            return
        if self._fusable():
            for model in self.state.models.values():
                model.pending = True
            return
        self._average_now(list(self.params))

    def _fusable(self) -> bool:
        return (self.world_size > 1 and self.mesh is None and not self.spec.sharded and not self.scaled
                and sum(p.numel() for ps in self.params.values() for p in ps.values())
                >= int(os.environ.get(FUSED_FROM_VARIABLE, self.FUSED_FROM))
                and all(fusable(ps) for ps in self.params.values()))

    def settle(self, names: Iterable[str] | None = None) -> None:
        """Make the averages still pending (of ``names``, default every model's) as a small model's
        are made (every rank calls it at the same point: it is a collective)."""
        models, asked = self.state.models, None if names is None else set(names)  # once: names may be a generator
        wanted = [name for name in self.params if models[name].pending and (asked is None or name in asked)]
        if wanted:
            for name in wanted:
                models[name].pending = False
            self._average_now(wanted)

    def _average_now(self, names: list[str]) -> None:
        for name in names:
            for p in self.params[name].values():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        ordered = self._reduction_orders(names)
        reductions = []
        for name in names:
            ps = self.params[name]
            # (the sharded wrappers, which reduce each sync's gradients apart and add them to those they
            # hold, are reduced as they reduce: ``_average_pending``)
            reductions += [Reduction({pname: p.grad for pname, p in ps.items()}, self.state.allowance_of(name),
                                     reproduced=name in ordered),
                           Reduction(self.state.local_of(name))]
        reduced = self.collectives.reduce_all(reductions)
        self._reproduce(ordered, {name: reduced[2 * index] for index, name in enumerate(names)})
        for index, name in enumerate(names):
            model = self.state.models[name]
            average, model.synced = reduced[2 * index], reduced[2 * index + 1]  # type: ignore[assignment]
            for pname, state in model.params.items():
                state.param.grad = average[pname].value
                state.allowed = average[pname].allowed

    def _reduction_orders(self, names: list[str]) -> dict[str, tuple[bool, dict[str, torch.Tensor]] | None]:
        """The models among ``names`` whose sync under DDP the oracle reproduces bit for bit, leaving
        nothing to allow for the reduction: each with whether DDP multiplied the gradients by 1/N (True)
        or divided them by N, and the ring segment gloo sums each gradient element in (from the buffer
        DDP put it in: ``sharding.ddp_reduce_layout``, confirmed by ``all_reduce_order_holds``); or None
        at one or two ranks, where the plain average is DDP's already (one rank: nothing to add; two:
        each gradient halved exactly, two terms summed, one rounding in either order). Where DDP's order
        or arithmetic is not known, its reduction is judged within the bound (harness/rank/numerics/closeness.py)
        and the cell says why (``NOT CHECKED: exact reduction order``). The sharded wrappers reduce as
        harness/rank/oracle/sharded_reduce.py reproduces them (``_average_pending``); a mesh is FSDP2's. A
        collective where it probes the order (once per process): every rank calls it alike."""
        if self.spec.sharded or self.mesh is not None:
            return {}
        if self.world_size == 1:
            return {name: None for name in names}
        # a model whose inputs are known only within their allowance (two token seeds): the order
        # reproduced on inputs that differ may round apart, by up to the bound (``uncertain``)
        dtypes = sorted({p.dtype for name in names for p in self.params[name].values()}, key=str)
        names = [name for name in names if not self.state.models[name].uncertain]
        ordered: dict[str, tuple[bool, dict[str, torch.Tensor]] | None] = {}
        why = ""
        if self.world_size > 2:
            why = next((w for w in (all_reduce_order_holds(self.world_size, d) for d in dtypes) if w), "")
        for name in names if not why else []:
            read = sharding.ddp_reduce_layout(self.user_models[name], self.world_size)
            if isinstance(read, str):
                why = why or f"{name!r}: {read}"
                continue
            layout, scales = read
            outside = [p for p, t in self.params[name].items() if p not in layout and t.requires_grad]
            if layout and outside:
                why = why or f"{name!r}: {outside[0]!r} is in no bucket of DDP's"
                continue
            # a frozen parameter is in no bucket: its gradient is zero on every rank, in any order
            ordered[name] = None if not layout else (scales, {
                pname: flat_segments([layout[pname][:2]], layout[pname][2], self.world_size)[0] if pname in layout
                else torch.zeros(t.numel(), dtype=torch.long) for pname, t in self.params[name].items()})
        if why:
            self.recorder.unchecked["exact reduction order"] = why
        return ordered

    def _fused_reproduced(self, name: str) -> bool:
        """Whether the fused pass's plain all-reduce makes DDP's average of a large model bit for bit:
        at one or two ranks, where DDP reduces in its buckets (``sharding.ddp_reduce_layout``: no
        communication hook). From three ranks on, the pass does not gather every rank's gradients (a
        model's worth each), and its reduction is judged within the bound; the cell says so."""
        if self.world_size == 1:
            return True
        if self.state.models[name].uncertain:  # inputs known only within their allowance: the bound
            return False
        read = sharding.ddp_reduce_layout(self.user_models[name], self.world_size) if self.world_size == 2 else (
            "a large model's average is made by the fused pass's all-reduce, in an order not reproduced "
            "from three ranks on (harness/rank/numerics/fused_check.py)")
        if isinstance(read, str):
            self.recorder.unchecked["exact reduction order"] = f"{name!r}: {read}"
            return False
        return True

    def _reproduce(self, ordered: Mapping[str, tuple[bool, Mapping[str, torch.Tensor]] | None],
                   averages: Mapping[str, dict[str, Expectation]]) -> None:
        """The averages of the models ``_reduction_orders`` gave segments for, made again in DDP's order
        (every rank's gradient multiplied by 1/N in its dtype, or divided by N, and summed down the ring:
        one all-gather a dtype and way), in place of the plain average in ``averages``; their allowance
        stays what ``reduce_all`` made with no reduction bound: the carried allowances, averaged, and the
        floor."""
        groups: dict[tuple[torch.dtype, bool], tuple[dict, dict]] = {}
        for name, order in ordered.items():
            if order is None:
                continue
            scales, segments = order
            for pname, p in self.params[name].items():
                grads, places = groups.setdefault((p.grad.dtype, scales), ({}, {}))
                grads[(name, pname)], places[(name, pname)] = p.grad, segments[pname]
        for (dtype, scales) in sorted(groups, key=str):
            grads, places = groups[(dtype, scales)]
            exact = self.collectives.ring_average(grads, places, dtype, pre=float(self.world_size), post=1.0,
                                                  pre_scales=scales)
            for (name, pname), expectation in exact.items():
                average = averages[name][pname]
                averages[name][pname] = Expectation(expectation.value, average.allowed)

    def _average_pending(self) -> None:
        """FSDP and DeepSpeed (fp32 and bf16): what accumulated since the last sync, reduced as the wrapper
        reduces it (harness/rank/oracle/sharded_reduce.py), added to the gradient the last sync left as the
        wrapper adds it to the gradient it holds (FSDP in fp32, DeepSpeed in bf16): the same add, so
        nothing more to allow. Where the window ran backwards with two token seeds (``uncertain``),
        each rank carries an allowance of its own into the sync: the average holds their average, the
        wrapper's sum of inputs that differ within them is judged within its bound (ShardedReduce), and
        the add to the gradient held within one rounding more."""
        names = list(self.params)
        uncertain = self.state.any_uncertain()
        reductions = [Reduction(self.state.local_of(name)) for name in names]
        if uncertain:
            reductions += [Reduction(self.state.allowance_of(name)) for name in names]
        reduced = self.collectives.reduce_all(reductions)
        averaged, why = self.sharded_reduce.average(uncertain=uncertain)  # type: ignore[union-attr]
        if why:
            self.recorder.unchecked["exact reduction order"] = why
        self.recorder.defects.update(self.sharded_reduce.defects)  # type: ignore[union-attr]
        for index, name in enumerate(self.params):
            model = self.state.models[name]
            model.synced = reduced[index]  # type: ignore[assignment]
            carried = reduced[len(names) + index] if uncertain else None
            self.state.allowance_of(name)
            for pname, state in model.params.items():
                p = state.param
                base = p.grad if p.grad is not None else torch.zeros_like(p)
                average = averaged[(name, pname)]
                p.grad = self.sharded_reduce.held(base, average.value)  # type: ignore[union-attr]
                if carried is None:
                    state.allowed = state.allowed + average.allowed
                else:  # and the add to the gradient held, of an average known within its allowance, may
                    # round apart (by an ulp of the held dtype: fp32 under FSDP, DeepSpeed's own)
                    state.allowed = (carried[pname].value + average.allowed + rounding_allowance(
                        p.grad, dtype=self.sharded_reduce.held_dtype(p.grad.dtype)))  # type: ignore[union-attr]

    def fused_grads(self, name: str, actual: Mapping[str, torch.Tensor]) -> FusedOutcome:
        """A large model's sync made as its gradient check judges the rank's ``actual`` gradients
        (harness/rank/numerics/fused_check.py). Where every rank's passed, the oracle carries on from the rank's
        gradients, adopted into the average's tensors; where any rank's failed, the average is made
        as a small model's is, for the check to run as it always does (every rank does either)."""
        ps, model = self.params[name], self.state.models[name]
        states = model.params
        outcome = check_synced(self.collectives, params=ps, grads={p: t.grad for p, t in ps.items()},
                               carried={p: s.allowed for p, s in states.items()},
                               rounded={p for p, s in states.items() if s.rounded},
                               local={p: s.local for p, s in states.items()}, actual=actual,
                               reproduced=self._fused_reproduced(name))
        model.pending = False
        if not outcome.passed:
            model.pending = True
            self.settle([name])
            return dataclasses.replace(outcome, average={})
        for pname, replica_param in ps.items():
            grad, average = actual[pname], outcome.average[pname]
            replica_param.grad = None if grad is None else average if outcome.same else average.copy_(grad.detach())
        self.state.reset_allowance(name)
        self.weighting.clear(name)
        # the local gradients are the oracle's own now (p.grad holds the adopted ones): the step may reuse them
        for state in states.values():
            if state.local is not None:
                state.reusable = True
        return outcome
