"""The project's model: an MLP with LayerNorm and dropout."""

from __future__ import annotations

import torch
from torch import nn


class TinyClassifier(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Dropout(dropout),
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))
