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


# A Trainer subclass that computes its own loss, as users (and TRL's DPO, ORPO, Reward and GKD
# trainers, trl #2617) write it: ``compute_loss`` returns the model's loss, the mean over the
# micro-batch's tokens. Trainer divides a loss by the window's micro-batches only where it takes the
# loss not to be "already scaled": whenever the model's forward accepts loss keyword arguments and the
# batch has labels (num_items_in_batch counted), whatever compute_loss returns (transformers #35856,
# reported after PR #35651 extended it, in 4.48.1, to batches without labels, DPO's; with labels it is
# so from 4.46, measured; 5.x decides the same by ``loss_is_scaled_for_ga``, left None). The window's micro-batch means are summed:
# every window's gradient is its micro-batches times the token mean's, the logged grad_norm too (the
# clip at max_grad_norm hides most of it from the update). The data: every sequence of one length, so
# each micro-batch's mean weighs its tokens as the window's token mean does, and the scale is the
# window's length alone.
LENGTH = 8


def fixed_length_data(ctx):
    return sequences(ctx, labelled="tokens", batches=BATCHES, batch_size=BATCH_SIZE, length=LENGTH)


def mean_loss_trainer(remedy=None, divisor=None):
    """A ``Trainer`` whose ``compute_loss`` returns the model's mean loss over the micro-batch (the
    model is given no ``num_items_in_batch``). ``remedy``: how the subclass asks Trainer to divide it
    by the window's micro-batches (``loss_is_scaled_for_ga = False``, 5.x's flag for exactly this;
    ``model_accepts_loss_kwargs = False`` after construction, TRL's fix in trl PR #2615).
    ``divisor``: the subclass divides the loss itself (and says so, ``loss_is_scaled_for_ga = True``),
    by the configured steps (``args.gradient_accumulation_steps``) or by the window's own micro-batches
    (``current_gradient_accumulation_steps``, from 4.55)."""
    from transformers import Trainer

    class MeanLossTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if remedy == "model_accepts_loss_kwargs":
                self.model_accepts_loss_kwargs = False

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            outputs = model(**inputs)
            loss = outputs.loss
            if divisor == "configured_steps":
                loss = loss / self.args.gradient_accumulation_steps
            elif divisor == "current_steps":
                loss = loss / self.current_gradient_accumulation_steps
            return (loss, outputs) if return_outputs else loss

    if remedy == "loss_is_scaled_for_ga":
        MeanLossTrainer.loss_is_scaled_for_ga = False
    elif divisor is not None:
        MeanLossTrainer.loss_is_scaled_for_ga = True
    return MeanLossTrainer


def train_mean_loss(ctx, **subclass):
    """The causal LM on sequences of one length, trained by ``mean_loss_trainer(**subclass)`` (made once
    transformers is known to be there: the cell is ``skip`` without it)."""
    model = hf_model(ctx, causal_lm)
    trainer = checked_trainer(ctx, model, train_dataset=fixed_length_data(ctx), data_collator=pad, loss="tokens",
                              gradient_accumulation_steps=ctx.variant["steps"],
                              trainer_class=mean_loss_trainer(**subclass), **ARGUMENTS)
    trainer.train()


def trainer_attribute_or_skip(ctx, name):
    """The cell ``skip`` where this transformers' Trainer has no class attribute ``name``."""
    import transformers

    if not hasattr(transformers.Trainer, name):
        ctx.skip(f"transformers {transformers.__version__}'s Trainer has no {name}")


def counts_short_windows_or_skip(ctx):
    """The cell ``skip`` before 4.55, whose Trainer has no ``current_gradient_accumulation_steps``
    (PR #39659; the loop sets it, so the class does not show it)."""
    import transformers

    from harness.versions import below

    if below("transformers", "4.55"):
        ctx.skip(f"transformers {transformers.__version__}'s Trainer has no current_gradient_accumulation_steps "
                 "(from 4.55)")


