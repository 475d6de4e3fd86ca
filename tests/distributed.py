"""Run a function on N real ranks (processes in one gloo group) and collect what each returns: for unit
tests of rank-side code that needs real collectives.

The ranks are started as the harness's pools start theirs (``harness.controller.rank_server.rank_context``):
forked from the fork server that has imported torch, accelerate and the rank side, where the platform
has one, else spawned. Spawned, each rank imported torch anew: about 2 s of CPU a rank, most of what
a test of a few collectives costs. A forked rank takes this process's environment as it is when the
ranks start (the server's is the one it started with)."""

from __future__ import annotations

import os
import queue as queue_module
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable


def _entry(rank: int, world_size: int, store_path: str, function: Callable[..., Any], args: tuple,
           results: Any, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        # every rank through gloo's connection of the mesh before any leaves: a rank whose own side was
        # connected could otherwise run its function, close the group and exit while another was still
        # finishing its handshake with it ("Connection closed by peer"; seen under a CPU hog, 1 in 50)
        dist.barrier()
        results.put((rank, True, function(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(function: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``function(rank, world_size, *args)`` on every rank; its return values, by rank. A rank that
    raises fails the caller with that rank's traceback. ``function`` must be importable (module level)."""
    from harness.controller.rank_server import rank_context, start_rank_server

    start_rank_server()
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="harness-test-ranks-") as folder:
        store = os.path.join(folder, "store")
        processes = [ctx.Process(target=_entry, args=(r, world_size, store, function, args, results,
                                                                   dict(os.environ)), daemon=True)
                     for r in range(world_size)]
        for process in processes:
            process.start()
        got: dict[int, Any] = {}
        try:
            while len(got) < world_size:
                try:
                    rank, ok, value = results.get(timeout=timeout)
                except queue_module.Empty:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(got))} gave no result "
                                         f"within {timeout:g} s") from None
                if not ok:
                    raise AssertionError(f"rank {rank} raised:\n{value}")
                got[rank] = value
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
                    process.join()
    return [got[r] for r in range(world_size)]


def loaded(rank: int, world_size: int, names: tuple[str, ...]) -> list[str]:
    """Which of the modules ``names`` a rank has loaded (for ``run_on_ranks``)."""
    import sys

    return [name for name in names if name in sys.modules]
