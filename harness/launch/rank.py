"""One launched process as a rank: its process group (generation after generation), its device, the
watch thread that keeps it answering while its cell is stuck, and the loop of a rank other than 0.

The first process group comes from the launcher's own rendezvous (``env://``: its store, its address).
After a rank raised, the others may be blocked in a collective it skipped. They must come back, and
the group is then unusable (the ranks disagree on how many collectives it has run), so:
- with gloo, a rank whose cell raised shuts down its group's connections to the other ranks (the
  TCP sockets it opened since it started, but the store's: ``sever``) before it reports, and every
  rank does when rank 0 aborts the generation. A peer blocked on it then fails at once with gloo's
  "Connection closed by peer", as when a process dies, and that failure, a collective's, is that of a
  victim; one blocked on the victim fails in turn when the victim's cell ends. Aborting a gloo group
  from another thread does not wake a rank waiting in DDP's own collectives (tried, and it did not),
  and neither does the raising rank's abort, destroy or shutdown of its group (they leave the
  sockets open until the process exits: tried). Still, no collective may much outlast a cell: the
  group's collective timeout is the cell's timeout (``--case-timeout``) and a margin, after which a
  blocked collective raises wherever sockets are not the cause (no /proc here, a rank that hangs).
  The margin lets rank 0 judge a stuck cell first, at its deadline, as a local pool does: which rank
  hung and which were blocked, never a timeout raised on the blocked ones;
- with nccl, every rank aborts the group, which ends its pending collectives (torch's documented
  use of ``_abort_process_group``, with TORCH_NCCL_ASYNC_ERROR_HANDLING off so that the watchdog
  does not end the process first);
then every rank joins a new generation of the group through the same store (bench/launch_faults.py:
the next cell after a raise starts within a second or two, where it waited for the timeout).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from harness.launch.channel import Channel, connect, message_key, result_key
from harness.launch.environment import RENDEZVOUS_VARIABLES, LaunchInfo
from harness.messages import Rejoin, RunCell, Shutdown, expect
from harness.rank.process import environment as rank_environment
from harness.rank.process import main as rank_side
from harness.rank.process.cell import run_rank_cell
from harness.records import RankOutcome

WATCH_S = 0.25  # how often a rank's watch thread beats and looks for requests
DRIVER_LOST_S = 30.0  # a rank whose driver's heartbeat stands still this long exits
WATCH_STOP_S = 30.0  # how long closing waits for the watch thread's last store call to return
PG_TIMEOUT_S = 1800.0  # joining a group; cells have their own, shorter, deadline (--case-timeout)
# after a cell's deadline: rank 0's grace for the others, its question to the stuck ones, and a second
COLLECTIVE_MARGIN_S = 10.0


def say(info: LaunchInfo, text: str) -> None:
    print(f"harness launch: rank {info.rank} on {info.host}: {text}", file=sys.stderr, flush=True)


def _stream_sockets() -> dict[str, int]:
    """This process's TCP sockets (an inode, ``socket:[n]``, to a descriptor of it); empty without /proc."""
    found: dict[str, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.setdefault(target, int(fd))
    return found


def _shut_down(fd: int, *, sparing: int) -> bool:
    """Shut down the connected TCP socket behind ``fd``, unless either end's port is ``sparing``; False
    for anything else (a listener, a Unix socket, a closed descriptor)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sparing in (sock.getsockname()[1], sock.getpeername()[1]):
            return False
        sock.shutdown(socket.SHUT_RDWR)  # acts on the socket, not the descriptor: gloo's reads fail
        return True
    except OSError:
        return False
    finally:
        sock.close()  # the duplicate


def all_stacks() -> str:
    """Every thread's stack, as faulthandler writes them."""
    with tempfile.TemporaryFile("w+") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
        handle.seek(0)
        return handle.read()


class RankRuntime:
    """This process's part in the launch's process group."""

    def __init__(self, info: LaunchInfo, backend: str, *, cell_timeout_s: float) -> None:
        self.info = info
        self.backend = backend
        self.cell_timeout_s = cell_timeout_s
        self.generation = 0
        self.lock = threading.Lock()
        self.device: Any = None
        self.closing = False
        self.watcher: threading.Thread | None = None  # the watch thread, once started
        self._stores: list[Any] = []  # clients the live process group uses
        self._sockets_before: set[str] = set()  # the sockets this process had before its first group

    def start(self) -> None:
        """Join the launcher's rendezvous and pay the one-time costs (imports, a first collective)."""
        if self.backend == "gloo":
            rank_environment.limit_threads()
        rank_environment.keep_large_allocations()
        import torch
        import torch.distributed as dist

        if self.backend == "gloo":
            torch.set_num_threads(1)
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        self.device = rank_side.rank_device(self.backend)
        rank_environment.record_collectives()
        self._sockets_before = set(_stream_sockets())
        dist.init_process_group(self.backend, init_method="env://", rank=self.info.rank,
                                world_size=self.info.world_size, timeout=timedelta(seconds=PG_TIMEOUT_S))
        self._limit_collectives()
        rank_side.warm_up(self.device)
        if self.info.world_size == 1:
            # as in a local pool, world size 1 is a plain single process: accelerate sees no launcher
            for name in RENDEZVOUS_VARIABLES:
                os.environ.pop(name, None)

    def _limit_collectives(self) -> None:
        """With gloo, a collective that waits longer than a cell may take raises (see the module's doc)."""
        if self.backend != "gloo":
            return
        import torch
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        timeout = timedelta(seconds=self.cell_timeout_s + COLLECTIVE_MARGIN_S)
        group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)

    def sever(self) -> int:
        """With gloo, shut down this rank's connections to the other ranks, so that a collective waiting
        on it fails at once (see the module's doc): every connected TCP socket opened since the rank
        started but the store's (the launcher's store carries the channel, and may be served here).
        How many were shut down."""
        if self.backend != "gloo":
            return 0
        severed = 0
        for inode, fd in _stream_sockets().items():
            if inode not in self._sockets_before:
                severed += _shut_down(fd, sparing=self.info.master_port)
        return severed

    def abort(self, generation: int, *, wait: bool = True) -> bool:
        """Abort generation ``generation`` if it is the live one: its blocked collectives return."""
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            import torch.distributed as dist

            if generation != self.generation or not dist.is_initialized():
                return False
            self.sever()
            dist.distributed_c10d._abort_process_group()
            return True
        finally:
            self.lock.release()

    def rejoin(self, generation: int, channel: Channel) -> None:
        """Leave the old group and join generation ``generation`` with every other rank."""
        import torch.distributed as dist

        with self.lock:
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
            self.generation = generation
        channel.put(f"ready/{generation}/{self.info.rank}", True)
        store = connect(self.info)
        self._stores = [store]
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"pg/{generation}", store),
                                rank=self.info.rank, world_size=self.info.world_size,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
        self._limit_collectives()

    def close(self) -> None:
        """Leave the process group and stop the watch thread. The thread is joined, not left to the
        interpreter's exit: a daemon thread still inside a store call then (its GIL released in
        C++) is ended by Python with a forced unwind through that C++ frame, which aborts the
        process ("terminate called without an active exception", SIGABRT) after its run passed."""
        import torch.distributed as dist

        self.closing = True
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        if self.watcher is not None and self.watcher is not threading.current_thread():
            self.watcher.join(timeout=WATCH_STOP_S)

    def exit_status(self, status: int) -> int:
        """``status``, for the process to exit with once closed; where the watch thread did not stop
        (a store call that never returned) the process leaves now, as an interpreter exit would abort it."""
        if self.watcher is not None and self.watcher.is_alive():
            say(self.info, f"the watch thread did not stop within {WATCH_STOP_S:g} s of the end; leaving at once")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        return status


