"""Trainer cases for the harness's own tests (tests/test_trainer.py); not a test module."""

import os

import torch

from harness import Diagnosis, case, grid
from harness.rank.hf_models import causal_lm, pad, sequences
from harness.rank.trainer import checked_trainer

STEPS = 2
ARGUMENTS = {"num_train_epochs": 2, "per_device_train_batch_size": 2, "optim": "sgd", "learning_rate": 0.5,
             "lr_scheduler_type": "linear", "max_grad_norm": 1.0, "gradient_accumulation_steps": STEPS}


def tokens(ctx):
    return sequences(ctx, labelled="tokens", batches=5, batch_size=2)


@case("planted_trainer_recorded", variants=grid(precision=["fp32"]), wrappers=["ddp"])
def test_planted_trainer_recorded(ctx):
    """The catalogue's causal LM under a checked Trainer; each rank also writes what a one-process
    float64 computation needs to $PLANTED_PROGRESS_DIR/trainer-ws<world size>-rank<r>.pt: its
    micro-batches in the order its model ran them (seen by a forward pre-hook of its own), the
    initial and final weights."""
    model = ctx.model(causal_lm)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = []

    def record(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            batches.append({k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask", "labels")})

    trainer = checked_trainer(ctx, model, train_dataset=tokens(ctx), data_collator=pad, loss="tokens", **ARGUMENTS)
    # after checked_trainer, which made the oracle's replica: a hook registered before would be copied
    # into it, and record the oracle's forwards too
    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train()
    folder = os.environ.get("PLANTED_PROGRESS_DIR")
    if folder:
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"batches": batches, "initial": initial, "final": final},
                   os.path.join(folder, f"trainer-ws{ctx.world_size}-rank{ctx.rank}.pt"))


def divides_again():
    """A Trainer whose compute_loss divides by the accumulation steps once more (the loss Trainer
    already normalised by the window's tokens): the misconfiguration a subclass makes."""
    from transformers import Trainer

    class DividesAgain(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss / self.args.gradient_accumulation_steps

    return DividesAgain


@case("planted_trainer_divides_again", variants=grid(precision=["fp32"]), wrappers=["ddp"],
      canary=Diagnosis("wrong_scale", model="model"))
def test_planted_trainer_divides_again(ctx):
    model = ctx.model(causal_lm)
    trainer = checked_trainer(ctx, model, train_dataset=tokens(ctx), data_collator=pad, loss="tokens",
                              trainer_class=divides_again(), **ARGUMENTS)
    trainer.train()
