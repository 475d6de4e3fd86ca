"""Planted token-weighted loops at 3 accumulation steps, in the two documented orders of arithmetic:
at world size 3 and 3 steps neither the weight nor its parts are powers of two, so each order rounds
the weight its own way (harness.rank.oracle.weighting.token_seeds)."""

import torch
from torch.utils.data import DataLoader

from harness import case, grid
from harness.rank.tokens import pad_tokens, token_loss_sum, valid_tokens

STEPS = 3
BATCHES = 7  # windows of 3, 3 and 1 (the last window of an epoch one batch: RankContext.windows)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def train(ctx, loss_of):
    accelerator = ctx.accelerator(gradient_accumulation_steps=STEPS)
    model = ctx.model("tiny_lm")
    dataset, per_rank = ctx.token_dataset(batches=BATCHES, batch_size=4)
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    optimizer = sgd(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer,
                                                   DataLoader(dataset, batch_size=4, collate_fn=pad_tokens))
    for window in ctx.windows(loader, ctx.schedule(per_rank, epochs=2)):
        batches = [b for _, b in window]
        oracle.token_window(b["labels"] for b in batches)
        tokens = accelerator.gather(sum(valid_tokens(b) for b in batches)).sum()
        for point, batch in window:
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(token_loss_sum(model, batch), tokens, accelerator.num_processes))
                oracle.check_sync_flag(point, accelerator.sync_gradients)
                oracle.backward(lambda m: token_loss_sum(m["model"], batch), sync=point.sync)
                oracle.check_grads(point, {"model": model})
                optimizer.step()
                optimizer.zero_grad()
            oracle.step(point)
            oracle.check_params(point, {"model": model}, {"model": optimizer})


@case("planted_token_guide_order", variants=grid(precision=["fp32", "bf16"]))
def test_guide_order(ctx):
    """accelerate's usage guide: (sum * steps * num_processes) / N."""
    train(ctx, lambda summed, tokens, processes: summed * STEPS * processes / tokens)


@case("planted_token_transformers_order", variants=grid(precision=["fp32", "bf16"]))
def test_transformers_order(ctx):
    """transformers' loss: sum / N, then times steps and num_processes."""
    train(ctx, lambda summed, tokens, processes: summed / tokens * STEPS * processes)
