"""Training loops checked as they are (``ctx.watch``), each with one of the usual mistakes of a loop
that accumulates, or with what the watch cannot infer; run only by tests/test_watch.py (not a test
module). The loops know nothing of the harness: each is what a user would have written."""

import contextlib
import itertools

import torch
from torch import nn
from torch.utils.data import DataLoader
from user_project import Noisy, dataset, loss_fn, make_optimizers

from harness import PRECISIONS, RankContext, case, grid

STEPS = 2
MAX_NORM = 0.05  # below the gradients' norms: every clip clips


def strong_dropout() -> nn.Module:
    """The user's model with dropout of 0.5: a forward replayed under other masks is far off."""
    return Noisy(dropout=0.5)


# --- the loops ---------------------------------------------------------------------------------------

def accumulate_loop(accelerator, model, data, *, divide=False, epochs=2):
    """accelerate's idiom; ``divide``: the loss divided by the steps by hand as well (the guide's bug)."""
    loader = DataLoader(data, batch_size=3, shuffle=True)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                if divide:
                    loss = loss / accelerator.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()


def drawn_ahead(loader, steps):
    """The loader's batches, each window's drawn before the first is given back (a loop that counts a
    window's tokens first draws them so)."""
    batches = iter(loader)
    while window := list(itertools.islice(batches, steps)):
        yield from window


def by_hand(accelerator, model, data, *, steps=STEPS, mistake="", epochs=2, ahead=False):
    """Accumulation by hand with ``no_sync``; ``mistake`` plants one of the usual ones; ``ahead``: each
    window's batches drawn before its first backward."""
    loader = DataLoader(data, batch_size=3, shuffle=True)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    forward_model = accelerator.unwrap_model(model) if mistake == "unwrapped_forward" else model
    for _ in range(epochs):
        for step, batch in enumerate(drawn_ahead(loader, steps) if ahead else loader):
            window_ends = (step + 1) % steps == 0 or step + 1 == len(loader)
            context = contextlib.nullcontext() if window_ends else accelerator.no_sync(model)
            if mistake == "forward_outside_no_sync":
                loss = loss_fn(forward_model, batch) / steps
                with context:
                    accelerator.backward(loss)
            else:
                with context:
                    loss = loss_fn(forward_model, batch) / steps
                    accelerator.backward(loss)
            if mistake == "clip_in_window" and not window_ends:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            if mistake == "one_optimizer_every_batch" and not window_ends:
                optimizers[0].step()
                optimizers[0].zero_grad()
            if window_ends:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def micro_batch(accelerator, model, optimizer, batch, *, losses=1):
    """accelerate's idiom for one micro-batch, with ``losses`` backwards on it."""
    with accelerator.accumulate(model):
        for _ in range(losses):
            accelerator.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()


def out_of_order(accelerator, model, data):
    """Takes each window's batches first and backs them last first."""
    model, loader, optimizer = accelerator.prepare(model, DataLoader(data, batch_size=3), sgd(model))
    batches = iter(loader)
    for window in zip(batches, batches):
        for batch in reversed(window):
            micro_batch(accelerator, model, optimizer, batch)


def unprepared_data(accelerator, model, data):
    """Iterates a DataLoader it never gave ``prepare``."""
    model, optimizer = accelerator.prepare(model, sgd(model))
    for batch in DataLoader(data, batch_size=3):
        micro_batch(accelerator, model, optimizer, batch)


def two_losses_ahead(accelerator, model, data):
    """Two backwards on each batch of a window drawn first."""
    model, loader, optimizer = accelerator.prepare(model, DataLoader(data, batch_size=3), sgd(model))
    batches = iter(loader)
    for window in zip(batches, batches):
        for batch in window:
            micro_batch(accelerator, model, optimizer, batch, losses=2)


def two_losses_a_batch(accelerator, model, data):
    """Two backwards on each batch (a GAN's generator and discriminator, say)."""
    model, loader, optimizer = accelerator.prepare(model, DataLoader(data, batch_size=3), sgd(model))
    for batch in loader:
        micro_batch(accelerator, model, optimizer, batch, losses=2)


