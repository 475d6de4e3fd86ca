"""Whether a launched rank's process is gone, told by rank 0 at once where it can see that process.

A rank on another host is found dead by its silence (its heartbeat stands still for
``group.LOST_AFTER_S``, or it does not answer where it is within ``group.ASK_WAIT_S``). A rank on
rank 0's own host, seen through the same process table, needs no wait: its process is not there
any more, or is a zombie its launcher has not reaped yet. Each rank says at start which process
it is (``identity``): a pid means the same process only on the same running kernel (its boot id),
in the same pid namespace (a container has its own), and while that pid has not been given to a
new process (the process's start time, in clock ticks since boot).
"""

from __future__ import annotations

import os
from typing import Any

from harness.rank.process.environment import process_alive

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def identity() -> dict[str, Any] | None:
    """This process, as another process on the same host can find it; None where /proc cannot say."""
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    started = _started(os.getpid())
    if started is None:
        return None
    return {"boot": boot, "pid_namespace": namespace, "pid": os.getpid(), "started": started}


def gone(peer: dict[str, Any] | None, mine: dict[str, Any] | None) -> bool:
    """Whether ``peer``'s process has ended (or is a zombie), told from this one's process table:
    False wherever that table cannot say (another host, another pid namespace, no identity)."""
    if not peer or not mine or (peer.get("boot"), peer.get("pid_namespace")) != (mine["boot"], mine["pid_namespace"]):
        return False
    pid = int(peer["pid"])
    return not process_alive(pid) or _started(pid) not in (None, peer["started"])


def _started(pid: int) -> int | None:
    """The process's start time (``man 5 proc``: field 22 of its stat), or None where it cannot be read.
    The name (field 2) may hold spaces and parentheses: the fields after it are counted from its last
    ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None
