"""What a case sees on its rank: who it is, accelerate, seeded models and data, and the oracle."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from harness import probe
from harness.checks import Recorder, count_batches
from harness.decorator import SkipCell
from harness.models import derive_seed, make_model, rank_batch, regression_dataset
from harness.oracle import OptimizerFactory, Oracle, SchedulerFactory
from harness.schedule import MicroStep, accumulation_schedule, batches_per_rank, dispatched_batches_per_rank


class RankContext:
    """Handed to a case body on every rank of a cell."""

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
        self.precision = str(self.variant.get("precision", "fp32"))
        self.recorder = Recorder(rank=rank)

    # what the installed accelerate offers (harness/probe.py): the API, or Unsupported naming it

    def require(self, owner: Any, attribute: str, api: str | None = None) -> Any:
        """``getattr(owner, attribute)``, or ``Unsupported`` naming the API when it is missing."""
        return probe.require(owner, attribute, api)

    def require_parameter(self, function: Any, parameter: str, api: str) -> None:
        """``Unsupported`` naming the API when ``function`` does not take ``parameter``."""
        probe.require_parameter(function, parameter, api)

    def skip(self, reason: str) -> None:
        raise SkipCell(reason)

    # accelerate

    def accelerator(self, **kwargs: Any) -> Any:
        """An ``Accelerator`` on this rank's device with the variant's mixed precision."""
        from accelerate import Accelerator

        kwargs.setdefault("mixed_precision", "bf16" if self.precision == "bf16" else "no")
        kwargs.setdefault("cpu", self.device.type == "cpu")
        return Accelerator(**kwargs)

    def gradient_accumulation(self, num_steps: int, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments for ``GradientAccumulationPlugin(num_steps=..., **options)``,
        or ``Unsupported`` naming the plugin or the option that the installed accelerate lacks."""
        return probe.gradient_accumulation_kwargs(num_steps, **options)

    def dataloader_options(self, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments for dataloader options (``split_batches``,
        ``dispatch_batches``), or ``Unsupported`` when the installed accelerate takes neither form."""
        return probe.dataloader_kwargs(**options)

    def ddp_options(self, **options: Any) -> dict[str, Any]:
        """``Accelerator`` keyword arguments that hand ``options`` to DistributedDataParallel."""
        return probe.ddp_kwargs(**options)

    # models and data

    def model(self, kind: str, name: str | None = None) -> nn.Module:
        """A model with the same weights on every rank (DDP would broadcast rank 0's anyway; the
        oracle's replicas must start from them too)."""
        model = make_model(kind, derive_seed(self.seed, self.case, name or kind))
        return model.to(self.device)

    def batch(self, step: int, *, rows: int = 6, features: int = 4, label: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own inputs and targets for one step: different on every rank."""
        x, y = rank_batch(
            derive_seed(self.seed, self.case, self.variant_name, label, step, self.rank),
            self.rank, rows=rows, features=features,
        )
        return x.to(self.device), y.to(self.device)

    def dataset(
        self,
        *,
        batches: int,
        batch_size: int,
        features: int = 4,
        split_batches: bool = False,
        dispatch_batches: bool = False,
        samples: int | None = None,
        label: str = "data",
    ):
        """A dataset all ranks share, and how many batches each rank's prepared dataloader must yield.

        By default it is sized so that each rank gets ``batches`` batches and the last global batch is
        one sample short (the uneven end); ``samples`` sets the size instead. The expected count comes
        from the contract of the sharding (or, with ``dispatch_batches``, the dispatching) dataloader."""
        if split_batches and batch_size % self.world_size:
            # accelerate rejects this at prepare(): the cell does not apply at this world size
            self.skip(f"split_batches needs the batch size ({batch_size}) to be a multiple of the world size "
                      f"({self.world_size})")
        global_batch = batch_size if split_batches else batch_size * self.world_size
        if samples is None:
            samples = batches * global_batch - 1
        dataset = regression_dataset(derive_seed(self.seed, self.case, label), samples=samples, features=features)
        count = dispatched_batches_per_rank if dispatch_batches else batches_per_rank
        expected = count(samples, batch_size=batch_size, world_size=self.world_size, split_batches=split_batches)
        return dataset, expected

    # the oracle and its schedule

    def oracle(
        self,
        models: Mapping[str, nn.Module],
        *,
        num_steps: int = 1,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_steps: int = 1,
    ) -> Oracle:
        """Replicas of ``models`` as they are now: call before ``accelerator.prepare``.

        ``scheduler_steps``: how many times the schedulers advance at each optimizer step."""
        return Oracle(
            models,
            recorder=self.recorder,
            rank=self.rank,
            world_size=self.world_size,
            precision=self.precision,
            num_steps=num_steps,
            optimizer=optimizer,
            scheduler=scheduler,
            scheduler_steps=scheduler_steps,
        )

    schedule = staticmethod(accumulation_schedule)

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
                yield next(points), batch
            for _ in range(expected - seen):
                next(points, None)

    def batches(self, loader: Iterable[Any], expected: int, *, what: str, epoch: int = 0) -> Iterator[Any]:
        """Iterate ``loader`` to its end, yielding at most ``expected`` batches; a different count is a
        failure of kind ``schedule`` (the loader is still exhausted, as a user's loop would)."""
        return count_batches(self.recorder, loader, expected, what=what, epoch=epoch)
