"""A user's project as a new user checks it: its own model (tests/planted/user_project.py), two
optimizers, accumulation by hand (``no_sync`` for every micro-batch of a window but its last, each
loss divided by the window's steps) and a clip at the window's end; and a second user's loop, a token
tagger on padded sequences. Each variant's ``bug`` is a mistake of that loop whose diagnosis must name
it; run only by tests/test_diagnosis_cells.py (not a test module)."""

import contextlib

from torch.utils.data import DataLoader
from user_project import (Noisy, Sequences, Tagger, dataset, loss_fn, make_optimizers, pad, tagger_optimizers,
                          tagging_loss)

from harness import RankContext, case, grid

MAX_NORM = 0.05  # below the gradients' norms: every clip scales them
BUGS = ["none", "loss_not_divided", "clip_every_micro_batch"]


@case("user_loop_by_hand", variants=grid(bug=BUGS, steps=[2, 3], precision=["fp32", "bf16"]), wrappers=["ddp"])
def test_user_loop_by_hand(ctx: RankContext) -> None:
    """``none`` passes; ``loss_not_divided`` hands backward the loss without dividing it by the steps;
    ``clip_every_micro_batch`` clips the local gradients after every backward, not only at the sync."""
    accelerator = ctx.accelerator()  # accumulation by hand: the Accelerator is given no steps
    beside_the_oracle(ctx, accelerator, ctx.model(Noisy, hidden=8), dataset(23), loss=loss_fn,
                      optimizers=make_optimizers, max_norm=MAX_NORM)


def beside_the_oracle(ctx, accelerator, model, data, *, loss, optimizers, max_norm, collate_fn=None):
    """A loop accumulating by hand with ``no_sync``, each loss divided by the steps, clipping to ``max_norm``
    and stepping every optimizer at a window's end, the oracle called beside it; the variant's ``bug``
    planted."""
    steps, bug = ctx.variant["steps"], ctx.variant["bug"]
    loader, per_rank = ctx.dataloader(data, batch_size=3, **({"collate_fn": collate_fn} if collate_fn else {}))
    oracle = ctx.oracle({"model": model}, optimizers=optimizers)
    made = optimizers(model)
    model, loader, *made = accelerator.prepare(model, loader, *made)
    for point, batch in ctx.epochs(loader, ctx.schedule(per_rank, epochs=2)):
        window_ends = (point.batch + 1) % steps == 0 or point.batch + 1 == per_rank
        with contextlib.nullcontext() if window_ends else accelerator.no_sync(model), ctx.replay_rng(point):
            value = loss(model, batch)
            accelerator.backward(value if bug == "loss_not_divided" else value / steps)
        oracle.backward(lambda m, batch=batch: loss(m["model"], batch) / steps, sync=window_ends, rng=point)
        oracle.check_grads(point.index, {"model": model})
        if window_ends or bug == "clip_every_micro_batch":
            accelerator.clip_grad_norm_(model.parameters(), max_norm)
        if window_ends:
            oracle.clip_grad_norm(max_norm)
            for optimizer in made:
                optimizer.step()
                optimizer.zero_grad()
        oracle.step(window_ends)
        oracle.check_params(point.index, {"model": model}, {"model": made})


# A second user's loop: a token tagger on padded sequences (dropout, AdamW on its embedding and body,
# SGD with momentum on its head), accumulating by hand, clipping to 0.5 (where some micro-batches'
# gradients are under the norm and others over, and the ranks' norms differ)
TAGGER_NORM = 0.5
TAGGER_BUGS = ["none", "clip_every_micro_batch"]


def tagger_by_hand(accelerator, model, data, *, steps, bug, epochs=2):
    """The user's loop as written, knowing nothing of the harness: ``no_sync`` for every micro-batch of
    a window but its last, each loss divided by the steps, clip, step and zero at the window's end;
    ``clip_every_micro_batch``: the clip after every backward instead."""
    loader = DataLoader(data, batch_size=3, shuffle=True, collate_fn=pad)
    optimizers = tagger_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    for _ in range(epochs):
        for step, batch in enumerate(loader):
            window_ends = (step + 1) % steps == 0 or step + 1 == len(loader)
            with contextlib.nullcontext() if window_ends else accelerator.no_sync(model):
                accelerator.backward(tagging_loss(model, batch) / steps)
            if window_ends or bug == "clip_every_micro_batch":
                accelerator.clip_grad_norm_(model.parameters(), TAGGER_NORM)
            if window_ends:
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()


@case("tagger_loop_watched", variants=grid(bug=TAGGER_BUGS, steps=[2, 3], precision=["fp32", "bf16"]),
      wrappers=["ddp"])
def test_tagger_loop_watched(ctx: RankContext) -> None:
    """The tagger's loop checked as it is (``ctx.watch``)."""
    steps = ctx.variant["steps"]
    accelerator = ctx.accelerator()
    model = ctx.model(Tagger)
    with ctx.watch(accelerator, model, loss=tagging_loss, optimizers=tagger_optimizers,
                   clip_grad_norm=TAGGER_NORM, num_steps=steps):
        tagger_by_hand(accelerator, model, Sequences(), steps=steps, bug=ctx.variant["bug"])


@case("tagger_loop_by_hand", variants=grid(bug=TAGGER_BUGS, steps=[2, 3], precision=["fp32", "bf16"]),
      wrappers=["ddp"])
def test_tagger_loop_by_hand(ctx: RankContext) -> None:
    """The tagger's loop with the oracle called beside it."""
    accelerator = ctx.accelerator()
    beside_the_oracle(ctx, accelerator, ctx.model(Tagger), Sequences(), loss=tagging_loss,
                      optimizers=tagger_optimizers, max_norm=TAGGER_NORM, collate_fn=pad)
