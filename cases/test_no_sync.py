"""no_sync, and its two ways out: an ordinary backward, or ``trigger_sync_in_backward``."""

import torch

from harness import PRECISIONS, Diagnosis, case, compiled, grid
from harness.rank.models import regression_loss

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


# DDP and FSDP (accelerate's no_sync calls FSDP2's set_requires_gradient_sync, FSDP1's no_sync);
# under DeepSpeed ZeRO >= 2 accelerate skips no_sync (PR #3656): accumulate's cases cover it.
@case("no_sync", variants=grid(precision=PRECISIONS) + compiled(*grid(precision=["fp32"])),
      wrappers=["ddp", "fsdp2", "fsdp1"])
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


# trigger_sync_in_backward acts on a DistributedDataParallel model only
@case("no_sync_trigger_sync", wrappers=["ddp"])
def test_no_sync_trigger_sync(ctx):
    """``backward(loss_a)`` under ``no_sync``, then ``backward(loss_b)`` under
    ``trigger_sync_in_backward``: the result equals the fused, synced ``backward(loss_a + loss_b)``."""
    trigger_sync_windows(ctx)


# A known accelerate defect, kept as a canary so that the run stays green while it lasts and turns
# ``missed`` (red) the day a release fixes it: trigger_sync_in_backward acts only when
# ``isinstance(model, DistributedDataParallel)`` (accelerate/accelerator.py, through 1.15.0), but with
# a ``dynamo_backend`` ``prepare`` returns torch.compile's wrapper around the DDP model, so the
# trigger does nothing and the last backward does not sync. The collective accounting sees the
# all-reduce missing; the gradients show it unsynced.
@case("no_sync_trigger_sync_compiled", variants=compiled(*grid(precision=["fp32"])), wrappers=["ddp"],
      canary=[Diagnosis("not_synced", model="model"), Diagnosis("comm_missing")])
def test_no_sync_trigger_sync_compiled(ctx):
    """``no_sync_trigger_sync`` on the model ``prepare`` returns with ``dynamo_backend="aot_eager"``:
    ``trigger_sync_in_backward`` is given the compiled model, not the DDP model inside it."""
    trigger_sync_windows(ctx)


def trigger_sync_windows(ctx):
    """Per window: ``backward(loss_a)`` under ``no_sync``, ``backward(loss_b)`` under the trigger."""
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


@case("multi_forward_trigger_sync", wrappers=["ddp"])
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
