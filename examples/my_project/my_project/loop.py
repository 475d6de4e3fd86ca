"""The project's training loops, as they are: nothing in them knows of the gradient-sync harness."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.utils.data import DataLoader, Dataset

from my_project.train import loss_fn, make_optimizers


def train(accelerator, model: nn.Module, dataset: Dataset, *, epochs: int = 2, batch_size: int = 4,
          max_norm: float = 0.5) -> nn.Module:
    """accelerate's idiom: ``accumulate`` says where gradients sync and the optimizers step."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    model.train()
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
    return model


def train_by_hand(accelerator, model: nn.Module, dataset: Dataset, *, accumulation_steps: int = 2,
                  epochs: int = 2, batch_size: int = 4, max_norm: float = 0.5) -> nn.Module:
    """Accumulation by hand: ``no_sync`` for every micro-batch of a window but its last, each loss
    divided by the window's steps; at a window's end (or the epoch's) clip, step and zero."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    optimizers = make_optimizers(model)
    model, loader, *optimizers = accelerator.prepare(model, loader, *optimizers)
    model.train()
    for _ in range(epochs):
        for step, batch in enumerate(loader):
            window_ends = (step + 1) % accumulation_steps == 0 or step + 1 == len(loader)
            with contextlib.nullcontext() if window_ends else accelerator.no_sync(model):
                loss = loss_fn(model, batch) / accumulation_steps
                accelerator.backward(loss)
            if window_ends:
                accelerator.clip_grad_norm_(model.parameters(), max_norm)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
    return model
