"""Token weighting for the oracle (``Oracle.token_window``): a window weighed by its valid tokens on
all ranks, the weight as the documented loops round it; and the contributions since the last check
that the ``misweighted`` diagnosis refits (harness/rank/judging/diagnosis.py, ``Reweighing``), kept in every
window of a model below ``REFIT_BELOW`` elements (and in every weighed window): after a sync, every
rank's, which takes an all-gather of the model's contributions at each sync, the cost a large
model's check does without (bench/README.md, "Against model size")."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist

from harness.rank.numerics.closeness import CHUNK

# A model of fewer elements keeps its contributions since the last check in every window, for a
# diagnosis that refits them (a larger one only in a window weighed by tokens or micro-batches)
REFIT_BELOW = CHUNK


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
        # the models small enough to keep their contributions in every window (REFIT_BELOW)
        self.refitted = {name for name, ps in params.items() if sum(t.numel() for t in ps.values()) < REFIT_BELOW}
        # by model, the contributions of the backward being run: made at the first weighted backward (a
        # model's worth of zeros an oracle that weighs nothing need not hold); and of each backward since
        # the last check, in order (the fit weighs each micro-batch apart)
        self._new: dict[str, dict[str, torch.Tensor]] = {}
        self._done: dict[str, list[dict[str, torch.Tensor]]] = {}
        # every rank's, after a sync: by backward since the last check, then by rank (or data shard)
        self._parts: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.backwards: dict[str, int] = {}  # how many backwards since the last check the parts hold
        # the gradient this rank held when the last check anchored the oracle to it (``hold``): what a clip
        # or a zero_grad inside the window scales before the next backward adds to it, on each rank by
        # its own factor (a clip's is max_norm over that rank's norm); after a sync every rank's, by rank
        # (or data shard), each divided by the world size as it enters the average
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        self._held_parts: dict[str, list[dict[str, torch.Tensor]]] = {}
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
        for name in list(self._params):
            self.clear(name)

    def hold(self, name: str, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Before a backward of ``name``: the gradients it adds to (a copy; None is zero), kept where it
        is the first since the last check, to be gathered by rank at a sync with the contributions
        (``held``). Called on every rank alike, or on none: the sync's all-gather carries them."""
        if name in self._done or name in self._new or name in self._held:
            return
        self._held[name] = {p: _copy_or_zeros(grads.get(p), t) for p, t in self._params[name].items()}

    def add(self, name: str, pname: str, grad: torch.Tensor) -> None:
        if name not in self._new:
            self._new[name] = {p: torch.zeros_like(t) for p, t in self._params[name].items()}
        self._new[name][pname] += grad

    def after_backward(self, *, sync: bool, models: Iterable[str]) -> None:
        """After a weighted backward of ``models`` (the same on every rank); at a sync, every rank's
        contributions since the last check, each divided by the world size as it enters the average
        (one all_gather a model)."""
        for name in models:
            # no gradient on this rank: its contributions are zero
            new = self._new.pop(name, None) or {p: torch.zeros_like(t) for p, t in self._params[name].items()}
            self._done.setdefault(name, []).append(new)
            if name in self._parts and not sync:
                self._mixed.add(name)
            self._weighted.add(name)
        if not sync:
            return
        names = [n for n in self._params if n in self._done]  # in one order on every rank
        alike = self._same_everywhere([len(self._done[n]) for n in names])
        for name, same in zip(names, alike):
            done = self._done.pop(name)
            if not same:
                # the ranks ran other numbers of backwards since the last check (no check between them):
                # each rank's together, as one contribution
                done = [{p: sum(new[p] for new in done) for p in done[0]}]
            held = self._held.pop(name, None)
            sent = done + ([held] if held is not None else [])  # the held gradient rides the same all-gather
            flat = torch.cat([t.reshape(-1) for new in sent for t in new.values()])
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)] if self.world_size > 1 else [flat]
            if self.world_size > 1:
                dist.all_gather(gathered, flat)
            shapes = [(p, t) for p, t in done[0].items()]
            split = [g.split([t.numel() for _, t in shapes] * len(sent)) for g in gathered]
            parts = []
            for backward in range(len(sent)):  # each backward's share of every rank, by rank; then the held
                pieces = [s[backward * len(shapes):(backward + 1) * len(shapes)] for s in split]
                by_rank = [{p: piece.view_as(t).clone() / self.world_size for (p, t), piece in zip(shapes, ps)}
                           for ps in pieces]
                parts += by_rank if self.shards is None else _by_shard(by_rank, self.shards)
            if held is not None:
                shares = len(parts) // len(sent)
                self._held_parts[name], parts = parts[len(parts) - shares:], parts[:len(parts) - shares]
            self._parts[name] = parts
            self.backwards[name] = len(done)

    def _same_everywhere(self, counts: list[int]) -> list[bool]:
        """Whether every rank has each of ``counts`` (one small all-gather)."""
        if self.world_size == 1 or not counts:
            return [True] * len(counts)
        mine = torch.tensor(counts, dtype=torch.int64, device=self._device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [bool((torch.stack(every)[:, i] == count).all()) for i, count in enumerate(counts)]

    def parts(self, name: str) -> list[dict[str, torch.Tensor]] | None:
        """The weighted contributions that the expected gradient adds since the last check, each
        backward's apart, in order (``backwards[name]`` of them): this rank's own (no sync since), or
        every rank's share of the average, by backward, then by rank (a sync). None
        outside token weighting, or when a local backward followed a sync before the check."""
        if name not in self._weighted or name in self._mixed:
            return None
        if name in self._parts:
            return self._parts[name]
        self.backwards[name] = len(self._done[name])
        return [{p: t.clone() for p, t in new.items()} for new in self._done[name]]

    def held(self, name: str) -> list[dict[str, torch.Tensor]] | None:
        """After a sync: every rank's share of the gradient it held at the last check (``hold``), by rank
        (or data shard), as ``parts`` gives its contributions since; None before a sync, or where the
        oracle kept none (a sharded wrapper's, which holds its own until the sync)."""
        return self._held_parts.get(name) if self.parts(name) is not None else None

    def clear(self, name: str) -> None:
        """A check adopted the rank's gradients of ``name``: nothing since."""
        self._held.pop(name, None)
        self._held_parts.pop(name, None)
        self._new.pop(name, None)
        self._done.pop(name, None)
        self.backwards.pop(name, None)
        self._parts.pop(name, None)
        self._weighted.discard(name)
        self._mixed.discard(name)


def _copy_or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.detach().clone()


def _by_shard(parts: list[dict[str, torch.Tensor]], shards: list[int]) -> list[dict[str, torch.Tensor]]:
    """Every rank's share summed over the ranks of one data shard, by shard (their least-squares fit
    would have as many identical columns as the shard has ranks)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for part, shard in zip(parts, shards):
        held = out.setdefault(shard, {p: torch.zeros_like(t) for p, t in part.items()})
        for p, t in part.items():
            held[p] += t
    return [out[shard] for shard in sorted(out)]
