"""unused_parameters: a branch that some micro-batches skip, under ``find_unused_parameters=True``."""

import torch
from torch.utils.data import DataLoader

from harness import PRECISIONS, case, grid
from harness.rank.schedule import windows

EPOCHS = 2
BATCHES = 5
BATCH_SIZE = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def branch_loss(model, batch, use_extra):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x, use_extra=use_extra), y)


def uses_extra(pattern, point, window, rank):
    """Whether this rank's forward uses the ``extra`` branch at this micro-batch.

    ``same``: every rank alike, window by window in turn: used at every micro-batch; used only before
    the sync point (so the branch is unused in the synced backward, used earlier in the window);
    never used (unused on every rank for the whole window).
    ``per_rank``: each rank its own way, alternating by micro-batch and by rank, so that at every
    step some ranks use the branch and some do not (where there are several ranks)."""
    if pattern == "per_rank":
        return (point.index + rank) % 2 == 0
    turn = window % 3
    if turn == 0:
        return True
    if turn == 1:
        return not point.optimizer_step
    return False


# find_unused_parameters is DistributedDataParallel's option
@case("unused_parameters", variants=grid(steps=[2, 3], pattern=["same", "per_rank"], precision=PRECISIONS),
      wrappers=["ddp"])
def test_unused_parameters(ctx):
    """``Branchy`` under ``accumulate`` with ``DistributedDataParallelKwargs(find_unused_parameters=True)``.

    DDP's contract: a parameter that gets no gradient in a rank's graph is marked ready and joins the
    all-reduce with nothing from that rank, so the synced gradient is the average over all ranks of
    what each accumulated in the window (a rank that never used it adds zero); a parameter that no
    rank used in the window keeps no gradient. That is the oracle's average with a missing gradient
    as zero."""
    steps, pattern = ctx.variant["steps"], ctx.variant["pattern"]
    accelerator = ctx.accelerator(gradient_accumulation_steps=steps, **ctx.ddp_options(find_unused_parameters=True))
    model = ctx.model("branchy")
    dataset, per_rank = ctx.dataset(batches=BATCHES, batch_size=BATCH_SIZE)
    oracle = ctx.oracle({"model": model}, num_steps=steps, optimizer=sgd)
    optimizer = sgd(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=BATCH_SIZE))
    models = {"model": model}
    schedule = ctx.schedule(per_rank, epochs=EPOCHS, num_steps=steps)
    window_of = dict(zip((p.index for p in schedule), windows(schedule)))
    for point, batch in ctx.epochs(loader, schedule):
        use = uses_extra(pattern, point, window_of[point.index], ctx.rank)
        with accelerator.accumulate(model):
            accelerator.backward(branch_loss(model, batch, use))
            oracle.check_sync_flag(point, accelerator.sync_gradients)
            oracle.backward(lambda m: branch_loss(m["model"], batch, use), sync=point.sync)
            oracle.check_grads(point, models)
            optimizer.step()
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, models, {"model": optimizer})
