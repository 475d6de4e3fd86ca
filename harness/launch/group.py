"""Rank 0 of a launch as the driver: it sends each cell to every rank (itself included, on a thread
of its own), collects the results, and turns a rank that raised, died or hung into faults, as a local
pool does. It stands in for the local PoolSet, so that cells run through the one cell runner
(harness/controller/cells.py).

A rank that raised leaves the group usable: every rank aborts the process group and joins a new one,
and the launch goes on. A rank that died or hung cannot be replaced under a launcher: the cell is an
error naming it, and every later cell is recorded as not run because of it (GroupLost).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from harness.controller.blame import collective_error, mark_victims, stuck_kinds, take_result
from harness.controller.pool import GRACE_S, WAIT_SLICE_S, GroupLost
from harness.launch import liveness
from harness.launch.channel import Channel, message_key, result_key
from harness.launch.rank import COLLECTIVE_MARGIN_S, RankRuntime, run_guarded
from harness.messages import CellOutcome, CellSpec, Rejoin, RunCell, Shutdown
from harness.rank.process import main as rank_side
from harness.records import FaultKind, RankFault

LOST_AFTER_S = 5.0  # a rank whose heartbeat stands still this long during a cell has died
# how often rank 0 looks for the processes of the ranks on its own host (harness/launch/liveness.py)
LOOK_S = 0.2
ASK_WAIT_S = 5.0  # how long stuck ranks get to say how far they got (a live one answers within a second)
REJOIN_S = 60.0  # how long every rank gets to join the new process group after a fault
BYE_WAIT_S = 3.0  # at the end, how long the others get to leave before rank 0 (maybe the store's host) exits


class Executor:
    """Rank 0's own part of each cell, on a thread: the main thread stays free to drive and to time out."""

    def __init__(self, runtime: RankRuntime) -> None:
        self.runtime = runtime
        self.todo: queue.Queue[tuple[int, RunCell]] = queue.Queue()
        self.done: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.busy = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="harness-rank0-cells", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.runtime.backend == "nccl":  # the current device is per thread
            import torch

            torch.cuda.set_device(self.runtime.device)
        while True:
            n, message = self.todo.get()
            self.busy.set()
            result = run_guarded(message, self.runtime)
            self.busy.clear()
            self.done.put((n, result))

    def submit(self, n: int, message: RunCell) -> None:
        self.busy.set()
        self.todo.put((n, message))

    def result(self, n: int) -> Any:
        """The result for message ``n`` if it is in (late results of earlier cells are dropped)."""
        while True:
            try:
                got, result = self.done.get_nowait()
            except queue.Empty:
                return None
            if got == n:
                return result

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.busy.is_set() or not self.todo.empty():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def stack(self) -> str:
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""


