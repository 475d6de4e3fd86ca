"""The oracle: plain replicas that compute, from the documented contract alone, what every rank must hold."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Hashable, Iterable, Mapping

import torch
from torch import nn

from harness.rank.numerics.closeness import Expectation, norm_rounding, rounding_allowance
from harness.rank.numerics.collectives import Collectives, flat
from harness.rank.oracle.anchoring import Anchoring
from harness.rank.oracle.averaging import Averaging
from harness.rank.oracle.interfaces import (
    CheckCalls,
    ClipNorm,
    ModelOptimizers,
    OptimizerFactory,
    OracleChecks,
    RngReplay,
    SchedulerFactory,
    make_optimizers,
    refuse_options,
    refuse_unequal_models,
    replicate,
    round_through,
)
from harness.rank.oracle.replica import autocast_of, forward_as, gradients, unsharded_grads
from harness.rank.oracle.schedule import MicroStep
from harness.rank.oracle.sharded_reduce import SHARDED_PRECISIONS, ShardedReduce
from harness.rank.oracle.state import Notes, OracleState
from harness.rank.oracle.weighting import TokenWeighting, token_seeds
from harness.wrappers.cell import CellConfig
from harness.wrappers.prepared import unwrap


class Oracle(CheckCalls):
    """Replicas of the user's models, with no DDP and no accelerate, on this rank.

    The case tells the oracle each micro-batch (as a closure over the replicas) and whether the
    contract of the API it used says that backward must average across ranks; the oracle then
    averages with an explicit ``all_reduce(SUM) / world_size``. It never reads accelerate's state.

    Each replica gradient carries its allowance (harness/rank/numerics/closeness.py): how far the rank's may
    legitimately be from it. What it holds between calls is ``state`` (harness/rank/oracle/state.py: one
    ``ParamState`` a parameter); its parts act on it: ``averaging`` makes a sync's average
    (harness/rank/oracle/averaging.py) and ``anchoring`` shows the checks what the rank must hold and
    carries the oracle on from the rank's real state after each check (harness/rank/oracle/anchoring.py).
    The checks a case calls are judged in harness/rank/judging/checks.py, which reads the oracle through
    ``JudgedOracle`` (harness/rank/judging/oracle_view.py).
    """

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        config: CellConfig,
        *,
        recorder: Notes,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        optimizers: ModelOptimizers | Mapping[str, ModelOptimizers] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_steps: int = 1,
        replay_rng: RngReplay | None = None,
        scaler_kwargs: Mapping[str, Any] | None = None,
        more_checks: Callable[[MicroStep | int], bool] | None = None,
        window_length: Callable[[], int] | None = None,
        weights: Mapping[str, nn.Module] | None = None,
    ) -> None:
        """``config``: the cell's (harness/wrappers/cell.py): its precision, wrapper and dtype policy,
        mesh, accumulation steps, contract, rank and world size. ``more_checks(step)``: whether another
        check surely follows this step's: rank 0's copies then wait for the next all-reduce
        (harness/rank/numerics/collectives.py), and whoever made the oracle calls ``finish`` when the case
        ends (RankContext does); without it each is sent at once. ``window_length``: under
        ``contract="full_batch"``, how many micro-batches the window of the backward being run has.
        ``weights``: the models to copy where ``models`` no longer hold their whole weights (a script's
        models sharded in place by prepare: harness/rank/script/run.py)."""
        refuse_options(models, precision=config.precision,
                       both_optimizers=optimizer is not None and optimizers is not None, num_steps=config.num_steps,
                       contract=config.contract, window_length=window_length, scheduler_steps=scheduler_steps)
        self.config = config
        self.window_length = window_length
        self.spec = config.spec  # the wrapper's (harness/wrappers/registry.py): how it reduces, what it casts
        self.replay_rng = replay_rng
        self.collectives = Collectives(rank=config.rank, world_size=config.world_size)
        self.replicas = replicate(weights or models, config.mesh)
        refuse_unequal_models(self.collectives, self.replicas)
        self.models = forward_as(self.replicas, config.precision, sharded=self.spec.sharded_forward,
                                 reduce=config.reduce)
        self.params = {name: dict(r.named_parameters()) for name, r in self.replicas.items()}
        # FSDP2, FSDP1 and DeepSpeed in fp32 and bf16 (harness/rank/oracle/replica.py): each rank's unsharded gradients
        # since the last sync accumulate apart, as the wrapper accumulates them, and are reduced as it
        # reduces them; the result is added to the gradient held (harness/rank/oracle/sharded_reduce.py)
        # under a mesh (harness/wrappers/mesh.py) every rank's gradient is still the average over all
        # ranks: the ranks that average each other's are the data-parallel and context ones, and a
        # tensor-parallel peer draws the same batch as its rank, so its replica's gradient is the same
        # and the average over every rank is the average over the data-parallel ones (within the bound)
        self.sharded_reduce = (ShardedReduce(config, self.params, models, self.collectives)
                        if self.spec.sharded and config.precision in SHARDED_PRECISIONS else None)
        if self.sharded_reduce is not None and self.sharded_reduce.stage is not None:
            # DeepSpeed makes its fp32 masters from the module it cast to bf16: the weights' low bits go
            round_through(self.params, self.sharded_reduce.param_dtype)
        self.state = OracleState(self.params)
        self.norms: dict[str, ClipNorm] = {}  # each model's at the last clip_grad_norm, before it (check_grad_norm)
        # each model's optimizers, in the order the case's own factory makes them
        self.optimizers = make_optimizers(self.replicas, optimizer, optimizers)
        self.schedulers = [scheduler(opt) for opts in self.optimizers.values() for opt in opts] if scheduler else []
        self.scheduler_steps = scheduler_steps
        # fp16 as accelerate documents it: the loss scaled by a GradScaler in backward, the
        # gradients unscaled before a clip and by the prepared optimizer's step, which skips on inf
        self.scaler = self._grad_scaler(scaler_kwargs or {}) if config.precision == "fp16" else None
        self._unscaled = False  # this window's gradients were unscaled (by a clip)
        # token weighting (token_window), and the contributions the misweighted diagnosis refits
        mesh = config.mesh
        self.weighting = TokenWeighting(self.params, world_size=config.world_size, shards=None if mesh is None else [
            mesh.data_index(r) for r in range(config.world_size)])
        self.recorder = recorder
        self.averaging = Averaging(self.state, self.params, config, collectives=self.collectives, recorder=recorder,
                                   weighting=self.weighting, sharded_reduce=self.sharded_reduce,
                                   user_models={name: unwrap(m) for name, m in models.items()},
                                   scaled=self.scaler is not None)
        self.anchoring = Anchoring(self.state, self.params, collectives=self.collectives, weighting=self.weighting,
                                   sharded_reduce=self.sharded_reduce, optimizers=self.optimizers, more_checks=more_checks)
        # the checks of ``check_*``, attached by harness/rank/judging/checks.py (``checked``)
        self.checks: OracleChecks | None = None

    @property
    def wrapper(self) -> str:
        """The name of the wrapper the oracle models (``wrapper=``)."""
        return self.spec.name

    def _grad_scaler(self, kwargs: Mapping[str, Any]) -> Any:
        device_type = next(next(iter(self.replicas.values())).parameters()).device.type
        return torch.amp.GradScaler(device_type, **kwargs)

    # the contract, step by step

    def backward(self, closure: Callable[[dict[str, nn.Module]], torch.Tensor], *, sync: bool,
                 rng: Hashable | None = None) -> None:
        """Run one micro-batch's loss (scaled by 1/num_steps, as ``Accelerator.backward`` documents,
        and by the gradient scaler under fp16) into the replicas' gradients; average across ranks
        when the contract says this backward syncs. In a window weighed by tokens (``token_window``)
        the closure returns the sum of the micro-batch's token losses, scaled by world_size / N.
        Under ``contract="full_batch"`` the loss is scaled by 1/(the micro-batches of its window)
        instead, and the window's contributions are kept for the ``misweighted`` diagnosis.

        ``closure(models)`` computes the loss from the replicas (a dict by model name), the same way
        the case computed it from the prepared models. ``rng``: the key the case's forward ran under
        ``ctx.replay_rng(key)``; the closure runs under the same RNG state (the same dropout masks)."""
        self.averaging.settle()
        if self.sharded_reduce is not None:
            self._as_prepared()
        with self._replayed(rng):
            loss = closure(self.models)
        self.state.forget_synced()
        flat = [(name, pname, p) for name, ps in self.params.items() for pname, p in ps.items() if p.requires_grad]
        # the contributions a misweighted diagnosis refits: a token window's, any window's held to the
        # full-batch mean, and any window's of a model small enough (``refitted``)
        weighted = self.weighting.tokens is not None or self.config.contract == "full_batch"
        refitted = self.params if weighted else self.weighting.refitted
        loss, other = self._scaled(loss)
        parts: list[list[torch.Tensor]] = []
        if other is not None:  # the same on every rank (the window's global count): so is the set
            for model in self.state.models.values():
                model.uncertain = True
        if self.sharded_reduce is None:
            for name in refitted:  # what this backward adds to, on every rank alike
                self.weighting.hold(name, {pname: p.grad for pname, p in self.params[name].items()})
            grads = gradients(loss, flat, retain_graph=other is not None)
            others = gradients(other, flat) if other is not None else [None] * len(grads)
        else:  # the gradients of the unsharded parameters (bf16 ones upcast exactly), as the wrapper adds them
            keys = [(name, pname) for name, pname, _ in flat]
            parts = [[c.float() for c in cs] for cs in unsharded_grads(loss, self.models, keys,
                                                                       retain_graph=other is not None)]
            grads = [sum(cs[1:], cs[0]) if cs else None for cs in parts]
            others = ([sum(cs[1:], cs[0]) if cs else None for cs in unsharded_grads(other, self.models, keys)]
                      if other is not None else [None] * len(grads))
        self.state.backward_syncs.append((sync, sum(g.numel() for g in grads if g is not None)))
        for index, ((name, pname, p), g, g_other) in enumerate(zip(flat, grads, others)):
            if g is None:
                continue
            self._add(name, pname, g, g_other, parts[index] if parts else [])
            if name in refitted:
                self.weighting.add(name, pname, g.detach())
        if refitted:
            self.weighting.after_backward(sync=sync, models=refitted)
        if self.sharded_reduce is not None:
            why = self.sharded_reduce.after_backward({name: m.order for name, m in self.models.items()},
                                              uncertain=self.state.any_uncertain())
            if why:
                self.recorder.unchecked["exact reduction order"] = why
        self.state.last_sync = sync
        if sync:
            self.averaging.average()

    def _as_prepared(self) -> None:
        """Under FSDP and DeepSpeed: each replica's forward as the prepared model runs it now (its
        autocast, ZeRO-3's buffer dtypes), over the unsharded parameters."""
        for name, m in self.models.items():
            prepared = unwrap(self.sharded_reduce.models[name])  # type: ignore[union-attr]  # prepared by now
            m.autocast = autocast_of(prepared)
            if self.sharded_reduce.stage is not None:  # type: ignore[union-attr]
                m.buffer_dtypes = {n: b.dtype for n, b in prepared.named_buffers()}
                m.boundaries = self.sharded_reduce.stage == 3  # type: ignore[union-attr]  # ZeRO-3's module hooks
            m.unshard(self.sharded_reduce.flat_groups(name))  # type: ignore[union-attr]

    def _scaled(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's loss as the contract weighs it in its window (and the gradient scaler under
        fp16); and, where a token window's weight rounds two ways, the loss under the other."""
        other: torch.Tensor | None = None
        tokens = self.weighting.tokens
        if tokens is not None:
            # the token mean's weight, world_size / N, as the two documented loops round it (each
            # backward seeded exactly so); where they differ the oracle runs both and allows each
            # gradient element their difference
            seed, other_seed = token_seeds(self.config.world_size, tokens, self.config.num_steps, dtype=loss.dtype)
            if other_seed is not None:
                other = loss * other_seed.to(loss.device)
            loss = loss * seed.to(loss.device)
        elif self.config.contract == "full_batch":
            loss = loss / self.window_length()  # type: ignore[misc]
        else:
            loss = loss / self.config.num_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
            other = None if other is None else self.scaler.scale(other)
        return loss, other

    def _add(self, name: str, pname: str, g: torch.Tensor, g_other: torch.Tensor | None,
             parts: list[torch.Tensor]) -> None:
        """One backward's gradient ``g`` of a parameter added to the replica's and to this rank's own,
        with its allowance (``g_other``: the gradient under a token weight's other rounding; ``parts``:
        its contributions apart, as a sharded wrapper adds them)."""
        state = self.state.params(name)[pname]
        p = state.param
        if self.sharded_reduce is not None:
            # held apart until the sync; the sharded gradient (p.grad) is what the last sync left;
            # the rank's own since the window began, as the wrapper would hold it unsynced
            for part in [g] if self.sharded_reduce.adds_contributions_once else parts:
                self.sharded_reduce.add(name, pname, part)
                local = state.local
                state.local = self.sharded_reduce.round(part if local is None else local + part)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if g_other is not None:  # operands not the rank's bit for bit: so are the sums of them
                state.allowed = state.allowed + rounding_allowance(state.local)
        else:
            state.reusable = False
            state.materialize()  # of p.grad as it is, before this backward adds to it
            local, g = state.local, g.detach()
            grad = g if p.grad is None else p.grad + g
            # the local gradient is p.grad's own tensor while they hold the same (None: both zero)
            state.local = grad if local is p.grad else g if local is None else local + g
            p.grad = grad
            # (under FSDP and DeepSpeed the same kernels run on the same values: the same bits)
            if state.allowed.dim() == 0 and g_other is None:
                state.rounded = True  # the same for every element, plus p.grad's rounding
            else:
                state.allowed = state.allowed + rounding_allowance(p.grad)
        if g_other is not None:
            held = state.allowed
            state.allowed = held + (g.double() - g_other.detach().double()).abs().to(held.dtype)

    def token_window(self, labels: Iterable[torch.Tensor], *, ignore_index: int = -100) -> int:
        """Weigh the backwards of this accumulation window (until the next optimizer step) by tokens,
        and return the window's valid tokens on all ranks, N.

        ``labels``: the labels of this rank's micro-batches of the window (an element equal to
        ``ignore_index`` does not count). The oracle counts them, sums the counts over the ranks itself
        (one collective), and from then on takes each ``backward`` closure to return the SUM of its
        micro-batch's token losses: the gradient due at the sync is that of the global token mean,
        (1/N) times the sum of every valid token's loss of the window on every rank, whatever
        normalisation the case's own loop uses. Each rank's share before the average is
        world_size / N times its sums."""
        return self.weighting.begin(labels, ignore_index)

    def _replayed(self, key: Hashable | None) -> ContextManager[None]:
        if key is None:
            return contextlib.nullcontext()
        if self.replay_rng is None:
            raise ValueError("backward(rng=...) needs an oracle made by ctx.oracle(...), which knows the RNG to replay")
        return self.replay_rng(key)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, *, reciprocal: bool = False,
                       measured: torch.Tensor | float | None = None) -> dict[str, float]:
        """Clip each model's replica gradients, as ``clip_grad_norm_`` on synced gradients does;
        the total norm of each model's gradients before clipping. ``reciprocal``: by the coefficient
        DeepSpeed's optimizer step computes, ``1 / max(1, (norm + 1e-6) / max_norm)`` (ZeRO's
        ``unscale_and_clip_grads``), which rounds apart from torch's ``min(1, max_norm / (norm + 1e-6))``.
        ``measured`` (with ``reciprocal``; one model): the norm the rank's clip measured, where it is
        the oracle's within what a sum of the same squares in another order gives (the bound
        ``Checks.grad_norm`` holds it to): the oracle clips by it, as it carries on from a rank's
        gradients after a check, so that the parameters judge the gradient and not the order of the
        norm's sum; the coefficient is computed in its dtype, as ZeRO computes it from its norm (fp32
        under ZeRO-1/2, fp64 under ZeRO-3; a Python float, fp64). The norm returned and checked is
        still the oracle's own."""
        self.averaging.settle()
        self._unscale()
        self.state.part_local()  # the clip scales p.grad in place
        norms = {}
        for name, replica in self.replicas.items():
            ps = self.params[name]
            before = {pname: p.grad.detach().abs() for pname, p in ps.items() if p.grad is not None}
            numel = sum(g.numel() for g in before.values())
            # the gradients' dtype: of any that has one (a check may have adopted a rank that held none)
            dtype = next((p.grad.dtype for p in ps.values() if p.grad is not None), next(iter(ps.values())).dtype)
            # the norm is off by at most the norm of the allowances, and the coefficient with it; the
            # rank's norm sums the squares in another order (its shards, then across the ranks), which
            # rounds the coefficient apart by up to norm_rounding (harness/rank/numerics/closeness.py), where it clips
            carried = float(torch.linalg.vector_norm(flat(self.state.allowance_of(name).values()), norm_type))
            if reciprocal:
                total = torch.nn.utils.clip_grad_norm_(replica.parameters(), float("inf"), norm_type=norm_type)
                norm = float(total)
                clip = ClipNorm(norm, carried, numel, dtype)
                if measured is not None and abs(float(measured) - norm) <= clip.allowed:
                    total = (measured.detach().clone() if isinstance(measured, torch.Tensor)
                             else torch.tensor(measured, dtype=torch.float64))
                scale = 1.0 / torch.clamp((total + 1e-6) / max_norm, min=1.0)
                for p in replica.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale.to(p.grad.dtype))
            else:
                norm = float(torch.nn.utils.clip_grad_norm_(replica.parameters(), max_norm, norm_type=norm_type))
                clip = ClipNorm(norm, carried, numel, dtype)
            norms[name] = norm
            coefficient = min(1.0, max_norm / (norm + 1e-6))
            self.norms[name] = clip
            relative = carried / norm if norm > 0 else 0.0
            if coefficient < 1.0:
                relative += norm_rounding(numel, dtype)
            for pname, magnitude in before.items():
                state = self.state.params(name)[pname]
                state.allowed = (coefficient * (state.allowed + magnitude * relative)
                                 + rounding_allowance(state.param.grad))
        return norms

    def _before(self, name: str, pname: str, param: torch.Tensor, *, reuse: bool) -> torch.Tensor:
        """A copy of the parameter before the step: where the step ends the window, into its local
        gradient's own tensor when nothing else holds that (after a fused check)."""
        state = self.state.params(name)[pname]
        local = state.local
        if (reuse and state.reusable and local is not None and local.shape == param.shape
                and local.dtype == param.dtype):
            state.reusable = False
            state.local = None
            return local.copy_(param.detach())
        return param.detach().clone()

    def _unscale(self) -> None:
        """Under fp16: divide the gradients (and their allowances) by the scale, once per window, as
        ``unscale_gradients`` does before a clip; the scale is a power of two, so exactly."""
        if self.scaler is None or self._unscaled:
            return
        self.averaging.settle()
        inverse = 1.0 / float(self.scaler.get_scale())
        self.state.part_local()  # the scaler unscales p.grad in place
        for opts in self.optimizers.values():
            for optimizer in opts:
                self.scaler.unscale_(optimizer)
        for name, model in self.state.models.items():
            for pname, allowed in self.state.allowance_of(name).items():
                model.params[pname].allowed = allowed * inverse
            for state in model.params.values():
                if state.local is not None:
                    state.local.mul_(inverse)
        self.state.forget_synced()
        self._unscaled = True

    def step(self, point: MicroStep | bool) -> None:
        """At an optimizer step of the schedule: step, advance the schedulers, clear the gradients.

        Under fp16 each optimizer steps through the gradient scaler (skipped when a gradient is
        not finite) and the scale is updated after it, as a prepared optimizer's ``step`` does."""
        self.averaging.settle()
        due = point.optimizer_step if isinstance(point, MicroStep) else bool(point)
        self.state.stepped = due
        for name, ps in self.params.items():
            states = self.state.params(name)
            for pname, p in ps.items():
                states[pname].before_step = self._before(name, pname, p, reuse=due)
        if not due:
            return
        for opts in self.optimizers.values():
            for optimizer in opts:
                if self.scaler is not None:
                    self.scaler.step(optimizer)
                    self.scaler.update()
                else:
                    optimizer.step()
        self._unscaled = False
        for scheduler in self.schedulers:
            for _ in range(self.scheduler_steps):
                scheduler.step()
        # the window's last gradient, which a missed zero_grad would leave behind: p.grad's own tensors,
        # which the replicas let go of here (kept until a check shows the rank cleared its own)
        for name in self.params:
            self.state.allowance_of(name)
        for name, ps in self.params.items():
            for pname, t in ps.items():
                state = self.state.params(name)[pname]
                state.previous = Expectation(t.grad.detach() if t.grad is not None else torch.zeros_like(t),
                                             state.allowed)
        self.state.forget_synced()
        if self.sharded_reduce is not None:
            self.sharded_reduce.clear()
        for name, ps in self.params.items():
            for pname, p in ps.items():
                p.grad = None
                self.state.params(name)[pname].local = None
            self.state.reset_allowance(name)
        self.weighting.end()

    def finish(self) -> None:
        """The case has ended: judge the checks still waiting for rank 0's copies (a collective when
        any wait). Every rank calls it, after the case returned."""
        self.anchoring.finish()
