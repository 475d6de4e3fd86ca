"""The pytest plugin end to end: planted faults are found where they are, bad input stops the run at
once, interrupted runs keep their finished cells, and no process outlives a session."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import (
    PLANTED,
    ROOT,
    killed_if_failing,
    session_env,
    signal_another_thread,
    start_pytest,
    wait_for_no_processes,
    wait_until,
)

from harness.controller.rank_server import SHARED_SERVER_VARIABLE


@pytest.fixture(scope="module")
def perturbed_run(tmp_path_factory):
    """One run with rank 1's gradients scaled by 1.01, read by the two tests below (a session's rank
    start-up costs seconds; neither test changes what the other reads)."""
    from conftest import _finished

    report_dir = tmp_path_factory.mktemp("perturbed") / "full"
    return _finished(["cases/test_fused_loss.py", "-k", "fp32-ws", "--world-sizes", "1,2",
                      "--harness-fault", "perturb_rank1"], report_dir)


def test_a_perturbed_rank_fails_the_cell_naming_rank_step_model_and_kind(perturbed_run):
    session = perturbed_run
    assert session.returncode == 1
    cell = session.cells()[("fused_loss", "fp32", 2)]
    assert cell["status"] == "fail"
    first = cell["failures"][0]
    assert (first["rank"], first["step"], first["model"], first["param"]) == (1, 1, "model", "fc1.weight")
    assert first["kind"] == "wrong_scale" and first["factor"] == pytest.approx(1.01, rel=1e-4)
    # rank 1 stepped with its own gradient: its parameters part from rank 0's, reported once each
    diverged = [f for f in cell["failures"] if f["kind"] == "params_diverged"]
    assert {(f["rank"], f["step"]) for f in diverged} == {(1, 1)} and len(diverged) == 4
    assert diverged[0]["message"].startswith(
        f"parameter 'model.{diverged[0]['param']}' on rank 1 at step 1: parameters diverged across ranks")
    # at step 1 rank 0's gradient was right: the fault is rank 1's alone
    assert not [f for f in cell["failures"] if f["rank"] == 0 and f["step"] == 1 and f["checked"] == "grad"]
    assert session.matrix["environment"]["fault"] == "perturb_rank1"
    assert "gradient of 'model.fc1.weight' on rank 1 at step 1: scaled by 1.01" in session.stdout
    assert ("Rerun this cell: pytest 'cases/test_fused_loss.py::test_fused_loss[fp32-ws2]' --world-sizes 2"
            in session.stdout)
    assert wait_for_no_processes(session.token) == []


def test_the_printed_rerun_command_runs_the_cell_without_replacing_the_runs_matrix(perturbed_run):
    session = perturbed_run
    report_dir = session.report_dir
    cell = session.cells()[("fused_loss", "fp32", 2)]
    rerun = shlex.split(cell["rerun"])
    assert rerun[0] == "pytest" and rerun[rerun.index("--report-dir") + 1] == str(report_dir / "rerun")
    before = (report_dir / "matrix.json").read_text()
    process = subprocess.run([sys.executable, "-m", *rerun, "-p", "no:cacheprovider"], cwd=ROOT,
                             env=session_env("rerun"), capture_output=True, text=True, timeout=300)
    assert process.returncode == 1, process.stdout[-2000:]
    assert (report_dir / "matrix.json").read_text() == before
    rerun_matrix = json.loads((report_dir / "rerun" / "matrix.json").read_text())
    assert [(c["case"], c["world_size"], c["status"]) for c in rerun_matrix["cells"]] == [("fused_loss", 2, "fail")]


def test_a_model_left_out_of_no_sync_is_named_as_synced_early(left_out_run):
    session = left_out_run
    assert session.returncode == 1
    cell = session.cells()[("planted_left_out_of_no_sync", "fp32", 2)]
    assert cell["status"] == "fail"
    grads = [f for f in cell["failures"] if f["checked"] == "grad"]
    assert {f["model"] for f in grads} == {"disc"}
    assert {f["kind"] for f in grads} == {"synced_early"}
    assert {f["rank"] for f in grads} == {0, 1}
    assert min(f["step"] for f in grads) == 1


def test_the_same_pattern_at_world_size_one_passes_and_says_its_checks_are_vacuous(left_out_run):
    cell = left_out_run.cells()[("planted_left_out_of_no_sync", "fp32", 1)]
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
    assert cell["summary"].startswith("diagnosed as declared (not_synced in gen, stepped_early in disc)")


def test_a_canary_found_only_as_another_kind_is_missed_and_alike_data_is_an_error(run_pytest):
    session = run_pytest(PLANTED, "-k", "misdeclared or alike", "--world-sizes", "2")
    assert session.returncode == 1
    cells = session.cells()
    canary = cells[("planted_canary_misdeclared", "fp32", 2)]
    assert canary["status"] == "missed"
    assert {f["kind"] for f in canary["failures"]} == {"stepped_early"}
    assert "not diagnosed as declared: no not_synced in model" in canary["summary"]
    alike = cells[("planted_alike", "fp32", 2)]
    assert alike["status"] == "error"
    assert alike["vacuous_checks"] == alike["grad_checks"] > 0
    assert "too alike to tell a synced gradient from a local one" in alike["summary"]


def test_a_case_name_defined_twice_is_a_collection_error_naming_both_places(run_pytest, tmp_path):
    twin = tmp_path / "test_twin.py"
    twin.write_text(textwrap.dedent("""
        from harness import case

        @case("fused_loss")
        def test_my_fused_loss(ctx):
            pass
    """))
    session = run_pytest("cases/test_fused_loss.py", str(twin), "--world-sizes", "1", timeout=120)
    assert session.returncode == pytest.ExitCode.INTERRUPTED  # pytest's "errors during collection"
    assert "case 'fused_loss' is defined twice" in session.stdout
    assert "cases/test_fused_loss.py:" in session.stdout
    assert f"{os.path.realpath(twin)}:4 (test_my_fused_loss)" in session.stdout
    assert not (session.report_dir / "matrix.json").exists()


def test_an_exception_while_waiting_for_a_cell_makes_it_an_error_and_the_next_cell_runs(tmp_path):
    """Whatever breaks in the controller while a cell runs: that cell is an error naming it, the pool
    is killed and rebuilt, and the run goes on."""
    (tmp_path / "break_one_wait.py").write_text(textwrap.dedent("""
        from harness.controller.pool import RankPool

        original = RankPool.run

        def run(self, spec, **kwargs):
            if spec.variant == "after_raise":
                raise OSError(9, "Bad file descriptor (planted in the controller)")
            return original(self, spec, **kwargs)

        RankPool.run = run
    """))
    process, token = start_pytest([PLANTED, "-k", "after_raise or after_exit", "--world-sizes", "2",
                                   "-p", "break_one_wait"], tmp_path / "reports",
                                  PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    stdout, _ = process.communicate(timeout=600)
    assert process.returncode == 1, stdout[-3000:]
    cells = {c["variant"]: c for c in json.loads((tmp_path / "reports" / "matrix.json").read_text())["cells"]}
    assert cells["after_raise"]["status"] == "error"
    assert cells["after_raise"]["summary"] == ("the harness failed while waiting for the cell: OSError: [Errno 9] "
                                               "Bad file descriptor (planted in the controller)")
    assert cells["after_exit"]["status"] == "pass"
    assert wait_for_no_processes(token) == []


@pytest.mark.parametrize(
    "args, option",
    [
        (["--world-sizes", "0"], "--world-sizes"),
        (["--world-sizes", "two"], "--world-sizes"),
        (["--world-sizes", "1,,2"], "--world-sizes"),
        (["--backend", "mpi"], "--backend"),
        (["--case-timeout", "-1"], "--case-timeout"),
        (["--case-timeout", "soon"], "--case-timeout"),
        (["--case-timeout", "3e6"], "--case-timeout"),  # longer than poll() can wait
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


def test_pytest_help_names_every_fault_harness_fault_takes(tmp_path):
    from harness.selfcheck.faults import FAULTS, PERTURBATION_FORMS

    shown = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    help_text = " ".join(shown.stdout[shown.stdout.index("--harness-fault"):].split())
    for name in FAULTS:
        assert f" {name}," in help_text, name
    assert " ".join(PERTURBATION_FORMS.split()) in help_text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nccl can run here")
def test_nccl_without_gpus_gives_skip_cells_with_the_reason(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "-k", "fp32-ws", "--backend", "nccl", "--world-sizes", "1,2")
    assert session.returncode == 0
    cells = session.cells()
    assert {c["status"] for c in cells.values()} == {"skip"}
    assert cells[("fused_loss", "fp32", 2)]["summary"] == "nccl needs one GPU per rank: world size 2, 0 GPU(s) here"
    assert session.matrix["environment"]["backend"] == "nccl"
    assert "fault" not in session.matrix["environment"]


def cells_in(report_dir):
    try:
        return json.loads((report_dir / "matrix.json").read_text())["cells"]
    except FileNotFoundError:
        return []


FINISHED = [("finishes1", "pass"), ("finishes2", "pass")]  # the cells before the blocked one
# A run's fork server listens on a socket in its TMPDIR, at pymp-XXXXXXXX/listener-XXXXXXXX, and a Unix
# socket's address holds 107 bytes of path
SOCKET_PATH_MAX, SOCKET_IN_TEMP = 107, len("/pymp-XXXXXXXX/listener-XXXXXXXX")


@pytest.fixture
def run_temp():
    """A TMPDIR for a run under test, whose pools' folders the test looks for afterwards: a folder
    of its own, short enough for the run's fork server. One in tmp_path (pytest's folder, then the
    test's name) came to 109 bytes with the socket under xdist: the server could not start, and
    every rank of those runs was spawned, importing torch and accelerate itself (15 of 55 CPU-s of
    these eight tests; tests/test_pool.py covers that fallback on purpose)."""
    temp = Path(tempfile.mkdtemp(prefix="gsync-"))
    try:
        assert len(os.fsencode(temp)) + SOCKET_IN_TEMP <= SOCKET_PATH_MAX, f"{temp}: too deep for a fork server"
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def interrupt_half_way(tmp_path, temp, how, extra, ctrl_c="handled"):
    """Start a run whose third cell blocks until the run is ended, and end it ``how`` once the run
    says it is there: the outcome cannot depend on the machine's speed. ``temp``: its TMPDIR;
    ``ctrl_c``: start_pytest's."""
    progress = tmp_path / "progress"
    progress.mkdir()
    report_dir = tmp_path / "reports"
    # a case timeout longer than any wait here: the blocked cell ends by the signal, never by its timeout
    process, token = start_pytest([*extra, PLANTED, "-k", "planted_blocks_half_way", "--world-sizes", "2",
                                   "--case-timeout", "3600"], report_dir, ctrl_c=ctrl_c,
                                  PLANTED_PROGRESS_DIR=str(progress), TMPDIR=str(temp),
                                  **{SHARED_SERVER_VARIABLE: ""})  # the run's own fork server, as a user's
    with killed_if_failing(process):
        # rank 0 has started the blocking cell, so the two before it have finished (under xdist their
        # reports may still be on their way from the worker to the controller, so wait until the
        # controller has written them too)
        wait_until(lambda: (progress / "blocks").exists() and ("-n" not in extra or len(cells_in(report_dir)) == 2),
                   process, "the run blocked in its third cell")
        how(process)
        stdout, _ = process.communicate(timeout=60)
    return process.returncode, stdout, report_dir, token, temp


