"""The project's training loops checked as they are (docs/writing-a-case.md#a-loop-as-it-is-ctxwatch):
the loop gets the case's Accelerator and model; ctx.watch gives the harness the specification."""

from my_project.data import NoisyBlobs
from my_project.loop import train, train_by_hand
from my_project.model import TinyClassifier
from my_project.train import loss_fn, make_optimizers

from harness import PRECISIONS, RankContext, case, grid


@case("my_training_loop", variants=grid(steps=[1, 2, 3], precision=PRECISIONS), wrappers=["ddp", "fsdp2", "fsdp1"])
def test_my_training_loop(ctx: RankContext) -> None:
    accelerator = ctx.accelerator(gradient_accumulation_steps=ctx.variant["steps"])
    model = ctx.model(TinyClassifier, features=8, classes=3)
    with ctx.watch(accelerator, model, loss=loss_fn, optimizers=make_optimizers, clip_grad_norm=0.5):
        train(accelerator, model, NoisyBlobs(samples=33), epochs=2)


@case("my_loop_by_hand", variants=grid(steps=[2, 3], precision=PRECISIONS), wrappers=["ddp", "fsdp2", "fsdp1"])
def test_my_loop_by_hand(ctx: RankContext) -> None:
    steps = ctx.variant["steps"]
    accelerator = ctx.accelerator()  # one step: the loop accumulates by hand, with no_sync
    model = ctx.model(TinyClassifier, features=8, classes=3)
    with ctx.watch(accelerator, model, loss=loss_fn, optimizers=make_optimizers, clip_grad_norm=0.5, num_steps=steps):
        train_by_hand(accelerator, model, NoisyBlobs(samples=33), accumulation_steps=steps, epochs=2)
