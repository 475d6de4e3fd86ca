"""One rank of a two-rank group set up by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), through the
launch's own RankRuntime with a collective timeout of ten minutes. Rank 1 shuts down its connections
(RankRuntime.sever), as a rank whose cell raised does, and stays alive until rank 0 has seen the
result; rank 0 runs an all-reduce that rank 1 never joins. Then both join generation 1 of the group
and all-reduce in it. Rank 0 prints what its all-reduce did, as JSON, on its last line.

Run by tests/test_launch.py."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from harness.launch.channel import Channel, connect
from harness.launch.environment import detect
from harness.launch.rank import RankRuntime


def main() -> None:
    info = detect()
    runtime = RankRuntime(info, "gloo", cell_timeout_s=600.0)
    runtime.start()
    channel = Channel(connect(info))
    said: dict[str, object] = {}
    if info.rank == 1:
        said["severed"] = runtime.sever()
        channel.put("severed", said["severed"])
        channel.wait_for("seen")  # alive until rank 0 knows: its failure is not this process's exit
    else:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            said["error"] = None
        except RuntimeError as exc:
            said["error"] = " ".join(str(exc).split())
        said["seconds"] = time.monotonic() - started
        said["severed"] = channel.wait_for("severed")
        channel.put("seen", True)
    runtime.rejoin(1, channel)  # every rank leaves the old group and joins the next generation
    total = torch.full((2,), float(info.rank + 1))
    dist.all_reduce(total)
    said["rejoined_sum"] = total.tolist()
    runtime.close()
    if info.rank == 0:
        print(json.dumps(said), flush=True)


if __name__ == "__main__":
    main()
