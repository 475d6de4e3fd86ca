"""Tiny Hugging Face models built from their configs (no download) and the data the Trainer cases feed
them (cases/test_trainer.py, docs/trainer.md): a one-layer Llama as a causal LM and as a sequence
classifier, sequences of 2 to 12 tokens, and a collator that pads them."""

from __future__ import annotations

from typing import Any

import torch

from harness.rank.tokens import IGNORE_INDEX, PAD_ID

VOCAB = 16
CLASSES = 3


def transformers_or_skip(ctx: Any) -> Any:
    """The installed transformers, or the cell ``skip``: none is installed, or it cannot run with this
    torch (harness/wrappers/capabilities.py)."""
    try:
        import transformers
    except ImportError:
        ctx.skip("transformers is not installed (pip install 'gradsync-harness[transformers]')")
    from harness.wrappers.capabilities import transformers_torch_missing

    missing = transformers_torch_missing()
    if missing:
        ctx.skip(missing)
    return transformers


def tiny_llama_config(**extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                       tie_word_embeddings=False, pad_token_id=PAD_ID, attn_implementation="eager", **extra)


def causal_lm() -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config())


def moe_causal_lm() -> Any:
    """A one-layer Mixtral of four experts, two per token, its router's load-balancing loss on
    (``output_router_logits``, weighed ``router_aux_loss_coef``): the MoE loss Trainer adds to the LM's."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                           num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                           router_aux_loss_coef=0.5, tie_word_embeddings=False, pad_token_id=PAD_ID,
                           attn_implementation="eager")
    return MixtralForCausalLM(config)


def classifier() -> Any:
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(tiny_llama_config(num_labels=CLASSES))


def sequences(ctx: Any, *, labelled: str, batches: int, batch_size: int, length: int | None = None,
              prompts: bool = False) -> list[dict[str, torch.Tensor]]:
    """Sequences of 2 to 12 tokens, the same on every rank (Trainer's sampler shards them): exactly
    ``batches`` full batches of ``batch_size`` per rank, each sequence labelled by its tokens
    (``"tokens"``, the LM: every position a label, as a plain LM collator makes them) or by a class.

    ``length``: every sequence that many tokens instead (no padding, so every micro-batch holds the
    same count of targets and the mean of micro-batch means is the token mean). ``prompts``: each
    token sequence's first 0 to length - 1 labels -100, a prompt the loss leaves out, as a
    completion-only collator masks it: the ranks' counts of valid targets then differ widely."""
    gen = torch.Generator().manual_seed(ctx.seed % 2**31)
    items = []
    for _ in range(batches * batch_size * ctx.world_size):
        size = length if length is not None else int(torch.randint(2, 13, (1,), generator=gen))
        ids = torch.randint(1, VOCAB, (size,), generator=gen)
        label = ids.clone() if labelled == "tokens" else torch.randint(0, CLASSES, (), generator=gen)
        if prompts and labelled == "tokens":
            label[: int(torch.randint(0, size, (1,), generator=gen))] = IGNORE_INDEX
        items.append({"input_ids": ids, "labels": label})
    return items


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding: PAD_ID inputs, an attention mask, token labels padded with -100."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        mask[row, : len(sample["input_ids"])] = 1
    if samples[0]["labels"].dim() == 0:
        labels = torch.stack([s["labels"] for s in samples])
    else:
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        for row, sample in enumerate(samples):
            labels[row, : len(sample["labels"])] = sample["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
