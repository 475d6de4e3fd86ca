"""The controller side of a rank pool: spawn N live ranks, send them cells, contain their faults."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _wait_for
from typing import Any, Callable, Protocol

from harness.controller.blame import mark_victims, stuck_kinds, take_result
from harness.controller.rank_server import rank_context, start_rank_server
from harness.messages import (
    CellOutcome,
    CellSpec,
    Ready,
    RunCell,
    Shutdown,
    StartupFailed,
    expect,
)
from harness.rank.process import main as rank_side
from harness.records import FaultKind, RankFault

# Seconds a pool may take to start: spawning, importing torch and accelerate, joining the group.
START_TIMEOUT_S = 180.0
# After the first rank fails, how long the others get to report before they are judged stuck.
GRACE_S = 3.0
# How long a stuck rank's progress thread gets to answer (it does not, while C code holds the GIL).
PROGRESS_ANSWER_S = 1.0
# while a cell runs, how often the controller looks up from waiting for its ranks (``while_waiting``)
WAIT_SLICE_S = 1.0
_TAIL_CHARS = 4000


def wait(handles: list[Any], timeout: float) -> list[Any]:
    """``multiprocessing.connection.wait``, woken by a signal as well (in the main thread).

    A signal sent to the process (Ctrl-C, SIGTERM, xdist's shutdown, which sends SIGINT) may be
    delivered to any of its threads that does not block it, torch's and gloo's among them. Python runs
    its handler in the main thread only once that thread runs again: a main thread asleep in a wait on
    the ranks' pipes would sleep through the signal for as long as the cell's timeout. The wait
    includes a socket that ``signal.set_wakeup_fd`` writes to whichever thread the signal lands on."""
    if threading.current_thread() is not threading.main_thread():
        return _wait_for(handles, timeout)
    wake, woken = socket.socketpair()
    try:
        wake.setblocking(False)
        woken.setblocking(False)
        previous = signal.set_wakeup_fd(woken.fileno(), warn_on_full_buffer=False)
        try:
            ready = _wait_for([*handles, wake], timeout)
        finally:
            signal.set_wakeup_fd(previous)
    finally:
        wake.close()
        woken.close()
    # the handler runs at the main thread's next instruction: KeyboardInterrupt rises from the caller
    return [handle for handle in ready if handle is not wake]


class PoolStartError(RuntimeError):
    """The ranks could not be started; the message says which rank and why."""


class GroupLost(RuntimeError):
    """Under a launcher: a rank died or hung, so no further cell can run; the message says which and where."""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _tail(path: str, since: int = 0) -> str:
    """The end of a rank's log (its stdout and stderr), from byte ``since`` on."""
    try:
        with open(path, "rb") as handle:
            handle.seek(since)
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return text[-_TAIL_CHARS:]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class RankPool:
    """N live rank processes of one world size, joined in one process group through a FileStore."""

    def __init__(self, world_size: int, *, backend: str, pg_timeout_s: float = 1800.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.watch_conns: list[Connection] = []
        self.workdir: str | None = None
        self.generation = 0
        self.log_offsets: list[int] = []

    @property
    def alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def _path(self, kind: str, rank: int) -> str:
        assert self.workdir is not None
        return os.path.join(self.workdir, f"gen{self.generation}-rank{rank}.{kind}")

    def start(self) -> None:
        """Spawn the ranks and wait until every one has joined the group."""
        self.generation += 1
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix=f"harness-ws{self.world_size}-")
        start_rank_server()
        ctx = rank_context()
        store_path = os.path.join(self.workdir, f"gen{self.generation}.store")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            watch_conn, child_watch_conn = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=rank_side.main,
                name=f"harness-ws{self.world_size}-rank{rank}",
                args=(rank, self.world_size, self.backend, store_path, self._path("log", rank),
                      self._path("stack", rank), child_conn, child_watch_conn, os.getpid(), self.pg_timeout_s,
                      dict(os.environ)),
                daemon=True,
            )
            process.start()
            child_conn.close()
            child_watch_conn.close()
            self.processes.append(process)
            self.conns.append(parent_conn)
            self.watch_conns.append(watch_conn)
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise PoolStartError(f"ranks {sorted(waiting)} did not join the process group within {START_TIMEOUT_S:.0f} s")
            ready = wait([self.conns[r] for r in waiting] + [self.processes[r].sentinel for r in waiting], remaining)
            for rank in sorted(waiting):
                conn, process = self.conns[rank], self.processes[rank]
                if conn in ready or (process.sentinel in ready and conn.poll()):
                    try:
                        message = expect(conn.recv(), Ready, StartupFailed)
                    except EOFError:
                        message = None
                    if isinstance(message, Ready):
                        waiting.discard(rank)
                        continue
                    detail = message.traceback if isinstance(message, StartupFailed) else _tail(self._path("log", rank))
                    self.kill()
                    raise PoolStartError(f"rank {rank} of {self.world_size} failed to start:\n{detail}")
                if process.sentinel in ready:
                    process.join(timeout=1)
                    code = process.exitcode
                    self.kill()
                    raise PoolStartError(
                        f"rank {rank} of {self.world_size} exited with code {code} while starting:\n"
                        f"{_tail(self._path('log', rank))}"
                    )

    def run(self, spec: CellSpec, *, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> CellOutcome:
        """Run one cell on every rank; a rank that raises, dies or hangs becomes a RankFault.
        ``while_waiting`` is called about every WAIT_SLICE_S while the ranks work (the progress line's).

        After any fault the pool is dead (killed): ``PoolSet.get`` starts it again before the next cell."""
        if not self.alive:
            raise PoolStartError("the pool's ranks are gone: PoolSet.get starts it again")
        self.log_offsets = [_size(self._path("log", rank)) for rank in range(self.world_size)]
        for conn in self.conns:
            conn.send(RunCell(spec))
        outcome = CellOutcome()
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world_size))
        first_fault_at: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if first_fault_at is None else min(deadline, first_fault_at + GRACE_S)
            if now >= limit:
                break
            handles = [self.conns[r] for r in pending] + [self.processes[r].sentinel for r in pending]
            ready = wait(handles, limit - now if while_waiting is None else min(limit - now, WAIT_SLICE_S))
            if while_waiting is not None:
                while_waiting()
            for rank in sorted(pending):
                conn, process = self.conns[rank], self.processes[rank]
                message: Any = None
                if conn in ready or (process.sentinel in ready and conn.poll()):
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = None
                if message is not None:
                    pending.discard(rank)
                    if take_result(outcome, rank, message, spec.cell_id):
                        first_fault_at = first_fault_at or time.monotonic()
                    continue
                if process.sentinel in ready or not process.is_alive():
                    process.join(timeout=1)
                    outcome.faults.append(self._death(rank))
                    pending.discard(rank)
                    first_fault_at = first_fault_at or time.monotonic()
        if pending:
            progress = self._progress(pending)
            stacks = self._dump_stacks(pending)
            kinds = stuck_kinds(sorted(pending), after_fault=first_fault_at is not None, progress=progress,
                                stacks=stacks)
            for rank in sorted(pending):
                outcome.faults.append(RankFault(rank, kinds[rank], stacks.get(rank, "")))
        mark_victims(outcome.faults)
        if outcome.faults:
            self.kill()
        return outcome

    def _death(self, rank: int) -> RankFault:
        code = self.processes[rank].exitcode
        log = _tail(self._path("log", rank), since=self.log_offsets[rank])
        if code is not None and code < 0:
            return RankFault(rank, FaultKind.KILLED, f"killed by {_signal_name(-code)}\n{log}".rstrip())
        return RankFault(rank, FaultKind.EXITED, f"exited with code {code}\n{log}".rstrip())

    def _progress(self, ranks: set[int]) -> dict[int, int | None]:
        """Each stuck rank's count of issued collectives, from its progress thread (None: no answer)."""
        asked = {}
        for rank in ranks:
            conn = self.watch_conns[rank]
            try:
                while conn.poll():  # an answer that came too late for an earlier cell
                    conn.recv()
                conn.send("progress?")
                asked[rank] = conn
            except (OSError, EOFError):
                pass
        answers: dict[int, int | None] = {rank: None for rank in ranks}
        deadline = time.monotonic() + PROGRESS_ANSWER_S
        while asked and time.monotonic() < deadline:
            for conn in wait(list(asked.values()), deadline - time.monotonic()):
                rank = next(r for r, c in asked.items() if c is conn)
                try:
                    answers[rank] = conn.recv()
                except (OSError, EOFError):
                    pass
                del asked[rank]
        return answers

    def _dump_stacks(self, ranks: set[int]) -> dict[int, str]:
        """Ask faulthandler in each stuck rank for every thread's stack."""
        for rank in ranks:
            path = self._path("stack", rank)
            try:
                os.truncate(path, 0)
                os.kill(self.processes[rank].pid, rank_side.DUMP_SIGNAL)
            except (OSError, TypeError):
                pass
        time.sleep(0.5)
        return {rank: _tail(self._path("stack", rank)) for rank in ranks}

    def kill(self) -> None:
        """End every rank at once and forget them."""
        for process in self.processes:
            if process.is_alive():
                try:
                    process.kill()
                except OSError:
                    pass
        for process in self.processes:
            process.join(timeout=5)
        for conn in self.conns + self.watch_conns:
            conn.close()
        self.processes = []
        self.conns = []
        self.watch_conns = []

    def close(self) -> None:
        """Ask the ranks to leave the group and exit; kill whoever does not within a few seconds."""
        for conn in self.conns:
            try:
                conn.send(Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5.0
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def remove_workdir(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


class CellRunner(Protocol):
    """Runs one cell on every rank of its world size: a local ``RankPool``, or a launch's ``LaunchedGroup``
    (harness/launch/group.py)."""

    def run(self, spec: CellSpec, *, timeout_s: float,
            while_waiting: Callable[[], None] | None = None) -> CellOutcome: ...


class Pools(Protocol):
    """Where a session's cells run: the local ``PoolSet`` (a pool per world size), or a launch's
    ``LaunchedGroup`` (the launcher's processes, of one world size)."""

    def prepare(self) -> None: ...

    def get(self, world_size: int) -> CellRunner: ...

    def close(self, *, graceful: bool = True) -> None: ...


class PoolSet:
    """One pool per world size, started when first needed and kept until ``close``."""

    def __init__(self, *, backend: str) -> None:
        self.backend = backend
        self.pools: dict[int, RankPool] = {}
        self.start_errors: dict[int, str] = {}
        # the last resort of every exit path that still runs Python code (the ranks themselves
        # die with this process through their parent-death signal)
        atexit.register(self.close, graceful=False)

    def prepare(self) -> None:
        """This session will start pools: have what their ranks import loaded ahead of time."""
        start_rank_server()

    def get(self, world_size: int) -> RankPool:
        """The live pool of this world size, (re)started if needed. A world size whose pool failed
        to start once is not tried again in this session: every later cell would wait for the
        same failure."""
        if world_size in self.start_errors:
            raise PoolStartError(f"{self.start_errors[world_size].splitlines()[0]} (failed earlier in this session)")
        if self.backend == "nccl":
            # A local pool's rank r uses GPU r: two pools at once would share GPUs (and fail outright
            # under EXCLUSIVE_PROCESS compute mode). One world size's pool at a time, then; the plugin
            # sends every nccl cell to one xdist worker, largest world size first.
            for other in [ws for ws in self.pools if ws != world_size]:
                previous = self.pools.pop(other)
                previous.close()
                previous.remove_workdir()
        pool = self.pools.get(world_size)
        if pool is None:
            pool = self.pools[world_size] = RankPool(world_size, backend=self.backend)
        if not pool.alive:
            pool.kill()
            try:
                pool.start()
            except PoolStartError as exc:
                self.start_errors[world_size] = str(exc)
                raise
        return pool

    def close(self, *, graceful: bool = True) -> None:
        """End every pool: ask the ranks to leave (``graceful``), or kill them at once. The pools'
        temporary folders go whatever happens on the way."""
        pools = list(self.pools.values())
        self.pools.clear()
        try:
            for pool in pools:
                if graceful:
                    pool.close()
                else:
                    pool.kill()
        finally:
            for pool in pools:
                pool.remove_workdir()
