"""bench/sweep.py: pairs, folder names, counts and the table as pure functions; one real sweep of the
installed pair with this interpreter (no venv, no download); tox.ini's refusals of a missing variable."""

from __future__ import annotations

import configparser
import importlib.metadata
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "sweep.py"

_spec = importlib.util.spec_from_file_location("sweep", SCRIPT)
sweep = importlib.util.module_from_spec(_spec)
sys.modules["sweep"] = sweep  # dataclasses look their module up by name
_spec.loader.exec_module(sweep)

STATUSES = ["pass", "fail", "error", "skip", "unsupported", "detected", "missed"]


def matrix_of(*statuses: str, complete: bool = True) -> dict:
    cells = [{"case": "fused_loss", "variant": f"v{i}", "world_size": 2, "status": s} for i, s in enumerate(statuses)]
    return {"schema_version": 1, "complete": complete, "environment": {}, "cells": cells}


# --- pairs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, torch, accelerate", [
    ("2.9.1/1.15.0", "2.9.1", "1.15.0"),
    ("2.6.0+cu124/0.28.0", "2.6.0+cu124", "0.28.0"),
    ("2.10.0rc1/1.0.0.dev0", "2.10.0rc1", "1.0.0.dev0"),
])
def test_a_pair_is_two_versions(text, torch, accelerate):
    assert sweep.parse_pair(text) == sweep.Pair(torch, accelerate)
    assert str(sweep.parse_pair(text)) == text


@pytest.mark.parametrize("text", ["2.9.1", "2.9.1/", "/1.15.0", "2.9.1/1.15.0/1", "torch==2.9.1/1.15.0",
                                  "2.9.1 /1.15.0", "2.9.1,1.15.0", "v2.9.1/1.15.0", ""])
