"""The oracle's collectives, as few as the checks allow.

A collective costs a warm gloo all-reduce about half a millisecond at world size 2 on a small CPU
host, whatever its size up to thousands of elements (bench/README.md), and a cell of the catalogue
is otherwise a few milliseconds of arithmetic. So the oracle sends what one check needs in one
flattened all-reduce, for every model at once, and what does not need an answer before the next
collective rides along with it:

- ``reduce_all``: several reductions (each a set of tensors, their magnitudes and the allowances
  carried into them) in one all-reduce per dtype. Elements are summed one by one, so each reduces
  exactly as it would alone at world size 2; at 3 and more ranks the backend may order an element's
  additions by its place in the buffer, which the reduction's allowance covers (harness/rank/closeness.py).
- ``later``: rank 0's copy of a tensor, wanted for a check whose verdict can wait because another
  check is sure to follow: every rank adds it to the next all-reduce of its dtype (rank 0 gives its
  values, the others zeros: x + 0 is exact), and the check is judged when it comes. The checks that
  wait are the same on every rank, so every rank issues the same collectives. A copy that could be
  the case's last is sent at once: a collective of the harness's after the case returned could meet
  a rank's stray collective (one rank hung in a collective no other joins must stay a hang).
  ``finish`` sends what still waits when a case stops early.
- ``same_everywhere``: whether every rank holds the same bytes, from one all-reduce of digests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping

import torch
import torch.distributed as dist

from harness.rank.closeness import Expectation, reduction_allowance


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def pieces(values: torch.Tensor, like: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
    """``values`` cut back into tensors shaped like ``like``'s, by key."""
    out = {}
    offset = 0
    for key, t in like.items():
        out[key] = values[offset : offset + t.numel()].view_as(t).clone()
        offset += t.numel()
    return out


@dataclass
class Reduction:
    """One all-rank average asked for: ``tensors`` (by key), with the allowances the ranks carried into
    it (``carried``) and the sizes of its terms (``magnitudes``; default |tensors|)."""

    tensors: Mapping[Hashable, torch.Tensor]
    carried: Mapping[Hashable, torch.Tensor] | None = None
    magnitudes: Mapping[Hashable, torch.Tensor] | None = None


@dataclass
class _Waiting:
    mine: torch.Tensor  # this rank's values (flat)
    deliver: Callable[[torch.Tensor], None]  # called with rank 0's


class Collectives:
    """One oracle's collectives on one rank."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._waiting: list[_Waiting] = []

    def _all_reduce(self, buffer: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)

    def reduce_all(self, reductions: list[Reduction]) -> list[dict[Hashable, Expectation]]:
        """The explicit all-rank average of each reduction's tensors, each element with its allowance:
        the reduction's bound from every rank's magnitudes, plus the carried allowances (averaged).
        One all-reduce for each dtype among them, carrying the copies waiting in that dtype."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        values = [flat(r.tensors.values()) for r in reductions]
        for index, v in enumerate(values):
            by_dtype.setdefault(v.dtype, []).append(index)
        results: list[dict[Hashable, Expectation]] = [{} for _ in reductions]
        for dtype, indices in by_dtype.items():
            parts: list[torch.Tensor] = []
            for index in indices:
                reduction, v = reductions[index], values[index]
                size = v.abs() if reduction.magnitudes is None else flat(reduction.magnitudes.values()).to(dtype)
                parts += [v, size] + ([flat(reduction.carried.values()).to(dtype)] if reduction.carried is not None else [])
            riding = [w for w in self._waiting if w.mine.dtype == dtype]
            parts += [self._contribution(w) for w in riding]
            buffer = torch.cat(parts)
            self._all_reduce(buffer)
            offset = 0
            for index in indices:
                reduction, n = reductions[index], values[index].numel()
                average = buffer[offset : offset + n] / self.world_size
                allowed = reduction_allowance(buffer[offset + n : offset + 2 * n], dtype=dtype)
                offset += 2 * n
                if reduction.carried is not None:
                    allowed = allowed + buffer[offset : offset + n].double() / self.world_size
                    offset += n
                averages, allowances = pieces(average, reduction.tensors), pieces(allowed, reduction.tensors)
                results[index] = {k: Expectation(averages[k], allowances[k]) for k in reduction.tensors}
            self._deliver(riding, buffer[offset:])
        return results

    def later(self, tensors: Mapping[Hashable, torch.Tensor],
              deliver: Callable[[dict[Hashable, torch.Tensor]], None], *, wait: bool) -> None:
        """Rank 0's copy of ``tensors`` (as they are now), given to ``deliver`` by key: with the next
        all-reduce of their dtype when ``wait`` (the caller then calls ``finish`` before the cell
        ends), else at once."""
        mine = flat(t.detach() for t in tensors.values())
        like = {k: t.detach() for k, t in tensors.items()}
        waiting = _Waiting(mine, lambda received: deliver(pieces(received, like)))
        if not wait or self.world_size < 2:
            received = mine.clone()
            if self.world_size > 1:
                dist.broadcast(received, src=0)
            waiting.deliver(received)
            return
        self._waiting.append(waiting)

    def finish(self) -> None:
        """Send the copies still waiting (one all-reduce a dtype) and judge their checks."""
        for dtype in list(dict.fromkeys(w.mine.dtype for w in self._waiting)):
            riding = [w for w in self._waiting if w.mine.dtype == dtype]
            buffer = torch.cat([self._contribution(w) for w in riding])
            self._all_reduce(buffer)
            self._deliver(riding, buffer)

    def _contribution(self, waiting: _Waiting) -> torch.Tensor:
        return waiting.mine if self.rank == 0 else torch.zeros_like(waiting.mine)

    def _deliver(self, riding: list[_Waiting], received: torch.Tensor) -> None:
        for w in riding:
            self._waiting.remove(w)
        offset = 0
        for w in riding:
            w.deliver(received[offset : offset + w.mine.numel()])
            offset += w.mine.numel()

    def same_everywhere(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """The ranks whose ``tensors`` differ from rank 0's, bit for bit (every rank learns the same
        list): one all-reduce of each rank's digest, in its own row."""
        if self.world_size < 2:
            return []
        digest = hashlib.blake2b(digest_size=32)
        device = None
        for t in tensors:
            device = t.device
            digest.update(str(t.dtype).encode())
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
        words = torch.frombuffer(bytearray(digest.digest()), dtype=torch.int64)
        rows = torch.zeros(self.world_size, words.numel(), dtype=torch.int64, device=device)
        rows[self.rank] = words.to(rows.device)
        self._all_reduce(rows)
        return [r for r in range(1, self.world_size) if not torch.equal(rows[r], rows[0])]
