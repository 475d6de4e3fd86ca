"""`python -m harness launch` under real launchers: two torchrun agents (two "nodes" on this machine,
c10d rendezvous on a local port), srun's variables (srun itself cannot run here: its environment is
set by hand), and accelerate launch. Real processes, real gloo groups, the real catalogue."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PLANTED, ROOT, session_env, wait_for_no_processes

from harness.launch import environment as launcher
from harness.launch.main import option_value

TIMEOUT_S = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launch:
    def __init__(self, processes: list[subprocess.Popen], token: str, report_dir: Path) -> None:
        started = time.monotonic()
        self.outputs = [p.communicate(timeout=600) for p in processes]
        self.seconds = time.monotonic() - started
        self.returncodes = [p.returncode for p in processes]
        self.token = token
        self.report_dir = report_dir

    @property
    def matrix(self) -> dict:
        return json.loads((self.report_dir / "matrix.json").read_text())

    def cells(self) -> dict[tuple[str, str], dict]:
        return {(c["case"], c["variant"]): c for c in self.matrix["cells"]}

    def log(self) -> str:
        return "\n".join(out + err for out, err in self.outputs)[-6000:]


def start(commands: list[list[str]], report_dir: Path, *, extra_env: list[dict[str, str]] | None = None) -> Launch:
    token = f"harness-test-{os.urandom(8).hex()}"
    processes = []
    for i, command in enumerate(commands):
        env = session_env(token, **(extra_env[i] if extra_env else {}))
        processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
    return Launch(processes, token, report_dir)


def two_torchrun_agents(args: list[str], report_dir: Path, *, nproc: int = 1) -> Launch:
    """Two torchrun agents, as on two nodes, meeting by c10d rendezvous on a local port."""
    endpoint = f"127.0.0.1:{free_port()}"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{os.getpid()}",
             "-m", "harness", "launch", *args, "--report-dir", str(report_dir), "-p", "no:cacheprovider"]
    return start([agent, agent], report_dir)


# --- where a launched process stands --------------------------------------------------------------


def test_torchrun_variables_give_the_rank_the_node_and_the_rendezvous():
    info = launcher.detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node-a",
                            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("torchrun", 5, 8, 1, 4)
    assert (info.node_rank, info.nodes, info.master_addr, info.master_port) == (1, 2, "node-a", 29500)


def test_accelerate_launch_is_told_apart_from_torchrun():
    info = launcher.detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                            "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x", "ACCELERATE_MIXED_PRECISION": "no"})
    assert info.launcher == "accelerate launch"


def test_slurm_variables_give_the_rank_and_a_rendezvous_on_the_first_host():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}
    info = launcher.detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("srun", 9, 16, 1, 8)
    assert (info.node_rank, info.nodes, info.master_addr) == (1, 2, "gpu07")
    assert info.master_port == launcher.SLURM_BASE_PORT + 4242
    exported: dict[str, str] = {}
    launcher.export(info, exported)
    assert exported == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(launcher.SLURM_BASE_PORT + 4242)}
    # the batch script's own address wins, and torchrun's variables win over srun's
    assert launcher.detect({**env, "MASTER_ADDR": "login", "MASTER_PORT": "2"}).master_addr == "login"
    both = launcher.detect({**env, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "3"})
    assert (both.rank, both.world_size) == (1, 2)


@pytest.mark.parametrize("nodelist, first", [("gpu[03-05,09],cpu1", "gpu03"), ("node7", "node7"),
                                             ("a[1,2]", "a1"), ("x-y[010-012]", "x-y010")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert launcher.first_host(nodelist) == first


def test_tasks_per_node_lists():
    assert [launcher.tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]


@pytest.mark.parametrize("env, reason", [
    ({}, "no launcher started this process"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not"),
])
def test_a_bad_environment_is_one_line_naming_what_is_wrong(env, reason):
    with pytest.raises(launcher.LaunchError, match=reason):
        launcher.detect(env)


def test_options_are_read_from_the_pytest_arguments():
    args = ["cases/", "--backend", "nccl", "--case-timeout=7", "-k", "x", "--", "--backend", "gloo"]
    assert option_value(args, "--backend") == "nccl"
    assert option_value(args, "--case-timeout") == "7"
    assert option_value(args, "--seed") is None


def test_launch_outside_a_launcher_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    done = subprocess.run([sys.executable, "-m", "harness", "launch", "cases/"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no launcher started this process" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_option_under_a_launcher_is_said_once_by_rank_0():
    said = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
        done = subprocess.run([sys.executable, "-m", "harness", "launch", "--backend", "mpi"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2
        said.append(done.stderr)
    assert said[0] == "harness launch (rank 0 on %s): error: --backend: 'mpi' is not one of auto, gloo, nccl\n" \
        % socket.gethostname()
    assert said[1] == ""


# --- launched runs ----------------------------------------------------------------------------------

SUBSET = ["cases/test_fused_loss.py", "cases/test_no_sync.py", "-k", "fp32-ws"]


@pytest.fixture(scope="module")
def agents_run(tmp_path_factory):
    return two_torchrun_agents(SUBSET, tmp_path_factory.mktemp("agents"))


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory):
    report_dir = tmp_path_factory.mktemp("pool")
    done = subprocess.run([sys.executable, "-m", "pytest", *SUBSET, "--world-sizes", "2", "--report-dir",
                           str(report_dir), "-p", "no:cacheprovider", "-q"], cwd=ROOT,
                          env=session_env("pool-run"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    return {(c["case"], c["variant"]): c for c in json.loads((report_dir / "matrix.json").read_text())["cells"]}


def test_two_agents_give_the_local_pools_verdicts(agents_run, pool_run):
    assert agents_run.returncodes == [0, 0], agents_run.log()
    cells = agents_run.cells()
    assert set(cells) == set(pool_run) and len(cells) >= 4
    for key, cell in cells.items():
        local = pool_run[key]
        assert cell["world_size"] == 2
        assert (cell["status"], cell["checks"], cell["grad_checks"], cell["max_abs_diff"]) == \
            (local["status"], local["checks"], local["grad_checks"], local["max_abs_diff"]), key


def test_the_matrix_records_the_launch(agents_run):
    environment = agents_run.matrix["environment"]
    assert environment["launcher"] == "torchrun"
    assert environment["nodes"] == 2 and environment["processes_per_node"] == 1
    assert environment["world_sizes"] == [2] and environment["backend"] == "gloo"
    assert environment["hosts"] == [socket.gethostname()] and environment["devices"] == ["cpu"]
    assert [r["rank"] for r in environment["ranks"]] == [0, 1]
    assert agents_run.matrix["complete"] is True
    # a cell's rerun command starts the same launch again, for that cell alone
    rerun = agents_run.cells()[("fused_loss", "fp32")]["rerun"]
    assert rerun.startswith("torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint ")
    assert " -m harness launch 'cases/test_fused_loss.py::test_fused_loss[fp32-ws2]' --backend gloo " in rerun
    assert "--world-sizes" not in rerun
    assert wait_for_no_processes(agents_run.token) == []


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory):
    args = [PLANTED, "-k", "raise or hang_outside", "--case-timeout", str(TIMEOUT_S)]
    return two_torchrun_agents(args, tmp_path_factory.mktemp("faults"))


def test_a_raise_is_an_error_naming_rank_and_host_and_the_launch_goes_on(faults_run):
    cells = faults_run.cells()
    host = socket.gethostname()
    raised = cells[("planted_rank_fault", "raise")]
    assert raised["status"] == "error"
    assert raised["summary"] == (f"rank 1 on {host} raised ZeroDivisionError: planted on rank 1 "
                                 f"(rank 0 on {host} blocked waiting for it)")
    assert "in plant" in raised["detail"]
    # rank 1 shut down its connections as it raised: rank 0's collective failed at once, as a victim's
    # ("blocked waiting for it"), not at the group's collective timeout (which reads "Timed out waiting")
    assert "Connection closed by peer" in raised["detail"]
    assert raised["duration_s"] <= TIMEOUT_S + 5  # rebuilding the group is not the cell's time
    # every rank left the aborted group and joined a new one: the next cell passes
    assert cells[("planted_rank_fault", "after_raise")]["status"] == "pass"


def test_a_rank_that_severs_its_connections_frees_the_peer_waiting_on_it_and_the_group_rejoins(tmp_path):
    """RankRuntime.sever on rank 1 of a real gloo group whose collectives time out after ten minutes:
    rank 0's all-reduce, which rank 1 never joins, fails with the closed connection while rank 1 is
    still alive, the store still answers (its connections are not severed), and both ranks then join
    the next generation of the group and all-reduce in it."""
    port = free_port()
    processes = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "planted" / "severed_rank.py")], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(r), "WORLD_SIZE": "2",
                                       "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for r in range(2)]
    try:
        outputs = [p.communicate(timeout=300) for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(out + err for out, err in outputs)[-4000:]
    said = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert said["severed"] >= 1  # rank 1's connection to rank 0, at least
    assert said["error"] is not None and "Connection closed by peer" in said["error"]
    assert said["rejoined_sum"] == [3.0, 3.0]


def test_closing_a_launched_rank_stops_its_watch_thread_before_the_process_exits():
    """The watch thread beats through the launch's store (a C++ call, the GIL released): left running
    at the interpreter's exit, a call of it that returns then aborts the process after its run passed
    (SIGABRT, a two-agent launch's rank in CI). ``close`` joins it, within a beat."""
    import torch.distributed as dist

    from harness.launch.channel import Channel, connect
    from harness.launch.rank import RankRuntime, start_watch

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = launcher.LaunchInfo(launcher="env", rank=0, world_size=1, local_rank=0, local_world_size=1,
                               node_rank=0, nodes=1, master_addr="127.0.0.1", master_port=server.port,
                               run_id="close-joins", host="localhost")
    runtime = RankRuntime(info, "gloo", cell_timeout_s=5.0)
    start_watch(runtime, driver=True)
    try:
        beats, deadline = Channel(connect(info)), time.monotonic() + 60
        while beats.count("beat/0", 0) < 2 and time.monotonic() < deadline:  # it beats, again and again
            time.sleep(0.01)
        assert beats.count("beat/0", 0) >= 2
    finally:
        runtime.close()  # else the thread, its store gone with this test, would end the test's process
    assert runtime.watcher is not None and not runtime.watcher.is_alive()
    assert runtime.exit_status(4) == 4


def test_a_watch_thread_whose_store_call_returns_only_at_exit_does_not_abort_the_process():
    """tests/planted/watch_at_exit.py: the thread's store call returns only once the interpreter has begun
    to exit (an atexit handler sets its key), so ``close`` cannot join it; ``exit_status`` then ends the
    process at once with its status. Left to the interpreter (as before), the process aborted (SIGABRT,
    4 of 5 runs by hand)."""
    script = ROOT / "tests" / "planted" / "watch_at_exit.py"
    process = subprocess.run([sys.executable, str(script), "0.5"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 3, process.stderr[-3000:]
    assert "terminate called" not in process.stderr
    assert "the watch thread did not stop within 0.5 s of the end; leaving at once" in process.stderr


def test_a_hang_is_an_error_and_every_later_cell_is_not_run(faults_run):
    cells = faults_run.cells()
    host = socket.gethostname()
    hung = cells[("planted_rank_fault", "hang_outside")]
    assert hung["status"] == "error"
    assert hung["summary"] == f"rank 1 on {host} hung (no result within {TIMEOUT_S} s) (rank 0 on {host} blocked waiting for it)"
    assert hung["duration_s"] <= TIMEOUT_S + 5
    after = cells[("planted_rank_fault", "after_hang_outside")]
    assert after["status"] == "error"
    assert after["summary"] == f"not run: rank 1 on {host} hung in planted_rank_fault[hang_outside]"


def test_after_a_hang_every_rank_exits_non_zero_and_none_is_left(faults_run):
    assert faults_run.returncodes == [1, 1], faults_run.log()
    assert faults_run.matrix["complete"] is True  # every selected cell is in it, run or not
    assert wait_for_no_processes(faults_run.token) == []
    # start-up and two faulty cells, each ended within the timeout and a few seconds
    assert faults_run.seconds < 120


# rank 1 as if on another host (a planted sitecustomize): rank 0 cannot see its process
ANOTHER_HOST = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "planted" / "another_host"), str(ROOT)])}