def test_a_bad_pair_is_one_line_naming_it_and_exit_2(text, capsys):
    with pytest.raises(sweep.UsageError, match="bad pair"):
        sweep.parse_pair(text)
    assert sweep.main([text, "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and repr(text) in err, err


@pytest.mark.parametrize("argv, says", [
    (["2.9.1/1.15.0", "2.9.1/1.15.0"], "given twice"),
    ([], "give at least one"),
    (["2.9.1/1.15.0", "--world-sizes", "two"], "--world-sizes: 'two'"),
    (["2.9.1/1.15.0", "--jobs", "many"], "--jobs: 'many'"),
    (["2.9.1/1.15.0", "--python", sys.executable, "--reuse"], "--reuse: nothing is installed with --python"),
    (["2.9.1/1.15.0", "--python", "/nonexistent/python"], "--python: '/nonexistent/python' is not a file"),
    (["--installed", "2.9.1/1.15.0"], "--installed takes no pairs"),
    (["2.9.1/1.15.0", "--no-such-option"], "unrecognized arguments: --no-such-option"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says, capsys):
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_arguments_after_the_separator_go_to_pytest():
    args, pairs, pytest_args = sweep.parse_arguments(["2.9.1/1.15.0", "--jobs", "0", "--", "-k", "a and b", "--", "x"])
    assert pairs == [sweep.Pair("2.9.1", "1.15.0")] and args.jobs == "0"
    assert pytest_args == ["-k", "a and b", "--", "x"]


@pytest.mark.parametrize("asked, installed, same", [
    ("2.6.0", "2.6.0+cu124", True),
    ("2.6", "2.6.0", True),
    ("2.6.0+cu124", "2.6.0+cu124", True),
    ("2.6.0+cu124", "2.6.0+cpu", False),
    ("2.6.0", "2.6.1", False),
    ("2.6.0", "2.6.0rc1", False),
    ("1.15.0", "", False),
])
def test_a_pair_matches_the_release_pip_would_take(asked, installed, same):
    assert sweep.same_release(asked, installed) is same


# --- names -------------------------------------------------------------------------------------------

def test_folders_are_named_by_the_pair():
    pair = sweep.Pair("2.9.1", "1.15.0")
    assert sweep.report_folder(pair) == "torch-2.9.1-accelerate-1.15.0"
    assert sweep.venv_folder(pair) == "torch-2.9.1-accelerate-1.15.0"
    assert sweep.venv_folder(pair, deepspeed=True) == "torch-2.9.1-accelerate-1.15.0-deepspeed"
    # tox -e torch names its folder by the versions installed, without the local label
    assert sweep.report_folder(sweep.installed_pair("2.13.0+cpu", "1.15.0")) == "torch-2.13.0-accelerate-1.15.0"


def test_the_venvs_folder_is_ignored_by_git():
    assert sweep.DEFAULT_VENVS.parent == ROOT
    ignored = subprocess.run(["git", "check-ignore", "-q", str(sweep.DEFAULT_VENVS / "x" / "bin" / "python")],
                             cwd=ROOT, capture_output=True)
    assert ignored.returncode == 0


# --- counts and the table ----------------------------------------------------------------------------

def test_statuses_are_counted_from_the_cells():
    assert list(sweep.STATUSES) == STATUSES  # the table's columns are the schema's statuses, in its order
    counts = sweep.count_statuses(matrix_of("pass", "pass", "fail", "detected", "unsupported"))
    assert counts == {"pass": 2, "fail": 1, "error": 0, "skip": 0, "unsupported": 1, "detected": 1, "missed": 0}
    assert sweep.count_statuses(matrix_of()) == dict.fromkeys(STATUSES, 0)


@pytest.mark.parametrize("matrix, says", [
    ({"cells": "none"}, "not a matrix"),
    ([], "not a matrix"),
    (matrix_of("pass", "flaky"), "status 'flaky'"),
    ({"cells": [None]}, "status None"),
])
def test_a_matrix_the_sweep_cannot_count_is_an_error(matrix, says):
    with pytest.raises(ValueError, match=says):
        sweep.count_statuses(matrix)


def test_the_table_has_a_row_per_pair_and_a_line_per_pair_that_did_not_run():
    new, old, missing = sweep.Pair("2.13.0", "1.15.0"), sweep.Pair("2.4.1", "0.28.0"), sweep.Pair("9.9.9", "1.15.0")
    results = [
        sweep.PairResult(new, "ran", exit_status=0, seconds=101.4, installed=("2.13.0+cpu", "1.15.0"),
                         counts=sweep.count_statuses(matrix_of("pass", "pass", "detected", "skip"))),
        sweep.PairResult(old, "ran", exit_status=1, seconds=88.6, installed=("2.4.1", "0.28.0"), complete=False,
                         counts=sweep.count_statuses(matrix_of("pass", "fail", "error", "missed", "unsupported"))),
        sweep.PairResult(missing, "install failed",
                         reason="ERROR: No matching distribution found for torch==9.9.9"),
    ]
    assert sweep.render_table(results) == (
        "| torch | accelerate | exit | seconds | pass | fail | error | skip | unsupported | detected | missed |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        "| 2.13.0+cpu | 1.15.0 | 0 | 101 | 2 | 0 | 0 | 1 | 0 | 1 | 0 |\n"
        "| 2.4.1 | 0.28.0 | 1 | 89 | 1 | 1 | 1 | 0 | 1 | 0 | 1 |\n"
        "| 9.9.9 | 1.15.0 | install failed | – | – | – | – | – | – | – | – |\n"
        "\n"
        "- `2.4.1/0.28.0`: the run did not finish (exit 1); its matrix is incomplete\n"
        "- `9.9.9/1.15.0`: install failed: ERROR: No matching distribution found for torch==9.9.9\n"
    )


def test_the_table_in_bench_readme_has_the_columns_the_sweep_prints():
    header = sweep.render_table([]).splitlines()[0]
    assert header in (ROOT / "bench" / "README.md").read_text().splitlines()


@pytest.mark.parametrize("log, line", [
    ("Collecting torch==9.9\nERROR: Could not find a version\nERROR: No matching distribution found for torch==9.9\n",
     "ERROR: No matching distribution found for torch==9.9"),
    ("ERROR: Cannot install torch==0.0.1 because these package versions have conflicting dependencies.\n\n"
     "The conflict is caused by:\n    The user requested torch==0.0.1\n\n"
     "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/\n",
     "ERROR: Cannot install torch==0.0.1 because these package versions have conflicting dependencies."),
    ("Error: [Errno 13] Permission denied: '/x'\n\n", "Error: [Errno 13] Permission denied: '/x'"),
    ("", "(pip printed nothing)"),
])
def test_a_failed_install_is_reported_by_pips_last_error_line(log, line):
    assert sweep.last_error_line(log) == line


# --- one sweep, with this interpreter ----------------------------------------------------------------

def test_a_sweep_with_this_interpreter_writes_the_table_and_the_comparison(tmp_path):
    """The installed pair runs one cell; a pair the interpreter does not hold is a mismatch, not a run."""
    here = sweep.installed_pair(importlib.metadata.version("torch"), importlib.metadata.version("accelerate"))
    other = sweep.Pair("1.0.0", "0.1.0")
    out = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(here), str(other), "--python", sys.executable, "--world-sizes", "2",
         "--jobs", "0", "--out", str(out), "--", "-p", "no:cacheprovider", "-k", "test_fused_loss and fp32-ws"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 1, stdout + stderr  # the mismatched pair did not run
    assert f"sweep: {other}: version mismatch: asked for torch 1.0.0, accelerate 0.1.0" in stderr

    folder = out / sweep.report_folder(here)
    pairs_md = (out / "pairs.md").read_text()
    rows = [line.split(" | ") for line in pairs_md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row[2:3] + row[4:] for row in rows] == [
        ["0", "1", "0", "0", "0", "0", "0", "0 |"],
        ["version mismatch", "–", "–", "–", "–", "–", "–", "– |"],
    ], pairs_md
    assert rows[0][0] == f"| {importlib.metadata.version('torch')}" and rows[1][:2] == ["| 1.0.0", "0.1.0"]
    assert not (out / sweep.report_folder(other)).exists()
    assert pairs_md in stdout  # the printed table is the file's
    assert (folder / "matrix.json").is_file() and (folder / "pytest.log").is_file()
    assert (out / "compare.html").is_file()
    compare_md = (out / "compare.md").read_text()
    assert "fused_loss" in compare_md and str(folder / "matrix.json") in compare_md


# --- tox.ini -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env_name, variable", [("accelerate", "ACCELERATE_VERSION"), ("torch", "TORCH_SPEC")])
def test_a_tox_env_refuses_a_missing_variable_with_one_line(env_name, variable):
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")
    guard = config[f"testenv:{env_name}"]["commands_pre"].strip().splitlines()[0]
    command = [sys.executable if word == "python" else word for word in shlex.split(guard)]
    env = {k: v for k, v in os.environ.items() if k != variable}
    refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith(f"tox -e {env_name}: set {variable}")
    assert subprocess.run(command, env={**env, variable: "x"}, timeout=60).returncode == 0
