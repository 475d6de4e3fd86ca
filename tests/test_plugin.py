"""The pytest plugin end to end: planted faults are found where they are, bad input stops the run at
once, interrupted runs keep their finished cells, and no process outlives a session."""

import json
import os
import signal
import time

import pytest
import torch

from conftest import PLANTED, start_pytest, wait_for_no_processes


def test_a_perturbed_rank_fails_the_cell_naming_rank_step_model_and_kind(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "-k", "fp32", "--world-sizes", "2",
                         "--harness-fault", "perturb_rank1")
    assert session.returncode == 1
    cell = session.cells()[("fused_loss", "fp32", 2)]
    assert cell["status"] == "fail"
    first = cell["failures"][0]
    assert (first["rank"], first["step"], first["model"], first["param"]) == (1, 1, "model", "fc1.weight")
    assert first["kind"] == "wrong_scale" and first["factor"] == pytest.approx(1.01, rel=1e-4)
    # rank 1 stepped with its own gradient: its parameters part from rank 0's, reported once each
    diverged = [f for f in cell["failures"] if f["kind"] == "params_diverged"]
    assert {(f["rank"], f["step"]) for f in diverged} == {(1, 1)} and len(diverged) == 4
    # at step 1 rank 0's gradient was right: the fault is rank 1's alone
    assert not [f for f in cell["failures"] if f["rank"] == 0 and f["step"] == 1 and f["checked"] == "grad"]
    assert session.matrix["environment"]["fault"] == "perturb_rank1"
    assert "gradient of 'model.fc1.weight' on rank 1 at step 1: scaled by 1.01" in session.stdout
    assert ("Rerun this cell: pytest 'cases/test_fused_loss.py::test_fused_loss[fp32-ws2]' --world-sizes 2"
            in session.stdout)
    assert wait_for_no_processes(session.token) == []


def test_a_model_left_out_of_no_sync_is_named_as_synced_early(run_pytest):
    session = run_pytest(PLANTED, "-k", "left_out", "--world-sizes", "2")
    assert session.returncode == 1
    cell = session.cells()[("planted_left_out_of_no_sync", "fp32", 2)]
    assert cell["status"] == "fail"
    grads = [f for f in cell["failures"] if f["checked"] == "grad"]
    assert {f["model"] for f in grads} == {"disc"}
    assert {f["kind"] for f in grads} == {"synced_early"}
    assert {f["rank"] for f in grads} == {0, 1}
    assert min(f["step"] for f in grads) == 1


def test_the_same_pattern_at_world_size_one_passes_and_says_its_checks_are_vacuous(run_pytest):
    session = run_pytest(PLANTED, "-k", "left_out", "--world-sizes", "1")
    cell = session.cells()[("planted_left_out_of_no_sync", "fp32", 1)]
    assert cell["status"] == "pass"
    assert cell["vacuous_checks"] == cell["checks"] > 0
    assert "all vacuous for sync (world size 1 cannot tell synced from local)" in cell["summary"]


def test_the_nested_accumulate_canary_is_detected_and_names_the_model_that_never_synced(run_pytest):
    session = run_pytest("cases/test_accumulate.py", "-k", "nested and fp32", "--world-sizes", "2")
    assert session.returncode == 0
    cell = session.cells()[("accumulate_nested", "steps=2-fp32", 2)]
    assert cell["status"] == "detected"
    not_synced = {f["model"] for f in cell["failures"] if f["kind"] == "not_synced"}
    assert not_synced == {"gen"}
    assert "not_synced in gen" in cell["summary"]


@pytest.mark.parametrize(
    "args, option",
    [
        (["--world-sizes", "0"], "--world-sizes"),
        (["--world-sizes", "two"], "--world-sizes"),
        (["--world-sizes", "1,,2"], "--world-sizes"),
        (["--backend", "mpi"], "--backend"),
        (["--case-timeout", "-1"], "--case-timeout"),
        (["--case-timeout", "soon"], "--case-timeout"),
        (["--seed", "x"], "--seed"),
        (["--report-dir", "pyproject.toml/sub"], "--report-dir"),
    ],
)
def test_bad_input_stops_the_run_at_start_with_one_line_naming_the_option(run_pytest, args, option):
    session = run_pytest("cases/", *args, timeout=120)
    assert session.returncode == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in session.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, session.stderr
    assert lines[0].startswith(f"ERROR: {option}:")
    assert "Traceback" not in session.stdout + session.stderr
    assert not (session.report_dir / "matrix.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nccl can run here")
def test_nccl_without_gpus_gives_skip_cells_with_the_reason(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "-k", "fp32", "--backend", "nccl", "--world-sizes", "1,2")
    assert session.returncode == 0
    cells = session.cells()
    assert {c["status"] for c in cells.values()} == {"skip"}
    assert cells[("fused_loss", "fp32", 2)]["summary"] == "nccl needs one GPU per rank: world size 2, 0 GPU(s) here"
    assert session.matrix["environment"]["backend"] == "nccl"
    assert "fault" not in session.matrix["environment"]


def interrupt_half_way(tmp_path, how, extra):
    progress = tmp_path / "progress"
    progress.mkdir()
    report_dir = tmp_path / "reports"
    process, token = start_pytest([*extra, PLANTED, "-k", "planted_slow", "--world-sizes", "2"], report_dir,
                                  PLANTED_PROGRESS_DIR=str(progress))
    deadline = time.monotonic() + 300
    while len(list(progress.iterdir())) < 3:  # the third cell has started: two have finished
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the planted cells never started"
        time.sleep(0.1)
    how(process)
    stdout, stderr = process.communicate(timeout=60)
    return process.returncode, stdout, report_dir, token


@pytest.mark.parametrize(
    "how, extra",
    [
        pytest.param(lambda p: os.killpg(p.pid, signal.SIGINT), [], id="ctrl-c-to-the-process-group"),
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), [], id="sigterm"),
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), ["-n", "2"], id="sigterm-to-the-xdist-controller"),
    ],
)
def test_an_interrupted_run_writes_the_finished_cells_marks_the_matrix_incomplete_and_leaves_no_process(
    tmp_path, how, extra
):
    returncode, stdout, report_dir, token = interrupt_half_way(tmp_path, how, extra)
    assert returncode == pytest.ExitCode.INTERRUPTED, stdout
    matrix = json.loads((report_dir / "matrix.json").read_text())
    assert matrix["complete"] is False
    assert len(matrix["cells"]) >= 2
    assert all(c["status"] == "pass" for c in matrix["cells"])
    assert "Incomplete run" in (report_dir / "matrix.md").read_text()
    assert "gradient-sync matrix (INCOMPLETE)" in stdout
    assert wait_for_no_processes(token) == []


def test_a_run_that_finishes_no_cell_leaves_the_previous_reports_alone(run_pytest, tmp_path):
    report_dir = tmp_path / "kept"
    report_dir.mkdir()
    (report_dir / "matrix.json").write_text("previous")
    session = run_pytest("cases/", "-k", "no such = expression", report_dir=report_dir, timeout=120)
    assert session.returncode == pytest.ExitCode.USAGE_ERROR
    assert (report_dir / "matrix.json").read_text() == "previous"
