"""A rank that raises, exits, is killed or hangs becomes an error cell naming it; the run goes on."""

import time

import pytest
from conftest import PLANTED, Session, start_pytest, wait_for_no_processes

from harness.controller.pool import GRACE_S

TIMEOUT_S = 4


@pytest.fixture(scope="module")
def faults_session(tmp_path_factory):
    """One session through every planted rank fault, each followed by a healthy cell."""
    report_dir = tmp_path_factory.mktemp("faults")
    started = time.monotonic()
    process, token = start_pytest([PLANTED, "-k", "planted_rank_fault", "--world-sizes", "2",
                                   "--case-timeout", str(TIMEOUT_S)], report_dir)
    stdout, stderr = process.communicate(timeout=600)
    return Session(process.returncode, stdout, stderr, report_dir, token, time.monotonic() - started)


EXPECTED = {
    "raise": "rank 1 raised ZeroDivisionError: planted on rank 1 (rank 0 blocked waiting for it)",
    "exit": "rank 1 exited with code 7 (rank 0 blocked waiting for it)",
    "kill": "rank 1 killed by SIGKILL (rank 0 blocked waiting for it)",
    "hang_in_collective": f"rank 1 hung (no result within {TIMEOUT_S} s)",
    "hang_outside": f"rank 1 hung (no result within {TIMEOUT_S} s) (rank 0 blocked waiting for it)",
}


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_becomes_an_error_cell_naming_the_rank(faults_session, fault):
    cell = faults_session.cells()[("planted_rank_fault", fault, 2)]
    assert cell["status"] == "error"
    assert cell["summary"] == EXPECTED[fault]
    # ended within the timeout plus a few seconds (the grace for the others, the stack dump)
    assert cell["duration_s"] <= TIMEOUT_S + GRACE_S + 5


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_the_next_cell_runs_on_a_rebuilt_pool_and_passes(faults_session, fault):
    assert faults_session.cells()[("planted_rank_fault", f"after_{fault}", 2)]["status"] == "pass"


def test_error_details_carry_the_traceback_or_the_stacks(faults_session):
    cells = faults_session.cells()
    raised = cells[("planted_rank_fault", "raise", 2)]["detail"]
    assert "Traceback" in raised and "in plant" in raised
    in_collective = cells[("planted_rank_fault", "hang_in_collective", 2)]["detail"]
    assert "all_reduce" in in_collective  # the faulthandler dump of rank 1
    outside = cells[("planted_rank_fault", "hang_outside", 2)]["detail"]
    hung, _, blocked = outside.partition("--- rank 0 was blocked")
    assert "in plant" in hung and "barrier" in blocked


def test_the_session_fails_and_leaves_no_process(faults_session):
    assert faults_session.returncode == 1
    assert "5 failed, 5 passed" in faults_session.stdout
    assert wait_for_no_processes(faults_session.token) == []


@pytest.fixture(scope="module")
def raise_session(tmp_path_factory):
    """One session of the planted declared raise (tests/planted/planted_cases.py) at world size 2."""
    report_dir = tmp_path_factory.mktemp("declared-raise")
    started = time.monotonic()
    process, token = start_pytest([PLANTED, "-k", "planted_library_error", "--world-sizes", "2"], report_dir)
    stdout, stderr = process.communicate(timeout=600)
    return Session(process.returncode, stdout, stderr, report_dir, token, time.monotonic() - started)


def test_a_declared_raise_of_the_library_is_detected_with_its_words_and_frame(raise_session):
    cell = raise_session.cells()[("planted_library_error", "declared", 2)]
    assert cell["status"] == "detected"
    assert [(f["rank"], f["step"], f["kind"]) for f in cell["failures"]] == [(0, 2, "raised"), (1, 2, "raised")]
    message = cell["failures"][0]["message"]
    assert message.startswith("torch raised ValueError: batch_size should be a positive integer value")
    assert "(torch/utils/data/sampler.py:" in message and "in __init__)" in message
    assert cell["summary"].startswith("diagnosed as declared (raised (planted)): 2 raises on ranks 0, 1: raised; "
                                      "first: torch raised ValueError")


@pytest.mark.parametrize("variant", ["undeclared", "from_the_case", "another_error"])
def test_any_other_raise_stays_an_error(raise_session, variant):
    # not declared for this variant; the declared words raised by the case itself; another of torch's errors
    cell = raise_session.cells()[("planted_library_error", variant, 2)]
    assert cell["status"] == "error"
    assert cell["summary"].startswith("ranks 0, 1 raised ValueError: ")
    assert "Traceback" in cell["detail"]


def test_a_compiled_cell_that_compiled_nothing_is_an_error_naming_it(run_pytest):
    session = run_pytest(PLANTED, "-k", "planted_compiled_nothing", "--world-sizes", "2")
    cells = session.cells()
    eager = cells[("planted_compiled_nothing", "sequential-compile=aot_eager", 2)]
    assert eager["status"] == "error"
    assert "torch.compile compiled no graph on this rank" in eager["summary"], eager["summary"]
    assert cells[("planted_compiled_nothing", "own_module-compile=aot_eager", 2)]["status"] == "pass"
