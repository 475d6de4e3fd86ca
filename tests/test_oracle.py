"""The oracle: scaling, steps, and that its checks fire on planted faults and stay quiet on a correct
loop; on one process, and on two real ranks (average, local, anchoring, vacuity)."""

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks

from harness.rank.judging.checks import checked
from harness.rank.judging.recorder import Recorder
from harness.rank.models import make_model, regression_loss
from harness.rank.oracle.core import Oracle
from harness.rank.oracle.replica import MixedPrecisionReplica
from harness.rank.oracle.schedule import accumulation_schedule
from harness.wrappers.cell import CellConfig


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def slow_sgd(params):
    return torch.optim.SGD(params, lr=1e-4)


def batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen)


def make(num_steps=1, precision="fp32", optimizer=sgd, rank=0, world_size=1):
    model = make_model("regressor", 7)
    recorder = Recorder(rank=rank)
    config = CellConfig(precision=precision, num_steps=num_steps, rank=rank, world_size=world_size)
    oracle = checked(Oracle({"model": model}, config, recorder=recorder, optimizer=optimizer))
    return model, oracle, recorder


def run_plain(model, optimizer, schedule, num_steps, *, perturb_at=None, skip_zero=False, oracle=None,
              skip_step_at=None, extra_step_at=None, world_size=1, batch_of=None, hand_optimizer=True):
    """The user's loop without accelerate, run beside the oracle and checked at every step. With
    several ranks it averages by hand where the schedule syncs, dividing before the all-reduce as
    DDP does (the oracle sums first)."""
    batch_of = batch_of or batch
    for point in schedule:
        b = batch_of(point.index)
        (regression_loss(model, b) / num_steps).backward()
        if point.sync and world_size > 1:
            for p in model.parameters():
                p.grad.div_(world_size)
                dist.all_reduce(p.grad)
        if point.index == perturb_at:
            model.fc1.weight.grad.mul_(1.5)
        oracle.backward(lambda m: regression_loss(m["model"], b), sync=point.sync)
        oracle.check_grads(point, {"model": model})
        steps = point.optimizer_step != (point.index in (skip_step_at, extra_step_at))
        if steps:
            optimizer.step()
        if point.optimizer_step and not skip_zero:
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, {"model": model}, {"model": optimizer} if hand_optimizer else None)


def test_a_correct_loop_leaves_no_failure_and_counts_checks_as_vacuous_at_world_size_one():
    model, oracle, recorder = make(num_steps=2)
    schedule = accumulation_schedule(5, epochs=2, num_steps=2)
    run_plain(model, sgd(model.parameters()), schedule, 2, oracle=oracle)
    assert recorder.failures == []
    assert recorder.grad_checks == len(schedule)
    assert recorder.checks == 2 * len(schedule)  # a gradient and a parameter check a micro-batch
    assert recorder.vacuous_checks == recorder.grad_checks
    assert recorder.max_abs_diff == 0.0


def test_a_perturbed_gradient_is_caught_at_its_step_with_its_factor():
    model, oracle, recorder = make(num_steps=2)
    run_plain(model, sgd(model.parameters()), accumulation_schedule(5, epochs=1, num_steps=2), 2,
              perturb_at=2, oracle=oracle)
    first = recorder.failures[0]
    assert (first.rank, first.step, first.model, first.param, first.checked) == (0, 2, "model", "fc1.weight", "grad")
    assert first.kind == "wrong_scale" and first.factor == pytest.approx(1.5, rel=1e-6)
    # after a mismatch the oracle carries on from the rank's real state: one fault, one step reported
    assert {f.step for f in recorder.failures} == {2}


def test_gradients_not_cleared_after_a_step_are_stale():
    model, oracle, recorder = make(num_steps=1)
    run_plain(model, sgd(model.parameters()), accumulation_schedule(3, epochs=1, num_steps=1), 1,
              skip_zero=True, oracle=oracle)
    grad_failures = [f for f in recorder.failures if f.checked == "grad"]
    assert grad_failures and grad_failures[0].step == 2
    assert {f.kind for f in grad_failures if f.step == 2} == {"stale"}


def test_loss_is_scaled_by_the_accumulation_steps():
    model, oracle, _ = make(num_steps=4)
    b = batch(1)
    oracle.backward(lambda m: regression_loss(m["model"], b), sync=False)
    reference = copy.deepcopy(model)
    regression_loss(reference, b).backward()
    for (name, p), q in zip(oracle.replicas["model"].named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 4, msg=name)


