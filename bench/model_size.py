"""The model-size rows of scaling.py: one cell of bench/scaling_case.py measured checked, and the
same steps without the harness's checks, on a bench's own ranks (rig.py).

Each cell runs its case body in one of three modes, the oracle the case makes swapped for the mode's:
- ``checked``: the harness's own oracle (a real cell);
- ``unchecked``: an oracle that does nothing, so the case's own forward, backward, DDP's collectives
  and optimizer step run alone;
- ``replica``: an oracle that runs only its replicas' arithmetic (each backward on the replica, the
  optimizer step), with no collective and no check, timed by itself: the oracle replica's step alone.
The oracle's collectives are those the checked cell issues beyond the unchecked one (torch's flight
recorder on rank 0), issued again bare (rig.replay).

Memory: each mode's cell runs once in fresh ranks, whose allocator is a pool rank's
(harness/rank/process/environment.py, keep_large_allocations), after one run of the smallest size (the imports);
the peak resident memory of the cell over the resident memory before it (VmHWM reset through
/proc/self/clear_refs) is what it holds. The checked cell's less the unchecked cell's, over the
model's fp32 bytes, is what the harness holds in model copies.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import statistics
import time
from collections import Counter
from typing import Any, Iterator

from rig import FLOOR_RING, recorded, replay, run_ranks

MODES = ("unchecked", "replica", "checked")


class UncheckedOracle:
    """An oracle that does nothing: the case's own steps run alone."""

    def __init__(self, models: Any, config: Any, *, recorder: Any = None, **_: Any) -> None:
        self.config, self.recorder = config, recorder  # what the context's ``checked`` reads of it
        self.busy_s = 0.0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("check_") or name in ("backward", "step", "finish"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class ReplicaOracle:
    """The oracle's replicas and nothing else: each backward on the replicas (the loss divided by the
    accumulation steps, as the oracle's), the optimizer step at a due step; no collective, no check;
    ``busy_s``, the time spent in them."""

    def __init__(self, models: Any, config: Any, *, optimizer: Any = None, recorder: Any = None, **_: Any) -> None:
        from harness.wrappers.prepared import unwrap

        self.config, self.recorder = config, recorder  # what the context's ``checked`` reads of it
        started = time.perf_counter()
        self.replicas = {name: copy.deepcopy(unwrap(m)) for name, m in models.items()}
        self.optimizers = [optimizer(r.parameters()) for r in self.replicas.values()] if optimizer else []
        self.num_steps = config.num_steps  # the cell's (harness/wrappers/cell.py)
        self.busy_s = time.perf_counter() - started

    def backward(self, closure: Any, *, sync: bool, rng: Any = None) -> None:
        started = time.perf_counter()
        (closure(self.replicas) / self.num_steps).backward()
        self.busy_s += time.perf_counter() - started

    def step(self, point: Any) -> None:
        due = point if isinstance(point, bool) else point.optimizer_step
        started = time.perf_counter()
        if due:
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad()
        self.busy_s += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        if name.startswith("check_") or name == "finish":
            return lambda *args, **kwargs: None
        raise AttributeError(name)


ORACLES = {"unchecked": UncheckedOracle, "replica": ReplicaOracle}


@contextlib.contextmanager
def _oracles_of(mode: str) -> Iterator[list[Any]]:
    """Within the block the oracles cases make are the mode's (the list of those made); ``checked``:
    the harness's own."""
    import harness.rank.context as context

    made: list[Any] = []
    original = context.Oracle
    if mode != "checked":
        def make(models: Any, config: Any, **options: Any) -> Any:
            made.append(ORACLES[mode](models, config, **options))
            return made[-1]
        context.Oracle = make  # type: ignore[assignment]
    try:
        yield made
    finally:
        context.Oracle = original  # type: ignore[assignment]


def _in_mode(mode: str, spec: Any, rank: int, device: Any) -> tuple[Any, float]:
    """Run the cell with the mode's oracle; the rank's result and the oracle's own busy seconds."""
    from harness.rank.process.cell import run_rank_cell

    with _oracles_of(mode) as made:
        result = run_rank_cell(spec, rank, device)
    if result.outcome.value != "ok" or result.failures:
        raise RuntimeError(f"{spec.case}[{spec.variant}] ({mode}) on rank {rank}: {result.outcome.value}, "
                           f"{len(result.failures)} failures: {result.detail[-2000:]}")
    return result, sum(o.busy_s for o in made)


def _timing_job(rank: int, world_size: int, device: Any, spec: Any, runs: int) -> dict[str, Any]:
    """Each mode warm: one unmeasured cell each, then ``runs`` rounds of one cell of each mode in turn
    (what the machine does meanwhile falls on every mode alike), the median wall of each (every rank
    starts together; the slowest rank's view is rank 0's, which waits for the others in the
    collectives)."""
    import torch.distributed as dist

    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    busy: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        _in_mode(mode, spec, rank, device)
    for _ in range(runs):
        for mode in MODES:
            dist.barrier()
            started = time.perf_counter()
            _, busy_s = _in_mode(mode, spec, rank, device)
            walls[mode].append(time.perf_counter() - started)
            busy[mode].append(busy_s)
    out: dict[str, Any] = {mode: {"ms": statistics.median(walls[mode]) * 1000,
                                  "busy_ms": statistics.median(busy[mode]) * 1000} for mode in MODES}
    # the oracle's collectives: the checked cell's beyond the unchecked one's, issued again bare
    issued = {}
    for mode in ("checked", "unchecked"):
        with _oracles_of(mode):
            issued[mode] = Counter((op, repr(sizes), dtype) for op, sizes, dtype in recorded(spec, rank, device))
    beyond = issued["checked"] - issued["unchecked"]
    oracle_collectives = [(op, ast.literal_eval(sizes), dtype) for (op, sizes, dtype), n in beyond.items()
                          for _ in range(n)]
    out["oracle_collectives"] = len(oracle_collectives)
    out["collectives_ms"] = replay(oracle_collectives, device, max(3, runs))
    return out


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))


def _memory_job(rank: int, world_size: int, device: Any, spec: Any, warm: Any, mode: str) -> float:
    """The mode's cell once in fresh ranks, after ``warm`` (the smallest size's cell, for the imports),
    with the allocator as a pool's ranks have it: its peak resident memory above the resident memory
    before it, MB."""
    _in_mode(mode, warm, rank, device)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = _rss_kb("VmRSS")
    _in_mode(mode, spec, rank, device)
    return (_rss_kb("VmHWM") - before) / 1024


def measure(world_size: int, spec: Any, warm: Any, runs: int) -> dict[str, Any]:
    """The timings (rank 0's) and each rank's memory of one model-size cell."""
    timing = run_ranks(world_size, _timing_job, spec, runs, env={"TORCH_FR_BUFFER_SIZE": FLOOR_RING})[0]
    memory = {mode: run_ranks(world_size, _memory_job, spec, warm, mode) for mode in MODES}
    return {**timing, "memory_mb": [{mode: memory[mode][r] for mode in MODES} for r in range(world_size)]}


def copies(memory: list[dict[str, float]], params: int) -> float:
    """The largest over the ranks of the checked cell's peak over the unchecked one's, in fp32 copies
    of the model."""
    return max(m["checked"] - m["unchecked"] for m in memory) * 2**20 / (4 * params)

