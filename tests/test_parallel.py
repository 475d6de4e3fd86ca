"""Parallel runs: pytest-xdist workers and concurrent sessions in one checkout do not interfere,
and each gives the same merged matrix as a serial run."""

import json

from conftest import PLANTED, killed_if_failing, start_pytest, wait_for_no_processes, wait_until

# Passing cells and one that must fail (a model left out of no_sync, planted): a harness that said
# pass to everything, or lost a failure on its way from a worker, would not give the same matrix.
SELECTION = ["cases/test_fused_loss.py", "cases/test_no_sync.py", PLANTED,
             "-k", "fp32-ws and (fused_loss or no_sync or left_out)", "--world-sizes", "1,2"]
FAILING = ("planted_left_out_of_no_sync", "fp32", 2)


def statuses(report_dir):
    """Each cell's status and, for a failing cell, what failed where: kind, rank, step, parameter."""
    matrix = json.loads((report_dir / "matrix.json").read_text())
    assert matrix["complete"] is True
    return {
        (c["case"], c["variant"], c["world_size"]): (
            c["status"], sorted((f["kind"], f["rank"], f["step"], f["model"], f["param"]) for f in c["failures"]))
        for c in matrix["cells"]
    }


def finish(process, token):
    stdout, stderr = process.communicate(timeout=900)
    assert process.returncode == 1, stdout[-3000:] + stderr[-3000:]  # the planted failure, nothing else
    assert wait_for_no_processes(token) == []
    return stdout


def test_xdist_and_concurrent_sessions_give_the_serial_matrix(tmp_path):
    # two sessions at once in one checkout, each with its own report dir (no shared ports: FileStore
    # rendezvous; no shared temporary files): a serial one, whose matrix is pinned below cell by
    # cell, and one under xdist; then one with more workers than world sizes
    serial, second = tmp_path / "serial", tmp_path / "second"
    a = start_pytest(SELECTION, serial)
    b = start_pytest(["-n", "2", *SELECTION], second)
    finish(*a)
    finish(*b)
    expected = statuses(serial)
    assert len(expected) == 10
    # the gradients say it, and so does DDP's all-reduce in backwards the contract keeps local
    assert expected[FAILING][0] == "fail" and {kind for kind, *_ in expected[FAILING][1]} == {"synced_early", "comm_unexpected"}
    assert {status for key, (status, _) in expected.items() if key != FAILING} == {"pass"}
    assert statuses(second) == expected

    xdist = tmp_path / "xdist"
    stdout = finish(*start_pytest(["-n", "4", *SELECTION], xdist))
    assert "gradient-sync matrix" in stdout
    assert statuses(xdist) == expected


def test_no_rank_outlives_a_session_that_is_killed_outright(tmp_path):
    """SIGKILL gives pytest no chance to clean up: the ranks must still go (parent-death signal)."""
    progress = tmp_path / "progress"
    progress.mkdir()
    # only the cell that blocks until the run ends, with a timeout that cannot end it first
    process, token = start_pytest([PLANTED, "-k", "planted_blocks_half_way and not finishes", "--world-sizes", "2",
                                   "--case-timeout", "3600"], tmp_path / "r", PLANTED_PROGRESS_DIR=str(progress))
    with killed_if_failing(process):
        # rank 0 is in that cell: the ranks are there, and the run cannot finish before the kill
        wait_until(lambda: (progress / "blocks").exists(), process, "the run blocked in its cell")
        process.kill()
        process.communicate(timeout=60)
    assert wait_for_no_processes(token) == []
