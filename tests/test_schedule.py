"""The accumulation schedule: sync points and optimizer steps from the documented contract."""

import pytest

from harness.rank.oracle.schedule import accumulation_schedule, batches_per_rank


def marks(points, attr):
    return "".join("S" if getattr(p, attr) else "." for p in points)


def test_steps_two_five_batches_two_epochs_resets_at_the_end_of_the_dataloader():
    points = accumulation_schedule(5, epochs=2, num_steps=2)
    # counter 1,2,3,4 then the last batch syncs and resets: 2 epochs alike
    assert marks(points, "sync") == ".S.SS" * 2
    assert marks(points, "optimizer_step") == ".S.SS" * 2
    assert [p.index for p in points] == list(range(1, 11))
    assert [p.epoch for p in points] == [0] * 5 + [1] * 5
    assert [p.end_of_dataloader for p in points].count(True) == 2


def test_steps_three():
    assert marks(accumulation_schedule(5, epochs=1, num_steps=3), "sync") == "..S.S"


def test_steps_one_syncs_every_batch():
    assert marks(accumulation_schedule(4, epochs=2, num_steps=1), "sync") == "S" * 8


def test_without_dataloader_sync_windows_span_epochs():
    points = accumulation_schedule(5, epochs=2, num_steps=3, sync_with_dataloader=False)
    # counter runs 1..10 across both epochs: steps at 3, 6, 9
    assert marks(points, "optimizer_step") == "..S..S..S."


def test_sync_each_batch_averages_every_batch_but_steps_on_the_schedule():
    points = accumulation_schedule(5, epochs=1, num_steps=2, sync_each_batch=True)
    assert marks(points, "sync") == "SSSSS"
    assert marks(points, "optimizer_step") == ".S.SS"


def test_epoch_lengths_may_differ():
    points = accumulation_schedule([3, 2], epochs=2, num_steps=2)
    assert marks(points, "sync") == ".SS" + ".S"


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_non_positive_steps(bad):
    with pytest.raises(ValueError, match="num_steps"):
        accumulation_schedule(3, epochs=1, num_steps=bad)


def test_rejects_wrong_number_of_epoch_lengths():
    with pytest.raises(ValueError, match="epoch lengths"):
        accumulation_schedule([3], epochs=2, num_steps=2)


@pytest.mark.parametrize(
    "samples, batch_size, world_size, split, expected",
    [(19, 4, 1, False, 5), (39, 4, 2, False, 5), (79, 4, 4, False, 5), (80, 4, 4, False, 5),
     (81, 4, 4, False, 6), (19, 4, 2, True, 5)],
)
def test_batches_per_rank(samples, batch_size, world_size, split, expected):
    assert batches_per_rank(samples, batch_size=batch_size, world_size=world_size, split_batches=split) == expected


@pytest.mark.parametrize(
    "samples, batch_size, world_size, split, expected",
    # the main process's loader yields ceil(samples / batch_size) batches; each rank gets a slice of
    # one of them (split) or of world_size of them at once
    [(19, 4, 1, False, 5), (39, 4, 2, False, 5), (41, 4, 2, False, 6), (19, 8, 2, True, 3), (16, 8, 4, True, 2)],
)
def test_dispatched_batches_per_rank(samples, batch_size, world_size, split, expected):
    from harness.rank.oracle.schedule import dispatched_batches_per_rank

    assert dispatched_batches_per_rank(samples, batch_size=batch_size, world_size=world_size,
                                       split_batches=split) == expected


def test_windows_end_at_optimizer_steps():
    from harness.rank.oracle.schedule import windows

    points = accumulation_schedule(5, epochs=1, num_steps=2)  # steps at 2, 4, 5
    assert windows(points) == [0, 0, 1, 1, 2]


def test_window_lengths_give_each_micro_step_its_windows_count_short_last_windows_included():
    from harness.rank.oracle.schedule import window_lengths

    lengths = window_lengths(accumulation_schedule(5, epochs=2, num_steps=3))
    assert [lengths[i] for i in range(1, 11)] == [3, 3, 3, 2, 2, 3, 3, 3, 2, 2]
    across = window_lengths(accumulation_schedule(5, epochs=2, num_steps=3, sync_with_dataloader=False))
    assert [across[i] for i in range(1, 11)] == [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]


def test_a_dataloaders_count_other_than_the_contracts_is_a_schedule_failure_and_the_same_count_is_none():
    from harness.rank.judging.recorder import Recorder

    recorder = Recorder(rank=1)
    assert recorder.batch_count(what="the prepared dataloader", epoch=0, seen=4, expected=4)
    assert recorder.failures == [] and recorder.timeline.marks == {(0, "schedule"): ""}
    assert not recorder.batch_count(what="the prepared dataloader", epoch=1, seen=3, expected=4)
    (failure,) = recorder.failures
    assert (failure.kind, failure.step, failure.max_abs_diff) == ("schedule", 0, 1.0)
    assert failure.message == "the prepared dataloader on rank 1 yielded 3 batches in epoch 1, the contract says 4"
