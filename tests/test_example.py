"""The guide's example project (examples/my_project), run as a user runs it: from its own folder,
outside this checkout, against the harness installed from a built wheel (not editable) into a fresh
virtual environment; then a copy with the guide's planted bug; then the installed catalogue and the
self-check on the example's cases.

The fresh environment gets the harness's dependencies (torch, accelerate, pytest, ...) from this
test's own environment through a .pth file, so that nothing is downloaded; the harness itself comes
only from the wheel, which the test proves by where ``harness`` is imported from."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT
from test_docs import GUIDE, counts_line, documented_run, fenced_blocks

EXAMPLE = ROOT / "examples" / "my_project"
# the guide's planted bug: the user divides the loss by the accumulation steps, which
# accelerator.backward already does
CORRECT_LINE = "        loss = loss_fn(model, batch)\n"
BUGGY_LINE = "        loss = loss_fn(model, batch) / accelerator.gradient_accumulation_steps\n"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the harness installed from its wheel; its python."""
    work = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(work / "wheels"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((work / "wheels").glob("gradsync_harness-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    python = work / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    Path(purelib, "harness_test_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    where = subprocess.run([str(python), "-c", "import harness; print(harness.__file__)"], cwd=work,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(purelib), f"harness imported from {where}, not the wheel's install in {purelib}"
    return python


def run(python: Path, args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def cells(report_dir: Path) -> dict[tuple[str, str, int], dict]:
    matrix = json.loads((report_dir / "matrix.json").read_text())
    return {(c["case"], c["variant"], c["world_size"]): c for c in matrix["cells"]}


def copy_example(tmp_path: Path, name: str, *, buggy: bool = False) -> Path:
    project = tmp_path / name
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    if buggy:
        train = project / "my_project" / "train.py"
        text = train.read_text()
        assert text.count(CORRECT_LINE) == 1, "the guide's planted bug no longer applies to train.py"
        train.write_text(text.replace(CORRECT_LINE, BUGGY_LINE))
    return project


def test_the_example_project_passes_from_its_own_folder_against_the_installed_harness(installed, tmp_path):
    project = copy_example(tmp_path, "my_project")
    result = run(installed, ["-m", "pytest", "-n", "2", "--world-sizes", "1,2", "-p", "no:cacheprovider"], project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = cells(project / "reports")
    ddp = {k: c for k, c in got.items() if "wrapper=" not in k[1]}
    assert len(ddp) == 12 and len(got) == 22  # the case names ddp, fsdp2 and fsdp1: no DeepSpeed cells
    # the user's loop under every other wrapper too, at its lead variants (--wrappers auto): FSDP2's
    # bf16 with accelerate's policy and with reduce_dtype=fp32, FSDP1's with accelerate's
    assert {k[1] for k in got if "wrapper=fsdp" in k[1]} == {
        "steps=1-fp32-wrapper=fsdp2", "steps=1-fp32-wrapper=fsdp1", "steps=1-bf16-wrapper=fsdp2",
        "steps=1-bf16-reduce=fp32-wrapper=fsdp2", "steps=1-bf16-wrapper=fsdp1"}
    for (case, variant, ws), cell in got.items():
        skipped = variant.endswith("fp16") or ("wrapper=fsdp" in variant and ws == 1)
        expected = "skip" if skipped else "pass"
        assert (case, cell["status"]) == ("my_train_step", expected), (variant, ws, cell["summary"])
        if expected == "pass" and ws == 2:
            assert cell["grad_checks"] > cell["vacuous_checks"]
    # What docs/writing-a-case.md shows of this run: the same rows and statuses at the world sizes run
    # here. Its ws=4 column is its ws=2 column: nothing in the example depends on the world size from
    # two ranks on, and ws=4 is left out here to spare a pool. (test_docs.py checks each documented
    # counts line against its own table.)
    guide = GUIDE.read_text(encoding="utf-8")
    shown = documented_run(guide, "cd examples/my_project && pytest -n auto gradsync/")
    assert set(shown.rows) == {(case, variant) for case, variant, _ in got}
    assert {(case, variant, ws): shown.rows[case, variant][ws] for case, variant, ws in got} == \
        {key: cell["status"] for key, cell in got.items()}
    assert all(by_ws[4] == by_ws[2] for by_ws in shown.rows.values())
    assert counts_line([cell["status"] for cell in got.values()]) in result.stdout.splitlines()
    launch = documented_run(guide, "cd examples/my_project && torchrun --nproc-per-node 2 -m harness launch gradsync/")
    assert launch.counts == counts_line([cell["status"] for (_, _, ws), cell in got.items() if ws == 2])
    quoted = re.search(r"A passing cell at world size 2 reads `([^`]+)`", guide)
    assert quoted, "the guide no longer quotes a passing cell's summary"
    assert {c["summary"] for (_, _, ws), c in got.items() if ws == 2 and c["status"] == "pass"} == {quoted.group(1)}


def test_the_guides_planted_bug_fails_with_the_diagnosis_the_guide_shows(installed, tmp_path):
    project = copy_example(tmp_path, "my_project_buggy", buggy=True)
    # the guide's command, whose output it shows
    shown = documented_run(GUIDE.read_text(encoding="utf-8"), "pytest gradsync/ --world-sizes 2 -k fp32")
    result = run(installed, ["-m", *shown.command.split(), "-p", "no:cacheprovider"], project)
    assert result.returncode == 1
    assert {(case, variant): {ws: cell["status"]} for (case, variant, ws), cell in cells(project / "reports").items()} \
        == shown.rows
    assert shown.counts in result.stdout.splitlines()
    diagnoses = next(line for line in shown.text.splitlines() if line.startswith("Diagnoses: "))
    assert diagnoses in result.stdout.splitlines()
    got = cells(project / "reports")
    assert got[("my_train_step", "steps=1-fp32", 2)]["status"] == "pass"  # dividing by 1 changes nothing
    failing = got[("my_train_step", "steps=2-fp32", 2)]
    assert failing["status"] == "fail"
    first = failing["failures"][0]
    assert (first["kind"], first["step"], first["param"]) == ("wrong_scale", 1, "body.0.weight")
    assert "scaled by 0.5" in first["message"]
    assert "Gradients are not right on every rank: my_train_step[steps=2-fp32] at world size 2" in result.stdout
    assert "Rerun this cell: pytest 'gradsync/test_train_step.py::test_my_train_step[steps=2-fp32-ws2]'" in result.stdout


@pytest.mark.parametrize("command", [["-m", "harness", "run"], ["-m", "pytest", "--pyargs", "harness.cases"]],
                         ids=["python -m harness run", "pytest --pyargs"])
def test_the_installed_catalogue_runs_from_the_package(installed, tmp_path, command):
    result = run(installed, [*command, "--world-sizes", "1", "-k", "fused_loss and fp32", "-p", "no:cacheprovider"],
                 tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PytestAssertRewriteWarning" not in result.stdout + result.stderr
    cell = cells(tmp_path / "reports")[("fused_loss", "fp32", 1)]
    assert cell["status"] == "pass"
    # the rerun command names the installed case file from here, so that it runs
    assert cell["rerun"].startswith("pytest ") and "harness/cases/test_fused_loss.py::test_fused_loss[fp32-ws1]" in cell["rerun"]


def test_the_selfcheck_measures_the_examples_cases(installed, tmp_path):
    project = copy_example(tmp_path, "my_project")
    result = run(installed, ["-m", "harness", "selfcheck", "--cases-dir", "gradsync", "--variants", "steps=2-fp32",
                             "--faults", "grads_summed,loss_not_scaled,no_sync_still_syncs", "--no-sensitivity",
                             "--json", "selfcheck.json"], project)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((project / "selfcheck.json").read_text())
    faults = {f["name"]: f for f in report["faults"]}
    assert set(faults) == {"grads_summed", "loss_not_scaled", "no_sync_still_syncs"}
    assert all(f["caught"] for f in faults.values())
    assert faults["grads_summed"]["caught_by"] == {"my_train_step[steps=2-fp32]": ["wrong_scale"]}
    assert "kill rate: 3/3 faults caught" in result.stdout
    # the guide's table of the same cells: these faults' rows and the cells' legend as printed here
    block = next(b for b in fenced_blocks(GUIDE.read_text(encoding="utf-8"))
                 if b.startswith("$ python -m harness selfcheck --cases-dir gradsync --variants steps=2-fp32\n"))

    def rows(text: str) -> set[tuple[str, ...]]:  # a fault's row, or a cell's line of the legend (" 1  case[...]")
        lines = [tuple(line.split()) for line in text.splitlines() if line.strip()]
        return {t for t in lines if t[0] in faults or (len(t) == 2 and t[0].isdigit() and t[1].endswith("]"))}

    assert rows(block) == rows(result.stdout)
