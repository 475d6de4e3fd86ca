"""The oracle's sync (a part of ``Oracle``, harness/rank/oracle/core.py): every rank's gradients averaged by
an explicit all-reduce, with their allowances, and the gradients and allowances the oracle holds
between syncs. A small model's sync is averaged when its backward ends; a large model's under DDP is
left pending for the gradient check that follows, which makes it as it judges the rank's gradients
(harness/rank/numerics/fused_check.py). Kept apart from the contract's steps (oracle.py) and from what the
checks read (anchoring.py): the reductions change with the wrappers' arithmetic, not with the API."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from harness.rank.numerics.closeness import CHUNK, Expectation, no_allowance, rounding_allowance
from harness.rank.numerics.collectives import Collectives, Reduction
from harness.rank.numerics.fused_check import FusedOutcome, check_synced, fusable
from harness.rank.numerics.ring_order import all_reduce_order_holds, flat_segments
from harness.wrappers import sharding

if TYPE_CHECKING:
    from harness.rank.oracle.interfaces import Notes
    from harness.rank.oracle.sharded_reduce import ShardedReduce
    from harness.rank.oracle.weighting import TokenWeighting
    from harness.wrappers.names import WrapperSpec

FUSED_FROM_VARIABLE = "GRADSYNC_HARNESS_FUSED_FROM"


class Averaging:
    """How ``Oracle`` averages its gradients at a sync, and holds them and their allowances between."""

    # a model of this many elements or more is checked at a sync as it is averaged
    # (harness/rank/numerics/fused_check.py); the variable FUSED_FROM_VARIABLE overrides it for a run
    # (tests: 0, the pass on the catalogue's small models)
    FUSED_FROM = CHUNK

    # the oracle's state (harness/rank/oracle/core.py, Oracle.__init__)
    params: dict[str, dict[str, torch.Tensor]]
    user_models: dict[str, torch.nn.Module]
    local: dict[str, dict[str, torch.Tensor | None]]
    allowed: dict[str, dict[str, torch.Tensor]]
    rounded: set[tuple[str, str]]
    uncertain: set[str]
    sharded: ShardedReduce | None
    collectives: Collectives
    weighting: TokenWeighting
    recorder: Notes
    world_size: int
    mesh: Any
    spec: WrapperSpec
    scaler: Any
    pending: set[str]
    reusable_local: set[tuple[str, str]]
    _synced: dict[str, dict[str, Expectation]]

    # the gradients held, and their allowances

    def _no_allowance(self, name: str) -> dict[str, torch.Tensor]:
        self.uncertain.discard(name)
        for pname in self.params[name]:
            self.rounded.discard((name, pname))
        return {p: no_allowance(t.dtype) for p, t in self.params[name].items()}

    def allowance_of(self, name: str) -> dict[str, torch.Tensor]:
        """Each replica gradient's allowance, by parameter, made whole where it was held as its 0-dim
        part and p.grad's rounding (``rounded``)."""
        for pname in self.params[name]:
            self._materialize(name, pname)
        return self.allowed[name]

    def _materialize(self, name: str, pname: str) -> None:
        if (name, pname) in self.rounded:
            self.rounded.discard((name, pname))
            self.allowed[name][pname] = self.allowed[name][pname] + rounding_allowance(self.params[name][pname].grad)

    def local_of(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's own gradients of ``name`` since the window began, a zero one made whole."""
        return {p: torch.zeros_like(self.params[name][p]) if t is None else t for p, t in self.local[name].items()}

    def _part_local(self, name: str | None = None) -> None:
        """Give every local gradient that is its replica's p.grad a tensor of its own, before p.grad
        changes in place (a clip, the gradient scaler)."""
        for model in [name] if name is not None else list(self.params):
            for pname, p in self.params[model].items():
                local = self.local[model][pname]
                if local is not None and local is p.grad:
                    self.local[model][pname] = local.clone()

    # the sync

    def _average_grads(self) -> None:
        """Every model's gradients averaged, and the average of its local gradients (the synced
        hypothesis a check asks for next), in one all-reduce; for a large model under DDP, left for
        the gradient check that follows to make as it judges (harness/rank/numerics/fused_check.py)."""
        if self.sharded is not None:
            self._average_pending()
            return
        if self._fusable():
            self.pending = set(self.params)
            return
        self._average_now(list(self.params))

    def _fusable(self) -> bool:
        return (self.world_size > 1 and self.mesh is None and not self.spec.sharded and self.scaler is None
                and sum(p.numel() for ps in self.params.values() for p in ps.values())
                >= int(os.environ.get(FUSED_FROM_VARIABLE, self.FUSED_FROM))
                and all(fusable(ps) for ps in self.params.values()))

    def settle(self, names: Iterable[str] | None = None) -> None:
        """Make the averages still pending (of ``names``, default every model's) as a small model's
        are made (every rank calls it at the same point: it is a collective)."""
        wanted = [name for name in self.params if name in self.pending and (names is None or name in set(names))]
        if wanted:
            self.pending.difference_update(wanted)
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
            reductions += [Reduction({pname: p.grad for pname, p in ps.items()}, self.allowance_of(name),
                                     reproduced=name in ordered),
                           Reduction(self.local_of(name))]
        reduced = self.collectives.reduce_all(reductions)
        self._reproduce(ordered, {name: reduced[2 * index] for index, name in enumerate(names)})
        for index, name in enumerate(names):
            average, self._synced[name] = reduced[2 * index], reduced[2 * index + 1]  # type: ignore[assignment]
            for pname, p in self.params[name].items():
                p.grad = average[pname].value
                self.allowed[name][pname] = average[pname].allowed

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
        names = [name for name in names if name not in self.uncertain]
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
        if name in self.uncertain:  # inputs known only within their allowance: the bound
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
        uncertain = bool(self.uncertain)
        reductions = [Reduction(self.local_of(name)) for name in names]
        if uncertain:
            reductions += [Reduction(self.allowance_of(name)) for name in names]
        reduced = self.collectives.reduce_all(reductions)
        averaged, why = self.sharded.average(uncertain=uncertain)  # type: ignore[union-attr]
        if why:
            self.recorder.unchecked["exact reduction order"] = why
        self.recorder.defects.update(self.sharded.defects)  # type: ignore[union-attr]
        for index, (name, ps) in enumerate(self.params.items()):
            self._synced[name] = reduced[index]  # type: ignore[assignment]
            carried = reduced[len(names) + index] if uncertain else None
            self.allowance_of(name)
            for pname, p in ps.items():
                base = p.grad if p.grad is not None else torch.zeros_like(p)
                average = averaged[(name, pname)]
                p.grad = self.sharded.held(base, average.value)  # type: ignore[union-attr]
                if carried is None:
                    self.allowed[name][pname] = self.allowed[name][pname] + average.allowed
                else:  # and the add to the gradient held, of an average known within its allowance, may
                    # round apart (by an ulp of the held dtype: fp32 under FSDP, DeepSpeed's own)
                    self.allowed[name][pname] = (carried[pname].value + average.allowed + rounding_allowance(
                        p.grad, dtype=self.sharded.held_dtype(p.grad.dtype)))  # type: ignore[union-attr]

    def fused_grads(self, name: str, actual: Mapping[str, torch.Tensor]) -> FusedOutcome:
        """A large model's sync made as its gradient check judges the rank's ``actual`` gradients
        (harness/rank/numerics/fused_check.py). Where every rank's passed, the oracle carries on from the rank's
        gradients, adopted into the average's tensors; where any rank's failed, the average is made
        as a small model's is, for the check to run as it always does (every rank does either)."""
        ps = self.params[name]
        outcome = check_synced(self.collectives, params=ps, grads={p: t.grad for p, t in ps.items()},
                               carried=self.allowed[name], rounded={p for p in ps if (name, p) in self.rounded},
                               local=self.local[name], actual=actual, reproduced=self._fused_reproduced(name))
        self.pending.discard(name)
        if not outcome.passed:
            self.pending.add(name)
            self.settle([name])
            return dataclasses.replace(outcome, average={})
        for pname, replica_param in ps.items():
            grad, average = actual[pname], outcome.average[pname]
            replica_param.grad = None if grad is None else average if outcome.same else average.copy_(grad.detach())
        self.allowed[name] = self._no_allowance(name)
        self.weighting.clear(name)
        # the local gradients are the oracle's own now (p.grad holds the adopted ones): the step may reuse them
        self.reusable_local.update((name, p) for p in ps if self.local[name][p] is not None)
        return outcome
