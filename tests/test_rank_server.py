"""A fork server shared by the sessions a process starts (harness/controller/rank_server.py): a
session whose own server would be the same forks its ranks from the shared one and never ends it; a
session whose start-up differs (a sitecustomize of its own, another interpreter, another
transformers, another HF_HUB_OFFLINE) or that is told nothing starts its own; a rank of the shared
server goes when its controller is killed outright; a session under test, which loads the suite's
conftest.py as it collects tests/planted/, starts no shared server of its own. A process that runs
many pools has its ranks forked with the libraries only some cells import already loaded, and
nothing printed of it; a session's own server, not."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, wait_until

from harness.controller import options, rank_server
from harness.rank.process.environment import process_alive

# which server a session took, and with an argument "ranks" its pool of two and the parent of each rank
POOL = """
import os, sys
from harness.controller import rank_server
from harness.rank.process.environment import process_alive
from harness.controller.pool import PoolSet
pools = PoolSet(backend="gloo")
pools.prepare()
if sys.argv[1:] == ["which"]:
    print(rank_server.shared_server_pid(), rank_server._rank_server["ends_at_exit"])
    raise SystemExit(0)
try:
    parents = [int(open(f"/proc/{p.pid}/status").read().split("PPid:")[1].split()[0])
               for p in pools.get(2).processes]
    print(parents, rank_server.shared_server_pid())
    sys.stdout.flush()
    if sys.argv[1:]:
        open(sys.argv[1], "w").write(" ".join(str(p.pid) for p in pools.get(2).processes))
        signal = __import__("signal")
        signal.pause()
finally:
    pools.close()
"""


@pytest.fixture(scope="module")
def shared():
    server, value = rank_server.start_shared_server()
    try:
        yield json.loads(value)["pid"], value
    finally:
        rank_server.end_shared_server(server)


def _session(value: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), rank_server.SHARED_SERVER_VARIABLE: value, **env}
    return subprocess.run([sys.executable, "-c", POOL, *args], capture_output=True, text=True, timeout=300,
                          env=environ, cwd=ROOT, check=False)


def test_a_session_forks_its_ranks_from_the_shared_server_and_leaves_it_running(shared):
    pid, value = shared
    done = _session(value)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [f"[{pid},", f"{pid}]", str(pid)]
    assert process_alive(pid)  # the session's exit ended its pools, not the server it shared
    again = _session(value)
    assert again.returncode == 0 and again.stdout.split()[-1] == str(pid), again.stderr[-3000:]


@pytest.mark.parametrize("how", ["empty", "another sitecustomize", "another transformers", "another interpreter",
                                 "another HF_HUB_OFFLINE", "server gone", "garbled"])
def test_a_session_whose_own_server_would_differ_starts_its_own(shared, tmp_path, how):
    _, value = shared
    env = {}
    if how == "empty":
        value = ""
    elif how == "another sitecustomize":  # as tests/planted/gloo_avg_sums plants a defect in every process
        (tmp_path / "sitecustomize.py").write_text("")
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    elif how == "another transformers":  # as tests/test_versions.py hides it: the server imported the installed one
        (tmp_path / "transformers").mkdir()
        (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('hidden')\n")
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    elif how == "another HF_HUB_OFFLINE":  # read as huggingface_hub loads, in the server: its ranks' is the server's
        env["HF_HUB_OFFLINE"] = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"
    elif how == "another interpreter":
        value = json.dumps({**json.loads(value), "python": "/elsewhere"})
    elif how == "server gone":
        value = json.dumps({**json.loads(value), "pid": 2**22 + 1})
    else:
        value = value[:-3]
    done = _session(value, "which", **env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "True"]  # a server of its own, ended at its exit


def test_the_process_that_started_it_keeps_its_own_pools_on_a_server_of_its_own(shared):
    pid, value = shared
    os.environ[rank_server.SHARED_SERVER_VARIABLE] = value
    try:
        from distributed import run_on_ranks

        parents = run_on_ranks(_parent, 2)
        assert len(set(parents)) == 1 and pid not in parents
    finally:
        os.environ.pop(rank_server.SHARED_SERVER_VARIABLE)


def _parent(rank: int, world_size: int) -> int:
    return os.getppid()


def test_a_rank_of_the_shared_server_goes_when_its_session_is_killed_outright(shared, tmp_path):
    """Its parent is the shared server, which stays: the rank sees its controller gone, a zombie
    until this test reaps it, and leaves."""
    pid, value = shared
    ranks_file = tmp_path / "ranks"
    environ = {**os.environ, "PYTHONPATH": str(ROOT), rank_server.SHARED_SERVER_VARIABLE: value}
    session = subprocess.Popen([sys.executable, "-c", POOL, str(ranks_file)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environ, cwd=ROOT)
    try:
        wait_until(lambda: ranks_file.exists() and ranks_file.read_text().strip(), session, "the pool started")
        ranks = [int(p) for p in ranks_file.read_text().split()]
        assert all(process_alive(r) for r in ranks)
        session.send_signal(signal.SIGKILL)
        session.communicate(timeout=60)  # the run's output ends: no rank holds it open
    finally:
        if session.poll() is None:
            session.kill()
    assert session.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while any(process_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [r for r in ranks if process_alive(r)] == [] and process_alive(pid)


# a plugin of the session under test: whether the suite's conftest.py, which that session loads too as
# it collects tests/planted/, started a shared server of its own there (tryfirst: before it ends it)
CONFTEST_PROBE = '''
import json, os, sys
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    conftest = sys.modules.get("conftest")
    rank_server = sys.modules["harness.controller.rank_server"]
    with open(os.environ["CONFTEST_PROBE"], "w", encoding="utf-8") as out:
        json.dump({"loaded": conftest is not None, "preload": rank_server._rank_server["preload"],
                   "server": None if conftest is None else conftest.SHARED_RANK_SERVER["pid"]}, out)
'''


def test_a_session_under_test_starts_no_shared_server_of_its_own(run_pytest, tmp_path):
    (tmp_path / "conftest_probe.py").write_text(CONFTEST_PROBE, encoding="utf-8")
    out = tmp_path / "probe.txt"
    session = run_pytest("-p", "conftest_probe", "tests/planted/planted_cases.py", "-k", "left_out", "--world-sizes", "1",
                         PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", CONFTEST_PROBE=str(out))
    assert session.returncode == 0, session.stdout[-3000:] + session.stderr[-3000:]
    # nor a server of its own that imports what its cells do not use (harness/rank/process/preload_all.py)
    assert json.loads(out.read_text(encoding="utf-8")) == {"loaded": True, "preload": rank_server.RANK_PRELOAD,
                                                           "server": None}


# what only some cells import (harness/rank/process/preload_all.py), and which of it a rank has loaded before
# any cell, forked from a server of its process's own; with an argument "all", of a process that runs
# many pools (the self-check's, the test suite's)
OPTIONAL = ("transformers.trainer", "deepspeed", "torch._inductor.compile_fx")
LOADED = f"""
import json, sys
from harness.controller import rank_server
from distributed import loaded, run_on_ranks
if sys.argv[1:] == ["all"]:
    rank_server.preload_all()
