"""The specification's loss of one micro-batch of a script (``python -m harness watch``): the model's
own ``.loss`` as the script called its model, or the function ``--loss`` names; and, under the token
contract, which of a batch's labels that loss counts."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

import torch
from torch import nn

from harness.rank.watch import LoopRefused

WHO = "watch"  # what a script's refusals say they come from


def model_loss(model: nn.Module, batch: Any, keywords: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The specification's loss of one micro-batch by default: the model's own ``.loss`` on it (a
    transformers model returns one for a batch with ``labels``), called with ``keywords`` beside the
    batch, as the script called it (harness/rank/watch/forwards.py, ``Forward.replayed``)."""
    if not isinstance(batch, Mapping):
        raise LoopRefused(f"{WHO}: the script's batches are {type(batch).__name__}, not a mapping of the model's "
                          "inputs, so the model's own .loss cannot be the specification; give --loss module:function")
    keywords = dict(keywords or {})
    try:
        outputs = model(**{**batch, **keywords})  # a keyword of the batch's the script passed otherwise wins
    except TypeError as exc:
        if not keywords:
            raise
        raise LoopRefused(f"{WHO}: the model ({type(model).__name__}) does not take {sorted(keywords)} beside the "
                          f"batch ({exc}); under the token contract give --loss module:function, the summed loss of "
                          "one micro-batch's tokens") from None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise LoopRefused(f"{WHO}: the model ({type(model).__name__}) returns no .loss for the script's batches "
                          f"(keys {sorted(batch)}; a transformers model returns one when the batch has labels); "
                          "give --loss module:function, the loss of one micro-batch")
    return loss


def named_loss(spec: str) -> Callable[[Any, Any], torch.Tensor]:
    """``module:function`` (importable from the working directory or the script's), the loss of one
    micro-batch: ``function(model, batch)``, before any division by the accumulation steps (under the
    token contract, the sum of its tokens' losses)."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise LoopRefused(f"{WHO}: --loss {spec!r}: give module:function")
    try:
        loss = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise LoopRefused(f"{WHO}: --loss {spec!r}: {type(exc).__name__}: {exc}") from None
    if not callable(loss):
        raise LoopRefused(f"{WHO}: --loss {spec!r} is not a function")
    return loss  # type: ignore[no-any-return]


def counted_labels(model: nn.Module, batch: Any) -> torch.Tensor:
    """The labels of ``batch`` whose tokens the model's loss averages over: ``shift_labels`` where the
    batch carries them; for a causal LM, whose loss shifts (position t predicts label t+1), every label
    but each row's first; else every label. The same rule as transformers' Trainer counts
    ``num_items_in_batch`` by (its ``_loss_shifts_labels``)."""
    labels = batch.get("shift_labels", batch.get("labels")) if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        raise LoopRefused(f"{WHO}: the token contract counts the valid tokens of each batch's labels; the script's "
                          "batches hold no labels tensor")
    if "shift_labels" in batch or not _loss_shifts_labels(model):
        return labels
    return labels[..., 1:]


def _loss_shifts_labels(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers decoder whose loss shifts its labels (``ForCausalLMLoss``)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
