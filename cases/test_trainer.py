"""transformers' ``Trainer.train()``, unmodified, under gradient accumulation (docs/trainer.md).

Each optimizer step's update must be the one the mean loss over every valid token (the causal LM)
or every sample (the classifier) of the step's global batch gives: every micro-batch of the window
on every rank, clipped at ``max_grad_norm``, stepped by Trainer's optimizer and scheduler
(harness/rank/trainer.py). The windows: 5 batches per rank and epoch, a multiple of neither 2 nor 3
accumulation steps, so each epoch ends in a shorter window; padded labels are -100.
"""

from harness import Diagnosis, case, grid
from harness.rank.hf_models import causal_lm, classifier, moe_causal_lm, pad, sequences, transformers_or_skip
from harness.rank.trainer import checked_trainer

EPOCHS = 2
BATCHES = 5  # per rank and epoch
BATCH_SIZE = 2
ARGUMENTS = {"num_train_epochs": EPOCHS, "per_device_train_batch_size": BATCH_SIZE, "optim": "sgd",
             "learning_rate": 0.5, "lr_scheduler_type": "linear", "max_grad_norm": 1.0}

# FSDP2 on CPU, and bf16 under DeepSpeed on CPU: skip, saying why (harness/rank/trainer.py). Trainer's
# DeepSpeed: TrainingArguments(deepspeed=...) with ZeRO at the cell's stage and every other value
# "auto" (DeepSpeed clips at max_grad_norm inside its step; Trainer passes scale_wrt_gas=False since
# PR #35808, so the engine does not divide the loss by the steps again).
WRAPPERS = ["ddp", "fsdp2", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3"]


def data(ctx, labelled):
    return sequences(ctx, labelled=labelled, batches=BATCHES, batch_size=BATCH_SIZE)


def hf_model(ctx, factory):
    """``ctx.model(factory)`` for a transformers model, the cell ``skip`` first where transformers is
    not installed or cannot run with this torch (the factory imports it)."""
    transformers_or_skip(ctx)
    return ctx.model(factory)


# average_tokens_across_devices=False: each rank divides by its own window's tokens, and DDP averages
# the ranks' token means; a rank with fewer tokens weighs its tokens more (transformers documents the
# flag for exactly this). Right on one rank.
LOCAL_TOKEN_MEAN = Diagnosis("misweighted", model="model", ranks=2, when={"average_tokens": False})


def token_averaging(ctx):
    """``average_tokens_across_devices`` as the variant says; releases without the option (before
    4.46) count each rank's tokens alone, which is the variant that turns it off."""
    from transformers import TrainingArguments

    from harness.wrappers.probe import takes_parameter

    if ctx.variant["average_tokens"] or takes_parameter(TrainingArguments, "average_tokens_across_devices"):
        return {"average_tokens_across_devices": ctx.variant["average_tokens"]}
    return {}


@case("trainer_causal_lm", variants=grid(steps=[2, 3], average_tokens=[True, False], precision=["fp32", "bf16"]),
      wrappers=WRAPPERS, canary=LOCAL_TOKEN_MEAN)
def test_trainer_causal_lm(ctx):
    """A tiny Llama trained by ``Trainer.train()``: its loss takes ``num_items_in_batch``, the
    window's valid tokens (gathered from every rank with ``average_tokens_across_devices``).
    Every position is labelled (only padding is -100), so the targets are the labels after the
    first of each row."""
    model = hf_model(ctx, causal_lm)
    trainer = checked_trainer(ctx, model, train_dataset=data(ctx, "tokens"), data_collator=pad,
                              loss="tokens", gradient_accumulation_steps=ctx.variant["steps"],
                              **token_averaging(ctx), **ARGUMENTS)
    trainer.train()


# transformers #47688 (open): Trainer takes a forward with **kwargs for one whose loss uses
# num_items_in_batch, passes the window's count and skips its division by the accumulation steps; the
# sequence-classification head takes **kwargs and drops them, so the loss is each micro-batch's mean,
# summed over the window (and times the ranks, with average_tokens_across_devices): scaled by the
# window's micro-batches and the world size. Clipped updates hide it; Trainer's grad_norm does not.
KWARGS_DROPPED = Diagnosis("wrong_scale", model="model", since={"transformers": "4.54"},
                           upstream="huggingface/transformers#47688")
# The same under DeepSpeed, where the gradients are read before DeepSpeed's own clip: each window's
# gradient is its micro-batches times the ranks too large, a wrong weight of the window's samples,
# which a sample-weighed window names misweighted (docs/judging.md)
KWARGS_DROPPED_UNCLIPPED = Diagnosis("misweighted", model="model", since={"transformers": "4.54"},
                                     upstream="huggingface/transformers#47688")


def train_classifier(ctx, model):
    trainer = checked_trainer(ctx, model, train_dataset=data(ctx, "classes"), data_collator=pad,
                              loss="samples", gradient_accumulation_steps=ctx.variant["steps"], **ARGUMENTS)
    trainer.train()


@case("trainer_classifier", variants=grid(steps=[2, 3], precision=["fp32", "bf16"]), wrappers=WRAPPERS,
      defects={"ddp": KWARGS_DROPPED, "deepspeed-z1": KWARGS_DROPPED_UNCLIPPED,
               "deepspeed-z2": KWARGS_DROPPED_UNCLIPPED, "deepspeed-z3": KWARGS_DROPPED_UNCLIPPED})
def test_trainer_classifier(ctx):
    """A tiny Llama sequence classifier, as transformers builds it, trained by ``Trainer.train()``:
    its loss is a plain mean over the micro-batch, which Trainer must divide by the window's
    micro-batches (the last window of an epoch has fewer)."""
    train_classifier(ctx, hf_model(ctx, classifier))


@case("trainer_classifier_plain_mean", variants=grid(steps=[2, 3], precision=["fp32", "bf16"]), wrappers=WRAPPERS)
def test_trainer_classifier_plain_mean(ctx):
    """The same classifier with ``model.accepts_loss_kwargs = False``, the remedy Trainer documents for
    a model whose loss takes no ``num_items_in_batch``: Trainer divides each micro-batch's mean by
    the window's micro-batch count (PR #39659: by the count it really has, in the shorter last window)."""
    model = hf_model(ctx, classifier)
    model.accepts_loss_kwargs = False
    train_classifier(ctx, model)


# transformers #48690 (open; PRs #48691 and #48706 open): a MoE model adds router_aux_loss_coef times its
# router's load-balancing loss to the LM loss it returns, and Trainer, having had num_items_in_batch
# (the window's tokens on every rank), multiplies the whole loss by the number of processes so that
# DDP's average leaves the token mean: the router term, a mean already, comes out world_size times its
# weight. Nor is it divided by the accumulation steps (Trainer skips that division when the model
# takes num_items_in_batch): the window's router terms are summed, not averaged; found by this case,
# no upstream report found. Neither is a uniform scale of the gradient: mismatch.
ROUTER_LOSS_TIMES_RANKS = Diagnosis("mismatch", model="model", ranks=2, when={"steps": 1},
                                    upstream="huggingface/transformers#48690")
ROUTER_LOSS_TIMES_STEPS = Diagnosis("mismatch", model="model", when={"steps": 2},
                                    upstream="router loss summed over the window's micro-batches, found by this case")


@case("trainer_moe_router_loss", variants=grid(steps=[1, 2], precision=["fp32", "bf16"]), wrappers=["ddp"],
      defects={"ddp": (ROUTER_LOSS_TIMES_RANKS, ROUTER_LOSS_TIMES_STEPS)})
def test_trainer_moe_router_loss(ctx):
    """A one-layer Mixtral of four experts (its router's load-balancing loss weighed 0.5) trained by
    ``Trainer.train()`` with ``average_tokens_across_devices``: each step's gradient must be the token
    mean's plus 0.5 times the mean of the router losses of the window's micro-batches on every rank."""
    model = hf_model(ctx, moe_causal_lm)
    trainer = checked_trainer(ctx, model, train_dataset=data(ctx, "tokens"), data_collator=pad, loss="tokens",
                              gradient_accumulation_steps=ctx.variant["steps"], **token_averaging_on(), **ARGUMENTS)
    trainer.train()


def token_averaging_on():
    """``average_tokens_across_devices=True`` (the default from 4.54 on), where the release has it."""
    from transformers import TrainingArguments

    from harness.wrappers.probe import takes_parameter

    return {"average_tokens_across_devices": True} if takes_parameter(TrainingArguments,
                                                                      "average_tokens_across_devices") else {}
