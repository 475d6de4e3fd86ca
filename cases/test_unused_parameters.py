"""unused_parameters: a branch that some micro-batches skip, under ``find_unused_parameters=True``;
unused_until_sync: a branch first used on the synced micro-batch of each window, under every wrapper."""

import torch
from torch.utils.data import DataLoader

from harness import PRECISIONS, Diagnosis, case, grid
from harness.rank.models import mse
from harness.rank.oracle.schedule import windows

EPOCHS = 2
BATCHES = 5
BATCH_SIZE = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def branch_loss(model, batch, use_extra):
    x, y = batch
    return mse(model(x, use_extra=use_extra), y)


def uses_extra(pattern, point, window, rank):
    """Whether this rank's forward uses the ``extra`` branch at this micro-batch.

    ``same``: every rank alike, window by window in turn: used at every micro-batch; used only before
    the sync point (so the branch is unused in the synced backward, used earlier in the window);
    never used (unused on every rank for the whole window).
    ``per_rank``: each rank its own way, alternating by micro-batch and by rank, so that at every
    step some ranks use the branch and some do not (where there are several ranks).
    ``before_sync``: every rank, every window, at every micro-batch but the synced one: the reproducer
    of pytorch #69031 (a parameter used only under ``no_sync`` never synced; fixed by PR #124193)."""
    if pattern == "per_rank":
        return (point.index + rank) % 2 == 0
    if pattern == "before_sync":
        return not point.optimizer_step
    turn = window % 3
    if turn == 0:
        return True
    if turn == 1:
        return not point.optimizer_step
    return False


# find_unused_parameters is DistributedDataParallel's option
@case("unused_parameters",
      variants=grid(steps=[2, 3], pattern=["same", "per_rank", "before_sync"], precision=PRECISIONS),
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
    branchy_loop(ctx, accelerator, steps, lambda point, window: uses_extra(pattern, point, window, ctx.rank))


def branchy_loop(ctx, accelerator, steps, use_of):
    """``Branchy`` under ``accumulate`` for two epochs, its ``extra`` branch used where
    ``use_of(point, window)`` says (``window``: the accumulation window's number), checked every
    micro-batch."""
    model = ctx.model("branchy")
    dataset, per_rank = ctx.dataset(batches=BATCHES, batch_size=BATCH_SIZE)
    oracle = ctx.oracle({"model": model}, num_steps=steps, optimizer=sgd)
    optimizer = sgd(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=BATCH_SIZE))
    models = {"model": model}
    schedule = ctx.schedule(per_rank, epochs=EPOCHS, num_steps=steps)
    window_of = dict(zip((p.index for p in schedule), windows(schedule)))
    for point, batch in ctx.epochs(loader, schedule):
        use = use_of(point, window_of[point.index])
        with accelerator.accumulate(model):
            accelerator.backward(branch_loss(model, batch, use))
            oracle.check_sync_flag(point, accelerator.sync_gradients)
            oracle.backward(lambda m: branch_loss(m["model"], batch, use), sync=point.sync)
            oracle.check_grads(point, models)
            optimizer.step()
            optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, models, {"model": optimizer})


# FSDP2 under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) keeps the gradients of the
# window's earlier micro-batches in fp32 (it accumulates in the reduce dtype); a parameter that gets
# its first gradient on the synced micro-batch brings a bf16 one, and foreach_reduce refuses the mix
# ("FSDP reduce-scatter expects uniform gradient dtype"): pytorch #196996, open. accelerate's own
# bf16 policy (reduce bf16) and fp32 have one dtype and are judged as any cell.
# ZeRO-3 (deepspeed/runtime/zero/stage3.py, partition_grads) copies a reduced gradient into the
# parameter's partition on the window's first micro-batch (micro_step_id 0) and adds it on later
# ones; nothing clears the partitions between windows, so ``extra``'s first gradient of a window is
# added to what its partition held at the last boundary (every earlier window's): stale from the
# second window on (deepspeed 0.19.8; found by this case, reproduced with deepspeed.initialize alone;
# no upstream report found). ZeRO-1/2 pass.
@case("unused_until_sync", variants=grid(steps=[2, 3], precision=PRECISIONS),
      defects={"fsdp2": Diagnosis("raised", when={"reduce": "fp32"}, match="uniform gradient dtype",
                                  upstream="pytorch/pytorch#196996"),
               "deepspeed-z3": Diagnosis("stale", model="model",
                                         upstream="deepspeed stage3.py partition_grads, found by this case")})
def test_unused_until_sync(ctx):
    """``Branchy`` under ``accumulate``, its ``extra`` branch used on every rank at the micro-batch
    that syncs and at no other: the window's earlier backwards leave ``extra`` without a gradient
    (no ``find_unused_parameters`` is needed, as every parameter is used where the wrapper reduces).

    The contract: the synced gradient of ``extra`` is the all-rank average of its one contribution,
    the trunk's and head's the average of the whole window's; between syncs ``extra`` has none."""
    steps = ctx.variant["steps"]
    accelerator = ctx.accelerator(gradient_accumulation_steps=steps)
    branchy_loop(ctx, accelerator, steps, lambda point, window: point.sync)