def test_the_optimizer_steps_only_when_the_schedule_says_so():
    model, oracle, _ = make(num_steps=2)
    before = [p.detach().clone() for p in oracle.replicas["model"].parameters()]
    b = batch(1)
    oracle.backward(lambda m: regression_loss(m["model"], b), sync=False)
    oracle.step(False)
    assert all(torch.equal(a, p) for a, p in zip(before, oracle.replicas["model"].parameters()))
    oracle.step(True)
    assert not all(torch.equal(a, p) for a, p in zip(before, oracle.replicas["model"].parameters()))
    assert all(p.grad is None for p in oracle.replicas["model"].parameters())


def test_sync_flag_disagreement_is_its_own_kind():
    _, oracle, recorder = make(num_steps=2)
    point = accumulation_schedule(3, epochs=1, num_steps=2)[0]
    oracle.check_sync_flag(point, point.optimizer_step)
    assert recorder.failures == []
    oracle.check_sync_flag(point, not point.optimizer_step)
    assert [f.kind for f in recorder.failures] == ["sync_flag"]
    assert "accelerator.sync_gradients on rank 0 at step 1" in recorder.failures[0].message


def test_bf16_replicas_run_under_autocast_and_return_fp32():
    model, oracle, _ = make(precision="bf16")
    replica = oracle.models["model"]
    assert isinstance(replica, MixedPrecisionReplica)
    x, _ = batch(1)
    out = replica(x)
    assert out.dtype == torch.float32
    # the forward ran in bf16: the result differs from the fp32 forward by bf16 rounding
    assert not torch.equal(out, model(x))


def test_replicas_do_not_share_parameters_with_the_model():
    model, oracle, _ = make()
    with torch.no_grad():
        model.fc1.weight.add_(1.0)
    assert not torch.equal(model.fc1.weight, oracle.replicas["model"].fc1.weight)


def test_learning_rate_checks_follow_the_schedulers_steps():
    model = make_model("regressor", 7)
    recorder = Recorder(rank=0)
    decay = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5**n)  # noqa: E731
    oracle = checked(Oracle({"model": model}, CellConfig(), recorder=recorder, optimizer=sgd, scheduler=decay,
                            scheduler_steps=2))
    optimizer = sgd(model.parameters())
    scheduler = decay(optimizer)
    oracle.step(True)  # the contract: two scheduler steps per optimizer step here
    optimizer.step()
    scheduler.step()
    oracle.check_lr(1, {"model": optimizer})
    assert [f.kind for f in recorder.failures] == ["mismatch"]
    assert "learning rate of optimizer 'model'" in recorder.failures[0].message
    scheduler.step()
    recorder.failures.clear()
    oracle.check_lr(2, {"model": optimizer})
    assert recorder.failures == []


# The parameter check judges each update (p_after - p_before), not |p|: at a realistic learning rate a
# whole step is far below 1e-5 of the parameter, and a skipped or extra step must still show.


def test_at_lr_1e4_a_correct_loop_is_quiet():
    model, oracle, recorder = make(num_steps=2, optimizer=slow_sgd)
    run_plain(model, slow_sgd(model.parameters()), accumulation_schedule(5, epochs=2, num_steps=2), 2, oracle=oracle)
    assert recorder.failures == []


@pytest.mark.parametrize("wrong, kind, step", [
    (dict(skip_step_at=2), "step_skipped", 2),
    (dict(extra_step_at=1), "stepped_early", 1),
])
def test_at_lr_1e4_a_skipped_or_extra_step_is_named(wrong, kind, step):
    model, oracle, recorder = make(num_steps=2, optimizer=slow_sgd)
    run_plain(model, slow_sgd(model.parameters()), accumulation_schedule(5, epochs=1, num_steps=2), 2,
              oracle=oracle, **wrong)
    params = [f for f in recorder.failures if f.checked == "param"]
    assert params and {f.kind for f in params} == {kind} and {f.step for f in params} == {step}
    # judged by the update: the whole of it is missing (or extra), however small next to the parameter
    weight = next(f for f in params if f.param == "fc1.weight")
    assert weight.max_rel_diff == pytest.approx(1.0) if kind == "step_skipped" else weight.max_rel_diff > 1e3
    assert f"update of parameter 'model.fc1.weight' on rank 0 at step {step}" in weight.message


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


@pytest.mark.parametrize("hand_optimizer", [True, False])
def test_after_a_skipped_adamw_step_the_next_steps_are_judged_on_their_own_when_the_state_is_handed_over(
    hand_optimizer,
):
    """AdamW's moments and step count are state: after a skipped step the oracle takes the rank's
    state over (when the case hands its optimizers to check_params), so later steps pass; without it
    every later step differs from the oracle's own state."""
    model, oracle, recorder = make(num_steps=1, optimizer=adamw)
    run_plain(model, adamw(model.parameters()), accumulation_schedule(6, epochs=1, num_steps=1), 1,
              oracle=oracle, skip_step_at=2, hand_optimizer=hand_optimizer)
    steps = {f.step for f in recorder.failures}
    if hand_optimizer:
        assert steps == {2}
    else:
        assert min(steps) == 2 and len(steps) > 1


