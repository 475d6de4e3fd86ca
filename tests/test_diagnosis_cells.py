"""The diagnoses a new user reads for the mistakes of a loop of their own (tests/planted/diagnosis_cases.py:
its own model, two optimizers, accumulation by hand with no_sync, a clip at the sync), at world size 2,
fp32 and bf16 autocast, windows of 2 and 3 micro-batches: the loss not divided by the steps is named a
scale (then, once the held gradient was adopted, a misweighting by the same factor), and a clip of the
local gradients inside the window a misweighting of the gradient held before the next micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.catalogue import load_case_file
from harness.records import Status
from harness.selfcheck.run import Runner, Target, first_kinds
from harness.wrappers.names import WRAPPERS
from harness.wrappers.prepare import cell_variants

CASES = Path(__file__).resolve().parent / "planted" / "diagnosis_cases.py"


@pytest.fixture(scope="module")
def runner_cells():
    refs = load_case_file(CASES)
    cells = {}
    with Runner(world_size=2) as runner:
        for ref in refs:
            for variant in cell_variants(ref.info.variants, ref.info.wrappers, WRAPPERS, ref.info.meshes):
                cells[variant.name] = runner.run(Target(ref, variant))
    return cells


def _variants(bug):
    return [f"bug={bug}-steps={steps}-{precision}" for steps in (2, 3) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("variant", _variants("none"))
def test_the_loop_done_right_passes(runner_cells, variant):
    cell = runner_cells[variant]
    assert cell.status == Status.PASS, cell.summary


@pytest.mark.parametrize("variant", _variants("loss_not_divided"))
def test_a_loss_not_divided_by_the_steps_is_named_a_scale_by_the_steps_at_any_steps_and_precision(runner_cells,
                                                                                                   variant):
    cell = runner_cells[variant]
    steps = int(variant.split("steps=")[1].split("-")[0])
    assert cell.status == Status.FAIL
    grads = [f for f in cell.failures if f.checked == "grad"]
    assert grads and {f.kind for f in grads} <= {"wrong_scale", "misweighted"}, cell.summary
    assert first_kinds(cell) == ["wrong_scale"]
    for f in grads:  # each the steps, fp32 or not (bf16's roundings move the fitted factor by parts in 1e3)
        assert f.factor == pytest.approx(steps, rel=1e-2), f.message


@pytest.mark.parametrize("variant", _variants("clip_every_micro_batch"))
def test_a_clip_inside_the_window_is_named_a_misweighting_of_the_gradient_held_before_the_next_micro_batch(
        runner_cells, variant):
    cell = runner_cells[variant]
    assert cell.status == Status.FAIL
    grads = [f for f in cell.failures if f.checked == "grad"]
    assert grads and {f.kind for f in grads} == {"misweighted"}, cell.summary
    for f in grads:
        assert "and the gradient held before them weighs" in f.message
        # the held gradient was scaled down by the clip's coefficient (max_norm / norm, well below 1)
        earlier = float(f.message.split("held before them weighs ")[1].split(" ")[0])
        assert 0.0 < earlier < 0.5, f.message
