"""What a case sees on its rank: who it is, accelerate, models and data built alike on every rank,
the schedule, and the oracle. ``RankContext`` is public API (docs/writing-a-case.md)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, ContextManager, Hashable, Iterable, Iterator, Mapping

import torch
from torch import nn

from harness.decorator import SkipCell
from harness.rank.judging.checks import checked
from harness.rank.judging.recorder import Recorder
from harness.rank.models import derive_seed, seeded
from harness.rank.numerics.accounting import Accounting
from harness.rank.oracle.core import Oracle
from harness.rank.oracle.interfaces import ModelOptimizers, OptimizerFactory, SchedulerFactory
from harness.rank.oracle.schedule import Accumulation, MicroStep, Windows, accumulation_schedule
from harness.rank.rank_data import RankData
from harness.rank.watch import LoopRefused
from harness.rank.watch.loop import Watch
from harness.wrappers import prepare
from harness.wrappers import probe
from harness.wrappers.cell import CellConfig
from harness.wrappers.registry import WrapperSpec

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class RankContext(RankData):
    """Handed to a case body on every rank of a cell.

    Attributes: ``case`` (the case name), ``variant_name`` (e.g. ``steps=2-bf16``), ``variant`` (its
    parameters, a dict), ``precision`` (``fp32``, ``bf16`` or ``fp16``), ``wrapper`` (``ddp``,
    ``fsdp2``, ...: harness/wrappers/registry.py), ``compile`` (a ``torch.compile`` backend, or None),
    ``rank``, ``world_size``, ``seed`` (the run's base seed) and ``device`` (this rank's
    ``torch.device``); under a mesh (``mesh=`` in the variant), ``mesh`` (its shape:
    harness/wrappers/mesh.py; None without one), ``data_rank`` and ``data_world`` (the data shard this
    rank draws and how many there are: tensor- and context-parallel peers draw the same; without a
    mesh, ``rank`` and ``world_size``). ``config``: all of the cell's configuration at once, frozen
    (harness/wrappers/cell.py), which ``precision``, ``wrapper`` and ``mesh`` read.
    """

    def __init__(
        self,
        *,
        case: str,
        variant: str,
        params: Mapping[str, Any],
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
    ) -> None:
        self.case = case
        self.variant_name = variant
        self.variant = dict(params)
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.device = device
        # the cell's precision, wrapper and its dtype policy (the spec's ``mixed_axis``, harness/wrappers/registry.py),
        # and device mesh (``mesh=`` in the variant: harness/wrappers/mesh.py), None without one
        self.config = CellConfig.of_variant(variant, self.variant, rank=rank, world_size=world_size)
        self.compile = self.variant.get("compile")  # a torch.compile backend, e.g. aot_eager
        # the data shard this rank draws and how many there are (tensor- and context-parallel peers draw one)
        mesh = self.config.mesh
        self.data_rank = self.config.data_rank
        self.data_world = mesh.data_shards if mesh else world_size
        self.recorder = Recorder(rank=rank)
        self.accounting = Accounting()
        self.accumulation: Accumulation | None = None
        self._made: Any = None  # the last Accelerator ctx.accelerator made
        self._scaler_kwargs: dict[str, Any] = {}
        self._oracles: list[Oracle] = []
        self.made_schedules = Windows()  # the schedules made here: their last micro-step, their windows' lengths
        self.at_step = 0  # the micro-step ``epochs`` last gave the case (where a raise happened)

    @property
    def spec(self) -> WrapperSpec:
        """The spec of the cell's wrapper (harness/wrappers/registry.py): how it reduces, what it casts."""
        return self.config.spec

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def wrapper(self) -> str:
        return self.config.wrapper

    @property
    def mesh(self) -> Any:
        return self.config.mesh

    # what the installed accelerate offers (harness/wrappers/probe.py): the API, or Unsupported naming it

    def require(self, owner: Any, attribute: str, api: str | None = None) -> Any:
        """``getattr(owner, attribute)``, or ``Unsupported`` naming the API when it is missing: the
        cell is then ``unsupported`` rather than an error (find APIs by asking, never by version)."""
        return probe.require(owner, attribute, api)

    def require_parameter(self, function: Any, parameter: str, api: str) -> None:
        """``Unsupported`` naming the API when ``function`` does not take ``parameter``."""
        probe.require_parameter(function, parameter, api)

    def skip(self, reason: str) -> None:
        """End the cell as ``skip`` with ``reason``: it does not apply here (every rank must agree)."""
        raise SkipCell(reason)

    # accelerate

    def accelerator(self, **kwargs: Any) -> Any:
        """An ``Accelerator`` on this rank's device with the variant's mixed precision; ``kwargs`` go
        to ``Accelerator`` as they are.

        Its accumulation settings (``gradient_accumulation_steps=``, or the plugin made by
        ``gradient_accumulation``) are remembered: ``oracle`` and ``schedule`` take them from here,
        so they are given once. Under fp16 a cell where accelerate makes no gradient scaler (it runs
        fp16 only on an accelerator device, not on CPU) is ``skip``, saying so.

        The cell's wrapper (``wrapper=`` in the variant) and compile backend (``compile=``) are
        asked of accelerate here: its FSDP or DeepSpeed plugin, its ``dynamo_backend``. Each
        ``accelerator.backward`` is watched for the collectives it issues (harness/rank/numerics/accounting.py)."""
        from accelerate import Accelerator

        kwargs = self.accelerator_arguments(kwargs)
        return self.adopt_accelerator(kwargs, lambda: Accelerator(**kwargs))

    def accelerator_arguments(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``kwargs`` with what the cell asks of the Accelerator: the variant's precision and this
        rank's device where they are not given, the wrapper's plugin, the compile backend; the
        accumulation settings remembered."""
        from accelerate import Accelerator

        kwargs = dict(kwargs)
        kwargs.setdefault("mixed_precision", MIXED_PRECISION[self.precision])
        kwargs.setdefault("cpu", self.device.type == "cpu")
        self.accumulation = _accumulation_of(kwargs)
        self.config = config = replace(self.config, num_steps=self.accumulation.num_steps)
        self._scaler_kwargs = _scaler_kwargs_of(kwargs)
        kwargs.update(prepare.accelerator_kwargs(config, kwargs, device_type=self.device.type))
        if self.compile is not None:
            self.require_parameter(Accelerator, "dynamo_backend", "Accelerator(dynamo_backend=...)")
            kwargs.setdefault("dynamo_backend", self.compile)
        return kwargs

    def adopt_accelerator(self, kwargs: Mapping[str, Any], construct: Callable[[], Any]) -> Any:
        """The Accelerator ``construct`` makes of ``kwargs`` (from ``accelerator_arguments``; a watched
        script's own Accelerator, harness/rank/script/run.py), made the cell's: what accelerate cannot run here is ``skip``, and its backwards are watched."""
        try:
            accelerator = construct()
        except ValueError as exc:
            if kwargs["mixed_precision"] == "fp16" and "fp16" in str(exc):
                self.skip(f"accelerate refuses fp16 on {self.device.type}: {exc}")
            if self.spec.family == "deepspeed":
                self._no_deepspeed_here(exc)
            raise
        except (AttributeError, KeyError, AssertionError, RuntimeError, ImportError, TypeError) as exc:
            if self.spec.family == "deepspeed":
                self._no_deepspeed_here(exc)
            raise
        if kwargs["mixed_precision"] == "fp16" and getattr(accelerator, "scaler", None) is None:
            self.skip(f"accelerate makes no fp16 gradient scaler on {self.device.type} "
                      "(it runs fp16 mixed precision on an accelerator device only)")
        prepare.after_construction(self.wrapper, accelerator, kwargs, self.mesh)
        self.accounting.watch(accelerator)
        self._made = accelerator
        return accelerator

    def _no_deepspeed_here(self, exc: Exception) -> None:
        """An Accelerator that cannot even be built for DeepSpeed on this device (before any training:
        old releases' DeepSpeed path calls ``torch.cuda.set_device`` on a CPU host, or reads config
        keys their own plugin left out; before 1.1 ZeRO-3's ``HfDeepSpeedConfig`` comes from a
        transformers that requires accelerate >= 1.1) is a wrapper this release cannot run here:
        ``skip``, naming it."""
        import accelerate

        words = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        self.skip(f"wrapper={self.wrapper} cannot run here: accelerate {accelerate.__version__} cannot build "
                  f"an Accelerator for DeepSpeed on {self.device.type} ({type(exc).__name__}: {words})")

    def gradient_accumulation(self, num_steps: int, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments for ``GradientAccumulationPlugin(num_steps=..., **options)``
        (e.g. ``sync_each_batch=True``), or ``Unsupported`` naming the plugin or the option that the
        installed accelerate lacks."""
        return probe.gradient_accumulation_kwargs(num_steps, **options)

    def dataloader_options(self, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments for dataloader options (``split_batches``,
        ``dispatch_batches``), or ``Unsupported`` when the installed accelerate takes neither form."""
        return probe.dataloader_kwargs(**options)

    def ddp_options(self, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments that hand ``options`` to DistributedDataParallel."""
        return probe.ddp_kwargs(**options)

    # randomness in the forward

    def replay_rng(self, key: Hashable) -> ContextManager[None]:
        """Run the block under an RNG state fixed by ``key`` (a ``MicroStep``, a step number, any
        label) and by this rank, cell and seed; ``oracle.backward(..., rng=key)`` runs the oracle's
        forward under the same state, so dropout draws the same masks on both sides. Each rank's
        state differs, as each rank's dropout does in training. The RNG state outside the block is
        left as it was."""
        label = key.index if isinstance(key, MicroStep) else key
        seed = derive_seed(self.seed, self.case, self.variant_name, "rng", self.rank, label)
        return seeded(seed, self.device)

    # the oracle and its schedule

    def oracle(
        self,
        models: Mapping[str, nn.Module],
        *,
        num_steps: int | None = None,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        optimizers: ModelOptimizers | Mapping[str, ModelOptimizers] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_steps: int = 1,
        contract: str = "accelerate",
    ) -> Oracle:
        """Replicas of ``models`` (by name) as they are now: call before ``accelerator.prepare``.
        Every rank's models must have the same weights (build them with ``model``).

        ``num_steps``: the accumulation steps, taken from ``accelerator`` when not given; under an
        Accelerator of one step, those of a loop that accumulates by hand.
        ``optimizers``: your own factory, called with a replica (``make_optimizers(model)``, returning
        one optimizer or a list), or one per model name; ``optimizer``: instead, a factory called with
        the replica's parameters (``lambda params: torch.optim.SGD(params, lr=0.1)``).
        ``scheduler``: called with each of the oracle's optimizers; ``scheduler_steps``: how many
        times the schedulers advance at each optimizer step.
        ``contract``: what a window's gradient must be. ``"accelerate"`` (the default): each backward's
        loss divided by the accumulation steps, as ``Accelerator.backward`` documents, in a short window
        too (the dataloader ended first). ``"full_batch"``: the mean over the micro-batches the window
        really had, as one batch of all of them would give, so a short last window weighs its samples
        as a full one does; the windows come from the schedule the case iterates with ``epochs`` or
        ``windows``, and a window weighed otherwise is ``misweighted``, with the weights."""
        return self.oracle_for(models, num_steps=self._steps(num_steps),
                            optimizer=optimizer, optimizers=optimizers, scheduler=scheduler,
                            scheduler_steps=scheduler_steps, contract=contract, replay_rng=self.replay_rng)

    def oracle_for(self, models: Mapping[str, nn.Module], *, num_steps: int, contract: str, replay_rng: Any,
                   **options: Any) -> Oracle:
        """The oracle of ``oracle``, ``watch`` and a watched script: the accumulation steps resolved, its
        contract, and the RNG replay of the case's forwards (``replay_rng`` keys, or the watch's states
        of the loop's); ``options`` as for ``Oracle``."""
        scaler = self._scaler_kwargs if self.precision == "fp16" else None
        oracle = checked(Oracle(
            models,
            replace(self.config, num_steps=num_steps, contract=contract),
            recorder=self.recorder,
            replay_rng=replay_rng,
            scaler_kwargs=scaler,
            more_checks=self.made_schedules.more_after,
            window_length=self._current_window_length,
            **options,
        ), self.accounting)
        self._oracles.append(oracle)
        return oracle

    def watch(
        self,
        accelerator: Any,
        models: nn.Module | Mapping[str, nn.Module],
        *,
        loss: Callable[[Any, Any], torch.Tensor],
        optimizers: ModelOptimizers | Mapping[str, ModelOptimizers] | None = None,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_steps: int = 1,
        clip_grad_norm: float | None = None,
        num_steps: int | None = None,
        contract: str = "accelerate",
    ) -> Watch:
        """Check a training loop as it is: ``with ctx.watch(accelerator, model, loss=loss_fn, ...):``
        around the call of your own training function, which gets ``accelerator`` (and ``model``) and
        prepares, iterates, backs and steps as it always does (harness/rank/watch/loop.py).

        The specification: ``loss(model, batch)`` (with several models, ``loss(models_by_name, batch)``):
        the loss of one micro-batch, before any division by the accumulation steps, computed by the
        oracle on its replicas from a copy of each batch the loop drew; ``optimizers``/``optimizer``,
        ``scheduler``, ``scheduler_steps`` and ``contract`` as for ``oracle``; ``clip_grad_norm``: the
        norm the gradients are clipped to before each optimizer step (the loop's
        ``accelerator.clip_grad_norm_`` is then checked too; a loop that clips without it is refused);
        ``num_steps``: for a loop that accumulates by hand (``no_sync``) under an Accelerator of one
        step, the micro-batches of its windows (otherwise the Accelerator's). The dropout of the
        loop's forwards is replayed for the oracle's without ``replay_rng``.

        Call it with the models as ``model`` built them, before anything is prepared. What cannot be
        inferred from the loop's calls is refused in one line (``LoopRefused``): a backward with no
        batch drawn from a prepared dataloader, a window's batches backed in another order than drawn,
        a second Accelerator, a model or optimizer the specification does not name."""
        if accelerator is not self._made or self.accumulation is None:
            raise LoopRefused("ctx.watch: give it the Accelerator ctx.accelerator(...) made (the harness watches "
                              "what each backward issues, and the cell's wrapper and precision are set there)")
        if any(getattr(accelerator, f"_{kind}", None) for kind in ("models", "optimizers", "dataloaders")):
            raise LoopRefused("ctx.watch: the Accelerator has prepared objects already; call ctx.watch before "
                              "accelerator.prepare (the oracle's replicas are copies of the models as built)")
        named = {"model": models} if isinstance(models, nn.Module) else dict(models)
        steps = self._steps(num_steps)
        return Watch(self, accelerator, named, loss=loss, clip_grad_norm=clip_grad_norm,
                     scheduler=scheduler is not None, num_steps=steps,
                     oracle=lambda replay: self.oracle_for(
                         named, num_steps=steps, optimizer=optimizer, optimizers=optimizers, scheduler=scheduler,
                         scheduler_steps=scheduler_steps, contract=contract, replay_rng=replay))

    def _current_window_length(self) -> int:
        """The micro-batches of the window of the micro-step ``epochs`` last gave the case."""
        if self.at_step not in self.made_schedules.lengths:
            raise ValueError("contract='full_batch' weighs each window by the micro-batches it has, from the "
                             "schedule: make it with ctx.schedule(...) and iterate with ctx.epochs(loader, schedule) "
                             "or ctx.windows(loader, schedule)")
        return self.made_schedules.lengths[self.at_step]

    def finish(self) -> None:
        """After the case returned, on every rank: the checks its oracles still hold for rank 0's
        copies are judged (harness/rank/numerics/collectives.py). The harness calls it; a case never needs to."""
        for oracle in self._oracles:
            oracle.finish()

    def schedule(
        self,
        batches_per_epoch: int | list[int],
        *,
        epochs: int,
        num_steps: int | None = None,
        sync_with_dataloader: bool | None = None,
        sync_each_batch: bool | None = None,
    ) -> list[MicroStep]:
        """The micro-steps the accumulation contract gives for ``epochs`` epochs of
        ``batches_per_epoch`` batches: where gradients must sync and the optimizer must step
        (``harness.rank.oracle.schedule.accumulation_schedule``). The accumulation settings come from
        ``accelerator`` when not given."""
        given = self.accumulation_settings()
        schedule = accumulation_schedule(
            batches_per_epoch,
            epochs=epochs,
            num_steps=self._steps(num_steps),
            sync_with_dataloader=self._given_once("sync_with_dataloader", sync_with_dataloader,
                                                  given.sync_with_dataloader),
            sync_each_batch=self._given_once("sync_each_batch", sync_each_batch, given.sync_each_batch),
        )
        self.made_schedules.add(schedule)
        return schedule

    def accumulation_settings(self) -> Accumulation:
        """The accumulation settings of the cell's Accelerator (accelerate's defaults before one is made)."""
        return self.accumulation if self.accumulation is not None else Accumulation()

    def _steps(self, num_steps: int | None) -> int:
        """The accumulation steps: the Accelerator's, or ``num_steps`` where it has one step (a loop that
        accumulates by hand); a different count given beside an Accelerator of several is refused."""
        configured = self.accumulation_settings().num_steps
        return num_steps if num_steps is not None and configured == 1 else self._given_once(
            "num_steps", num_steps, configured)

    def _given_once(self, what: str, value: Any, configured: Any) -> Any:
        if value is None:
            return configured
        if self.accumulation is not None and value != configured:
            raise ValueError(f"{what}={value!r} here, but the Accelerator was given {what}={configured!r}; "
                             "give it once, to ctx.accelerator")
        return value

    def epochs(self, loader: Iterable[Any], schedule: list[MicroStep]) -> Iterator[tuple[MicroStep, Any]]:
        """Iterate ``loader`` once per epoch of ``schedule``, pairing each batch with its micro-step.

        A dataloader that yields more or fewer batches than the contract says is a failure of kind
        ``schedule``; the extra batches are not run."""
        epochs = max((p.epoch for p in schedule), default=-1) + 1
        points = iter(schedule)
        for epoch in range(epochs):
            expected = sum(1 for p in schedule if p.epoch == epoch)
            seen = 0
            for batch in self.batches(loader, expected, what="the prepared dataloader", epoch=epoch):
                seen += 1
                self.at_step = (point := next(points)).index
                yield point, batch
            for _ in range(expected - seen):
                next(points, None)

    def windows(self, loader: Iterable[Any], schedule: list[MicroStep]) -> Iterator[list[tuple[MicroStep, Any]]]:
        """``epochs``, one accumulation window at a time: the micro-steps up to each optimizer step of
        ``schedule``, with their batches, all taken from ``loader`` before the window's first
        backward, as a loop that normalises by the window's token count must (it counts them first).

        The prepared dataloader says it has ended once it has yielded its last batch, and
        ``accumulate`` syncs every micro-batch from then on: take the last window of an epoch ahead
        and its micro-batches all sync, which the checks report. The schedule gives the windows."""
        window: list[tuple[MicroStep, Any]] = []
        for point, batch in self.epochs(loader, schedule):
            window.append((point, batch))
            if point.optimizer_step:
                yield window
                window = []
        if window:
            yield window

    def batches(self, loader: Iterable[Any], expected: int, *, what: str, epoch: int = 0) -> Iterator[Any]:
        """Iterate ``loader`` to its end, yielding at most ``expected`` batches; a different count is a
        failure of kind ``schedule`` (the loader is still exhausted, as a user's loop would)."""
        seen = 0
        for batch in loader:
            seen += 1
            if seen <= expected:
                yield batch
        self.recorder.batch_count(what=what, epoch=epoch, seen=seen, expected=expected)


def _accumulation_of(kwargs: Mapping[str, Any]) -> Accumulation:
    """What the Accelerator's keyword arguments say of accumulation (a plugin wins, as in accelerate)."""
    plugin = kwargs.get("gradient_accumulation_plugin")
    if plugin is not None:
        return Accumulation(
            num_steps=int(plugin.num_steps),
            sync_with_dataloader=bool(getattr(plugin, "sync_with_dataloader", True)),
            sync_each_batch=bool(getattr(plugin, "sync_each_batch", False)),
        )
    return Accumulation(num_steps=int(kwargs.get("gradient_accumulation_steps", 1)))


def _scaler_kwargs_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A ``GradScalerKwargs`` handler's settings, for the oracle's own gradient scaler."""
    for handler in kwargs.get("kwargs_handlers") or ():
        if type(handler).__name__ == "GradScalerKwargs":
            with contextlib.suppress(Exception):
                return dict(handler.to_kwargs())
    return {}
