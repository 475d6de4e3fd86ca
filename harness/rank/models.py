"""Tiny models and per-rank data, seeded so that models agree across ranks and data does not."""

from __future__ import annotations

import torch
from torch import nn

# the RNG helpers, where cases and tests have always imported them from
from harness.rank.numerics.rng import (RngState, derive_seed, forked_rng, generator, rng_state,  # noqa: F401
                                       seed_rng, seeded, under_rng_state)


def as_weights(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``x`` in ``layer``'s weight dtype, as a transformers model's embedding hands its first layer
    its own dtype: a no-op in fp32, under autocast (fp32 weights) and under FSDP's bf16 (the wrapper
    cast the inputs already); under DeepSpeed's bf16, whose module is bf16 and casts no input, what
    lets the catalogue's float inputs reach it at all."""
    return x.to(layer.weight.dtype) if x.is_floating_point() else x


class Regressor(nn.Module):
    """A two-layer MLP: big enough for distinct gradients per parameter, cheap enough for thousands of checks."""

    def __init__(self, features: int = 4, hidden: int = 8, outputs: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(as_weights(x, self.fc1))))


class Generator(nn.Module):
    """Maps noise to fake samples for the discriminator."""

    def __init__(self, noise: int = 3, features: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(noise, 6), nn.Tanh(), nn.Linear(6, features))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(as_weights(z, self.net[0]))


class Discriminator(nn.Module):
    """Scores samples."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(as_weights(x, self.net[0]))


class Encoder(nn.Module):
    """A third model in front of the generator, as a text encoder stands in front of a unet."""

    def __init__(self, inputs: int = 5, noise: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(as_weights(x, self.proj)))


class Branchy(nn.Module):
    """A model whose ``extra`` branch is used only when asked: for unused-parameter cases."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.trunk = nn.Linear(features, 6)
        self.head = nn.Linear(6, 1)
        self.extra = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(as_weights(x, self.trunk)))
        out = self.head(h)
        if use_extra:
            out = out + self.extra(h)
        return out


class TinyLM(nn.Module):
    """A language model's shape at a toy's cost: token embeddings, a tanh, a linear head over the
    vocabulary (logits per position). For the token-weighted cases (harness/rank/tokens.py)."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


class TinyMlpLM(nn.Module):
    """``TinyLM`` with a hidden MLP between the embedding and the head (up, tanh, down): a pair of
    Linear layers that tensor parallelism splits column- then row-wise (mesh=tp's token cells)."""

    def __init__(self, vocab: int = 16, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.tanh(self.up(torch.tanh(self.embed(input_ids))))))


MODEL_TYPES = {
    "regressor": Regressor,
    "generator": Generator,
    "discriminator": Discriminator,
    "encoder": Encoder,
    "branchy": Branchy,
    "tiny_lm": TinyLM,
    "tiny_mlp_lm": TinyMlpLM,
}


def make_model(kind: str, seed: int) -> nn.Module:
    """A fresh model whose weights depend only on the seed, so every rank builds the same one."""
    try:
        model_type = MODEL_TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(sorted(MODEL_TYPES))}") from None
    with seeded(seed):
        return model_type()


def rank_batch(seed: int, rank: int, *, rows: int, features: int, targets: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for one rank: each rank's distribution is shifted and scaled differently,
    so that a rank's local gradient is far from the average of all ranks' gradients."""
    gen = generator(seed)
    shift = 1.5 * rank - 1.0
    scale = 1.0 + 0.5 * rank
    x = torch.randn(rows, features, generator=gen) * scale + shift
    y = torch.randn(rows, targets, generator=gen) + 2.0 * rank - 1.0
    return x, y


def regression_dataset(seed: int, *, samples: int, features: int = 4) -> torch.utils.data.TensorDataset:
    """A dataset shared by all ranks (the prepared dataloader shards it): sample i's distribution
    drifts with i, so the shards that different ranks receive differ."""
    gen = generator(seed)
    index = torch.arange(samples, dtype=torch.float32).unsqueeze(1)
    drift = torch.sin(index * 0.7) * 2.0 + (index % 3) - 1.0
    x = torch.randn(samples, features, generator=gen) + drift
    y = torch.randn(samples, 1, generator=gen) + drift * 1.5
    return torch.utils.data.TensorDataset(x, y)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mse_loss`` with both sides in their promoted dtype first: a bf16 output (FSDP2's and
    DeepSpeed's bf16 return one) against the catalogue's fp32 targets. The forward is the same
    (``mse_loss`` promotes), and so is the backward, bit for bit (torch 2.13.0: both compute in fp32
    and cast the gradient to bf16); but the mixed-dtype ``MseLossBackward0`` raises "Found dtype
    Float but expected BFloat16" on torch 2.7.1, 2.9.1 and 2.10.0 (pytorch #36553, #94086), which
    made every such bf16 cell an ``error`` there."""
    dtype = torch.promote_types(output.dtype, target.dtype)
    return torch.nn.functional.mse_loss(output.to(dtype), target.to(dtype))


def regression_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return mse(model(x), y)


def adversarial_loss(models: dict[str, nn.Module], real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Generator and discriminator losses summed, as one backward of a GAN step.

    With an ``encoder`` model, the noise goes through it first (three models in one step)."""
    gen, disc = models["gen"], models["disc"]
    if "enc" in models:
        noise = models["enc"](noise)
    fake = gen(noise)
    fake_score = disc(fake)
    ones = torch.ones_like(fake_score)
    g_loss = torch.nn.functional.mse_loss(fake_score, ones)
    d_loss = torch.nn.functional.mse_loss(disc(real), ones) + torch.nn.functional.mse_loss(
        disc(fake.detach()), torch.zeros_like(fake_score)
    )
    return g_loss + d_loss
