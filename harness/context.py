"""What a case sees on its rank: who it is, accelerate, seeded models and data, and the oracle."""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from harness.catalogue import SkipCell, Unsupported
from harness.matrix import Failure
from harness.models import derive_seed, make_model, rank_batch, regression_dataset
from harness.oracle import OptimizerFactory, Oracle, Recorder, SchedulerFactory
from harness.schedule import MicroStep, accumulation_schedule, batches_per_rank


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

    # capabilities

    def require(self, owner: Any, attribute: str, api: str | None = None) -> Any:
        """``getattr(owner, attribute)``, or ``Unsupported`` naming the API when it is missing."""
        value = getattr(owner, attribute, None)
        if value is None:
            raise Unsupported(api or f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}")
        return value

    def require_parameter(self, function: Any, parameter: str, api: str) -> None:
        """``Unsupported`` naming the API when ``function`` does not take ``parameter``."""
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            return
        takes_var_keyword = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        if parameter not in signature.parameters and not takes_var_keyword:
            raise Unsupported(api)

    def skip(self, reason: str) -> None:
        raise SkipCell(reason)

    # accelerate

    def accelerator(self, **kwargs: Any) -> Any:
        """An ``Accelerator`` on this rank's device with the variant's mixed precision."""
        from accelerate import Accelerator

        kwargs.setdefault("mixed_precision", "bf16" if self.precision == "bf16" else "no")
        kwargs.setdefault("cpu", self.device.type == "cpu")
        return Accelerator(**kwargs)

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

    def dataset(self, *, batches: int, batch_size: int, features: int = 4, split_batches: bool = False):
        """A dataset all ranks share, sized so that each rank's prepared dataloader yields
        ``batches`` batches and the last global batch is one sample short (the uneven end)."""
        global_batch = batch_size if split_batches else batch_size * self.world_size
        samples = batches * global_batch - 1
        dataset = regression_dataset(derive_seed(self.seed, self.case, "data"), samples=samples, features=features)
        expected = batches_per_rank(samples, batch_size=batch_size, world_size=self.world_size, split_batches=split_batches)
        return dataset, expected

    # the oracle and its schedule

    def oracle(
        self,
        models: Mapping[str, nn.Module],
        *,
        num_steps: int = 1,
        optimizer: OptimizerFactory | Mapping[str, OptimizerFactory] | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> Oracle:
        """Replicas of ``models`` as they are now: call before ``accelerator.prepare``."""
        return Oracle(
            models,
            recorder=self.recorder,
            rank=self.rank,
            world_size=self.world_size,
            precision=self.precision,
            num_steps=num_steps,
            optimizer=optimizer,
            scheduler=scheduler,
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
            for batch in loader:
                seen += 1
                if seen > expected:
                    continue
                yield next(points), batch
            if seen != expected:
                self.recorder.add(
                    Failure(
                        rank=self.rank, step=0, model="dataloader", param="len", kind="schedule",
                        max_abs_diff=float(abs(seen - expected)), checked="schedule",
                        message=(
                            f"the prepared dataloader on rank {self.rank} yielded {seen} batches in epoch "
                            f"{epoch}, the contract says {expected}"
                        ),
                    )
                )
                for _ in range(expected - seen):
                    next(points, None)
