"""The diagnoses a new user reads for the mistakes of a loop of their own (tests/planted/diagnosis_cases.py:
its own model, two optimizers, accumulation by hand with no_sync, a clip at the sync), at world size 2,
fp32 and bf16 autocast, windows of 2 and 3 micro-batches: the loss not divided by the steps is named a
scale (then, once the held gradient was adopted, a misweighting by the same factor), and a clip of the
local gradients inside the window a misweighting of the gradient held before the next micro-batch; and
so in a second loop (a token tagger on padded sequences, ``tagger_loop_*``), checked beside the oracle
and through ``ctx.watch``, where each rank's clip scales by its own norm."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.catalogue import load_case_file
from harness.records import Status
from harness.selfcheck.run import Runner, Target, first_kinds
from harness.wrappers.registry import WRAPPERS
from harness.wrappers.prepare import cell_variants

CASES = Path(__file__).resolve().parent / "planted" / "diagnosis_cases.py"


@pytest.fixture(scope="module")
def runner_cells():
    refs = load_case_file(CASES)
    cells = {}
    with Runner(world_size=2) as runner:
        for ref in refs:
            for variant in cell_variants(ref.info.variants, ref.info.wrappers, WRAPPERS, ref.info.meshes):
                cells[ref.name, variant.name] = runner.run(Target(ref, variant))
    return cells


def _variants(bug):
    return [f"bug={bug}-steps={steps}-{precision}" for steps in (2, 3) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("variant", _variants("none"))
def test_the_loop_done_right_passes(runner_cells, variant):
    cell = runner_cells["user_loop_by_hand", variant]
    assert cell.status == Status.PASS, cell.summary


@pytest.mark.parametrize("variant", _variants("loss_not_divided"))
def test_a_loss_not_divided_by_the_steps_is_named_a_scale_by_the_steps_at_any_steps_and_precision(runner_cells,
                                                                                                   variant):
    cell = runner_cells["user_loop_by_hand", variant]
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
    cell = runner_cells["user_loop_by_hand", variant]
    assert cell.status == Status.FAIL
    grads = [f for f in cell.failures if f.checked == "grad"]
    assert grads and {f.kind for f in grads} == {"misweighted"}, cell.summary
    for f in grads:
        # the held gradient was scaled down by the clip's coefficient (max_norm / norm, well below 1)
        assert all(0.0 < earlier < 0.5 for earlier in held_weights(f.message)), f.message


def held_weights(message):
    """The weights a misweighted failure fitted to the gradient held before the micro-batches since the
    last check: one, or after a sync one a rank ('weighs 0.4 (rank 0), 0.66 (rank 1) times itself')."""
    assert "held before them weighs " in message, message
    said = message.split("held before them weighs ")[1].split(" times itself")[0]
    return [float(part.split(" ")[0]) for part in said.split(", ")]


def _tagger_variants(bug):
    return [f"bug={bug}-steps={steps}-{precision}" for steps in (2, 3) for precision in ("fp32", "bf16")]


@pytest.mark.parametrize("case", ["tagger_loop_watched", "tagger_loop_by_hand"])
@pytest.mark.parametrize("variant", _tagger_variants("none"))
def test_the_tagger_loop_done_right_passes(runner_cells, case, variant):
    cell = runner_cells[case, variant]
    assert cell.status == Status.PASS, cell.summary


@pytest.mark.parametrize("case", ["tagger_loop_watched", "tagger_loop_by_hand"])
@pytest.mark.parametrize("variant", _tagger_variants("clip_every_micro_batch"))
def test_a_clip_after_every_micro_batch_of_a_users_own_loop_is_named_misweighted_by_each_ranks_clip(
        runner_cells, case, variant):
    """A loop of padded sequences, dropout, AdamW on one part and SGD with momentum on another, clipping
    to 0.5 after every micro-batch: some clips scale and some do not, and each rank's by its own norm.
    Every gradient failure is named, at a sync with each rank's own weight of what it held (each its
    clip's coefficient, max_norm / that rank's norm, at most 1), never a bare mismatch."""
    cell = runner_cells[case, variant]
    assert cell.status == Status.FAIL
    grads = [f for f in cell.failures if f.checked == "grad"]
    assert grads and {f.kind for f in grads} == {"misweighted"}, cell.summary
    assert first_kinds(cell) == ["misweighted"]
    fitted = [held_weights(f.message) for f in grads]
    for f, weights in zip(grads, fitted):
        assert all(0.0 < w <= 1.0 + 1e-3 for w in weights), f.message
    assert min(w for weights in fitted for w in weights) < 0.9, "no clip scaled by much: the loop tests little"
    assert any(len(weights) == 2 and abs(weights[0] - weights[1]) > 1e-2 for weights in fitted), \
        "no sync where the ranks' clips scaled by other factors: the loop tests nothing the first one does not"
