"""Token-weighted losses: the mean over every valid token of an accumulation window on every rank,
with padded batches of variable length (harness/rank/tokens.py). The loss normalisation that Hugging
Face's "Fixing Gradient Accumulation" (2024-10-16) and transformers PR #34191 were about: a mean per
micro-batch, divided by the accumulation steps and averaged over the ranks, is not that mean when
micro-batches and ranks hold different numbers of valid tokens. The oracle's expectation at a sync is
the window's token mean from the replicas alone (``oracle.token_window``), whatever the loop divides by.
"""

import torch
from torch.utils.data import DataLoader

from harness import PRECISIONS, Diagnosis, case, grid
from harness.rank.hf_models import transformers_or_skip
from harness.rank.tokens import causal_loss_sum, pad_tokens, token_loss_mean, token_loss_sum, valid_tokens
from harness.wrappers.registry import MESHES
from harness.wrappers.probe import takes_parameter

EPOCHS = 2
STEPS = 2
# per rank and epoch: windows of 2, 2 and 1 micro-batches. The last window of an epoch is one batch:
# the window is taken from the prepared dataloader before its first backward, and once the loader has
# yielded its last batch accumulate() syncs every micro-batch (RankContext.windows)
BATCHES = 5
BATCH_SIZE = 4

# sync_each_batch=false first: the lead variant, which every wrapper runs by default (--wrappers auto)
VARIANTS = grid(sync_each_batch=[False, True], precision=PRECISIONS)

# Under DeepSpeed ZeRO-1 sync_each_batch does nothing (see accumulate_sync_each_batch)
ZERO1_SYNC_EACH_BATCH = [Diagnosis("not_synced", model="model", when={"sync_each_batch": True}),
                         Diagnosis("comm_missing", when={"sync_each_batch": True})]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def token_accelerator(ctx):
    if ctx.variant["sync_each_batch"]:
        return ctx.accelerator(**ctx.gradient_accumulation(STEPS, sync_each_batch=True))
    return ctx.accelerator(gradient_accumulation_steps=STEPS)


def train(ctx, accelerator, model, loss_for, *, causal=False):
    """``model`` through a prepared dataloader of padded token batches for two epochs, one
    accumulation window at a time: the window's batches are taken first (to count their tokens),
    then each goes through forward, ``backward``, ``step`` and ``zero_grad`` inside
    ``accumulate(model)``. ``loss_for(accelerator, window)`` is the loop's normalisation: it returns
    the loss of a (model, batch) in that window. ``causal``: a Hugging Face causal LM, which predicts
    label t+1 at position t (label 0 is never a target)."""
    dataset, per_rank = ctx.token_dataset(batches=BATCHES, batch_size=BATCH_SIZE, causal=causal)
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    optimizer = sgd(model.parameters())
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, collate_fn=pad_tokens)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    models = {"model": model}
    summed = causal_loss_sum if causal else token_loss_sum
    for window in ctx.windows(loader, ctx.schedule(per_rank, epochs=EPOCHS)):
        batches = [batch for _, batch in window]
        oracle.token_window(batch["labels"][:, 1:] if causal else batch["labels"] for batch in batches)
        loss = loss_for(accelerator, batches)
        for point, batch in window:
            with accelerator.accumulate(model):
                accelerator.backward(loss(model, batch))
                oracle.check_sync_flag(point, accelerator.sync_gradients)
                oracle.backward(lambda m: summed(m["model"], batch), sync=point.sync)
                oracle.check_grads(point, models)
                optimizer.step()
                optimizer.zero_grad()
            oracle.step(point)
            oracle.check_params(point, models, {"model": optimizer})


def token_model(ctx):
    """The toy LM; under a tensor-parallel mesh the one with a hidden MLP, which tp splits."""
    return ctx.model("tiny_mlp_lm" if ctx.mesh is not None and ctx.mesh.size("tp") > 1 else "tiny_lm")


def gathered_token_loss(accelerator, window):
    # accelerate's usage guide ("Gradient accumulation on training samples of variable size"): the
    # summed token loss over the window's valid tokens on all ranks (gathered), times the accumulation
    # steps (accelerate divides by them) and the number of processes (DDP averages)
    num_items_in_batch = accelerator.gather(sum(valid_tokens(b) for b in window)).sum().item()
    steps = accelerator.gradient_accumulation_steps
    return lambda model, batch: token_loss_sum(model, batch) * steps * accelerator.num_processes / num_items_in_batch


@case("accumulate_token_loss", variants=VARIANTS, defects={"deepspeed-z1": ZERO1_SYNC_EACH_BATCH},
      meshes=MESHES)