@pytest.mark.parametrize(
    "how, extra, ctrl_c",
    [
        pytest.param(lambda p: os.killpg(p.pid, signal.SIGINT), [], "handled", id="ctrl-c-to-the-process-group"),
        # delivered to a thread other than the main one, which is asleep waiting for the ranks (the
        # session is given a thread of its own to receive it: which threads a session has besides its
        # main one depends on the machine, and with OMP_NUM_THREADS=1 it has none)
        pytest.param(lambda p: signal_another_thread(p.pid, signal.SIGINT), ["-p", "tests.planted.second_thread"],
                     "handled", id="ctrl-c-landing-on-another-thread"),
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), [], "handled", id="sigterm"),
        pytest.param(lambda p: p.send_signal(signal.SIGHUP), [], "handled", id="sighup"),
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), ["-n", "2"], "handled",
                     id="sigterm-to-the-xdist-controller"),
        # a script's background job (`pytest -n 2 ... &`, nohup) starts with Ctrl-C ignored, and its
        # xdist workers with it: the controller's shutdown interrupts a worker with SIGINT all the same
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), ["-n", "2"], "ignored",
                     id="sigterm-to-the-xdist-controller-of-a-background-job"),
    ],
)
def test_an_interrupted_run_writes_the_finished_cells_marks_the_matrix_incomplete_and_leaves_nothing_behind(
    tmp_path, run_temp, how, extra, ctrl_c
):
    returncode, stdout, report_dir, token, temp = interrupt_half_way(tmp_path, run_temp, how, extra, ctrl_c)
    assert returncode == pytest.ExitCode.INTERRUPTED, stdout
    matrix = json.loads((report_dir / "matrix.json").read_text())
    assert matrix["complete"] is False
    assert sorted((c["variant"], c["status"]) for c in matrix["cells"]) == FINISHED
    assert "Incomplete run" in (report_dir / "matrix.md").read_text()
    assert "gradient-sync matrix (INCOMPLETE)" in stdout
    assert wait_for_no_processes(token) == []
    assert [p.name for p in temp.iterdir() if p.name.startswith("harness-")] == []  # the pools' folders


