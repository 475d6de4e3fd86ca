"""What the fork server of a process that runs many pools imports: what every rank imports
(harness/rank/process/preload.py), and the libraries only some cells use, which a rank otherwise imports at
its first such cell: transformers' Trainer, DeepSpeed, and torch.compile's inductor.

Imported once here, they cost about 1.3 s of CPU in the server instead of as much in each rank of
each pool that runs such a cell: three times that in a pool of three ranks, again in every pool
restarted after a fault. A run of a cell or two pays it without gain, and waits for it (the server
is still importing when its first pool starts): a session's own server imports them only where its
process asked (``rank_server.preload_all``: the self-check, the harness's own test suite), and a
shared server always (``rank_server.start_shared_server``); neither on a host with a GPU driver,
where DeepSpeed asks torch for the GPUs as it loads and a fork server must never initialise CUDA. The
ranks' cells are the same either way.
"""

from __future__ import annotations

import importlib
import os
import sys

from harness import heap
from harness.rank.process import preload  # noqa: F401  (first: its thread settings hold for what follows)

# What some cells import: the Trainer cases (and a script's own Trainer), the deepspeed-* wrappers, and
# the compiled variants (a first aot_eager compile imports 600 modules, much of inductor and networkx
# among them; inductor's compile_fx imports them all).
OPTIONAL = ("transformers.trainer", "deepspeed", "torch._inductor.compile_fx")


def _import_quietly(names: tuple[str, ...]) -> None:
    """Import each of ``names`` that imports, printing nothing: this server writes to its starter's
    terminal, where DeepSpeed would log the accelerator it picked. One that does not import is left
    to the cells that need it, which say why."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    quiet = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:
                pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, quiet):
            os.close(fd)


with heap.imports_frozen():
    _import_quietly(OPTIONAL)