def test_accumulate_token_loss(ctx):
    """The documented token loss: each micro-batch's summed token loss divided by the window's valid
    tokens gathered from every rank, times the accumulation steps and the number of processes. Every
    token of the window weighs the same, on every rank."""
    train(ctx, token_accelerator(ctx), token_model(ctx), gathered_token_loss)


def per_batch_mean(accelerator, window):
    return token_loss_mean


@case("accumulate_token_mean", variants=VARIANTS, canary=Diagnosis("misweighted", model="model"),
      meshes=MESHES)
def test_accumulate_token_mean(ctx):
    """Canary: the loss is each micro-batch's own token mean (``reduction="mean"``), as before the fix.
    A micro-batch with few valid tokens weighs as much as one with many: ``misweighted``."""
    train(ctx, token_accelerator(ctx), token_model(ctx), per_batch_mean)


def local_token_loss(accelerator, window):
    num_items_in_batch = sum(valid_tokens(b) for b in window).item()  # this rank's only: not gathered
    steps = accelerator.gradient_accumulation_steps
    return lambda model, batch: token_loss_sum(model, batch) * steps * accelerator.num_processes / num_items_in_batch


@case("accumulate_token_local_count", variants=VARIANTS,
      canary=Diagnosis("misweighted", model="model", ranks=2), meshes=MESHES)
def test_accumulate_token_local_count(ctx):
    """Canary: the documented loss with the window's token count of this rank alone (not gathered):
    a rank with fewer tokens weighs its tokens more. Right on one rank; ``misweighted`` from two."""
    train(ctx, token_accelerator(ctx), token_model(ctx), local_token_loss)


def data_parallel_count_all_processes(accelerator, window):
    # transformers #39648 (fixed by PR #45994): the window's valid tokens counted over the
    # data-parallel ranks (accelerate's flattened "dp" mesh dimension: each batch once), but the loss
    # scaled by every process, where the gradient is averaged over the data-parallel and context ranks
    # only (tensor-parallel peers hold the same batch; under cp, without sequence splitting, so do the
    # context peers)
    count = sum(valid_tokens(b) for b in window).clone()
    torch.distributed.all_reduce(count, group=accelerator.torch_device_mesh["dp"].get_group())
    steps = accelerator.gradient_accumulation_steps
    return lambda model, batch: token_loss_sum(model, batch) * steps * accelerator.num_processes / count.item()


@case("accumulate_token_all_processes", variants=VARIANTS, wrappers=["fsdp2"], meshes=("tp", "cp"),
      canary=Diagnosis("misweighted", model="model"))
def test_accumulate_token_all_processes(ctx):
    """Canary, on a mesh whose tensor- or context-parallel peers draw the same batch: the token loss
    with the window's tokens counted over the data-parallel ranks and scaled by every process
    (``accelerator.num_processes``) instead of the ranks the gradient is averaged over: every token
    weighs twice what it should (transformers #39648, where expert parallelism made it four times)."""
    if ctx.mesh is None:
        ctx.skip("a mesh's canary: without a mesh every process is data-parallel and the count is right")
    train(ctx, token_accelerator(ctx), token_model(ctx), data_parallel_count_all_processes)


