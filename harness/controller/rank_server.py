"""What a local pool's ranks are forked from: a fork server that has imported what every rank needs
(harness/rank/process/preload.py), started by this process, or one another process started and shares.

A session starts its own server as it collects its first case file and kills it when it exits (its
ranks go with it). A process that starts many sessions one after another (the harness's own test
suite) can start one server for all of them and name it to them in GRADSYNC_HARNESS_RANK_SERVER
(``start_shared_server``): each then forks its ranks from that one instead of importing torch and
accelerate into a server of its own, seconds of CPU a session; the shared one also imports the
libraries only some cells use (harness/rank/process/preload_all.py), except on a host with a GPU driver. A
session adopts a shared server only where its own would fork the same ranks: the same interpreter,
the same start-up code (``sitecustomize``, ``usercustomize``), the same torch, accelerate, harness,
transformers and DeepSpeed found where the server found them, the same settings of what those read
from the environment as they load (HF_HUB_OFFLINE, say), a Python whose fork server takes a client
without a key (3.14 adds one), and the server still there; else it starts its own, as without the
variable. It never ends a server it did not start. A rank forked from a shared server is not its
controller's child: it leaves when its controller is gone (``process.main._die_with_parent`` polls for it).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
from typing import Any

from harness.controller.options import gpu_driver_present
from harness.rank.process.environment import process_alive

# The module the ranks' fork server imports before it forks any rank; and the one that also imports
# the libraries only some cells use, for a process that runs many pools (``preload_all``).
RANK_PRELOAD = "harness.rank.process.preload"
RANK_PRELOAD_ALL = "harness.rank.process.preload_all"
# A fork server another process started, for this one's ranks (``start_shared_server``'s value);
# empty or unset: this process starts its own.
SHARED_SERVER_VARIABLE = "GRADSYNC_HARNESS_RANK_SERVER"
# What makes a fresh interpreter's imports what they are: where each of these is found (None: not
# found), the libraries a server imports for some cells with them (harness/rank/process/preload_all.py). A
# rank is a fork of its server, with the server's modules, not the session's.
_FOUND = ("sitecustomize", "usercustomize", "torch", "accelerate", "harness", "transformers", "deepspeed")
# ... and what they read from the environment as they load, kept in module constants: huggingface_hub
# its HF_HUB_OFFLINE and HF_HOME, DeepSpeed its DS_ACCELERATOR, torch its TORCH_LOGS and dynamo's and
# inductor's settings. A rank has what its server read, whatever the rank's own environment says.
_READ_AS_THEY_LOAD = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DS_", "DEEPSPEED_", "TORCH", "PYTORCH_")
# Of those, what the libraries write there themselves as they load (torch its inductor's cache folder,
# for its own subprocesses; DeepSpeed PYTORCH_NVML_BASED_CUDA_CHECK): they differ between a server and
# a session only by what each has loaded yet.
_WRITTEN_AS_THEY_LOAD = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")

# Whether the fork server could not start (why, then), whether it is ended at exit, the pid of a
# shared server this process forks from (never ended here), that of one it started for others, and
# what this process's own server preloads.
_rank_server: dict[str, Any] = {"failed": "", "ends_at_exit": False, "shared": None, "for_others": set(),
                                "preload": RANK_PRELOAD}


def rank_context() -> Any:
    """How ranks are started: forked from a server that has imported what every rank needs, where
    the platform has one and it could start; else spawned, each rank importing it anew (the same
    ranks, seconds slower)."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or _rank_server["failed"]:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([_rank_server["preload"]])  # a name: the controller must not import it
    return ctx


def preload_all() -> None:
    """Have this process's own fork server, if it starts later, also import the libraries only some
    cells use (harness/rank/process/preload_all.py): for a process that will run many pools, which would
    otherwise import them in each rank that runs such a cell."""
    _rank_server["preload"] = _for_many_pools()


def _for_many_pools() -> str:
    """What a server for many pools preloads: RANK_PRELOAD_ALL, except on a host with a GPU driver. There
    DeepSpeed asks torch for the GPUs as it loads, and a fork server must never initialise CUDA (no
    rank forked from it could use the GPU): each rank imports what its cells use, as before."""
    return RANK_PRELOAD if gpu_driver_present() else RANK_PRELOAD_ALL


