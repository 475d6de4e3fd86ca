"""The one way to run a cell: the plugin, the self-check and the benchmarks get the same cell, the same
node id and the same rerun command from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.catalogue import CatalogueError, discover, find_case, load_case_file
from harness.controller.cells import cell_spec, nodeid, run_cell
from harness.controller.options import resolve
from harness.controller.pool import PoolSet
from harness.selfcheck.run import Runner, Target

ROOT = Path(__file__).resolve().parent.parent


def fused_loss():
    case = load_case_file(ROOT / "cases" / "test_fused_loss.py")[0]
    return case, case.info.variants[0]


def test_a_case_file_is_loaded_once_and_found_by_path_and_name():
    case, _ = fused_loss()
    assert load_case_file(ROOT / "cases" / "test_fused_loss.py")[0].info is case.info
    assert find_case(str(case.path), case.attr) is case.info
    with pytest.raises(CatalogueError, match="has no case function test_nothing"):
        find_case(case.path, "test_nothing")
    assert [c.name for c in discover(ROOT / "cases")][:1] == ["accumulate"]


def test_the_node_id_is_the_one_pytest_gives_the_cell(monkeypatch):
    monkeypatch.chdir(ROOT)
    case, variant = fused_loss()
    assert nodeid(case, variant.name, 2) == f"cases{os.sep}test_fused_loss.py::test_fused_loss[fp32-ws2]"


def test_every_spec_has_a_cell_id_of_its_own():
    case, variant = fused_loss()
    settings = resolve(world_sizes="2", backend="gloo", report_dir="r", case_timeout="60", seed="1", gpu_count=0)
    ids = {cell_spec(case, variant, 2, settings, label="same").cell_id for _ in range(3)}
    assert len(ids) == 3


def test_a_world_size_the_gpus_cannot_hold_is_skipped_without_starting_a_pool():
    """Mocked: the GPU count (this machine has none); nccl is never started."""
    case, variant = fused_loss()
    settings = resolve(world_sizes="2", backend="nccl", report_dir="r", case_timeout="60", seed="1", gpu_count=1)
    pools = PoolSet(backend="nccl")
    try:
        cell = run_cell(pools, case, variant, 2, settings)
    finally:
        pools.close()
    assert (cell.status, cell.summary) == ("skip", "nccl needs one GPU per rank: world size 2, 1 GPU(s) here")
    assert "--backend nccl" in cell.rerun
    assert not pools.start_errors and not pools.pools


def test_the_self_check_runs_a_cell_as_the_plugin_does_and_prints_the_same_rerun_command(monkeypatch):
    monkeypatch.chdir(ROOT)
    case, variant = fused_loss()
    with Runner(world_size=2, seed=7) as runner:
        from_selfcheck = runner.run(Target(case, variant), fault="grads_summed")
    settings = resolve(world_sizes="2", backend="gloo", report_dir="reports", case_timeout="120", seed="7",
                       gpu_count=0, fault="grads_summed")
    pools = PoolSet(backend="gloo")
    try:
        from_plugin = run_cell(pools, case, variant, 2, settings,
                               node="cases/test_fused_loss.py::test_fused_loss[fp32-ws2]")
    finally:
        pools.close()
    assert from_selfcheck.status == from_plugin.status == "fail"
    assert from_selfcheck.rerun == from_plugin.rerun == (
        "pytest 'cases/test_fused_loss.py::test_fused_loss[fp32-ws2]' --world-sizes 2 --backend gloo --seed 7 "
        "--report-dir reports/rerun --harness-fault grads_summed")
    assert [f.message for f in from_selfcheck.failures] == [f.message for f in from_plugin.failures]
