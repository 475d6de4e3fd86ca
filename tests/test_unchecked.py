"""A check that cannot run is never silent (docs/upgrade-checks.md, "Supported versions and checks that cannot run"): the cell says
what it did not check and why, the matrix's environment names the check, matrix.md and matrix.html
show it at the top, and a canary that needs it is ``skip`` rather than ``missed``.

The collective accounting needs torch's flight recorder. On torch 2.6 it records no gloo collective;
here (torch 2.13) the same state is had for real by turning the recorder off for the run
(``TORCH_FR_BUFFER_SIZE=0``): the ranks probe the ring after their start-up all-reduce and find
nothing, exactly as on a torch without it."""

from __future__ import annotations

import json

import pytest
from conftest import start_pytest, wait_for_no_processes

from harness.matrix.file import parse_matrix
from harness.matrix.merge import merge_matrices
from harness.matrix.schema import Cell, Matrix, unavailable_checks, with_unavailable_checks
from harness.records import Status

SELECTION = ["cases/test_no_sync.py", "-k", "test_no_sync_trigger_sync_compiled or test_no_sync[fp32-ws2]",
             "--world-sizes", "2"]


def run(tmp_path, **env):
    process, token = start_pytest(SELECTION, tmp_path, **env)
    stdout, _ = process.communicate(timeout=600)
    assert wait_for_no_processes(token) == []
    return process.returncode, stdout, json.loads((tmp_path / "matrix.json").read_text())


def test_without_the_flight_recorder_each_cell_says_what_it_did_not_check_and_the_canary_is_skip(tmp_path):
    returncode, stdout, matrix = run(tmp_path, TORCH_FR_BUFFER_SIZE="0")
    assert returncode == 0, stdout[-3000:]
    cells = {(c["case"], c["variant"]): c for c in matrix["cells"]}
    ordinary = cells[("no_sync", "fp32")]
    assert ordinary["status"] == "pass" and ordinary["comm_checks"] == 0
    assert set(ordinary["unchecked"]) == {"collective_accounting"}
    assert "flight recorder is off" in ordinary["unchecked"]["collective_accounting"]
    assert "NOT CHECKED: collective accounting (comm_unexpected, comm_missing)" in ordinary["summary"]
    canary = cells[("no_sync_trigger_sync_compiled", "fp32-compile=aot_eager")]
    assert canary["status"] == "skip", canary["summary"]
    assert "comm_missing" in canary["summary"] and "cannot run here" in canary["summary"]
    assert set(matrix["environment"]["unavailable_checks"]) == {"collective_accounting"}
    markdown = (tmp_path / "matrix.md").read_text()
    assert "**Not checked in this run: collective accounting (comm_unexpected, comm_missing)**" in markdown
    assert markdown.index("Not checked in this run") < markdown.index("| case |")
    page = (tmp_path / "matrix.html").read_text()
    assert 'data-check="collective_accounting">NOT CHECKED in this run' in page


def test_with_the_flight_recorder_the_same_cells_check_collectives_and_say_nothing_of_it(tmp_path):
    returncode, stdout, matrix = run(tmp_path)
    assert returncode == 0, stdout[-3000:]
    cells = {(c["case"], c["variant"]): c for c in matrix["cells"]}
    assert cells[("no_sync", "fp32")]["comm_checks"] > 0
    assert cells[("no_sync_trigger_sync_compiled", "fp32-compile=aot_eager")]["status"] == "detected"
    assert all("unchecked" not in c and "NOT CHECKED" not in c["summary"] for c in matrix["cells"])
    assert "unavailable_checks" not in matrix["environment"]
    assert "Not checked" not in (tmp_path / "matrix.md").read_text()


def cell(unchecked=None, **kw):
    return Cell(case="no_sync", variant="fp32", world_size=2, status=Status.PASS, unchecked=unchecked or {}, **kw)


def test_the_environment_names_each_unavailable_check_once_and_a_file_keeps_it():
    reason = "torch 2.6.0's flight recorder (_dump_nccl_trace) records no gloo collective"
    cells = [cell(), cell({"collective_accounting": reason}), cell({"collective_accounting": "other words"})]
    cells[0].variant, cells[2].variant = "fp16", "bf16"
    environment = with_unavailable_checks({"torch": "2.6.0"}, cells)
    assert environment == {"torch": "2.6.0", "unavailable_checks": {"collective_accounting": "other words"}}
    assert with_unavailable_checks({"torch": "2.13.0"}, [cell()]) == {"torch": "2.13.0"}
    data = Matrix(environment=environment, cells=cells).to_dict()
    assert "unchecked" not in data["cells"][1]  # fp16 checked everything: its JSON as before
    again = parse_matrix(json.loads(json.dumps(data)))
    assert unavailable_checks(again.environment) == {"collective_accounting": "other words"}
    assert [c.unchecked for c in again.sorted_cells()] == [{"collective_accounting": "other words"}, {},
                                                           {"collective_accounting": reason}]


def test_a_malformed_unchecked_field_is_named():
    data = Matrix(environment={}, cells=[cell()]).to_dict()
    data["cells"][0]["unchecked"] = ["collective_accounting"]
    with pytest.raises(ValueError, match=r"cells\[0\] \(no_sync / fp32 / ws=2\): unchecked is a list, expected an object"):
        parse_matrix(data)


def test_a_merged_matrix_names_the_checks_any_input_could_not_run(tmp_path):
    reason = "torch 2.6.0 has no flight recorder reader"
    a = Matrix(environment={"world_sizes": [2], "torch": "2.6.0"}, cells=[cell({"collective_accounting": reason})])
    b = Matrix(environment={"world_sizes": [4], "torch": "2.6.0"},
               cells=[Cell(case="no_sync", variant="fp32", world_size=4, status=Status.PASS)])
    a.environment = with_unavailable_checks(a.environment, a.cells)
    merged = merge_matrices([("a.json", a), ("b.json", b)])
    assert unavailable_checks(merged.environment) == {"collective_accounting": reason}
    merged = merge_matrices([("b.json", b)])
    assert "unavailable_checks" not in merged.environment
