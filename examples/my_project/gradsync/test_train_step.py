"""Gradient-sync checks of my_project's own training step: `pytest -n auto gradsync/`."""

from my_project.data import NoisyBlobs
from my_project.model import TinyClassifier
from my_project.train import loss_fn, make_optimizers, train_step

from harness import ALL_PRECISIONS, RankContext, case, grid

EPOCHS = 2


# DDP and FSDP: make_optimizers gives two optimizers, and DeepSpeed's engine takes one
@case("my_train_step", variants=grid(steps=[1, 2], precision=ALL_PRECISIONS), wrappers=["ddp", "fsdp2", "fsdp1"])
def test_my_train_step(ctx: RankContext) -> None:
    """my_project's train_step for two epochs of a shuffled, prepared dataloader: every rank's
    gradients after every backward, and its parameters after every micro-batch."""
    accelerator = ctx.accelerator(gradient_accumulation_steps=ctx.variant["steps"])
    model = ctx.model(TinyClassifier, features=8, classes=3)
    loader, batches_per_rank = ctx.dataloader(NoisyBlobs(samples=33), batch_size=4, shuffle=True)
    oracle = ctx.oracle({"model": model}, optimizers=make_optimizers)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)

    for point, batch in ctx.epochs(loader, ctx.schedule(batches_per_rank, epochs=EPOCHS)):

        def after_backward() -> None:
            oracle.check_sync_flag(point, accelerator.sync_gradients)
            oracle.backward(lambda replicas: loss_fn(replicas["model"], batch), sync=point.sync, rng=point)
            oracle.check_grads(point, {"model": model})

        with ctx.replay_rng(point):
            train_step(accelerator, model, optimizers, batch, after_backward=after_backward)
        oracle.step(point)
        oracle.check_params(point, {"model": model}, {"model": optimizers})