def watch(runtime: RankRuntime, channel: Channel, *, driver: bool) -> None:
    """The body of every rank's watch thread. It beats; on a rank other than 0 it also answers rank
    0's questions, aborts the process group when told, exits when told to stop, and exits when rank
    0 (the driver) stops beating: no rank outlives the launch's driver."""
    info = runtime.info
    next_ask = 1
    driver_beat, since = -1, time.monotonic()
    while True:
        time.sleep(WATCH_S)
        if runtime.closing:
            return
        try:
            channel.count(f"beat/{info.rank}", 1)
            if driver:
                continue
            if channel.has("stop"):
                status = channel.take("stop")
                channel.put(f"bye/{info.rank}", True)
                say(info, f"rank 0 ended the launch (exit status {status})")
                os._exit(status)
            generation = runtime.generation
            if channel.has(f"abort/{generation}"):
                runtime.abort(generation, wait=False)
            while channel.has(f"ask/{next_ask}"):
                channel.put(f"answer/{next_ask}/{info.rank}", (rank_side.collectives_issued(), all_stacks()))
                next_ask += 1
            beat = channel.count("beat/0")
        except Exception as exc:  # the store is gone: rank 0's host, or the launcher, went down
            if runtime.closing:
                return
            say(info, f"the launch's store stopped answering ({' '.join(str(exc).split())[:200]}); exiting")
            os._exit(1)
        now = time.monotonic()
        if beat != driver_beat:
            driver_beat, since = beat, now
        elif now - since > DRIVER_LOST_S:
            say(info, f"rank 0 (the driver) gave no heartbeat for {DRIVER_LOST_S:.0f} s; exiting")
            os._exit(1)


def start_watch(runtime: RankRuntime, *, driver: bool) -> None:
    channel = Channel(connect(runtime.info))
    runtime.watcher = threading.Thread(target=watch, args=(runtime, channel), kwargs={"driver": driver},
                                       name="harness-watch", daemon=True)
    runtime.watcher.start()


def follow(runtime: RankRuntime, channel: Channel) -> int:
    """A rank other than 0: run every cell rank 0 sends, until it says stop; the run's exit status."""
    n = 1
    while True:
        message = expect(channel.wait_for(message_key(n)), RunCell, Rejoin, Shutdown)
        if isinstance(message, RunCell):
            result = run_guarded(message, runtime)
            channel.put(result_key(n, runtime.info.rank), result)
            channel.count(f"done/{n}", 1)
        elif isinstance(message, Rejoin):
            runtime.rejoin(message.generation, channel)
        else:
            runtime.close()
            channel.put(f"bye/{runtime.info.rank}", True)
            return runtime.exit_status(message.exit_status)
        n += 1


def run_guarded(message: RunCell, runtime: RankRuntime) -> Any:
    """run_rank_cell, with anything it lets through (a case's SystemExit) made a raise of the cell:
    under a launcher the process is the rank and must stay."""
    from harness.messages import RankResult

    try:
        result = run_rank_cell(message.spec, runtime.info.rank, runtime.device)
    except BaseException:
        result = RankResult(rank=runtime.info.rank, outcome=RankOutcome.RAISED, cell_id=message.spec.cell_id,
                            detail=traceback.format_exc())
    if result.outcome == RankOutcome.RAISED:
        runtime.sever()  # the group is rebuilt after a raise: free whoever waits on this rank now
    return result
