"""Collective accounting: the gradient reductions each rank issues in each backward, recorded
(harness/rank/judging/reductions.py judges them against the contract: docs/matrix-schema.md, failure
kinds ``comm_unexpected`` and ``comm_missing``).

Final gradients cannot show every sync fault: a ``no_sync`` that is a no-op still ends the window
with the right average (FSDP2 before accelerate PR #3762 reduce-scattered every micro-batch). So the
rank counts what it sent. torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, set for every rank
before its process group starts) records each collective as it is issued, on every process group
and for every backend, including the ones DDP's reducer and FSDP issue from C++. The harness reads
the records made inside each ``accelerator.backward`` of the case's Accelerator; the oracle's own
collectives run outside it and are never counted.

A gradient reduction is an all-reduce, a reduce-scatter or a reduce (FSDP2 on gloo reduce-scatters
with an all-reduce); all-gathers and broadcasts move parameters and are not counted. The contract:
a backward that does not sync issues none (except under ZeRO >= 2, which reduces every
micro-batch by design), and one that syncs reduces at least every element that got a gradient.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

# Entries the flight recorder keeps (a ring). Reading it costs about 10 us an entry, once a backward;
# a backward of the harness's models issues a few. One that issues more than this is not judged.
BUFFER_ENTRIES = 64
ENV = "TORCH_FR_BUFFER_SIZE"
# torch before the recorder was made backend-neutral sized it with this name (torch 2.6: NCCL only)
ENV_BEFORE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
# The readers torch has had: backend-neutral, then the NCCL-only one of earlier releases.
READERS = ("_dump_fr_trace", "_dump_nccl_trace")
# The check this module performs, by the name the reports give it (docs/upgrade-checks.md);
# harness/records.py, UNCHECKED_KINDS, holds the failure kinds only it can give.
CHECK = "collective_accounting"


def enable() -> None:
    """Ask torch to record collectives; call before the process group is made."""
    os.environ.setdefault(ENV, str(BUFFER_ENTRIES))
    os.environ.setdefault(ENV_BEFORE, os.environ[ENV])


def _is_reduction(profiling_name: str) -> bool:
    # "gloo:all_reduce", "nccl:reduce_scatter_tensor_coalesced", "nccl:allreduce_coalesced", ...
    return "reduce" in profiling_name.split(":", 1)[-1]


def _reader() -> tuple[str, Any] | tuple[None, None]:
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None, None
    for name in READERS:
        dump = getattr(c10d, name, None)
        if dump is not None:
            return name, dump
    return None, None


# Why this rank's collectives cannot be counted, found once the process group has issued its first
# collective (``probe``); None while they can be, or before the probe.
_unavailable: str | None = None


def _dump() -> Any:
    """torch's reader of the flight recorder, or None where this torch has none, it is off, or the
    probe found that it does not record this process group's collectives."""
    if _unavailable is not None:
        return None
    _, dump = _reader()
    return dump if int(os.environ.get(ENV, "0") or 0) > 0 else None


def probe(backend: str) -> str | None:
    """Whether the flight recorder holds the collective the process group just issued (the rank's
    start-up all-reduce): asked of torch, never inferred from its version. Returns, and keeps for
    every later cell of the process, the reason the accounting cannot run here, or None when it can.
    torch 2.6 has only ``_dump_nccl_trace``, which records NCCL's collectives and not gloo's."""
    global _unavailable
    import torch

    _unavailable = _unrecorded()
    name, dump = _reader()
    if _unavailable is None:
        records = _records(dump)
        if not any("all_reduce" in str(e.get("profiling_name", "")) or "allreduce" in str(e.get("profiling_name", ""))
                   for e in records or ()):
            _unavailable = (f"torch {torch.__version__}'s flight recorder ({name}) records no {backend} "
                            "collective (the rank's start-up all-reduce is not in it)")
        elif any("time_created_ns" not in e for e in records or ()):
            _unavailable = (f"torch {torch.__version__}'s flight recorder ({name}) gives no creation time "
                            "(time_created_ns) to tell a backward's collectives from the others")
    return _unavailable


def _unrecorded() -> str | None:
    """Why nothing is recorded here, as far as can be told without reading the ring, or None."""
    if _reader()[1] is None:
        import torch

        return (f"torch {torch.__version__} has no flight recorder reader "
                f"({' or '.join('torch._C._distributed_c10d.' + n for n in READERS)})")
    if int(os.environ.get(ENV, "0") or 0) <= 0:
        return f"the flight recorder is off ({ENV} is not set above 0)"
    return None


def unavailable() -> str | None:
    """Why the collectives of this rank cannot be counted: ``probe``'s finding, or before a probe
    what can be told without one; None when they can be."""
    return _unavailable if _unavailable is not None else _unrecorded()


def recording() -> bool:
    """Whether collectives are recorded here (without reading the ring: that costs a millisecond)."""
    return _dump() is not None


