"""no_sync, and its two ways out: an ordinary backward, or ``trigger_sync_in_backward``."""

import torch

from harness import case
from harness.models import regression_loss

WINDOWS = 2
LOCAL_STEPS = 2


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def prepared_regressor(ctx):
    """An Accelerator, a prepared model and optimizer, and the oracle's replica of the model
    (taken before ``prepare``)."""
    accelerator = ctx.accelerator()
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    return accelerator, model, optimizer, oracle


def step_both(optimizer, oracle, step, models):
    """The user's optimizer step and the oracle's, then the parameters compared."""
    optimizer.step()
    optimizer.zero_grad()
    oracle.step(True)
    oracle.check_params(step, models, {"model": optimizer})


@case("no_sync")
def test_no_sync(ctx):
    """Backwards under ``accelerator.no_sync(model)`` keep each rank's own gradient; the next
    backward outside it averages the whole accumulated sum."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    models = {"model": model}
    step = 0
    for _ in range(WINDOWS):
        for _ in range(LOCAL_STEPS):
            step += 1
            batch = ctx.batch(step)
            with accelerator.no_sync(model):
                accelerator.backward(regression_loss(model, batch))
            oracle.backward(lambda m: regression_loss(m["model"], batch), sync=False)
            oracle.check_grads(step, models)
        step += 1
        batch = ctx.batch(step)
        accelerator.backward(regression_loss(model, batch))
        oracle.backward(lambda m: regression_loss(m["model"], batch), sync=True)
        oracle.check_grads(step, models)
        step_both(optimizer, oracle, step, models)


@case("no_sync_trigger_sync")
def test_no_sync_trigger_sync(ctx):
    """``backward(loss_a)`` under ``no_sync``, then ``backward(loss_b)`` under
    ``trigger_sync_in_backward``: the result equals the fused, synced ``backward(loss_a + loss_b)``."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    trigger = ctx.require(accelerator, "trigger_sync_in_backward", "Accelerator.trigger_sync_in_backward")
    models = {"model": model}
    step = 0
    for _ in range(WINDOWS):
        a = ctx.batch(step + 1, label="a")
        b = ctx.batch(step + 2, label="b")
        with accelerator.no_sync(model):
            step += 1
            accelerator.backward(regression_loss(model, a))
            oracle.backward(lambda m: regression_loss(m["model"], a), sync=False)
            oracle.check_grads(step, models)
            step += 1
            loss_b = regression_loss(model, b)
            with trigger(model):
                accelerator.backward(loss_b)
            oracle.backward(lambda m: regression_loss(m["model"], b), sync=True)
            oracle.check_grads(step, models)
        step_both(optimizer, oracle, step, models)


@case("multi_forward_trigger_sync")
def test_multi_forward_trigger_sync(ctx):
    """Several forwards under ``no_sync``, then their backwards after it: all local but the last,
    which runs under ``trigger_sync_in_backward`` and averages the sum of all of them."""
    accelerator, model, optimizer, oracle = prepared_regressor(ctx)
    trigger = ctx.require(accelerator, "trigger_sync_in_backward", "Accelerator.trigger_sync_in_backward")
    models = {"model": model}
    forwards = 3
    step = 0
    for window in range(WINDOWS):
        batches = [ctx.batch(window * forwards + i, label="multi") for i in range(forwards)]
        with accelerator.no_sync(model):
            losses = [regression_loss(model, batch) for batch in batches]
        for i, (loss, batch) in enumerate(zip(losses, batches)):
            step += 1
            last = i == forwards - 1
            if last:
                with trigger(model):
                    accelerator.backward(loss)
            else:
                accelerator.backward(loss)
            oracle.backward(lambda m: regression_loss(m["model"], batch), sync=last)
            oracle.check_grads(step, models)
        step_both(optimizer, oracle, step, models)
