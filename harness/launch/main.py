"""``python -m harness launch [pytest options and paths]``: the catalogue with a launcher's processes as
the ranks (``torchrun ... -m harness launch``, ``srun python -m harness launch``, ``accelerate launch -m
harness launch``).

Every process joins the launcher's rendezvous (env://) as one rank: the world size is the launcher's,
the device is its LOCAL_RANK's. Global rank 0 runs pytest: it collects the cells, runs each through
the one cell runner on every rank (LaunchedGroup), and writes the one matrix, recording the launch in
its environment (launcher, nodes, processes per node, hosts, devices). Every rank exits with the run's
status. Without paths it runs ``cases/`` of the working directory, else the installed catalogue.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

import pytest

from harness import heap
from harness.controller.options import (
    DEFAULT_CASE_TIMEOUT_S,
    OptionError,
    Settings,
    parse_backend,
    parse_case_timeout,
    parse_world_sizes,
)
from harness.launch import environment as launcher
from harness.plugin import LAUNCH_PLUGIN

EXIT_USAGE = 2
EXIT_START = 3


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value given to ``name`` (``--name V`` or ``--name=V``; the last one wins), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def choose_backend(requested: str, info: launcher.LaunchInfo) -> str:
    """auto: nccl when every local rank of this node has a GPU of its own (CUDA or ROCm), else gloo."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= info.local_world_size else "gloo"
    if requested == "nccl" and info.local_rank >= gpus:
        raise OptionError(f"--backend: nccl needs a GPU for every local rank, but local rank {info.local_rank} "
                          f"on {info.host} sees {gpus}")
    return requested


def relaunch_prefix(info: launcher.LaunchInfo) -> tuple[str, ...]:
    """The same launcher and shape, up to ``-m harness launch``: what a cell's rerun command starts with."""
    if info.launcher == "srun":
        return ("srun", "--nodes", str(info.nodes), "--ntasks-per-node", str(info.local_world_size), "python")
    if info.launcher == "accelerate launch":
        return ("accelerate", "launch", "--multi_gpu", "--num_machines", str(info.nodes),
                "--num_processes", str(info.world_size))
    if info.nodes == 1:
        return ("torchrun", "--standalone", "--nproc-per-node", str(info.local_world_size))
    return ("torchrun", "--nnodes", str(info.nodes), "--nproc-per-node", str(info.local_world_size),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{info.master_addr}:29500")


def _device_name(backend: str, device: Any) -> str:
    if backend != "nccl":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_name(device))


class LaunchPlugin:
    """Given to rank 0's pytest: the plugin (harness/plugin.py) takes its ranks, settings and
    environment from here instead of starting local pools."""

    def __init__(self, group: Any, info: launcher.LaunchInfo, backend: str, peers: list[dict[str, Any]],
                 dropped: list[str]) -> None:
        self.__name__ = LAUNCH_PLUGIN  # the name pluggy registers it under, which the plugin looks up
        self.pools = group
        self.info = info
        self.backend = backend
        self.peers = peers
        self.dropped = dropped

    def adapt(self, config: pytest.Config, settings: Settings) -> Settings:
        """The run's settings under the launcher; OptionError for what cannot be."""
        if config.getoption("numprocesses", None):
            raise OptionError("-n: cannot be used under a launcher: its processes are the ranks")
        requested = parse_world_sizes(config.getoption("world_sizes"))
        ws = self.info.world_size
        if requested is not None and requested != (ws,):
            raise OptionError(f"--world-sizes: the launcher started {ws} rank{'s' if ws > 1 else ''}; under a "
                              f"launcher the world size is the launcher's (leave it out, or give {ws})")
        return dataclasses.replace(settings, world_sizes=(ws,), backend=self.backend,
                                   device="cuda" if self.backend == "nccl" else "cpu", gpu_count=ws, launched=True,
                                   relaunch=relaunch_prefix(self.info))

    def environment(self) -> dict[str, Any]:
        hosts = list(dict.fromkeys(p["host"] for p in self.peers))
        per_node = sorted({p["local_world_size"] for p in self.peers})
        environment: dict[str, Any] = {
            "launcher": self.info.launcher,
            "nodes": self.info.nodes,
            "processes_per_node": per_node[0] if len(per_node) == 1 else per_node,
            "hosts": hosts,
            "devices": list(dict.fromkeys(p["device"] for p in self.peers)),
            "ranks": self.peers,
        }
        return environment

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        # no paths: the catalogue (not the project's testpaths, which may be the harness's own tests)
        if config.args_source != pytest.Config.ArgsSource.ARGS:
            from harness.catalogue import default_cases_dir

            config.args = [str(default_cases_dir())]
            config.args_source = pytest.Config.ArgsSource.ARGS


def _say(info: launcher.LaunchInfo | None, text: str, *, everyone: bool = False) -> None:
    if info is None or everyone or info.rank == 0:
        where = "" if info is None else f" (rank {info.rank} on {info.host})"
        print(f"harness launch{where}: error: {text}", file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if args[:1] == ["--"]:
        args = args[1:]
    try:
        info = launcher.detect()
    except launcher.LaunchError as exc:
        _say(None, str(exc))
        return EXIT_USAGE
    try:  # what every rank must know before pytest parses the rest, on rank 0
        requested = parse_backend(option_value(args, "--backend") or "auto")
        cell_timeout_s = parse_case_timeout(option_value(args, "--case-timeout") or DEFAULT_CASE_TIMEOUT_S)
    except OptionError as exc:
        _say(info, str(exc))  # the same on every rank: said once
        return EXIT_USAGE
    launcher.export(info)
    paused = heap.pause()  # until the rank has joined, torch and accelerate imported (harness/heap.py)
    from harness.rank.process.environment import drop_launcher_settings

    dropped = drop_launcher_settings()
    try:
        backend = choose_backend(requested, info)
    except OptionError as exc:
        _say(info, str(exc), everyone=True)
        return EXIT_USAGE
    from harness.launch import liveness
    from harness.launch.channel import Channel, connect
    from harness.launch.rank import RankRuntime, follow, start_watch

    runtime = RankRuntime(info, backend, cell_timeout_s=cell_timeout_s)
    try:
        runtime.start()
        import torch.distributed as dist

        me = {"rank": info.rank, "host": info.host, "node": info.node_rank, "local_rank": info.local_rank,
              "local_world_size": info.local_world_size, "device": _device_name(backend, runtime.device)}
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, (me, liveness.identity()))  # each rank's process: rank 0's to watch
        peers, processes = [p for p, _ in gathered], [q for _, q in gathered]
        channel = Channel(connect(info))
        start_watch(runtime, driver=info.rank == 0)
    except Exception as exc:
        _say(info, f"could not join the launch: {' '.join(str(exc).split())[:500]}", everyone=True)
        return EXIT_START
    heap.resume(paused)
    if info.rank != 0:
        return follow(runtime, channel)
    from harness.launch.group import LaunchedGroup

    group = LaunchedGroup(runtime, channel, hosts=[p["host"] for p in peers], processes=processes)
    status = EXIT_START
    try:
        # the harness is imported already (this command), too early for pytest to rewrite its asserts
        status = int(pytest.main([*args, "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                                 plugins=[LaunchPlugin(group, info, backend, peers, dropped)]))
    finally:
        status = group.finish(status)
    return status
