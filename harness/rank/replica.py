"""The oracle's replicas: the user's module out of its wrapper, run as the variant's precision documents."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel (or similar) wrapper and torch.compile's.
    FSDP2 wraps nothing: the prepared module is the user's, its parameters made DTensors."""
    while True:
        compiled = vars(model).get("_modules", {}).get("_orig_mod")
        if isinstance(compiled, nn.Module):
            model = compiled
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecisionReplica(nn.Module):
    """A replica whose forward runs as ``mixed_precision="bf16"`` (or ``"fp16"``) documents: under
    autocast, with low-precision floating outputs returned as fp32."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            out = self.inner(*args, **kwargs)
        return _to_fp32(out)


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_fp32(v) for k, v in value.items()}
    return value


def forward_as(replicas: Mapping[str, nn.Module], precision: str) -> dict[str, nn.Module]:
    """The modules the oracle runs its micro-batches through: the replicas themselves in fp32, under
    autocast for ``bf16`` and ``fp16`` (the parameters, and so the gradients, stay fp32 either way)."""
    if precision not in AUTOCAST_DTYPES:
        return dict(replicas)
    device_type = next(next(iter(replicas.values())).parameters()).device.type
    return {name: MixedPrecisionReplica(r, device_type, AUTOCAST_DTYPES[precision]) for name, r in replicas.items()}