MEAN_LOSS_NOT_DIVIDED = Diagnosis("wrong_scale", model="model", since={"transformers": "4.46"},
                                  upstream="huggingface/transformers#35856")


@case("trainer_compute_loss_mean", variants=grid(steps=[2, 3]), wrappers=["ddp"],
      defects={"ddp": MEAN_LOSS_NOT_DIVIDED})
def test_trainer_compute_loss_mean(ctx):
    """A ``compute_loss`` override returning the model's mean loss, on a causal LM (its forward takes
    loss keyword arguments) and batches with labels: each step's gradient must be the token mean's
    over the window on every rank, the micro-batch means averaged."""
    train_mean_loss(ctx)


@case("trainer_compute_loss_remedied", variants=grid(remedy=["loss_is_scaled_for_ga", "model_accepts_loss_kwargs"],
                                                     steps=[2, 3]), wrappers=["ddp"])
def test_trainer_compute_loss_remedied(ctx):
    """The same override with the remedy set: Trainer divides each micro-batch's mean by the window's
    micro-batches, the last window of an epoch by its own (fewer) ones."""
    transformers_or_skip(ctx)
    if ctx.variant["remedy"] == "loss_is_scaled_for_ga":
        trainer_attribute_or_skip(ctx, "loss_is_scaled_for_ga")
    train_mean_loss(ctx, remedy=ctx.variant["remedy"])


# A subclass that divides its loss by the configured steps itself: the last window of an epoch,
# shorter when the epoch's batches are not a multiple of the steps (5 here), weighs its micro-batches
# by 1/steps where the window's mean is 1/k, k < steps: that window's gradient k/steps of the mean's
# (Trainer's own, transformers #38837, fixed by PR #39659 in 4.55; the same in a subclass measured by
# modelscope/ms-swift PR #10084). Dividing by current_gradient_accumulation_steps is right.
SHORT_WINDOW_BY_THE_STEPS = Diagnosis("wrong_scale", model="model", when={"divisor": "configured_steps"},
                                      upstream="huggingface/transformers#38837")


@case("trainer_compute_loss_own_scale", variants=grid(divisor=["configured_steps", "current_steps"], steps=[2, 3]),
      wrappers=["ddp"], defects={"ddp": SHORT_WINDOW_BY_THE_STEPS})
def test_trainer_compute_loss_own_scale(ctx):
    """A ``compute_loss`` override that divides the model's mean loss by the window's micro-batches
    itself (``loss_is_scaled_for_ga = True``), by the configured steps or by the window's own count."""
    transformers_or_skip(ctx)
    trainer_attribute_or_skip(ctx, "loss_is_scaled_for_ga")
    if ctx.variant["divisor"] == "current_steps":
        counts_short_windows_or_skip(ctx)
    train_mean_loss(ctx, divisor=ctx.variant["divisor"])


@case("trainer_default_token_averaging", variants=grid(steps=[2, 3]), wrappers=["ddp"],
      defects={"ddp": Diagnosis("misweighted", model="model", ranks=2, fixed_in={"transformers": "4.54"},
                                upstream="huggingface/transformers#39392")})
def test_trainer_default_token_averaging(ctx):
    """The causal LM trained at Trainer's default arguments (``average_tokens_across_devices`` not
    given), each sequence's prompt masked from the loss, so that the ranks' counts of valid tokens
    differ widely: each step must weigh every valid token of the global batch alike. Before 4.54 the
    default was off (PR #39395 turned it on): each rank divided by its own count and DDP averaged the
    ranks, a rank with few tokens weighing each of them more."""
    model = hf_model(ctx, causal_lm)
    dataset = sequences(ctx, labelled="tokens", batches=BATCHES, batch_size=BATCH_SIZE, prompts=True)
    trainer = checked_trainer(ctx, model, train_dataset=dataset, data_collator=pad, loss="tokens",
                              gradient_accumulation_steps=ctx.variant["steps"], **ARGUMENTS)
    trainer.train()