def start_rank_server() -> None:
    """Have the ranks' fork server running now, so that it imports torch while the controller does
    other work (importing the case files), not when the first pool starts: the shared one named in
    SHARED_SERVER_VARIABLE where it can be adopted, else one of this process's own. Where there is
    none, or it cannot start, ranks are spawned instead."""
    ctx = rank_context()
    if ctx.get_start_method() != "forkserver" or _rank_server["shared"] is not None:
        return
    from multiprocessing import forkserver

    if _adopt_shared_server(forkserver._forkserver):
        return
    try:
        forkserver.ensure_running()
    except OSError as exc:
        # its socket is a file in the temporary folder: under a deep TMPDIR the path can be longer
        # than a Unix socket's address may be ("AF_UNIX path too long")
        _rank_server["failed"] = str(exc) or type(exc).__name__
        return
    if not _rank_server["ends_at_exit"]:
        atexit.register(_end_rank_server)
        _rank_server["ends_at_exit"] = True


def _end_rank_server() -> None:
    """At exit, end this process's own fork server at once. It would go by itself once it saw this
    process gone, but only after its imports: a run that started it and then had no cell to run
    (every case deselected, say) would leave it importing torch, and holding the run's output open,
    for seconds after the run ended. Its ranks go with it (their parent-death signal)."""
    from multiprocessing import forkserver

    if _rank_server["shared"] is None:
        _kill(getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None))


def start_shared_server() -> tuple[Any, str]:
    """Start a fork server of this process's (apart from the one its own pools use) for the sessions
    it will start, and return it with the value of SHARED_SERVER_VARIABLE that names it to them. It
    ends when this process does, or at ``end_shared_server``."""
    from multiprocessing import forkserver

    server = forkserver.ForkServer()
    preload = _for_many_pools()  # it serves many sessions, of many pools
    server.set_forkserver_preload([preload])
    server.ensure_running()
    value = json.dumps({"pid": server._forkserver_pid, "address": server._forkserver_address,
                        "python": sys.prefix, "found": _found(), "preload": preload,
                        "environment": _read_as_they_load()})
    _rank_server["for_others"].add(server._forkserver_pid)  # this process's own pools keep their own server
    return server, value


def end_shared_server(server: Any) -> None:
    """End a server of ``start_shared_server``'s, its ranks with it, and reap it."""
    if _kill(getattr(server, "_forkserver_pid", None), reap=True):
        server._forkserver_pid = None


def _kill(pid: int | None, *, reap: bool = False) -> bool:
    """SIGKILL a fork server of this process's (``pid``; None: there is none), and with ``reap`` wait
    for it; whether there was one."""
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        if reap:
            os.waitpid(pid, 0)
    except OSError:
        pass
    return True


def shared_server_pid() -> int | None:
    """The pid of the shared server this process forks its ranks from, if it adopted one."""
    return _rank_server["shared"]


def _adopt_shared_server(server: Any) -> bool:
    """Make multiprocessing's fork server of this process the shared one named in the environment,
    where it is one this process's own would equal and this Python's fork server can be pointed at
    it: its address, its pid, and an end of a pipe of this process's own to hand each rank where
    the server's starter hands the end the server watches. multiprocessing checks that a server it
    started is still its child before each fork (``ensure_running``); this one is not, so that check
    is replaced, for this server object alone, by the resource tracker's start it also makes."""
    value = os.environ.get(SHARED_SERVER_VARIABLE, "")
    if not value or getattr(server, "_forkserver_pid", None) is not None:  # unnamed, or a server of its own
        return False
    try:
        named = json.loads(value)
    except ValueError:
        named = None
    # a server that also imports the optional libraries forks the same ranks (harness/rank/process/preload_all.py)
    if not isinstance(named, dict) or named.get("python") != sys.prefix \
            or named.get("preload") not in (RANK_PRELOAD, RANK_PRELOAD_ALL) \
            or named.get("found") != _found() or named.get("environment") != _read_as_they_load():
        return False
    attributes = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if not all(hasattr(server, a) for a in attributes) or hasattr(server, "_forkserver_authkey"):
        return False
    pid, address = named.get("pid"), named.get("address")
    if not isinstance(pid, int) or not isinstance(address, str) or not os.path.exists(address) \
            or not process_alive(pid) or pid in _rank_server["for_others"]:
        return False
    from multiprocessing import resource_tracker

    with server._lock:
        if server._forkserver_pid is not None:
            return False
        read_end, write_end = os.pipe()
        os.close(read_end)
        server._forkserver_address = address
        server._forkserver_alive_fd = write_end
        server._forkserver_pid = pid
        server.ensure_running = resource_tracker.ensure_running
    _rank_server["shared"] = pid
    return True


def _read_as_they_load() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name.startswith(_READ_AS_THEY_LOAD) and name not in _WRITTEN_AS_THEY_LOAD}


def _found() -> dict[str, str | None]:
    found = {}
    for name in _FOUND:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        found[name] = None if spec is None else spec.origin
    return found
