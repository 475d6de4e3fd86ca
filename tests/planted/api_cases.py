"""Cases written as a user writes them, with the public API only (harness.__all__); run only by
tests/test_case_api.py (not a test module)."""


from user_project import Noisy, dataset, loss_fn, make_optimizers

from harness import RankContext, case, grid


def train(ctx: RankContext, *, replay: bool, drop_last: bool = False, split: bool = False, samples: int = 23) -> None:
    options = ctx.dataloader_options(split_batches=True) if split else {}
    accelerator = ctx.accelerator(gradient_accumulation_steps=ctx.variant.get("steps", 2), **options)
    model = ctx.model(Noisy, hidden=8)
    loader, per_rank = ctx.dataloader(dataset(samples), batch_size=4 if split else 3, drop_last=drop_last,
                                      split_batches=split)
    oracle = ctx.oracle({"model": model}, optimizers=make_optimizers)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    for point, batch in ctx.epochs(loader, ctx.schedule(per_rank, epochs=2)):
        with accelerator.accumulate(model), ctx.replay_rng(point):
            accelerator.backward(loss_fn(model, batch))
            oracle.check_sync_flag(point, accelerator.sync_gradients)
            oracle.backward(lambda m: loss_fn(m["model"], batch), sync=point.sync, rng=point if replay else None)
            oracle.check_grads(point, {"model": model})
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        oracle.step(point)
        oracle.check_params(point, {"model": model}, {"model": optimizers})


@case("api_own_model", variants=grid(steps=[2], drop_last=[False, True], split=[False, True]))
def test_api_own_model(ctx: RankContext) -> None:
    """A user's model with dropout, two optimizers, a user's dataset: passes."""
    train(ctx, replay=True, drop_last=ctx.variant["drop_last"], split=ctx.variant["split"])


@case("api_dropout_not_replayed", variants=grid(steps=[2]))
def test_api_dropout_not_replayed(ctx: RankContext) -> None:
    """The oracle's forward without the case's RNG state: other dropout masks, a fail."""
    train(ctx, replay=False)


@case("api_model_differs", variants=grid(steps=[2]))
def test_api_model_differs(ctx: RankContext) -> None:
    """A model built under each rank's own seed: refused on every rank, saying why."""
    model = Noisy().to(ctx.device)
    ctx.oracle({"model": model})


@case("api_steps_twice", variants=grid(steps=[2]))
def test_api_steps_twice(ctx: RankContext) -> None:
    """Accumulation steps given to the Accelerator and, differently, to the oracle: refused."""
    ctx.accelerator(gradient_accumulation_steps=2)
    ctx.oracle({"model": ctx.model(Noisy)}, num_steps=3)
