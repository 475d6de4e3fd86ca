"""A launched rank of world size 1 whose watch thread is inside a store call when the process ends, and
whose call returns only once the interpreter has begun to exit (the key it waits on is set by an
``atexit`` handler, through another client). Its store is one this process serves.

The rank ends as a launched rank does (``RankRuntime.close``, then ``exit_status``) and exits with
status 3. Left to the interpreter's exit, the thread's return into Python from a C++ frame is ended
by a forced unwind, which aborts the process (SIGABRT: the abort a passing launch once ended with);
the runtime must not leave it there.

Run by tests/test_launch.py."""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta

import torch.distributed as dist

from harness.launch import rank as launched
from harness.launch.channel import Channel, connect
from harness.launch.environment import LaunchInfo


class HeldChannel(Channel):
    """The watch thread's channel: its first beat waits until the interpreter has begun to exit."""

    def count(self, key: str, by: int) -> int:
        self.store.set("entered", b"1")
        self.store.wait(["exiting"], timedelta(seconds=60))
        return super().count(key, by)


def main() -> int:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = LaunchInfo(launcher="env", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      nodes=1, master_addr="127.0.0.1", master_port=server.port, run_id="watch-at-exit",
                      host="localhost")
    launched.Channel = HeldChannel  # what start_watch gives the thread
    launched.WATCH_STOP_S = float(sys.argv[1])
    runtime = launched.RankRuntime(info, "gloo", cell_timeout_s=5.0)
    launched.start_watch(runtime, driver=True)
    releaser = connect(info)
    releaser.wait(["entered"], timedelta(seconds=60))  # the thread is in its call (or about to be)
    atexit.register(lambda: releaser.set("exiting", b"1"))
    runtime.close()
    return runtime.exit_status(3)


if __name__ == "__main__":
    sys.exit(main())
