"""The oracle on one process (world size 1): scaling, steps, and that its checks fire on planted faults."""

import copy

import pytest
import torch

from harness.models import make_model, regression_loss
from harness.oracle import MixedPrecisionReplica, Oracle, Recorder
from harness.schedule import accumulation_schedule


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batch(i):
    gen = torch.Generator().manual_seed(i)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen)


def make(num_steps=1, precision="fp32"):
    model = make_model("regressor", 7)
    recorder = Recorder(rank=0)
    oracle = Oracle({"model": model}, recorder=recorder, rank=0, world_size=1, precision=precision,
                    num_steps=num_steps, optimizer=sgd)
    return model, oracle, recorder


def run_plain(model, optimizer, schedule, num_steps, *, perturb_at=None, skip_zero=False, oracle=None):
    """The user's loop without accelerate, run beside the oracle and checked at every step."""
    for point in schedule:
        b = batch(point.index)
        (regression_loss(model, b) / num_steps).backward()
        if point.index == perturb_at:
            model.fc1.weight.grad.mul_(1.5)
        oracle.backward(lambda m: regression_loss(m["model"], b), sync=point.sync)
        oracle.check_grads(point, {"model": model})
        if point.optimizer_step:
            optimizer.step()
            if not skip_zero:
                optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, {"model": model})


def test_a_correct_loop_leaves_no_failure_and_counts_checks_as_vacuous_at_world_size_one():
    model, oracle, recorder = make(num_steps=2)
    schedule = accumulation_schedule(5, epochs=2, num_steps=2)
    run_plain(model, sgd(model.parameters()), schedule, 2, oracle=oracle)
    assert recorder.failures == []
    assert recorder.checks == len(schedule)
    assert recorder.vacuous_checks == recorder.checks
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
    oracle = Oracle({"model": model}, recorder=recorder, rank=0, world_size=1, precision="fp32",
                    optimizer=sgd, scheduler=decay, scheduler_steps=2)
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
