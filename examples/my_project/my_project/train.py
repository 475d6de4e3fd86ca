"""The project's training step: what the gradient-sync harness checks."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    points, labels = batch
    return nn.functional.cross_entropy(model(points), labels)


def make_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW with weight decay for the body, SGD with momentum for the head."""
    body = torch.optim.AdamW(model.body.parameters(), lr=1e-2, weight_decay=0.01)
    head = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
    return [body, head]


def train_step(accelerator, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch,
               *, after_backward: Callable[[], None] = lambda: None) -> float:
    """One micro-batch under gradient accumulation; ``after_backward`` is a hook (the harness
    checks the gradients there)."""
    with accelerator.accumulate(model):
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        after_backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return float(loss.detach())
