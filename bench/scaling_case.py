"""model_size: fused_loss's cell (cases/test_fused_loss.py) on a model of about N parameters,
for bench/scaling.py's table against model size. A bench case, not part of the catalogue.

The model is the harness's Regressor with ``features = hidden = k``: Linear(k, k), tanh, Linear(k, 1),
(k + 1) ** 2 parameters, k chosen so that this is as near N as a square allows.
"""

import math

import torch

from harness import case, grid
from harness.rank.models import Regressor, regression_loss

STEPS = 3
PARAMS = [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 100_000_000]
ROWS = 6


def width(params: int) -> int:
    """k for about ``params`` parameters: (k + 1) ** 2 nearest it, k >= 1."""
    return max(1, round(math.sqrt(params)) - 1)


def param_count(params: int) -> int:
    """The exact parameter count of the model built for ``params``."""
    return (width(params) + 1) ** 2


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def fused(models, a, b):
    return regression_loss(models["model"], a) + regression_loss(models["model"], b)


@case("model_size", variants=grid(params=PARAMS), wrappers=["ddp"])
def test_model_size(ctx):
    """``backward(loss_a + loss_b)`` on a model of about ``params`` parameters, checked every step."""
    k = width(int(ctx.variant["params"]))
    accelerator = ctx.accelerator()
    model = ctx.model(Regressor, features=k, hidden=k, name="sized")
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    optimizer = sgd(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    models = {"model": model}
    for step in range(1, STEPS + 1):
        a, b = ctx.batch(step, rows=ROWS, features=k, label="a"), ctx.batch(step, rows=ROWS, features=k, label="b")
        accelerator.backward(fused(models, a, b))
        oracle.backward(lambda m: fused(m, a, b), sync=True)
        oracle.check_grads(step, models)
        optimizer.step()
        optimizer.zero_grad()
        oracle.step(True)
        oracle.check_params(step, models, {"model": optimizer})
