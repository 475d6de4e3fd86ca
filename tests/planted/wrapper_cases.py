"""Planted wrapper situations in real rank processes; run only by the harness's own tests."""

import torch

from harness import case, grid
from harness.rank.models import regression_loss


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


@case("planted_silently_ddp", variants=grid(precision=["fp32"]), wrappers=["fsdp2"])
def test_planted_silently_ddp(ctx):
    """Under wrapper=fsdp2 the distributed type is put back to MULTI_CPU before ``prepare``, as accelerate
    leaves it on a CPU host by itself: the model is wrapped in DDP. The cell must be an error."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    accelerator = ctx.accelerator()
    AcceleratorState().distributed_type = DistributedType.MULTI_CPU
    PartialState().distributed_type = DistributedType.MULTI_CPU
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    batch = ctx.batch(1)
    accelerator.backward(regression_loss(model, batch))
    oracle.backward(lambda m: regression_loss(m["model"], batch), sync=True)
    oracle.check_grads(1, {"model": model})


@case("planted_logged_loss", variants=grid(precision=["fp32"]), wrappers=["ddp", "fsdp2"])
def test_planted_logged_loss(ctx):
    """``no_sync`` windows whose loss is averaged across ranks for a log line after every backward
    (``accelerator.reduce``): an all-reduce outside ``backward``, which the collective accounting
    must not count as a gradient reduction."""
    accelerator = ctx.accelerator()
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    models = {"model": model}
    for step in range(1, 5):
        batch = ctx.batch(step)
        sync = step % 2 == 0
        if sync:
            loss = regression_loss(model, batch)
            accelerator.backward(loss)
        else:
            with accelerator.no_sync(model):
                loss = regression_loss(model, batch)
                accelerator.backward(loss)
        accelerator.reduce(loss.detach(), reduction="mean")
        oracle.backward(lambda m: regression_loss(m["model"], batch), sync=sync)
        oracle.check_grads(step, models)
        if sync:
            optimizer.step()
            optimizer.zero_grad()
        oracle.step(sync)
        oracle.check_params(step, models, {"model": optimizer})
