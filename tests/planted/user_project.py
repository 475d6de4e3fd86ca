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


# A second project: a token tagger trained on padded sequences of several lengths, AdamW on its
# embedding and body, SGD with momentum on its head (tests/planted/diagnosis_cases.py).
VOCAB, TAGS, PAD = 13, 5, 0


class Tagger(nn.Module):
    """Tags each token of a padded sequence: embedding, dropout, a body and a head."""

    def __init__(self, dim: int = 16, hidden: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.body = nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, TAGS)
        nn.init.normal_(self.head.weight, std=0.3)  # confident from the start: gradients of norm about 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


class Sequences(torch.utils.data.Dataset):
    """Sequences of 2 to 7 tokens, each token's tag a function of it and its neighbour."""

    def __init__(self, samples: int = 23) -> None:
        generator = torch.Generator().manual_seed(11)
        lengths = torch.randint(2, 8, (samples,), generator=generator)
        self.items = []
        for n in lengths.tolist():
            tokens = torch.randint(1, VOCAB, (n,), generator=generator)
            tags = (tokens + torch.roll(tokens, 1)) % TAGS
            self.items.append((tokens, tags))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def pad(samples):
    """The collate_fn: sequences padded on the right, their padding's tags -100 (ignored by the loss)."""
    longest = max(len(tokens) for tokens, _ in samples)
    tokens = torch.full((len(samples), longest), PAD, dtype=torch.long)
    tags = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, (t, y) in enumerate(samples):
        tokens[row, :len(t)] = t
        tags[row, :len(y)] = y
    return tokens, tags


def tagging_loss(model: nn.Module, batch) -> torch.Tensor:
    """The mean cross-entropy over the batch's real tokens."""
    tokens, tags = batch
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, TAGS).float(), tags.reshape(-1), ignore_index=-100)


def tagger_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    body = list(model.embed.parameters()) + list(model.body.parameters())
    return [torch.optim.AdamW(body, lr=1e-2), torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)]
