"""A pool's rank process: join the process group once, then run cells until told to stop."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from harness.messages import Ready, RunCell, Shutdown, StartupFailed, expect
from harness.rank.process.cell import freeze_imports, run_rank_cell
from harness.rank.process.environment import process_alive, set_environment


# Signal that makes a rank dump every thread's stack (faulthandler) into its stack file.
DUMP_SIGNAL = signal.SIGUSR1

_PR_SET_PDEATHSIG = 1


def _die_with_parent(controller_pid: int) -> None:
    """A rank must never outlive the process that owns its pool, however that process ends.

    A spawned rank's parent is that process, and the kernel kills the rank when it goes (a
    parent-death signal). A forked rank's parent is the pools' fork server, which exits when the
    controller does, if no rank holds the end of the pipe it watches for that: the rank lets go of
    it (multiprocessing hands each forked child that end, for starting children of its own), and
    also polls for the controller, so that the rank goes even where the server would stay."""
    parent_pid = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid or not process_alive(controller_pid):
        os._exit(70)  # the parent, or the controller, went before the signal was armed
    if parent_pid != controller_pid:
        _release_fork_server()
    elif armed:
        return

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid or not process_alive(controller_pid):
                os._exit(70)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def _release_fork_server() -> None:
    """Close this forked rank's copy of the pipe whose end tells the fork server that its
    controller is gone: while a rank held it, the server (and so the rank) would outlive the run."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def rank_device(backend: str) -> Any:
    """The device of this rank: with nccl, the GPU of its LOCAL_RANK (never its global rank: on the
    second node of a launch, global rank 8 is local rank 0), made current; else the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def collectives_issued() -> int | None:
    """How many collectives this rank's default process group has issued (torch's per-group sequence
    number; DDP's own all-reduces count): the progress that says who the others wait for
    (harness/controller/blame.py). None when there is no group or the backend cannot say."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return None


def _answer_progress(conn: Any) -> None:
    """A thread that tells the pool's controller this rank's progress whenever asked: it answers
    while the main thread is stuck in a case or a collective."""
    while True:
        try:
            conn.recv()
            conn.send(collectives_issued())
        except (EOFError, OSError):
            return


def warm_up(device: Any) -> None:
    """Pay the one-time costs at start-up, not in the first cell: importing accelerate, torch's
    lazy import of torch._dynamo on the first optimizer (seconds), and a first collective."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator  # noqa: F401

    torch.optim.SGD([torch.zeros(1, device=device, requires_grad=True)], lr=0.1)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != dist.get_world_size():
        raise RuntimeError(f"all_reduce of ones gave {probe.item()}, expected the world size {dist.get_world_size()}")
    from harness.rank.numerics import accounting, backend_defects

    accounting.probe(str(dist.get_backend()))  # does the flight recorder hold that all-reduce?
    backend_defects.probe()  # does gloo's AVG reduce-scatter sum? (harness/decorator.py)
    freeze_imports()


def main(rank: int, world_size: int, backend: str, store_path: str, log_path: str, stack_path: str,
         conn: Any, watch_conn: Any, controller_pid: int, pg_timeout_s: float, environ: dict[str, str]) -> None:
    """Entry point of a rank process (the target of a forked or spawned process). ``environ`` is
    the controller's environment when the pool started: a forked rank would otherwise keep its fork
    server's, from the server's start."""
    _die_with_parent(controller_pid)
    os.environ.clear()
    os.environ.update(environ)
    log = open(log_path, "a", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    stacks = open(stack_path, "a", encoding="utf-8")  # O_APPEND: the controller truncates it before each dump
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    set_environment(rank, world_size, backend)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        device = rank_device(backend)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        warm_up(device)
    except BaseException:
        conn.send(StartupFailed(rank=rank, traceback=traceback.format_exc()))
        raise SystemExit(3)
    threading.Thread(target=_answer_progress, args=(watch_conn,), name="harness-progress", daemon=True).start()
    conn.send(Ready(rank=rank, pid=os.getpid()))
    while True:
        try:
            message = expect(conn.recv(), RunCell, Shutdown)
        except EOFError:
            break
        if isinstance(message, Shutdown):
            break
        conn.send(run_rank_cell(message.spec, rank, device))
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    conn.close()