print(json.dumps(run_on_ranks(loaded, 1, {OPTIONAL!r})))
"""


def test_the_ranks_of_a_process_that_runs_many_pools_start_with_what_only_some_cells_import():
    environ = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", rank_server.SHARED_SERVER_VARIABLE: ""}
    runs = {which: subprocess.run([sys.executable, "-c", LOADED, which], capture_output=True, text=True, timeout=300,
                                  env=environ, cwd=ROOT, check=False) for which in ("own", "all")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    # a session's own server: a rank imports them at its first cell that uses them
    assert json.loads(runs["own"].stdout) == [[]]
    installed = [name for name in OPTIONAL if importlib.util.find_spec(name.split(".")[0]) is not None]
    assert "torch._inductor.compile_fx" in installed  # at least one: the check below is not of nothing
    if options.gpu_driver_present():
        installed = []  # a fork server never initialises CUDA, which DeepSpeed's import can
    assert json.loads(runs["all"].stdout) == [installed]
    assert runs["all"].stderr == ""  # DeepSpeed's word on the accelerator it picked, as it loads, is not the run's


def test_on_a_host_with_a_gpu_driver_a_server_for_many_pools_preloads_only_what_every_rank_needs(tmp_path,
                                                                                                 monkeypatch):
    # no GPU here: a file of ours stands for the driver's device file (harness/controller/options.py)
    driver = tmp_path / "nvidiactl"
    driver.write_text("")
    saved = rank_server._rank_server["preload"]
    try:
        monkeypatch.setattr(options, "GPU_DEVICE_FILES", (str(driver),))
        rank_server.preload_all()
        assert rank_server._rank_server["preload"] == rank_server.RANK_PRELOAD
        monkeypatch.setattr(options, "GPU_DEVICE_FILES", (str(tmp_path / "none"),))
        rank_server.preload_all()
        assert rank_server._rank_server["preload"] == rank_server.RANK_PRELOAD_ALL
    finally:
        rank_server._rank_server["preload"] = saved