def _records(dump: Any = None) -> list[dict[str, Any]] | None:
    """The flight recorder's entries (read with ``dump``, else with ``_dump()``), or None where this
    torch has none, it is off, or it does not record this process group."""
    dump = dump or _dump()
    if dump is None:
        return None
    try:
        return list(pickle.loads(dump(includeCollectives=True, includeStackTraces=False, onlyActive=False))
                    .get("entries", []))
    except Exception:
        return None


# Record-id ranges (first, last] of collectives the harness itself issued inside a backward (a
# wrapper's reader that gathers gradients where only then they exist: harness/wrappers/deepspeed_cpu.py):
# not the library's, so never counted. Cleared at each backward.
_UNCOUNTED: list[tuple[int, int]] = []


@contextlib.contextmanager
def uncounted() -> Any:
    """Collectives issued in the block are the harness's own: the backward around it is judged
    without them (a reduction the harness makes must not stand in for one the library missed)."""
    records = _records()
    if records is None:
        yield
        return
    before = _last_id(records)
    try:
        yield
    finally:
        _UNCOUNTED.append((before, _last_id(_records())))


def _counted(record_id: int) -> bool:
    return not any(first < record_id <= last for first, last in _UNCOUNTED)


@dataclass
class Backward:
    """What one ``accelerator.backward`` issued on this rank."""

    reductions: list[tuple[str, int]] = field(default_factory=list)  # (collective, elements)
    complete: bool = True  # False when the ring lost entries: no claim is made
    # the ranks of each reduction's process group (None where it cannot be named), as ``reductions``
    groups: list[tuple[int, ...] | None] = field(default_factory=list)

    @property
    def reduced(self) -> int:
        return sum(n for _, n in self.reductions)

    def describe(self) -> str:
        if not self.reductions:
            return "no gradient reduction"
        names: dict[str, list[int]] = {}
        for op, n in self.reductions:
            names.setdefault(op, []).append(n)
        parts = [f"{len(ns)} {op} of {'+'.join(map(str, ns))} elements" for op, ns in names.items()]
        return ", ".join(parts)


def _numel(sizes: Any) -> int:
    return sum(math.prod(int(d) for d in shape) for shape in sizes or ())


class Accounting:
    """The backwards of one rank in one cell, as the flight recorder saw them."""

    def __init__(self) -> None:
        self.available = recording()
        self.backwards: list[Backward] = []

    def watch(self, accelerator: Any) -> None:
        """Record what each ``accelerator.backward`` of this Accelerator issues (an instance
        attribute: the class, and every other Accelerator, are untouched)."""
        if not self.available:
            return
        original = accelerator.backward

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            _UNCOUNTED.clear()
            started_ns = time.time_ns()  # the records' own clock (CLOCK_REALTIME): one read of the ring, after
            try:
                return original(*args, **kwargs)
            finally:
                self.backwards.append(_issued_since(_records(), started_ns))
                _UNCOUNTED.clear()

        accelerator.backward = backward

    def take(self) -> list[Backward]:
        taken, self.backwards = self.backwards, []
        return taken


def _last_id(entries: list[dict[str, Any]] | None) -> int:
    return int(entries[-1]["record_id"]) if entries else -1


def _issued_since(entries: list[dict[str, Any]] | None, started_ns: int) -> Backward:
    """The reductions recorded from ``started_ns`` on (each record carries the wall-clock time it was
    issued at). The ring kept all of them when it still holds a record from before, or has never
    dropped one (its first record is the first ever made)."""
    if entries is None or any("time_created_ns" not in e for e in entries):
        return Backward(complete=False)
    new = [e for e in entries if int(e["time_created_ns"]) >= started_ns]
    complete = len(new) < len(entries) or not entries or int(entries[0]["record_id"]) == 0
    counted = [e for e in new if _is_reduction(str(e.get("profiling_name", ""))) and _counted(int(e["record_id"]))]
    reductions = [(str(e["profiling_name"]), _numel(e.get("input_sizes"))) for e in counted]
    return Backward(reductions=reductions, complete=complete, groups=[_group_ranks(e.get("process_group")) for e in counted])


# Each process group's ranks by the name records give it: a group's name is never reused in a process
_GROUP_RANKS: dict[str, tuple[int, ...]] = {}


def _group_ranks(process_group: Any) -> tuple[int, ...] | None:
    """The global ranks of the process group a record names (``(name, description)``), from
    torch.distributed's own registry of groups (read again only for a name not seen yet); None
    where it is not there."""
    try:
        name = str(process_group[0])
        if name not in _GROUP_RANKS:
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _world

            for group, group_name in _world.pg_names.items():
                if str(group_name) == name:
                    _GROUP_RANKS[name] = tuple(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - another torch's private registry: the group stays unnamed
        return None
    return _GROUP_RANKS.get(name)
