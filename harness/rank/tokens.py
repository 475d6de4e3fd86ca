"""Token data of variable length, and the losses over it: what the token-weighted cases train on.

A batch is a dict of ``input_ids`` and ``labels`` padded to the batch's longest sequence; padding and
the prompt carry the label ``IGNORE_INDEX`` (-100), as Hugging Face's collators and losses do. The
sequences have different lengths and prompts, so every micro-batch on every rank holds a different
number of valid tokens: the case where a mean per micro-batch is not the mean over the window
(the Hugging Face "Fixing Gradient Accumulation" post, 2024-10-16; transformers PR #34191).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from harness.rank.models import generator

IGNORE_INDEX = -100
PAD_ID = 0
VOCAB = 16  # harness.rank.models.TinyLM's default


class TokenDataset(Dataset):
    """Sequences of 2 to ``max_len`` tokens drawn from a seeded generator, shared by all ranks (the
    prepared dataloader shards them). Each one's prompt (its first 1 to len-1 tokens) is labelled
    ``IGNORE_INDEX``; the labels of the rest are the tokens that follow, so every sequence has at
    least one valid token and none has them all. ``causal``: labelled as a Hugging Face causal LM
    takes them, the labels aligned with the inputs (the same valid tokens)."""

    def __init__(self, seed: int, *, samples: int, max_len: int = 12, vocab: int = VOCAB,
                 causal: bool = False) -> None:
        gen = generator(seed)
        self.items = []
        for _ in range(samples):
            length = int(torch.randint(2, max_len + 1, (1,), generator=gen))
            prompt = int(torch.randint(1, length, (1,), generator=gen))
            tokens = torch.randint(1, vocab, (length + 1,), generator=gen)
            if causal:
                # Hugging Face's convention: labels are the inputs, which the model shifts itself
                # (position t predicts label t+1; label 0, in the prompt, is never predicted)
                labels = tokens.clone()
                labels[: prompt + 1] = IGNORE_INDEX
                self.items.append({"input_ids": tokens, "labels": labels})
                continue
            labels = tokens[1:].clone()
            labels[:prompt] = IGNORE_INDEX
            self.items.append({"input_ids": tokens[:-1], "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


def pad_tokens(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ``collate_fn``: sequences padded on the right to the longest, with ``PAD_ID`` inputs,
    ``IGNORE_INDEX`` labels and an ``attention_mask`` of 1 on real tokens."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def valid_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """The number of labels that count (not ``IGNORE_INDEX``), as a 0-d tensor."""
    return batch["labels"].ne(IGNORE_INDEX).sum()


def _logits_and_labels(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    return logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1)


def token_loss_sum(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The cross-entropy of every valid token, summed (what a token mean divides by the count)."""
    logits, labels = _logits_and_labels(model, batch)
    return nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def token_loss_mean(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The cross-entropy averaged over this batch's valid tokens (``reduction="mean"``): the naive
    loss whose average over micro-batches and ranks is not the window's token mean."""
    logits, labels = _logits_and_labels(model, batch)
    return nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def causal_loss_sum(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """A Hugging Face causal LM's token losses summed, computed here from its logits: position t
    predicts label t+1 (``TokenDataset(causal=True)``)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                       batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
                                       reduction="sum")
