"""The self-check: planted faults are caught with their diagnosis, the search for the smallest caught
perturbation bisects, and the clean catalogue raises no false alarm over seeds and world sizes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import selfcheck
from harness.matrix import ERROR, FAIL, PASS, Cell
from harness.selfcheck import Runner, Target, first_kinds, measure_sensitivity, run_selfcheck

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(1000, 1010)


@pytest.fixture(scope="module")
def catalogue():
    return selfcheck.discover(ROOT / "cases")


def test_three_faults_on_one_case_are_each_caught_with_their_diagnosis(catalogue):
    result = run_selfcheck(
        catalogue, cases=["no_sync"], faults=["no_sync_still_syncs", "grads_summed", "zero_grad_skipped"],
        sensitivity_cases=None,
    )
    assert [c.status for c in result.clean] == [PASS]
    by_fault = {r.fault.name: r.cells[0] for r in result.faults}
    assert {name: cell.status for name, cell in by_fault.items()} == dict.fromkeys(by_fault, FAIL)
    # between sync points the gradients were averaged; at the window's end they were right
    early = by_fault["no_sync_still_syncs"]
    assert first_kinds(early) == ["synced_early"]
    assert {f.kind for f in early.failures if f.checked == "grad"} == {"synced_early"}
    assert {f.step for f in early.failures if f.checked == "grad"} == {1, 2, 4, 5}
    summed = by_fault["grads_summed"]
    assert first_kinds(summed) == ["wrong_scale"]
    assert summed.failures[0].factor == pytest.approx(2.0, rel=1e-4)  # the sum of 2 ranks, not their mean
    assert "stale" in first_kinds(by_fault["zero_grad_skipped"])
    assert result.ok


def test_selfcheck_command_exits_1_on_an_uncaught_fault_and_writes_its_table_and_json(tmp_path):
    report = tmp_path / "selfcheck.json"
    process = subprocess.run(
        [sys.executable, "-m", "harness", "selfcheck", "--cases", "no_sync", "--faults",
         "no_sync_still_syncs,trigger_noop", "--no-sensitivity", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 1, process.stderr
    assert "kill rate: 1/2 faults caught by at least one case (50%)" in process.stdout
    assert "NOT CAUGHT: trigger_noop" in process.stdout
    assert "no_sync_still_syncs" in process.stderr  # a progress line a fault
    data = json.loads(report.read_text())
    caught = [(f["name"], f["caught"]) for f in data["faults"]]
    assert caught == [("no_sync_still_syncs", True), ("trigger_noop", False)]
    assert data["faults"][0]["caught_by"] == {"no_sync[fp32]": ["synced_early"]}


@pytest.mark.parametrize("argv, reason", [
    (["--cases", "no_such_case"], "unknown case 'no_such_case'"),
    (["--faults", "no_such_fault"], "unknown fault 'no_such_fault'"),
    (["--world-size", "1"], "--world-size"),
    (["--variants", "fp64"], "no variant matches fp64"),
])
def test_selfcheck_command_rejects_bad_arguments_in_one_line(argv, reason):
    process = subprocess.run([sys.executable, "-m", "harness", "selfcheck", *argv], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    assert reason in process.stderr
    assert "Traceback" not in process.stderr


def test_default_variants_are_the_first_fp32_one_of_each_case(catalogue):
    targets = selfcheck.select_targets(catalogue)
    assert len(targets) == len(catalogue)
    assert all(t.precision == "fp32" for t in targets)
    bf16 = selfcheck.select_targets(catalogue, cases=["fused_loss"], variants=["bf16"])
    assert [t.variant.name for t in bf16] == ["bf16"]


class _ThresholdRunner:
    """Fails a cell exactly when the perturbation is at least ``threshold``."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.calls = 0

    def run(self, target, *, fault=None, seed=None) -> Cell:
        self.calls += 1
        relative = float(fault.split(":", 1)[1])
        status = FAIL if relative >= self.threshold else PASS
        return Cell(case=target.case.name, variant=target.variant.name, world_size=2, status=status)