def test_a_rank_that_dies_is_an_error_and_every_later_cell_is_not_run(tmp_path):
    """On rank 0's own host a dead rank is found by its process, gone from the process table (on
    another host, by its silence: the next test)."""
    run = two_torchrun_agents([PLANTED, "-k", "kill", "--case-timeout", "30"], tmp_path)
    cells = run.cells()
    killed = cells[("planted_rank_fault", "kill")]
    assert killed["status"] == "error"
    assert killed["summary"].startswith(f"rank 1 on {socket.gethostname()} died (its process, pid "), killed["summary"]
    assert killed["duration_s"] < 30  # found by its process, not by the cell's timeout
    assert cells[("planted_rank_fault", "after_kill")]["summary"].startswith("not run: rank 1 on ")
    assert run.returncodes[0] == 1
    assert wait_for_no_processes(run.token) == []


def srun_like(args: list[str], report_dir: Path) -> Launch:
    """srun cannot run on this machine: two processes get the variables it sets, as on one node."""
    base = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_ID": "77",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(free_port())}
    command = [sys.executable, "-m", "harness", "launch", *args, "--report-dir", str(report_dir), "-p",
               "no:cacheprovider"]
    return start([command, command], report_dir,
                 extra_env=[{**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)} for r in range(2)])


def test_a_world_size_other_than_the_launchers_stops_every_rank_with_one_line(tmp_path):
    run = srun_like(["cases/test_fused_loss.py", "--world-sizes", "1,2"], tmp_path)
    assert run.returncodes == [4, 4], run.log()
    assert "ERROR: --world-sizes: the launcher started 2 ranks; under a launcher the world size is the " \
           "launcher's (leave it out, or give 2)" in run.outputs[0][1]
    assert not (tmp_path / "matrix.json").exists()
    assert wait_for_no_processes(run.token) == []


