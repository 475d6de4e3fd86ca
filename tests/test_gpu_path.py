"""The GPU path, as far as it runs without a GPU: GPUs counted through torch in a process of their
own (CUDA and ROCm builds alike, the controller never importing torch), nccl pools one at a time and
on one xdist worker, and blame that holds for asynchronous collectives. The tests at the end need a
GPU and skip without one."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, session_env

from harness.controller import options
from harness.controller.blame import stuck_kinds
from harness.controller.pool import PoolSet, RankPool
from harness.records import FaultKind

GPUS = options.count_gpus()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a GPU (torch sees none on this machine)")


def test_gpus_are_counted_by_torch_in_a_process_of_their_own():
    assert options.probe_gpus([sys.executable, "-c", "print(3)"]) == 3
    assert options.probe_gpus([sys.executable, "-c", "raise SystemExit(1)"]) == 0
    assert options.probe_gpus(["/nonexistent/python"]) == 0


def test_counting_gpus_imports_no_torch_and_is_remembered_for_xdist_workers():
    code = ("import os, sys; from harness.controller.options import count_gpus, GPU_COUNT_VARIABLE; "
            "n = count_gpus(); print(n, 'torch' in sys.modules, os.environ[GPU_COUNT_VARIABLE])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=session_env("gpus"), capture_output=True,
                          text=True, timeout=120, check=True)
    count, imported, remembered = done.stdout.split()
    assert imported == "False" and count == remembered
    # a worker started with the variable set uses it (the GPU count is mocked here: there is no GPU)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=session_env("gpus", GRADSYNC_HARNESS_GPU_COUNT="4"), check=True)
    assert done.stdout.split()[0] == "4"


def test_nccl_pools_run_one_world_size_at_a_time(monkeypatch):
    """Local pool rank r uses GPU r: a second pool must never start while another holds the GPUs.
    Starting a real nccl pool needs GPUs, so the pools' start and close are recorded, not run."""
    events = []
    monkeypatch.setattr(RankPool, "start", lambda self: events.append(("start", self.world_size)))
    monkeypatch.setattr(RankPool, "close", lambda self: events.append(("close", self.world_size)))
    monkeypatch.setattr(RankPool, "alive", property(lambda self: ("start", self.world_size) in events
                                                    and ("close", self.world_size) not in events))
    pools = PoolSet(backend="nccl")
    pools.get(4)
    pools.get(4)
    pools.get(2)
    pools.get(1)
    assert events == [("start", 4), ("close", 4), ("start", 2), ("close", 2), ("start", 1)]
    gloo = PoolSet(backend="gloo")
    events.clear()
    gloo.get(4)
    gloo.get(2)
    assert events == [("start", 4), ("start", 2)]  # CPU pools share nothing: they stay


def test_under_xdist_every_nccl_cell_goes_to_one_worker(tmp_path):
    """With nccl, cells of every world size go to one xdist worker (its pools then take turns). Here
    there is no GPU, so each cell is a skip saying so, decided on the worker that got it."""
    done = subprocess.run([sys.executable, "-m", "pytest", "cases/test_fused_loss.py", "cases/test_no_sync.py",
                           "-n", "2", "-v", "--backend", "nccl", "--world-sizes", "1,2,4", "-p", "no:cacheprovider",
                           "--report-dir", str(tmp_path)], cwd=ROOT, env=session_env("scope"),
                          capture_output=True, text=True, timeout=300)
    workers = {line.split("]")[0] for line in done.stdout.splitlines() if line.startswith("[gw")}
    assert done.stdout.count(" SKIPPED ") >= 9, done.stdout[-2000:]
    assert len(workers) == 1, workers


def test_blame_follows_progress_where_stacks_mislead():
    # nccl: rank 0 issued collective 12 and then waits in .item(), far from any collective, for
    # rank 1, which hangs before issuing it; the stacks alone would blame rank 0
    stacks = {0: "File \"train.py\", line 3, in step\n    loss.item()", 1: "File \"train.py\", line 9, in step"}
    assert stuck_kinds([0, 1], after_fault=False, progress={0: 12, 1: 11}, stacks=stacks) == \
        {0: FaultKind.BLOCKED, 1: FaultKind.HUNG}
    # equal progress, or a rank that could not say: the stacks decide
    in_collective = {0: "torch/distributed/distributed_c10d.py all_reduce", 1: "time.sleep"}
    assert stuck_kinds([0, 1], after_fault=False, progress={0: 5, 1: 5}, stacks=in_collective) == \
        {0: FaultKind.BLOCKED, 1: FaultKind.HUNG}
    assert stuck_kinds([0, 1], after_fault=False, progress={0: 7, 1: None}, stacks=in_collective) == \
        {0: FaultKind.BLOCKED, 1: FaultKind.HUNG}
    assert stuck_kinds([0, 1], after_fault=True, progress={0: 1, 1: 9}, stacks={}) == \
        {0: FaultKind.BLOCKED, 1: FaultKind.BLOCKED}


@needs_gpu
def test_a_local_nccl_pool_runs_a_cell(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pytest", "cases/test_fused_loss.py", "--backend", "nccl",
                           "--world-sizes", "1", "-k", "fp32-ws", "--report-dir", str(tmp_path), "-p", "no:cacheprovider"],
                          cwd=ROOT, env=session_env("nccl-pool"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]


@needs_gpu
def test_a_torchrun_launch_runs_on_the_gpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "harness", "launch", "cases/test_fused_loss.py", "-k", "fp32-ws", "--backend", "nccl",
                           "--report-dir", str(tmp_path), "-p", "no:cacheprovider"],
                          cwd=ROOT, env=session_env("nccl-launch"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
