"""The supported range (docs/upgrade-checks.md, "Supported versions"): pyproject.toml and harness/versions.py
declare the same lowest releases, and below them a run with cells stops at start with one line.

No torch below the range can be installed here (the registry serves 2.4 and later), so the runs
below raise the range above what is installed instead, in the controller's process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, session_env, start_pytest

from harness import versions
from harness.controller.rank_server import SHARED_SERVER_VARIABLE

RAISED = "import sys, pytest, harness.versions as v; v.MINIMUM['torch'] = '99.1'; sys.exit(pytest.main(sys.argv[1:]))"


def test_pyproject_declares_the_range_the_harness_enforces():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split(">=")[0]: d.split(">=")[1] for d in dependencies if d.split(">=")[0] in versions.MINIMUM}
    assert declared == versions.MINIMUM


def test_inside_the_range_nothing_is_said():
    assert versions.below_range() is None


@pytest.mark.parametrize("text, release", [("2.6.0+cu124", (2, 6, 0)), ("2.14.0a0+git12", (2, 14, 0)),
                                           ("0.19.0", (0, 19, 0)), ("1.15", (1, 15))])
def test_a_release_is_compared_by_its_numbers(text, release):
    assert versions._release(text) == release


def test_below_the_range_one_line_names_the_range_and_what_is_installed():
    line = versions.below_range({"torch": "99.1", "accelerate": "0.19", "no-such-package-here": "1"})
    assert "\n" not in line
    assert line.startswith("gradsync-harness supports torch >= 99.1 and accelerate >= 0.19 and no-such-package-here >= 1;")
    assert f"torch {versions.installed('torch')} is installed" in line and "no-such-package-here is not installed" in line
    assert "accelerate " + versions.installed("accelerate") not in line


def run(tmp_path, *args):
    process = subprocess.run([sys.executable, "-c", RAISED, "-p", "no:cacheprovider", "--report-dir",
                              str(tmp_path / "reports"), *args], cwd=ROOT, env=session_env("versions"),
                             capture_output=True, text=True, timeout=600)
    return process.returncode, process.stdout + process.stderr


@pytest.mark.parametrize("jobs", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_run_with_cells_below_the_range_stops_at_start_with_one_line(tmp_path, jobs):
    returncode, output = run(tmp_path, "cases/test_fused_loss.py", "-k", "fp32-ws", "--world-sizes", "2", *jobs)
    assert returncode == pytest.ExitCode.USAGE_ERROR, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert errors == [f"ERROR: gradsync-harness supports torch >= 99.1 and accelerate >= 0.19; torch "
                      f"{versions.installed('torch')} is installed: install a release in the range to run the "
                      "gradient-sync matrix"]
    assert "Traceback" not in output
    assert not (tmp_path / "reports").exists()


# A test file of a user's, run where the harness is installed (its plugin loaded), which looks at
# whether the ranks' fork server (harness/rank/process/preload.py) was started for it.
SERVER_STARTED = """{imports}
from multiprocessing import forkserver

def test_mine():
    assert (forkserver._forkserver._forkserver_pid is not None) is {started}
"""


def test_a_run_without_cells_is_left_alone(tmp_path):
    # ... below the range, and without a fork server for ranks it will never start, though a module
    # beside it, which pytest passes on the way but does not import, names the harness
    (tmp_path / "test_mine.py").write_text(SERVER_STARTED.format(imports="", started=False))
    (tmp_path / "test_not_selected.py").write_text("import harness  # noqa: F401\n")
    returncode, output = run(tmp_path, str(tmp_path / "test_mine.py"))
    assert returncode == 0, output[-2000:]
    assert "1 passed" in output


def test_a_file_that_imports_the_harness_has_the_fork_server_started_as_it_is_collected(tmp_path):
    (tmp_path / "test_mine.py").write_text(SERVER_STARTED.format(imports="import harness  # noqa: F401",
                                                                 started=True))
    process = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir",
                              str(tmp_path / "reports"), str(tmp_path / "test_mine.py")], cwd=ROOT,
                             env=session_env("versions", **{SHARED_SERVER_VARIABLE: ""}),  # its own, as a user's
                             capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, (process.stdout + process.stderr)[-2000:]


def test_without_transformers_its_cells_skip_and_say_so(tmp_path):
    """transformers is optional (pyproject's extras): where it cannot be imported, every cell that
    builds its models (Trainer's, the token loss through a transformers model, DeepSpeed's) is
    ``skip`` naming it, never an ``error``. Here a package of that name that raises on import hides
    the installed one from the session and its ranks."""
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("transformers is hidden by this test")\n')
    process, _ = start_pytest(["cases/test_trainer.py", "cases/test_token_loss.py", "-k", "trainer or transformers",
                               "--world-sizes", "1", "--meshes", "none"], tmp_path / "reports",
                              PYTHONPATH=f"{shadow.parent}{os.pathsep}{ROOT}")
    stdout, _ = process.communicate(timeout=600)
    cells = json.loads((tmp_path / "reports" / "matrix.json").read_text())["cells"]
    assert {c["case"] for c in cells} >= {"trainer_causal_lm", "trainer_classifier", "trainer_classifier_plain_mean",
                                          "trainer_moe_router_loss"}, stdout[-2000:]
    assert {c["status"] for c in cells} == {"skip"}, stdout[-3000:]
    assert all("transformers" in c["summary"] for c in cells), [c["summary"] for c in cells]
    assert process.returncode == 0, stdout[-2000:]