def own_accelerator(accelerator, model, data):
    """Makes its own Accelerator."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=STEPS)
    accumulate_loop(accelerator, model, data)


def unwrap_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


# --- the cases ---------------------------------------------------------------------------------------

def watched(ctx: RankContext, *, accelerator_steps: int, **spec):
    accelerator = ctx.accelerator(gradient_accumulation_steps=accelerator_steps)
    model = ctx.model(strong_dropout)
    return accelerator, model, ctx.watch(accelerator, model, loss=loss_fn, optimizers=make_optimizers, **spec)


@case("watch_accumulate", variants=grid(steps=[1, 2, 3], precision=PRECISIONS), wrappers=["ddp", "fsdp2"])
def test_watch_accumulate(ctx):
    accelerator, model, watch = watched(ctx, accelerator_steps=ctx.variant["steps"], clip_grad_norm=MAX_NORM)
    with watch:
        accumulate_loop(accelerator, model, dataset())
    # each prepared optimizer once, in the order of the oracle's (prepare calls prepare_optimizer: both tell)
    held = watch.optimizers["model"]
    if len(held) != 2 or [type(unwrap_optimizer(o)) for o in held] != [torch.optim.AdamW, torch.optim.SGD]:
        raise AssertionError(f"the watch holds the loop's optimizers as {held}")


@case("watch_by_hand", variants=grid(steps=[2, 3], draw=["each", "ahead"], precision=PRECISIONS),
      wrappers=["ddp", "fsdp2"])
def test_watch_by_hand(ctx):
    steps = ctx.variant["steps"]
    accelerator, model, watch = watched(ctx, accelerator_steps=1, clip_grad_norm=MAX_NORM, num_steps=steps)
    with watch:
        by_hand(accelerator, model, dataset(), steps=steps, ahead=ctx.variant["draw"] == "ahead")


# the guide's bug: accelerator.backward divides by the steps, and so does the loop
@case("watch_loss_divided_twice", variants=grid(precision=PRECISIONS), wrappers=["ddp"])
def test_watch_loss_divided_twice(ctx):
    accelerator, model, watch = watched(ctx, accelerator_steps=STEPS, clip_grad_norm=MAX_NORM)
    with watch:
        accumulate_loop(accelerator, model, dataset(), divide=True)


# accumulation by hand under an Accelerator given the steps too: the loss is divided twice
@case("watch_by_hand_divided_twice", variants=grid(precision=PRECISIONS), wrappers=["ddp"])
def test_watch_by_hand_divided_twice(ctx):
    accelerator, model, watch = watched(ctx, accelerator_steps=STEPS, clip_grad_norm=MAX_NORM, num_steps=STEPS)
    with watch:
        by_hand(accelerator, model, dataset())


@case("watch_by_hand_mistake", variants=grid(mistake=["forward_outside_no_sync", "clip_in_window",
                                                      "one_optimizer_every_batch", "unwrapped_forward"],
                                             precision=PRECISIONS), wrappers=["ddp"])
def test_watch_by_hand_mistake(ctx):
    accelerator, model, watch = watched(ctx, accelerator_steps=1, clip_grad_norm=MAX_NORM, num_steps=STEPS)
    with watch:
        by_hand(accelerator, model, dataset(), mistake=ctx.variant["mistake"])


@case("watch_refused", variants=grid(loop=["out_of_order", "unprepared_data", "own_accelerator",
                                           "clip_unspecified", "two_losses_a_batch", "two_losses_ahead"]),
      wrappers=["ddp"])
def test_watch_refused(ctx):
    loop = ctx.variant["loop"]
    spec = {} if loop == "clip_unspecified" else {"clip_grad_norm": MAX_NORM}
    accelerator, model, watch = watched(ctx, accelerator_steps=STEPS, **spec)
    with watch:
        if loop == "clip_unspecified":
            accumulate_loop(accelerator, model, dataset())
        else:
            {"out_of_order": out_of_order, "unprepared_data": unprepared_data, "own_accelerator": own_accelerator,
             "two_losses_a_batch": two_losses_a_batch, "two_losses_ahead": two_losses_ahead}[loop](
                accelerator, model, dataset())


def specified_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """What the specification says the loop's optimizers are; the loop's AdamW has another lr."""
    return [torch.optim.AdamW(model.body.parameters(), lr=2e-2), torch.optim.SGD(model.head.parameters(), lr=0.05)]


# under FSDP2 a parameter mismatch leaves the oracle with the loop's DTensor optimizer state, which it
# cannot load: it judges on with its own (the cell fails; it does not raise)
@case("watch_fsdp2_other_optimizer", variants=grid(precision=["fp32"]), wrappers=["fsdp2"])
def test_watch_fsdp2_other_optimizer(ctx):
    accelerator = ctx.accelerator(gradient_accumulation_steps=STEPS)
    model = ctx.model(strong_dropout)
    with ctx.watch(accelerator, model, loss=loss_fn, optimizers=specified_optimizers, clip_grad_norm=MAX_NORM):
        accumulate_loop(accelerator, model, dataset())
