"""The models and data a case builds through its ``RankContext`` (harness/rank/context.py): the same
weights on every rank, each rank's own batches (each data shard's, under a mesh), the harness's own
datasets, and how many batches each rank's prepared dataloader must yield. Part of ``RankContext``'s
public API (docs/writing-a-case.md)."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from harness.rank.models import derive_seed, make_model, rank_batch, regression_dataset, seeded
from harness.rank.oracle.schedule import batches_per_rank, dispatched_batches_per_rank

ModelT = TypeVar("ModelT", bound=nn.Module)


class RankData:
    """``RankContext``'s models and data: it sets ``seed``, ``case``, ``variant_name``, ``device``,
    ``world_size``, ``mesh``, ``data_rank`` and ``data_world``, and ``skip``s."""

    seed: int
    case: str
    variant_name: str
    device: torch.device
    world_size: int
    mesh: Any
    data_rank: int
    data_world: int

    def skip(self, reason: str) -> None:  # RankContext's
        raise NotImplementedError

    # models and data

    def model(self, factory: Callable[..., ModelT] | str, *args: Any, name: str | None = None,
              **kwargs: Any) -> ModelT:
        """``factory(*args, **kwargs)`` (your model's class or any function that builds it) with the
        same weights on every rank, moved to this rank's device.

        The RNG is seeded from the run's seed, the case and ``name`` (default: the factory's name)
        while it builds, so every rank builds the same weights, as DDP and the oracle's replicas
        both need; two models of one class in a case need two names. A string names one of the
        harness's own toy models (``regressor``, ``generator``, ...)."""
        if isinstance(factory, str):
            if args or kwargs:
                raise TypeError(f"ctx.model({factory!r}): a toy model takes no arguments (name= names it)")
            model: Any = make_model(factory, derive_seed(self.seed, self.case, name or factory))
        else:
            label = name or getattr(factory, "__qualname__", None) or type(factory).__name__
            with seeded(derive_seed(self.seed, self.case, "model", label), self.device):
                model = factory(*args, **kwargs)
            if not isinstance(model, nn.Module):
                raise TypeError(f"ctx.model({label}): the factory returned {type(model).__name__}, not a torch.nn.Module")
        return model.to(self.device)

    def batch(self, step: int, *, rows: int = 6, features: int = 4, label: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own inputs and targets for one step: different on every rank (under a mesh, on
        every data shard: tensor- and context-parallel peers get the same, as from accelerate's dataloader)."""
        x, y = rank_batch(
            derive_seed(self.seed, self.case, self.variant_name, label, step, self.data_rank),
            self.data_rank, rows=rows, features=features,
        )
        return x.to(self.device), y.to(self.device)

    def dataloader(self, dataset: Dataset, *, batch_size: int, drop_last: bool = False, split_batches: bool = False,
                   dispatch_batches: bool = False, **loader_kwargs: Any) -> tuple[DataLoader, int]:
        """A ``DataLoader`` over your own map-style dataset (give it to ``accelerator.prepare``), and
        how many batches each rank's prepared dataloader must yield per epoch, from the contract of
        accelerate's sharding (or, with ``dispatch_batches``, dispatching) with ``even_batches``.

        ``split_batches``/``dispatch_batches`` must be what the Accelerator was given
        (``dataloader_options``); ``loader_kwargs`` go to ``DataLoader`` (``shuffle``, ``collate_fn``,
        ...). A yield of another length is a failure of kind ``schedule`` in ``epochs``."""
        expected = self.expected_batches(len(dataset), batch_size,  # type: ignore[arg-type]
                                         split_batches=split_batches, dispatch_batches=dispatch_batches,
                                         drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, drop_last=drop_last, **loader_kwargs), expected

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
    ) -> tuple[Dataset, int]:
        """The harness's own regression dataset, shared by all ranks, and how many batches each
        rank's prepared dataloader must yield.

        By default it is sized so that each rank gets ``batches`` batches and the last global batch is
        one sample short (the uneven end); ``samples`` sets the size instead."""
        samples, expected = self._sized(batches, batch_size, split_batches=split_batches,
                                        dispatch_batches=dispatch_batches, samples=samples)
        dataset = regression_dataset(derive_seed(self.seed, self.case, label), samples=samples, features=features)
        return dataset, expected

    def token_dataset(self, *, batches: int, batch_size: int, max_len: int = 12, causal: bool = False,
                      label: str = "tokens") -> tuple[Dataset, int]:
        """The harness's own token dataset (harness/rank/tokens.py: sequences of 2 to ``max_len`` tokens
        with their prompts and, once padded by ``harness.rank.tokens.pad_tokens``, their padding labelled
        -100), shared by all ranks, and how many batches each rank's prepared dataloader must yield.
        Sized as ``dataset``: ``batches`` per rank, the last global batch one sample short. Give
        ``DataLoader`` ``collate_fn=pad_tokens``. ``causal``: labelled for a Hugging Face causal LM."""
        from harness.rank.tokens import TokenDataset

        samples, expected = self._sized(batches, batch_size, split_batches=False, dispatch_batches=False)
        dataset = TokenDataset(derive_seed(self.seed, self.case, label), samples=samples, max_len=max_len,
                               causal=causal)
        return dataset, expected

    def _sized(self, batches: int, batch_size: int, *, split_batches: bool, dispatch_batches: bool,
               samples: int | None = None) -> tuple[int, int]:
        """The harness's own datasets' size (``batches`` per rank, the last global batch one sample
        short, unless ``samples`` is given) and what each rank's prepared dataloader must yield."""
        if samples is None:
            samples = batches * (batch_size if split_batches else batch_size * self.data_world) - 1
        return samples, self.expected_batches(samples, batch_size, split_batches=split_batches,
                                              dispatch_batches=dispatch_batches)

    def expected_batches(self, samples: int, batch_size: int, *, split_batches: bool, dispatch_batches: bool,
                         drop_last: bool = False) -> int:
        """What each rank's prepared dataloader must yield per epoch (harness/rank/oracle/schedule.py)."""
        if split_batches and batch_size % self.data_world:
            # accelerate rejects this at prepare(): the cell does not apply at this world size
            self.skip(f"split_batches needs the batch size ({batch_size}) to be a multiple of the world size "
                      f"({self.data_world})")
        if dispatch_batches:
            if drop_last:
                raise ValueError("ctx.dataloader: the harness has no contract for dispatch_batches with drop_last")
            if self.mesh is not None:
                self.skip(f"dispatch_batches under mesh={self.mesh.name}: the harness has no contract for it")
            return dispatched_batches_per_rank(samples, batch_size=batch_size, world_size=self.world_size,
                                               split_batches=split_batches)
        return batches_per_rank(samples, batch_size=batch_size, world_size=self.data_world,
                                split_batches=split_batches, drop_last=drop_last)
