"""The house rules of the layout, as tests: the rank side imports nothing of the controller, the
records depend on nothing, and fault injection stays off the path of a real cell."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"

# What runs inside a rank (harness/rank.py and everything a cell imports there).
RANK_SIDE = {
    "harness.rank", "harness.messages", "harness.records", "harness.catalogue", "harness.decorator",
    "harness.context", "harness.probe", "harness.oracle", "harness.checks", "harness.closeness",
    "harness.diagnosis", "harness.replica", "harness.schedule", "harness.models", "harness.render",
    "harness.render.failures", "harness.render.text", "harness.faults", "harness.faults_fsdp",
    "harness.wrappers", "harness.sharding", "harness.accounting", "harness.faults_deepspeed", "harness.deepspeed_cpu",
    "harness.tokens", "harness.faults_tokens", "harness.weighting", "harness.timeline", "harness.collectives",
    "harness.capabilities", "harness.versions",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def harness_imports(path: Path) -> set[str]:
    """The harness modules a file imports at run time, anywhere in it (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("harness"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (PACKAGE / node.module.removeprefix("harness").lstrip(".").replace(".", "/") / f"{a.name}.py").exists())
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_is_known_to_these_rules():
    assert "harness.rank" in MODULES and "harness.render.text" in MODULES


@pytest.mark.parametrize("name", sorted(RANK_SIDE & set(MODULES)))
def test_the_rank_side_imports_nothing_of_the_controller(name):
    outside = {m for m in harness_imports(MODULES[name]) if m not in RANK_SIDE and m != "harness"}
    assert not outside, f"{name} (rank side) imports {sorted(outside)}"


def test_the_records_depend_on_nothing():
    assert harness_imports(MODULES["harness.records"]) == set()
    tree = ast.parse(MODULES["harness.records"].read_text(encoding="utf-8"))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "dataclasses", "enum", "typing", "harness"}, imported


def test_statuses_and_failure_kinds_are_their_public_names():
    from harness.records import FailureKind, Status

    assert [str(s) for s in Status] == ["pass", "fail", "error", "skip", "unsupported", "detected", "missed"]
    assert f"{FailureKind.NOT_SYNCED}" == "not_synced" and FailureKind.NOT_SYNCED == "not_synced"
    assert json.dumps({"status": Status.FAIL}) == '{"status": "fail"}'


# Runs one world-size-1 cell on this process's rank side, as a pool's rank would, and reports which
# harness modules that imported.
_RUN_ONE_CELL = """
import json, sys
import torch
from harness.catalogue import load_case_file
from harness.cells import cell_spec
from harness.options import resolve
from harness.rank import run_cell

case = load_case_file("cases/test_accumulate.py")[0]
variant = next(v for v in case.info.variants if v.name == "steps=2-fp32")
settings = resolve(world_sizes="1", backend="gloo", report_dir="reports", case_timeout="60", seed="1234",
                   fault=sys.argv[1] or None)
before = set(sys.modules)
result = run_cell(cell_spec(case, variant, 1, settings, label="layout"), 0, torch.device("cpu"))
print(json.dumps({"outcome": str(result.outcome), "failures": len(result.failures), "detail": result.detail,
                  "faults_imported": "harness.faults" in sys.modules,
                  "controller": sorted(m for m in set(sys.modules) - before
                                       if m.startswith("harness") and m not in %r)}))
""" % (sorted(RANK_SIDE),)


@pytest.mark.parametrize("fault", ["", "loss_not_scaled"])
def test_fault_injection_is_imported_only_for_a_cell_with_a_fault(fault):
    done = subprocess.run([sys.executable, "-c", _RUN_ONE_CELL, fault], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["outcome"] == "ok", seen["detail"]
    assert seen["controller"] == []
    assert seen["faults_imported"] is bool(fault)
    assert (seen["failures"] > 0) is bool(fault)  # the planted fault did act: the rank found it


def test_the_public_api_and_the_plugin_import_no_torch():
    """The controller (pytest, every xdist worker) never needs torch: the decorator, the public names
    that need none, and the plugin load without it; RankContext and Oracle import it on first use."""
    probe = ("import sys, harness, harness.plugin\n"
             "from harness import case, grid, Diagnosis, MicroStep, PRECISIONS, ALL_PRECISIONS\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n"
             "from harness import RankContext, Oracle\n"
             "assert 'torch' in sys.modules and RankContext.__module__ == 'harness.context'\n"
             "assert sorted(harness.__all__) == sorted(n for n in harness.__all__ if hasattr(harness, n))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
