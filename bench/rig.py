"""A bench's own ranks: N spawned processes joined in a gloo group exactly as a pool's ranks are
(harness/rank/process/main.py: the same environment, one thread, the same warm-up), each running a job function
and returning plain data. For measurements a pool cannot make from outside: a breakdown of a warm
cell by section on every rank (profile_cell.py), and the floor of a cell, its own collectives
replayed bare (floor_ms).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RIG_TIMEOUT_S = 900.0


def _rank_main(rank: int, world_size: int, store_path: str, queue: Any, env: dict[str, str],
               job: Callable[..., Any], args: tuple) -> None:
    os.environ.update(env)
    from harness.rank.process.environment import set_environment
    from harness.rank.process.main import warm_up

    set_environment(rank, world_size, "gloo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=RIG_TIMEOUT_S))
        device = torch.device("cpu")
        warm_up(device)
        queue.put((rank, job(rank, world_size, device, *args), None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(world_size: int, job: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> list[Any]:
    """``job(rank, world_size, device, *args)`` on every rank of a fresh group; the results by rank.
    ``env``: variables set in each rank before its group is made (e.g. the flight recorder's ring)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench-rig-") as folder:
        store = os.path.join(folder, "store")
        processes = [ctx.Process(target=_rank_main, args=(r, world_size, store, queue, env or {}, job, args),
                                 daemon=True) for r in range(world_size)]
        # a pool rank's settings that take effect only before its first tensor (harness/rank/process/environment.py,
        # keep_large_allocations): a spawned rank imports this bench's modules, and torch, before the job
        from harness.rank.process.environment import TORCH_HUGE_PAGES

        inherited = os.environ.get(TORCH_HUGE_PAGES)
        os.environ.setdefault(TORCH_HUGE_PAGES, "1")
        try:
            for process in processes:
                process.start()
        finally:
            if inherited is None:
                os.environ.pop(TORCH_HUGE_PAGES, None)
        results: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + RIG_TIMEOUT_S
            while len(results) < world_size:
                rank, result, error = queue.get(timeout=max(1.0, deadline - time.monotonic()))
                if error is not None:
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{error}")
                results[rank] = result
            for process in processes:
                process.join(timeout=30)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
    return [results[r] for r in range(world_size)]


def cell_spec(case_file: str, variant_name: str, world_size: int, seed: int = 1234) -> Any:
    """What a pool's controller would send its ranks for this cell (harness/controller/cells.py)."""
    from harness.catalogue import load_case_file
    from harness.controller.cells import cell_spec as spec_of
    from harness.controller.options import resolve
    from harness.wrappers.registry import WRAPPERS
    from harness.wrappers.prepare import cell_variants

    path = Path(case_file) if Path(case_file).is_absolute() else ROOT / case_file
    case = load_case_file(path)[0]
    known = cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)  # e.g. fp32-wrapper=deepspeed-z2
    variant = next((v for v in known if v.name == variant_name), None)
    if variant is None:
        raise SystemExit(f"{case_file}: no variant {variant_name!r}; known: {', '.join(v.name for v in known)}")
    settings = resolve(world_sizes=str(world_size), backend="gloo", report_dir="reports", case_timeout="120",
                       seed=str(seed))
    return spec_of(case, variant, world_size, settings, label=f"bench {case.name}[{variant.name}]")


# the floor: a cell's own collectives (the case's, DDP's and the oracle's, as torch's flight
# recorder saw them) issued again bare, on tensors of the same sizes and dtypes

DTYPES = {"Float": "float32", "Double": "float64", "BFloat16": "bfloat16", "Half": "float16", "Long": "int64",
          "Int": "int32", "Byte": "uint8", "Bool": "bool", "Char": "int8", "Short": "int16"}
# ring entries for the floor's recording: every collective of one cell (the pools keep 64)
FLOOR_RING = "65536"


def recorded(spec: Any, rank: int, device: Any) -> list[tuple[str, list[list[int]], str]]:
    """Run the cell once; the collectives it issued on this rank: (op, input sizes, dtype)."""
    from harness.rank.numerics.accounting import _records
    from harness.rank.process.cell import run_rank_cell

    before = max((e["record_id"] for e in _records() or []), default=-1)
    result = run_rank_cell(spec, rank, device)
    if result.outcome.value not in ("ok",):
        raise RuntimeError(f"{spec.case}[{spec.variant}] on rank {rank}: {result.outcome}: {result.detail[-2000:]}")
    return [(e["profiling_name"].split(":", 1)[-1], e["input_sizes"], e["input_dtypes"][0] if e["input_dtypes"] else "Float")
            for e in _records() or [] if e["record_id"] > before]


def replay(collectives: list[tuple[str, list[list[int]], str]], device: Any, repeats: int) -> float:
    """Median ms to issue ``collectives`` bare, each waited for (as a cell waits for each)."""
    import torch
    import torch.distributed as dist

    calls = []
    for op, sizes, dtype in collectives:
        numel = sum(int(torch.Size(s).numel()) for s in sizes) or 1
        tensor = torch.zeros(numel, dtype=getattr(torch, DTYPES.get(dtype, "float32")), device=device)
        world = dist.get_world_size()
        if "all_gather" in op or "allgather" in op:
            out = torch.zeros(numel * world, dtype=tensor.dtype, device=device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            calls.append(lambda t=tensor, o=out, gather=gather: gather(o, t))
        elif "reduce_scatter" in op:
            out = torch.zeros(max(1, numel // world), dtype=tensor.dtype, device=device)
            calls.append(lambda t=tensor[: out.numel() * world], o=out: dist.reduce_scatter_tensor(o, t))
        elif "broadcast" in op:
            calls.append(lambda t=tensor: dist.broadcast(t, src=0))
        elif "barrier" in op:
            calls.append(dist.barrier)
        else:  # all_reduce, allreduce_coalesced, reduce: one reduction of as many elements
            calls.append(lambda t=tensor: dist.all_reduce(t))
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        for call in calls:
            call()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1000


def _floor_job(rank: int, world_size: int, device: Any, specs: list[Any], repeats: int) -> list[tuple[int, float]]:
    from harness.rank.process.cell import run_rank_cell

    out = []
    for spec in specs:
        run_rank_cell(spec, rank, device)  # import the case, warm it
        collectives = recorded(spec, rank, device)
        out.append((len(collectives), replay(collectives, device, repeats)))
    return out


def floors(world_size: int, specs: list[Any], *, repeats: int = 20) -> list[tuple[int, float]]:
    """For each cell (a CellSpec at ``world_size``): how many collectives it issues on rank 0, and
    the median ms those take issued bare, slowest rank's view (rank 0's: every rank waits for all)."""
    if world_size < 2:
        return [(0, 0.0) for _ in specs]
    return run_ranks(world_size, _floor_job, specs, repeats, env={"TORCH_FR_BUFFER_SIZE": FLOOR_RING})[0]