def test_a_run_killed_outright_keeps_every_finished_cell_in_its_reports(tmp_path, run_temp):
    """SIGKILL runs no code: the reports must already hold each cell as it finished."""
    returncode, _, report_dir, token, _ = interrupt_half_way(tmp_path, run_temp, lambda p: p.kill(), [])
    assert returncode == -signal.SIGKILL
    matrix = json.loads((report_dir / "matrix.json").read_text())
    assert matrix["complete"] is False
    assert sorted((c["variant"], c["status"]) for c in matrix["cells"]) == FINISHED
    assert "planted_blocks_half_way" in (report_dir / "matrix.html").read_text()
    assert wait_for_no_processes(token) == []


def test_a_finished_run_marks_its_matrix_complete_and_removes_the_pools_folders(tmp_path, run_temp):
    temp = run_temp
    process, token = start_pytest(["cases/test_fused_loss.py", "-k", "fp32-ws", "--world-sizes", "1,2"],
                                  tmp_path / "reports", TMPDIR=str(temp))
    stdout, _ = process.communicate(timeout=600)
    assert process.returncode == 0, stdout[-3000:]
    assert json.loads((tmp_path / "reports" / "matrix.json").read_text())["complete"] is True
    assert [p.name for p in (tmp_path / "reports").iterdir() if p.name.startswith(".")] == []  # no temp files
    assert [p.name for p in temp.iterdir() if p.name.startswith("harness-")] == []
    assert wait_for_no_processes(token) == []


