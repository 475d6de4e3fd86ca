"""The project's dataset: noisy points around one centre per class."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class NoisyBlobs(Dataset):
    def __init__(self, samples: int = 33, features: int = 8, classes: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, features, generator=generator) * 2.0
        self.labels = torch.randint(0, classes, (samples,), generator=generator)
        self.points = centres[self.labels] + torch.randn(samples, features, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index], self.labels[index]
