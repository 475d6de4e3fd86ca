"""fused_loss: two losses summed into one ``accelerator.backward``."""

import torch

from harness import ALL_PRECISIONS, case, compiled, grid
from harness.rank.models import regression_loss

STEPS = 3


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def fused(models, a, b):
    return regression_loss(models["model"], a) + regression_loss(models["model"], b)


@case("fused_loss", variants=grid(precision=ALL_PRECISIONS) + compiled(*grid(precision=["fp32"])))
def test_fused_loss(ctx):
    """``backward(loss_a + loss_b)``: one synced backward per step, the average over ranks of both
    losses' gradients."""
    accelerator = ctx.accelerator()
    model = ctx.model("regressor")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    optimizer = sgd(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    models = {"model": model}
    for step in range(1, STEPS + 1):
        a, b = ctx.batch(step, label="a"), ctx.batch(step, label="b")
        accelerator.backward(fused(models, a, b))
        oracle.backward(lambda m: fused(m, a, b), sync=True)
        oracle.check_grads(step, models)
        optimizer.step()
        optimizer.zero_grad()
        oracle.step(True)
        oracle.check_params(step, models, {"model": optimizer})