def test_a_run_that_finishes_no_cell_leaves_the_previous_reports_alone(run_pytest, tmp_path):
    report_dir = tmp_path / "kept"
    report_dir.mkdir()
    (report_dir / "matrix.json").write_text("previous")
    session = run_pytest("cases/", "-k", "no such = expression", report_dir=report_dir, timeout=120)
    assert session.returncode == pytest.ExitCode.USAGE_ERROR
    assert (report_dir / "matrix.json").read_text() == "previous"


def test_accelerate_settings_in_the_environment_do_not_change_the_cells(tmp_path):
    """A shell or launcher that exported ACCELERATE_MIXED_PRECISION=bf16 (as `accelerate launch`
    does) would make every fp32 cell bf16: the ranks drop such settings, and the matrix names them."""
    process, _ = start_pytest(["cases/test_fused_loss.py", "-k", "fp32-ws", "--world-sizes", "2"], tmp_path,
                              ACCELERATE_MIXED_PRECISION="bf16", ACCELERATE_GRADIENT_ACCUMULATION_STEPS="3")
    stdout, _ = process.communicate(timeout=300)
    assert process.returncode == 0, stdout[-2000:]
    matrix = json.loads((tmp_path / "matrix.json").read_text())
    assert matrix["environment"]["ignored_launcher_settings"] == ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                                                  "ACCELERATE_MIXED_PRECISION"]
    assert [(c["variant"], c["status"], c["max_abs_diff"]) for c in matrix["cells"]] == [("fp32", "pass", 0.0)]