# On two real ranks: the collectives of the oracle.


def two_rank_scenarios(rank, world_size):
    """Each scenario's failures (kind, step, checked) and check counts on this rank."""

    def rank_batch(i):
        x, y = batch(100 * rank + i)
        return x * (1 + rank) + rank, y + 2 * rank

    def same_batch(i):
        return batch(i)

    out = {}
    schedule = accumulation_schedule(5, epochs=1, num_steps=2)

    def scenario(name, *, batch_of=rank_batch, perturb=None, never_sync=False, always_sync=False):
        model, oracle, recorder = make(num_steps=2, rank=rank, world_size=world_size)
        points = schedule
        if never_sync or always_sync:
            # the user's loop syncs differently from the contract the oracle is told
            points = [p.__class__(**{**p.__dict__, "sync": always_sync}) for p in schedule]
        optimizer = sgd(model.parameters())
        for point, told in zip(points, schedule):
            b = batch_of(point.index)
            (regression_loss(model, b) / 2).backward()
            if point.sync:
                for p in model.parameters():
                    p.grad.div_(world_size)
                    dist.all_reduce(p.grad)
            if perturb == point.index and rank == 1:
                model.fc1.weight.grad.mul_(1 + 1e-5)
            oracle.backward(lambda m: regression_loss(m["model"], b), sync=told.sync)
            oracle.check_grads(told, {"model": model})
            if told.optimizer_step:
                optimizer.step()
                optimizer.zero_grad()
            oracle.step(told)
            oracle.check_params(told, {"model": model}, {"model": optimizer})
        out[name] = {
            "failures": sorted({(f.kind, f.step, f.checked) for f in recorder.failures}),
            "checks": recorder.grad_checks,
            "vacuous": recorder.vacuous_checks,
        }

    scenario("average")
    scenario("not_synced", never_sync=True)
    scenario("synced_early", always_sync=True)
    scenario("one_off_1e-5", perturb=3)
    scenario("alike", batch_of=same_batch)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(two_rank_scenarios, 2)


def test_two_ranks_a_hand_averaged_loop_matches_the_oracles_all_reduce_and_is_not_vacuous(two_ranks):
    for rank in (0, 1):
        result = two_ranks[rank]["average"]
        assert result["failures"] == []
        assert result["checks"] == 5 and result["vacuous"] == 0


def test_two_ranks_a_missing_sync_is_not_synced_on_every_rank_at_the_sync_points(two_ranks):
    for rank in (0, 1):
        grads = [f for f in two_ranks[rank]["not_synced"]["failures"] if f[2] == "grad"]
        assert {kind for kind, _, _ in grads} == {"not_synced"}
        assert {step for _, step, _ in grads} == {2, 4, 5}  # the sync points of 5 batches in windows of 2


def test_two_ranks_a_sync_where_local_was_due_is_synced_early(two_ranks):
    for rank in (0, 1):
        grads = [f for f in two_ranks[rank]["synced_early"]["failures"] if f[2] == "grad"]
        assert {kind for kind, _, _ in grads} == {"synced_early"}
        assert {step for _, step, _ in grads} == {1, 3}


def test_two_ranks_a_one_off_error_of_1e5_is_reported_once_where_it_happened(two_ranks):
    """The anchor: rank 1's gradient scaled by 1 + 1e-5 at one backward is a failure at that step on
    rank 1 alone; the oracle carries on from rank 1's real gradient, so the next steps are judged on
    their own, and rank 1's parameters part from rank 0's (a real consequence, reported once)."""
    assert two_ranks[0]["one_off_1e-5"]["failures"] == []
    failures = two_ranks[1]["one_off_1e-5"]["failures"]
    assert ("wrong_scale", 3, "grad") in failures
    assert {step for _, step, checked in failures if checked == "grad"} == {3}
    assert {kind for kind, _, checked in failures if checked == "param"} <= {"params_diverged"}


def test_two_ranks_with_the_same_data_every_check_is_vacuous(two_ranks):
    for rank in (0, 1):
        result = two_ranks[rank]["alike"]
        assert result["failures"] == []
        assert result["vacuous"] == result["checks"] == 5


