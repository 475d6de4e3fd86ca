"""What every rank of a local pool imports before it is a rank: loaded once, in the pools' fork server.

A local pool's ranks are forked from one server process that imported torch, accelerate and the
rank side (multiprocessing's "forkserver" start method, with this module as its preload). Each
rank then starts in a fraction of a second instead of importing them again: about 2.5 s of CPU a
rank, 12 s for the pools of world sizes 1 to 4 on two cores, and again for each pool restarted
after a fault. The server is a fresh single-threaded interpreter started by the controller (not a
fork of it: the controller runs pytest's and xdist's threads), and it only imports: no thread, no
process group and no device is made before the fork. A rank takes the controller's environment as
it was when its pool started (``process.main.main``), not the server's.
"""

from __future__ import annotations

import os

from harness import heap

# The threads torch's OpenMP runtime starts with are read from the environment when it loads:
# a rank computes on one thread (``process.environment.limit_threads``), and so does the server it is forked from.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("ACCELERATE_DISABLE_RICH", "1")
# large tensors on huge pages (harness/rank/process/environment.py, keep_large_allocations): torch reads it once, at the
# first tensor, which this server may make before it forks the ranks
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# the collector paused while torch, accelerate and the rank side are imported, and what they leave
# alive frozen out of its reach, in this server and so in every rank forked from it (harness/heap.py)
with heap.imports_frozen():
    import torch  # noqa: E402
    import torch._dynamo  # noqa: E402,F401  (imported lazily by a rank's first optimizer: a second)
    import torch.distributed  # noqa: E402,F401
    from accelerate import Accelerator  # noqa: E402,F401

    from harness.rank import context  # noqa: E402,F401
    from harness.rank.process import main  # noqa: E402,F401

    torch.set_num_threads(1)
