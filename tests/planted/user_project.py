"""A user's own model, loss, optimizers and data, as the planted cases written as a user writes them
share them (tests/planted/api_cases.py, tests/planted/watch_cases.py); not a test module."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Noisy(nn.Module):
    """A user's model: LayerNorm and dropout, built from keyword arguments."""

    def __init__(self, features: int = 4, hidden: int = 8, dropout: float = 0.2) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.Tanh(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.body.parameters(), lr=1e-2), torch.optim.SGD(model.head.parameters(), lr=0.05)]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def dataset(samples: int = 23) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 4, generator=generator) + torch.linspace(-2, 2, samples).unsqueeze(1)
    return TensorDataset(x, torch.randn(samples, 1, generator=generator) + x[:, :1])