@pytest.mark.parametrize("threshold", [3e-9, 2e-6, 1e-3, 0.9])
def test_sensitivity_bisects_to_the_grid_points_around_the_threshold(catalogue, threshold):
    runner = _ThresholdRunner(threshold)
    target = selfcheck.select_targets(catalogue, cases=["fused_loss"])[0]
    found = measure_sensitivity(runner, [target])
    assert found.caught >= threshold and (found.missed is None or found.missed < threshold)
    grid = selfcheck.SENSITIVITY_GRID
    assert found.missed is None or grid.index(found.caught) == grid.index(found.missed) + 1
    assert runner.calls <= 2 + len(grid).bit_length()


def test_sensitivity_says_when_nothing_is_caught(catalogue):
    target = selfcheck.select_targets(catalogue, cases=["fused_loss"])[0]
    found = measure_sensitivity(_ThresholdRunner(10.0), [target])
    assert found.caught is None and "not caught" in found.text()


class _AlwaysFailRunner:
    world_size = 2

    def run(self, target, *, fault=None, seed=None) -> Cell:
        return Cell(case=target.case.name, variant=target.variant.name, world_size=2, status=FAIL)


def test_a_case_that_fails_clean_cannot_catch_a_fault(catalogue):
    targets = selfcheck.select_targets(catalogue, cases=["fused_loss", "no_sync"])
    clean = [Cell(case="fused_loss", variant="fp32", world_size=2, status=FAIL),
             Cell(case="no_sync", variant="fp32", world_size=2, status=PASS)]
    [result] = selfcheck.run_faults(_AlwaysFailRunner(), targets, [selfcheck.FAULTS["grads_summed"]], clean=clean)
    assert [c.status for c in result.cells] == ["skip", FAIL]
    assert [c.case for c in result.caught_by] == ["no_sync"]


def _false_alarm_targets(catalogue, seed_index: int) -> list[Target]:
    """For one seed: one variant of every non-canary case, fp32 on even seeds and bf16 on odd ones,
    moving through the case's variants of that precision from seed to seed."""
    precision = selfcheck.PRECISIONS[seed_index % len(selfcheck.PRECISIONS)]
    targets = []
    for case in catalogue:
        if case.info.canary:
            continue
        variants = [v for v in case.info.variants if v.params.get("precision", "fp32") == precision]
        if variants:
            targets.append(Target(case, variants[seed_index // len(selfcheck.PRECISIONS) % len(variants)]))
    return targets


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_no_false_alarm_over_ten_seeds(catalogue, world_size):
    """The clean catalogue passes for every seed. A fail here is a false alarm of the harness (or a
    real accelerate bug that only some seeds show): report it with its data, and do not loosen the
    tolerances in harness/compare.py to make it pass. A case that errors fails this test too, and is
    not run again at this world size: each error costs a pool restart."""
    started = time.monotonic()
    failed, errored = [], {}
    cells = 0
    with Runner(world_size=world_size) as runner:
        for n, seed in enumerate(SEEDS):
            for target in _false_alarm_targets(catalogue, n):
                if target.case.name in errored:
                    continue
                cell = runner.run(target, seed=seed)
                cells += 1
                if cell.status == FAIL:
                    failed.append(f"{target.label} seed {seed}: {cell.summary}\n  rerun: {cell.rerun}")
                elif cell.status == ERROR:
                    errored[target.case.name] = f"{target.label} seed {seed}: {cell.summary}"
    elapsed = time.monotonic() - started
    print(f"world size {world_size}: {cells} clean cells over {len(SEEDS)} seeds in {elapsed:.0f} s")
    assert not failed, (f"{len(failed)} of {cells} clean cells failed (false alarms) at world size {world_size}:\n"
                        + "\n".join(failed))
    assert not errored, f"clean cells errored at world size {world_size}:\n" + "\n".join(errored.values())
