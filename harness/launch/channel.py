"""How a launch's ranks talk: keys in the launcher's own store (the TCPStore behind torchrun's, srun's or
accelerate's env:// rendezvous at MASTER_ADDR:MASTER_PORT), under a prefix that names the launch.

Rank 0 drives; every rank runs the cells. The keys:

- ``msg/N``: the Nth message from rank 0 to every rank (run a cell, rejoin a new process group, shut down)
- ``result/N/R`` and the counter ``done/N``: rank R's result for message N
- ``beat/R``: rank R's heartbeat, a counter its watch thread moves twice a second
- ``ask/K``, ``answer/K/R``: rank 0 asks every rank how far it got (collectives issued) and where it is (stacks)
- ``abort/G``: abort process group generation G, so that ranks blocked in its collectives return
- ``ready/G/R``: rank R is about to join generation G
- ``stop``: exit now with this status (after a rank died or hung, nothing else can end the others)

Each thread has its own client: a client runs one request at a time, so a thread that waits must not
hold up another's heartbeat.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any

from harness.launch.environment import LaunchInfo

STORE_TIMEOUT_S = 300.0
_MAX_SLEEP_S = 0.02


def connect(info: LaunchInfo, *, timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """A new client of the launcher's store, with this launch's prefix."""
    import torch.distributed as dist

    client = dist.TCPStore(info.master_addr, info.master_port, is_master=False,
                           timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"gradsync-harness/{info.run_id}", client)


class Channel:
    """One thread's view of the launch's keys."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def put(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def take(self, key: str) -> Any:
        return pickle.loads(self.store.get(key))

    def drop(self, key: str) -> None:
        """Forget a key that no rank reads again: a long launch leaves no pile of results in the store."""
        self.store.delete_key(key)

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def count(self, key: str, add: int = 0) -> int:
        return int(self.store.add(key, add))

    def wait_for(self, key: str, *, timeout_s: float | None = None, idle: Any = None) -> Any:
        """The value of ``key`` once it is set. Polls (a blocking wait would hold this client, and a
        timed-out one logs a warning); ``idle()`` runs between polls and may raise to give up."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sleep = 0.0005
        while not self.has(key):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(key)
            if idle is not None:
                idle()
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
        return self.take(key)


def message_key(n: int) -> str:
    return f"msg/{n}"


def result_key(n: int, rank: int) -> str:
    return f"result/{n}/{rank}"