class LaunchedGroup:
    """The launch's ranks, driven from rank 0; ``Pools`` (harness/controller/pool.py) as the plugin and
    cells.py use it, and the one ``CellRunner`` it gets."""

    def __init__(self, runtime: RankRuntime, channel: Channel, hosts: list[str],
                 processes: list[dict[str, Any] | None] | None = None) -> None:
        self.runtime = runtime
        self.channel = channel
        self.hosts = hosts
        # each rank's process (liveness.identity), and rank 0's: a rank on this host found gone is lost at once
        self.processes = processes or [None] * len(hosts)
        self.me = liveness.identity()
        self.world_size = runtime.info.world_size
        self.executor = Executor(runtime)
        self.sent = 0
        self.asked = 0
        self.lost = ""  # why no further cell can run
        self.stopping = ""  # the signal with which the launcher is stopping this run
        self.stopping_at = 0.0
        self.running = False
        self.rejoin_after = ""  # a rank raised in this cell: rebuild the group before the next one

    # Pools, and CellRunner

    def get(self, world_size: int) -> "LaunchedGroup":
        """The group, ready for a cell: rebuilt first if a rank raised in the last one (as a local pool
        is restarted before the next cell, outside any cell's time)."""
        if world_size != self.world_size:
            raise GroupLost(f"the launcher started {self.world_size} ranks, not {world_size}")
        if self.rejoin_after and not self.lost and not self.stopping:
            where, self.rejoin_after = self.rejoin_after, ""
            self._rejoin(where)
        if self.lost:
            raise GroupLost(self.lost)
        if self.stopping:
            raise GroupLost(f"the launcher stopped the run ({self.stopping})")
        return self

    def prepare(self) -> None:
        """Nothing to load ahead: the launcher's processes are the ranks, and imported what they run."""

    def close(self, *, graceful: bool = True) -> None:
        """Nothing to do here: the launch command ends the group with the run's status (finish)."""

    def kill(self) -> None:
        """The driver failed while waiting on a cell: the ranks may be anywhere, so none is run again."""
        self.lost = self.lost or "rank 0 failed while it waited for a cell"

    def on_signal(self, signum: int) -> bool:
        """SIGTERM or SIGHUP from the launcher (torchrun stops every rank of a node when one of them
        dies): let the running cell end within a grace, naming who failed, and run no other. True
        when a cell is running (the signal is handled); False to let pytest's interrupt path end the
        run."""
        if not self.running:
            return False
        self.stopping, self.stopping_at = signal.Signals(signum).name, time.monotonic()
        return True

    def _send(self, message: Any) -> int:
        """Post the next message. Every rank has read the one before (rank 0 sends a message only
        once each rank answered the last, or was given up on), so that one goes."""
        self.sent += 1
        self.channel.put(message_key(self.sent), message)
        if self.sent > 1:
            self.channel.drop(message_key(self.sent - 1))
        return self.sent

    def run(self, spec: CellSpec, *, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> CellOutcome:
        self.running = True
        try:
            return self._run(spec, timeout_s=timeout_s, while_waiting=while_waiting)
        finally:
            self.running = False

    def _run(self, spec: CellSpec, *, timeout_s: float, while_waiting: Callable[[], None] | None) -> CellOutcome:
        n = self._send(RunCell(spec))
        self.executor.submit(n, RunCell(spec))
        outcome = CellOutcome()
        pending = set(range(self.world_size))
        now = time.monotonic()
        deadline, first_fault_at, seen = now + timeout_s, None, 0
        beats: dict[int, tuple[int, float]] = {r: (-1, now) for r in pending if r != 0}
        next_beat_check, next_look, sleep = now + 1.0, now + LOOK_S, 0.0005
        next_tick = now + WAIT_SLICE_S
        while pending:
            now = time.monotonic()
            limit = deadline if first_fault_at is None else min(deadline, first_fault_at + GRACE_S)
            if self.stopping:
                limit = min(limit, self.stopping_at + GRACE_S)
            if now >= limit:
                break
            got = False
            if 0 in pending:
                result = self.executor.result(n)
                if result is not None:
                    self._take(outcome, pending, 0, result, spec)
                    got = True
            followers = sorted(pending - {0})
            if followers and self.channel.count(f"done/{n}") > seen:
                seen = self.channel.count(f"done/{n}")
                for rank in followers:
                    if self.channel.has(result_key(n, rank)):
                        self._take(outcome, pending, rank, self.channel.take(result_key(n, rank)), spec)
                        self.channel.drop(result_key(n, rank))
                got = True
            if followers and now >= next_beat_check:
                next_beat_check = now + 1.0
                for rank in followers:
                    beat, since = beats[rank]
                    count = self.channel.count(f"beat/{rank}")
                    if count != beat:
                        beats[rank] = (count, now)
                    elif now - since > LOST_AFTER_S and rank in pending:
                        outcome.faults.append(self._lost(rank, f"no heartbeat for {now - since:.0f} s"))
                        pending.discard(rank)
            if followers and now >= next_look:
                next_look = now + LOOK_S
                for rank in self._gone(pending - {0}):
                    outcome.faults.append(self._lost_here(rank))
                    pending.discard(rank)
            if first_fault_at is None and outcome.faults:
                first_fault_at = now
            sleep = 0.0005 if got else min(sleep * 2, 0.01)
            if while_waiting is not None and now >= next_tick:
                next_tick = now + WAIT_SLICE_S
                while_waiting()
            time.sleep(sleep)
        if pending:
            # a rank whose collective timed out or failed is a victim: it shows no cause of its own
            caused = any(f.what != FaultKind.RAISED or not collective_error(f.detail) for f in outcome.faults)
            outcome.faults += self._stuck(pending, after_fault=caused or bool(self.stopping))
        mark_victims(outcome.faults)
        for fault in outcome.faults:
            fault.host = self.hosts[fault.rank]
        if outcome.faults or self.stopping:
            self._after_faults(outcome.faults, spec)
        return outcome

    def _take(self, outcome: CellOutcome, pending: set[int], rank: int, message: Any, spec: CellSpec) -> None:
        pending.discard(rank)
        take_result(outcome, rank, message, spec.cell_id)

    def _lost(self, rank: int, why: str) -> RankFault:
        return RankFault(rank, FaultKind.LOST, f"{why}: the process died, or its host did (its exit status and "
                                               f"output are in the launcher's log on {self.hosts[rank]})")

    def _gone(self, ranks: set[int]) -> list[int]:
        """Those of ``ranks`` on rank 0's own host whose process has ended."""
        return [rank for rank in sorted(ranks) if liveness.gone(self.processes[rank], self.me)]

    def _lost_here(self, rank: int) -> RankFault:
        return RankFault(rank, FaultKind.LOST, f"its process, pid {self.processes[rank]['pid']}, has ended: its exit "
                                               f"status and output are in the launcher's log on {self.hosts[rank]}")

    def _stuck(self, pending: set[int], *, after_fault: bool) -> list[RankFault]:
        """Ask the ranks that gave no result how far they got and where they are; blame from that."""
        progress: dict[int, int | None] = {}
        stacks: dict[int, str] = {}
        faults: list[RankFault] = []
        if 0 in pending:
            progress[0], stacks[0] = rank_side.collectives_issued(), self.executor.stack()
        silent = set(pending - {0})
        if silent:
            self.asked += 1
            self.channel.put(f"ask/{self.asked}", True)
            deadline = time.monotonic() + ASK_WAIT_S
            while silent and time.monotonic() < deadline:
                for rank in sorted(silent):
                    if self.channel.has(f"answer/{self.asked}/{rank}"):
                        progress[rank], stacks[rank] = self.channel.take(f"answer/{self.asked}/{rank}")
                        silent.discard(rank)
                gone = self._gone(silent)  # no answer will come: not waited for
                if gone:
                    faults += [self._lost_here(rank) for rank in gone]
                    silent.difference_update(gone)
                    pending = pending - set(gone)
                time.sleep(0.02)
        faults += [self._lost(rank, f"no answer within {ASK_WAIT_S:g} s") for rank in sorted(silent)]
        answered = sorted(pending - silent)
        kinds = stuck_kinds(answered, after_fault=after_fault or bool(silent) or bool(faults), progress=progress,
                            stacks=stacks)
        return faults + [RankFault(rank, kinds[rank], stacks.get(rank, "")) for rank in answered]

    def _after_faults(self, faults: list[RankFault], spec: CellSpec) -> None:
        where = f"{spec.case}[{spec.variant}]"
        fatal = [f for f in faults if f.what not in (FaultKind.RAISED, FaultKind.BLOCKED)]
        if fatal:
            words = {FaultKind.HUNG: "hung", FaultKind.LOST: "died"}
            self.lost = "; ".join(f"rank {f.rank} on {f.host} {words.get(f.what, f.what)} in {where}" for f in fatal)
        elif self.stopping:
            self.lost = f"the launcher stopped the run ({self.stopping}) during {where}"
        else:
            self.rejoin_after = where

    def _rejoin(self, where: str) -> None:
        """After a raise: abort the process group everywhere and join a new one, or give up naming who did not."""
        old = self.runtime.generation
        self.channel.put(f"abort/{old}", True)
        self.runtime.abort(old)
        # a blocked gloo collective returns at its timeout (the cell's and a margin); nccl's at the abort
        if not self.executor.wait_idle(self.runtime.cell_timeout_s + COLLECTIVE_MARGIN_S + REJOIN_S):
            self.lost = f"rank 0 on {self.hosts[0]} did not return from {where} after its process group was aborted"
            return
        generation = old + 1
        self._send(Rejoin(generation))
        missing = set(range(1, self.world_size))
        deadline = time.monotonic() + REJOIN_S
        while missing and time.monotonic() < deadline:
            missing = {r for r in missing if not self.channel.has(f"ready/{generation}/{r}")}
            time.sleep(0.01)
        if missing:
            ranks = ", ".join(f"rank {r} on {self.hosts[r]}" for r in sorted(missing))
            self.lost = f"{ranks} did not rejoin the process group after the fault in {where} (stuck there)"
            return
        self.runtime.rejoin(generation, self.channel)

    def finish(self, status: int) -> int:
        """End the launch with the run's status on every rank. Ranks that may not be listening (one
        died or hung, or the last cell's fault left ranks blocked) are told through the store, and
        this process leaves at once: a thread of it may be stuck in a collective."""
        if not self.lost and not self.stopping and not self.rejoin_after:
            self._send(Shutdown(status))
            self._wait_for_byes()
            self.runtime.close()
            return self.runtime.exit_status(status)
        self.channel.put("stop", status)
        self._wait_for_byes()
        self.runtime.abort(self.runtime.generation, wait=False)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def _wait_for_byes(self) -> None:
        deadline = time.monotonic() + BYE_WAIT_S
        waiting = set(range(1, self.world_size))
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not self.channel.has(f"bye/{r}")} - set(self._gone(waiting))
            time.sleep(0.02)