@pytest.mark.parametrize("divide_by_window", [True, False], ids=["window-mean", "divided-by-the-steps"])
def test_full_batch_contract_weighs_a_short_window_by_its_micro_batches(divide_by_window):
    from harness.rank.oracle.schedule import window_lengths

    schedule = accumulation_schedule(5, epochs=1, num_steps=3)  # windows of 3 and 2
    lengths = window_lengths(schedule)
    at = {"point": schedule[0]}
    model = make_model("regressor", 7)
    recorder = Recorder(rank=0)
    oracle = checked(Oracle({"model": model}, CellConfig(num_steps=3, contract="full_batch"), recorder=recorder,
                            optimizer=sgd, window_length=lambda: lengths[at["point"].index]))
    optimizer = sgd(model.parameters())
    for point in schedule:
        at["point"] = point
        b = batch(point.index)
        (regression_loss(model, b) / (lengths[point.index] if divide_by_window else 3)).backward()
        oracle.backward(lambda m: regression_loss(m["model"], b), sync=point.sync)
        oracle.check_grads(point, {"model": model})
        if point.optimizer_step:
            optimizer.step()
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, {"model": model}, {"model": optimizer})
    if divide_by_window:
        assert recorder.failures == [] and recorder.max_abs_diff == 0.0
    else:  # the full windows are right; the short one's micro-batches weigh 2/3 of their share
        grads = [f for f in recorder.failures if f.checked == "grad"]
        assert grads and {f.step for f in grads} == {4, 5} and {f.kind for f in grads} == {"misweighted"}
        assert "its micro-batches since the last check weigh 0.666667 times their share of the mean of the " \
               "micro-batches' losses" in grads[0].message


def test_full_batch_contract_needs_the_window_and_an_unknown_contract_is_refused():
    model = make_model("regressor", 7)
    with pytest.raises(ValueError, match="needs window_length"):
        Oracle({"model": model}, CellConfig(contract="full_batch"), recorder=Recorder(rank=0))
    with pytest.raises(ValueError, match="unknown contract 'mean'; known: accelerate, full_batch"):
        Oracle({"model": model}, CellConfig(contract="mean"), recorder=Recorder(rank=0))


def test_a_reported_clip_norm_is_judged_against_the_oracles_norm_before_the_clip():
    model, oracle, recorder = make()
    b = batch(1)
    (regression_loss(model, b) * 100).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    oracle.backward(lambda m: regression_loss(m["model"], b) * 100, sync=True)
    oracle.clip_grad_norm(0.1)
    oracle.check_grad_norm(1, {"model": norm})
    assert recorder.failures == []
    oracle.check_grad_norm(1, {"model": norm * 0.5})  # a shard's norm, say
    (wrong,) = recorder.failures
    assert (wrong.kind, wrong.checked, round(wrong.factor, 6)) == ("wrong_scale", "grad_norm", 0.5)
    assert wrong.message.startswith("grad_norm returned by accelerator.clip_grad_norm_ on rank 0 at step 1: is ")
    with pytest.raises(ValueError, match="no oracle.clip_grad_norm for 'other'"):
        oracle.check_grad_norm(1, {"other": norm})


def test_settle_makes_every_pending_average_it_is_given_by_a_generator():
    """``settle`` takes its names once: the gradient check passes a generator, and each pending model
    of it, not only the first, gets its average (before: the second found the generator spent and
    kept its local gradient as if synced)."""
    models = {"gen": make_model("regressor", 7), "disc": make_model("regressor", 8)}
    config = CellConfig(precision="fp32", num_steps=1, rank=0, world_size=1)
    oracle = checked(Oracle(models, config, recorder=Recorder(rank=0), optimizer=sgd))
    b = batch(0)
    oracle.backward(lambda m: regression_loss(m["gen"], b) + regression_loss(m["disc"], b), sync=True)
    for model in oracle.state.models.values():
        model.pending = True  # as a large model's sync leaves it, for its fused check
    oracle.averaging.settle(name for name in models)
    assert {name: m.pending for name, m in oracle.state.models.items()} == {"gen": False, "disc": False}


@pytest.mark.quick
def test_an_optimizer_state_of_other_groups_is_not_adopted():
    """After a parameter mismatch the oracle adopts the case's optimizer state only where it fits its
    own optimizer: the torch optimizer inside DeepSpeed's ZeRO holds one flat partition per group, which
    load_state_dict would refuse (a ValueError inside the check, an error cell), momentum or none."""
    _, oracle, _ = make(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in oracle.params["model"].values())))
    theirs = torch.optim.SGD([flat], lr=0.1)
    flat.grad = torch.ones_like(flat)
    theirs.step()
    mine = oracle.optimizers["model"][0]
    before = copy.deepcopy(mine.state_dict())
    oracle.anchoring.adopt_optimizer_state("model", theirs)
    assert mine.state_dict() == before
