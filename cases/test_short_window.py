"""The short last window, held to the full-batch mean: an epoch whose micro-batches are not a multiple
of the accumulation steps ends in a window of fewer, and ``Accelerator.backward`` still divides each
loss by the configured steps, so that window's samples weigh less than every other window's.

Both cases hold the loop to ``contract="full_batch"`` (``ctx.oracle``): each window's gradient is the
mean over the micro-batches it really had, as one batch of all of them would give. accelerate's
idiomatic loop does not meet it (a canary); a loop that rescales the short window's losses does."""

import torch
from torch.utils.data import DataLoader

from harness import PRECISIONS, Diagnosis, case, grid
from harness.rank.models import regression_loss

EPOCHS = 2
BATCHES = 5  # per rank and epoch: the last window has 1 micro-batch at 2 steps, 2 at 3
BATCH_SIZE = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def short_window_loop(ctx, rescale):
    """One model under ``accumulate`` for two epochs of a prepared dataloader, held to the full-batch
    mean; ``rescale(batch_index, batches)``: what the loop multiplies each loss by."""
    steps = ctx.variant["steps"]
    accelerator = ctx.accelerator(gradient_accumulation_steps=steps)
    model = ctx.model("regressor")
    dataset, per_rank = ctx.dataset(batches=BATCHES, batch_size=BATCH_SIZE)
    oracle = ctx.oracle({"model": model}, optimizer=sgd, contract="full_batch")
    optimizer = sgd(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=BATCH_SIZE))
    models = {"model": model}
    for point, batch in ctx.epochs(loader, ctx.schedule(per_rank, epochs=EPOCHS)):
        factor = rescale(point.batch, len(loader))
        with accelerator.accumulate(model):
            accelerator.backward(regression_loss(model, batch) * factor)
            oracle.check_sync_flag(point, accelerator.sync_gradients)
            oracle.backward(lambda m: regression_loss(m["model"], batch), sync=point.sync)
            oracle.check_grads(point, models)
            optimizer.step()
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, models, {"model": optimizer})


# accelerate/accelerator.py ``backward`` (through 1.15.0): ``loss = loss / self.gradient_accumulation_steps``
# whatever the window; the last window of an epoch of 5 micro-batches has 1 (2 steps) or 2 (3 steps), so
# its gradient is 1/2 or 2/3 of the full-batch mean's. transformers' Trainer fixed the same in its own
# loop (PR #39659, 4.55); accelerate documents the division, so this is a canary of a contract it does
# not promise, and turns ``missed`` the day a release weighs the short window as a full batch.
# (fp32 only: what it shows is the loop's weighting, which bf16 autocast does not change; the passing
# loop below runs in both)
@case("short_last_window", variants=grid(steps=[2, 3], precision=["fp32"]),
      canary=Diagnosis("misweighted", model="model"))
def test_short_last_window(ctx):
    """accelerate's idiomatic ``accumulate`` loop, unchanged, held to the full-batch mean: the last
    window of each epoch, shorter than the steps, weighs its micro-batches k/steps of their share."""
    short_window_loop(ctx, lambda index, batches: 1.0)


@case("short_last_window_rescaled", variants=grid(steps=[2, 3], precision=PRECISIONS))
def test_short_last_window_rescaled(ctx):
    """The same loop, each loss of a short last window multiplied by steps / k (k: its micro-batches,
    from the prepared dataloader's length), so that ``backward``'s division by the steps leaves the
    window's mean: the full-batch mean in every window."""
    steps = ctx.variant["steps"]

    def rescale(index, batches):
        short = batches % steps
        return steps / short if short and index >= batches - short else 1.0

    short_window_loop(ctx, rescale)