def tiny_llama():
    """A randomly initialised Llama of one layer, built from its config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config)


# Under mesh=cp accelerate hooks every ``self_attn`` to drop its attention mask and pass
# ``is_causal=True`` instead (``_attach_context_parallel_hooks``), which only SDPA reads: the tiny
# Llama's eager attention ignores it and attends to every position, later tokens and padding
# included. Measured: the same cells with attn_implementation="sdpa" pass. Related upstream: accelerate
# PR #4177 (the same hook makes sliding-window layers fully causal); no report of the eager case found.
CP_DROPS_EAGER_MASK = Diagnosis("mismatch", model="model", when={"mesh": "cp"})


@case("accumulate_token_loss_transformers", variants=VARIANTS,
      defects={"deepspeed-z1": ZERO1_SYNC_EACH_BATCH, "fsdp2": CP_DROPS_EAGER_MASK},
      wrappers=["ddp", "fsdp2", "fsdp1", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3"], meshes=("hsdp", "cp"))
def test_accumulate_token_loss_transformers(ctx):
    """A tiny Llama from transformers trained through its own loss with ``num_items_in_batch`` (the
    window's valid tokens gathered from every rank, as transformers' Trainer counts them), times the
    accumulation steps and the number of processes. Needs transformers (the ``transformers`` extra);
    with none, or a release whose model takes no ``num_items_in_batch`` (before 4.46.0), the cell is
    ``skip``, saying so."""
    transformers = transformers_or_skip(ctx)
    accelerator = token_accelerator(ctx)
    model = ctx.model(tiny_llama)
    if not takes_parameter(model.forward, "num_items_in_batch"):
        # transformers before 4.46.0 (PR #34191): the forward refuses the keyword, its loss is a mean
        ctx.skip(f"transformers {transformers.__version__} takes no num_items_in_batch in the model's forward "
                 "(added in 4.46.0, PR #34191)")
    train(ctx, accelerator, model, transformers_loss, causal=True)


def transformers_loss(accelerator, window):
    # the model's own loss: summed token losses divided by num_items_in_batch (counted as transformers'
    # Trainer counts them, gathered from every rank), times the accumulation steps and num_processes
    num_items_in_batch = accelerator.gather(sum(valid_tokens(b) for b in window)).sum()

    def loss(model, batch):
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                        num_items_in_batch=num_items_in_batch)
        return outputs.loss * accelerator.gradient_accumulation_steps * accelerator.num_processes

    return loss


# TRL's GRPO (trl issue #5619, fixed by PR #6024 in 1.9.1): a generation batch of steps_per_generation
# micro-batches is made at once and its valid tokens counted over every rank, and the dapo, cispo and
# vespo losses divided each micro-batch's summed token loss by that count, while an optimizer step
# accumulates only gradient_accumulation_steps of them: each update weighs its tokens by
# steps / steps_per_generation of their share (half here). The pattern itself, in a plain accelerate
# loop, with a generation batch of two windows (the oracle holds the loop to the window's token mean;
# GRPOTrainer's own loss, from completions it samples and their rewards, is beyond what the oracle
# models: docs/catalogue.md, "Reports looked at that are not cases").
GENERATION_WINDOWS = 2  # steps_per_generation = GENERATION_WINDOWS * STEPS micro-batches


def generation_batch_train(ctx, normaliser):
    """Two epochs in windows of ``STEPS`` micro-batches, without the dataloader's end forcing a sync
    (``sync_with_dataloader=False``, as Trainer's own loop): the windows of a generation batch
    (``GENERATION_WINDOWS`` of them) are all drawn before the first of them runs, their valid tokens
    counted over every rank; each micro-batch's summed token loss is divided by the window's count
    (``normaliser="window"``) or by the generation batch's (``"generation_batch"``), times the steps
    and the number of processes (accelerate divides by the one, DDP averages over the other)."""
    accelerator = ctx.accelerator(**ctx.gradient_accumulation(STEPS, sync_with_dataloader=False))
    model = token_model(ctx)
    dataset, per_rank = ctx.token_dataset(batches=BATCHES, batch_size=BATCH_SIZE)
    oracle = ctx.oracle({"model": model}, optimizer=sgd)
    optimizer = sgd(model.parameters())
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, collate_fn=pad_tokens)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    models = {"model": model}
    windows = ctx.windows(loader, ctx.schedule(per_rank, epochs=EPOCHS))
    scale = STEPS * accelerator.num_processes
    while True:
        generation = [window for _, window in zip(range(GENERATION_WINDOWS), windows)]
        if not generation:
            break
        generated = accelerator.gather(sum(valid_tokens(b) for window in generation for _, b in window)).sum().item()
        for window in generation:
            batches = [batch for _, batch in window]
            oracle.token_window(batch["labels"] for batch in batches)
            count = (accelerator.gather(sum(valid_tokens(b) for b in batches)).sum().item()
                     if normaliser == "window" else generated)
            for point, batch in window:
                with accelerator.accumulate(model):
                    accelerator.backward(token_loss_sum(model, batch) * scale / count)
                    oracle.check_sync_flag(point, accelerator.sync_gradients)
                    oracle.backward(lambda m: token_loss_sum(m["model"], batch), sync=point.sync)
                    oracle.check_grads(point, models)
                    optimizer.step()
                    optimizer.zero_grad()
                oracle.step(point)
                oracle.check_params(point, models, {"model": optimizer})


@case("accumulate_token_generation_batch", variants=grid(normaliser=["window", "generation_batch"],
                                                         precision=PRECISIONS),
      canary=Diagnosis("misweighted", model="model", when={"normaliser": "generation_batch"}))
def test_accumulate_token_generation_batch(ctx):
    """Canary at ``normaliser=generation_batch``: the token loss divided by the valid tokens of a
    generation batch of two windows, drawn and counted at once (TRL GRPO's dapo loss before PR #6024):
    each window weighs its tokens by about half their share, ``misweighted``. ``normaliser=window``
    (the lead variant, which every wrapper runs), the same loop dividing by each window's own count,
    passes."""
    generation_batch_train(ctx, ctx.variant["normaliser"])
