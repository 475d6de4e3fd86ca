"""Where a launched process stands: its rank, world size, local rank and rendezvous, read from the
launcher's environment (torchrun and accelerate launch, or SLURM's srun). No torch here.

torchrun (and ``accelerate launch``, which runs torchrun's agent) sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``GROUP_WORLD_SIZE`` (the node and the node
count) and ``MASTER_ADDR``/``MASTER_PORT`` (its store). srun sets ``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID`` and ``SLURM_NNODES``; the rendezvous address is the batch
script's ``MASTER_ADDR``/``MASTER_PORT``, else the first host of the job and a port derived from the
job id. Where both are set (torchrun started by srun), torchrun's variables win: they describe the
processes torchrun made.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, MutableMapping

# The variables accelerate and torch's env:// rendezvous read.
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A SLURM job without MASTER_PORT meets on this port plus its job id modulo PORT_SPAN.
SLURM_BASE_PORT = 20000
PORT_SPAN = 20000


class LaunchError(ValueError):
    """The environment does not describe a launched process; the message is one line."""


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in a launch."""

    launcher: str  # "torchrun", "accelerate launch", "srun" or "env" (the variables set by hand)
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    run_id: str  # names this launch in the store, so that keys of another launch never mix in
    host: str


def _int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    text = environ.get(name, "")
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer") from None
    if value < minimum:
        raise LaunchError(f"{name}={text!r} must be at least {minimum}")
    return value


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,09],cpu1`` gives ``gpu03``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[,-]", ranges)[0]


def tasks_on_node(spec: str, node: int) -> int | None:
    """From SLURM's tasks-per-node list (``2(x3),1``): how many tasks node ``node`` runs."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _from_torchrun(environ: Mapping[str, str]) -> LaunchInfo:
    world_size = _int(environ, "WORLD_SIZE", minimum=1)
    rank = _int(environ, "RANK")
    if rank >= world_size:
        raise LaunchError(f"RANK={rank} is not below WORLD_SIZE={world_size}")
    local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in environ else world_size
    if "GROUP_RANK" in environ and "GROUP_WORLD_SIZE" in environ:
        node_rank, nodes = _int(environ, "GROUP_RANK"), _int(environ, "GROUP_WORLD_SIZE", minimum=1)
    else:
        node_rank, nodes = rank // local_world_size, max(1, world_size // local_world_size)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise LaunchError(f"RANK and WORLD_SIZE are set but {name} is not: the rendezvous needs it")
    if any(name.startswith("ACCELERATE_") for name in environ) and "TORCHELASTIC_RUN_ID" in environ:
        launcher = "accelerate launch"
    elif "TORCHELASTIC_RUN_ID" in environ:
        launcher = "torchrun"
    else:
        launcher = "env"
    run_id = f"{environ.get('TORCHELASTIC_RUN_ID', 'env')}.{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return LaunchInfo(launcher=launcher, rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, node_rank=node_rank, nodes=nodes,
                      master_addr=environ["MASTER_ADDR"], master_port=_int(environ, "MASTER_PORT", minimum=1),
                      run_id=run_id, host=socket.gethostname())


def _from_slurm(environ: Mapping[str, str]) -> LaunchInfo:
    world_size = _int(environ, "SLURM_NTASKS" if "SLURM_NTASKS" in environ else "SLURM_NPROCS", minimum=1)
    rank = _int(environ, "SLURM_PROCID")
    if rank >= world_size:
        raise LaunchError(f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}")
    node_rank = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    nodes = _int(environ, "SLURM_NNODES", minimum=1) if "SLURM_NNODES" in environ else 1
    local_rank = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    local_world_size = tasks_on_node(spec, node_rank) or max(1, world_size // nodes)
    job = environ.get("SLURM_JOB_ID", "0")
    master_addr = environ.get("MASTER_ADDR") or first_host(environ.get("SLURM_JOB_NODELIST", "") or
                                                           environ.get("SLURM_NODELIST", ""))
    if environ.get("MASTER_PORT"):
        master_port = _int(environ, "MASTER_PORT", minimum=1)
    else:
        master_port = SLURM_BASE_PORT + (int(job) if job.isdigit() else 0) % PORT_SPAN
    return LaunchInfo(launcher="srun", rank=rank, world_size=world_size, local_rank=local_rank,
                      local_world_size=local_world_size, node_rank=node_rank, nodes=nodes,
                      master_addr=master_addr, master_port=master_port,
                      run_id=f"slurm-{job}.{environ.get('SLURM_STEP_ID', '0')}", host=socket.gethostname())


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """This process's place in its launch; LaunchError when no launcher started it."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and ("SLURM_NTASKS" in environ or "SLURM_NPROCS" in environ):
        return _from_slurm(environ)
    raise LaunchError("no launcher started this process (neither RANK and WORLD_SIZE nor SLURM_PROCID and "
                      "SLURM_NTASKS are set): run it as `torchrun --nproc-per-node N -m harness launch`, "
                      "`srun python -m harness launch` or `accelerate launch -m harness launch`, or run "
                      "`pytest cases/` for local rank pools")


def export(info: LaunchInfo, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the variables torch's env:// rendezvous and accelerate read (srun sets none of them)."""
    environ = os.environ if environ is None else environ
    values = (info.rank, info.world_size, info.local_rank, info.local_world_size, info.master_addr, info.master_port)
    for name, value in zip(RENDEZVOUS_VARIABLES, values):
        environ[name] = str(value)
