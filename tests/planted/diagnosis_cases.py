"""A user's project as a new user checks it: its own model (tests/planted/user_project.py), two
optimizers, accumulation by hand (``no_sync`` for every micro-batch of a window but its last, each
loss divided by the window's steps) and a clip at the window's end. Each variant's ``bug`` is a mistake
of that loop whose diagnosis must name it; run only by tests/test_diagnosis.py (not a test module)."""

import contextlib

from user_project import Noisy, dataset, loss_fn, make_optimizers

from harness import RankContext, case, grid

MAX_NORM = 0.05  # below the gradients' norms: every clip scales them
BUGS = ["none", "loss_not_divided", "clip_every_micro_batch"]


@case("user_loop_by_hand", variants=grid(bug=BUGS, steps=[2, 3], precision=["fp32", "bf16"]), wrappers=["ddp"])
def test_user_loop_by_hand(ctx: RankContext) -> None:
    """``none`` passes; ``loss_not_divided`` hands backward the loss without dividing it by the steps;
    ``clip_every_micro_batch`` clips the local gradients after every backward, not only at the sync."""
    steps, bug = ctx.variant["steps"], ctx.variant["bug"]
    accelerator = ctx.accelerator()  # accumulation by hand: the Accelerator is given no steps
    model = ctx.model(Noisy, hidden=8)
    loader, per_rank = ctx.dataloader(dataset(23), batch_size=3)
    oracle = ctx.oracle({"model": model}, optimizers=make_optimizers)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    for point, batch in ctx.epochs(loader, ctx.schedule(per_rank, epochs=2)):
        window_ends = (point.batch + 1) % steps == 0 or point.batch + 1 == per_rank
        with contextlib.nullcontext() if window_ends else accelerator.no_sync(model), ctx.replay_rng(point):
            loss = loss_fn(model, batch)
            accelerator.backward(loss if bug == "loss_not_divided" else loss / steps)
        oracle.backward(lambda m, batch=batch: loss_fn(m["model"], batch) / steps, sync=window_ends, rng=point)
        oracle.check_grads(point.index, {"model": model})
        if window_ends or bug == "clip_every_micro_batch":
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        if window_ends:
            oracle.clip_grad_norm(MAX_NORM)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        oracle.step(window_ends)
        oracle.check_params(point.index, {"model": model}, {"model": optimizers})