def test_srun_variables_are_a_launch(tmp_path):
    run = srun_like(["cases/test_fused_loss.py", "-k", "fp32-ws"], tmp_path)
    assert run.returncodes == [0, 0], run.log()
    assert run.matrix["environment"]["launcher"] == "srun"
    assert run.matrix["cells"][0]["rerun"].startswith("srun --nodes 1 --ntasks-per-node 2 python -m harness launch ")
    assert [c["status"] for c in run.matrix["cells"]] == ["pass"]
    assert wait_for_no_processes(run.token) == []


def test_accelerate_launch_is_a_launch_whose_settings_do_not_change_the_cells(tmp_path):
    """accelerate launch with mixed precision bf16 in its settings: the fp32 cell stays fp32 (the
    launcher's ACCELERATE_* settings are dropped on every rank, and named in the matrix)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "harness", "launch", "cases/test_fused_loss.py",
               "-k", "fp32-ws", "--report-dir", str(tmp_path), "-p", "no:cacheprovider"]
    run = start([command], tmp_path)
    assert run.returncodes == [0], run.log()
    environment = run.matrix["environment"]
    assert environment["launcher"] == "accelerate launch" and environment["world_sizes"] == [2]
    assert "ACCELERATE_MIXED_PRECISION" in environment["ignored_launcher_settings"]
    assert [(c["variant"], c["status"]) for c in run.matrix["cells"]] == [("fp32", "pass")]
    assert wait_for_no_processes(run.token) == []


def test_when_the_launcher_stops_a_nodes_ranks_the_running_cell_still_names_who_died(tmp_path):
    """torchrun stops every rank of a node (SIGTERM) when one of them dies: rank 0, on that node,
    still ends the cell naming the dead rank, and records the rest as not run because of it. Rank 1
    is as if on another host, so that only the launcher's signal, and then rank 1's silence, tell
    rank 0 (on this host rank 0 could find it dead first, by its process)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "harness", "launch",
               PLANTED, "-k", "kill", "--case-timeout", "30", "--report-dir", str(tmp_path), "-p", "no:cacheprovider"]
    run = start([command], tmp_path, extra_env=[ANOTHER_HOST])
    cells = run.cells()
    host = socket.gethostname()
    assert cells[("planted_rank_fault", "kill")]["summary"].startswith(f"rank 1 on {host} died (no answer within ")
    assert cells[("planted_rank_fault", "after_kill")]["summary"] == \
        f"not run: rank 1 on {host} died in planted_rank_fault[kill]"
    assert run.returncodes == [1] and run.matrix["complete"] is True
    assert wait_for_no_processes(run.token) == []


