"""Token weighting for the oracle (``Oracle.token_window``): a window weighed by its valid tokens on
all ranks, the weight as the documented loops round it, and the contributions since the last check
that the ``misweighted`` diagnosis refits (harness/rank/diagnosis.py, ``Reweighing``)."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist


def token_seeds(world_size: int, tokens: int, num_steps: int, *, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a token-weighted micro-batch's summed loss is multiplied by in the backward, world_size / N,
    as the two documented loops round it in ``dtype``, after ``Accelerator.backward`` divides by the
    accumulation steps: accelerate's usage guide, ``(sum * steps * world_size) / N``, seeds with
    ((1/steps)/N * world_size) * steps; transformers' loss, ``sum / N`` times steps and world size,
    with ((1/steps) * world_size * steps) / N. The first, and the second where it rounds otherwise
    (scaling by a power of two is exact: at power-of-two world sizes and steps they are one)."""
    one = torch.ones((), dtype=dtype)
    guide = ((one / num_steps) / tokens * world_size) * num_steps
    transformers_loss = (one / num_steps * world_size * num_steps) / tokens
    return guide, None if torch.equal(guide, transformers_loss) else transformers_loss


class TokenWeighting:
    """One oracle's token weighting: ``tokens``, the window's valid tokens on all ranks (None outside
    a token-weighted window), and by model the weighted contributions since the last check."""

    def __init__(self, params: Mapping[str, Mapping[str, torch.Tensor]], *, world_size: int,
                 shards: list[int] | None = None) -> None:
        self.world_size = world_size
        # the data shard each rank draws, by rank (under a mesh tensor- and context-parallel peers draw
        # one: their contributions are the same and are fitted as one); None: every rank its own
        self.shards = shards
        self.tokens: int | None = None
        self._params = params
        # by model, the contributions since the last check: made at the first weighted backward (a model's
        # worth of zeros an oracle that weighs nothing need not hold)
        self._new: dict[str, dict[str, torch.Tensor]] = {}
        self._parts: dict[str, list[dict[str, torch.Tensor]]] = {}  # every rank's, after a sync
        self._weighted: set[str] = set()  # models with a weighted backward since their last check
        self._mixed: set[str] = set()  # ... and a local one after a sync: no parts to fit
        self._device = next(t.device for ps in params.values() for t in ps.values())

    def begin(self, labels: Iterable[torch.Tensor], ignore_index: int) -> int:
        """Count this rank's valid labels of the window and sum the counts over the ranks (one
        all-reduce): the window's N, from now until ``end``."""
        count = sum(int(t.ne(ignore_index).sum()) for t in labels)
        total = torch.tensor([count], dtype=torch.int64, device=self._device)
        if self.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        tokens = int(total.item())
        if tokens == 0:
            raise ValueError("token_window: no rank has a valid token in this window (every label is "
                             f"{ignore_index}); the token mean is undefined")
        self.tokens = tokens
        return tokens

    def end(self) -> None:
        """The window's optimizer step: its gradients are gone, and the next window counts anew."""
        self.tokens = None
        for name in self._new:
            self.clear(name)

    def add(self, name: str, pname: str, grad: torch.Tensor) -> None:
        if not self._new:
            self._new = {n: {p: torch.zeros_like(t) for p, t in ps.items()} for n, ps in self._params.items()}
        self._new[name][pname] += grad

    def after_backward(self, *, sync: bool) -> None:
        """After a weighted backward of every model; at a sync, every rank's contributions since the
        last check, each divided by the world size as it enters the average (one all_gather a model)."""
        for name in self._new:
            if name in self._parts and not sync:
                self._mixed.add(name)
            self._weighted.add(name)
        if not sync:
            return
        for name, new in self._new.items():
            flat = torch.cat([t.reshape(-1) for t in new.values()])
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)] if self.world_size > 1 else [flat]
            if self.world_size > 1:
                dist.all_gather(gathered, flat)
            sizes = [t.numel() for t in new.values()]
            parts = [{p: piece.view_as(t).clone() / self.world_size
                      for (p, t), piece in zip(new.items(), g.split(sizes))} for g in gathered]
            self._parts[name] = parts if self.shards is None else _by_shard(parts, self.shards)
            for t in new.values():
                t.zero_()

    def parts(self, name: str) -> list[dict[str, torch.Tensor]] | None:
        """The weighted contributions that the expected gradient adds since the last check: this
        rank's own (no sync since), or every rank's share of the average, by rank (a sync). None
        outside token weighting, or when a local backward followed a sync before the check."""
        if name not in self._weighted or name in self._mixed:
            return None
        if name in self._parts:
            return self._parts[name]
        return [{p: t.clone() for p, t in self._new[name].items()}]

    def clear(self, name: str) -> None:
        """A check adopted the rank's gradients of ``name``: nothing since."""
        for t in self._new.get(name, {}).values():
            t.zero_()
        self._parts.pop(name, None)
        self._weighted.discard(name)
        self._mixed.discard(name)


def _by_shard(parts: list[dict[str, torch.Tensor]], shards: list[int]) -> list[dict[str, torch.Tensor]]:
    """Every rank's share summed over the ranks of one data shard, by shard (their least-squares fit
    would have as many identical columns as the shard has ranks)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for part, shard in zip(parts, shards):
        held = out.setdefault(shard, {p: torch.zeros_like(t) for p, t in part.items()})
        for p, t in part.items():
            held[p] += t
    return [out[shard] for shard in sorted(out)]