# --- a rank's process, as rank 0 finds it on its own host (harness/launch/liveness.py) ----------


def test_a_live_process_is_not_gone_and_one_on_another_host_or_unknown_is_never_called_gone():
    from harness.launch import liveness

    me = liveness.identity()
    assert me is not None and me["pid"] == os.getpid()
    assert not liveness.gone(me, me)
    dead = {**me, "pid": 2 ** 22 + 1}  # above any pid this kernel gives (pid_max is at most 2**22)
    assert liveness.gone(dead, me)
    assert not liveness.gone({**dead, "boot": "another host's"}, me)  # its process table is not this one
    assert not liveness.gone({**dead, "pid_namespace": "pid:[1]"}, me)
    assert not liveness.gone(None, me) and not liveness.gone(dead, None)


CHILD_SAYS_WHO = ("import json, sys\nfrom harness.launch import liveness\n"
                  "print(json.dumps(liveness.identity()), flush=True)\nsys.stdin.read()\n")


def test_a_process_that_exited_a_zombie_and_a_reused_pid_are_gone():
    from harness.launch import liveness

    me = liveness.identity()
    child = subprocess.Popen([sys.executable, "-c", CHILD_SAYS_WHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        peer = json.loads(child.stdout.readline())  # as a rank sends it
        assert peer["pid"] == child.pid
        assert not liveness.gone(peer, me)
        assert liveness.gone({**peer, "started": peer["started"] - 1}, me)  # the pid is another process's now
        child.stdin.close()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it exited; not reaped: a zombie
        assert liveness.gone(peer, me)
    finally:
        child.wait()
    assert liveness.gone(peer, me)
