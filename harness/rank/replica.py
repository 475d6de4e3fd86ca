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


class ShardedMixedReplica(nn.Module):
    """A replica computing as FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16, ...)`` does:
    floating inputs cast to bf16 (``cast_forward_inputs``), the module run with its fp32 parameters
    cast to bf16 (FSDP2's all-gather in the param dtype), its outputs cast to the policy's
    ``output_dtype`` (FSDP2's post-forward; None leaves them as computed). accelerate 1.15 prepares
    an FSDP2 model without its autocast and fp32-outputs wrapper (``Accelerator._prepare_fsdp2``
    never calls ``prepare_model``); where a release wraps it (``_original_forward`` on the prepared
    model, ``autocast_of``), ``autocast`` is set and the module runs under autocast with outputs made
    fp32 first. The parameters stay the fp32 masters; the oracle takes the gradients of the bf16
    ones (``unshard``)."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype, output_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype
        self.output_dtype = output_dtype
        self.autocast = False
        self.unsharded: dict[str, torch.Tensor] = {}
        self.unshard()

    def unshard(self) -> dict[str, torch.Tensor]:
        """The bf16 parameters one backward differentiates: each a leaf, as FSDP2's unsharded
        parameter is, so that a parameter used twice before a backward (two forwards, one loss)
        sums its two contributions in bf16 there, as FSDP2's does."""
        self.unsharded = {n: p.detach().to(self.dtype).requires_grad_(p.requires_grad)
                          for n, p in self.inner.named_parameters()}
        return self.unsharded

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.func import functional_call

        args, kwargs = _cast_floating((args, kwargs), self.dtype)
        if self.autocast:
            with torch.autocast(device_type=self.device_type, dtype=self.dtype):
                out = _to_fp32(functional_call(self.inner, self.unsharded, args, kwargs))
        else:
            out = functional_call(self.inner, self.unsharded, args, kwargs)
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)


def autocast_of(prepared: nn.Module) -> bool:
    """Whether accelerate wrapped ``prepared``'s forward in its autocast and fp32-outputs wrapper
    (``Accelerator.prepare_model`` keeps the unwrapped one as ``_original_forward``)."""
    return "_original_forward" in vars(prepared)


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


# The wrappers whose bf16 is not autocast over fp32 parameters, and the output dtype of each
# reduce dtype's policy: accelerate's own (no ``reduce`` in the variant) casts outputs to bf16, an
# explicit MixedPrecisionPolicy leaves them as computed.
SHARDED_MIXED = {"fsdp2"}


def forward_as(replicas: Mapping[str, nn.Module], precision: str, *, wrapper: str = "ddp",
               reduce: str | None = None) -> dict[str, nn.Module]:
    """The modules the oracle runs its micro-batches through: the replicas themselves in fp32, under
    autocast for ``bf16`` and ``fp16`` (the parameters, and so the gradients, stay fp32 either way);
    under FSDP2 in bf16, as the sharded replica above."""
    if precision not in AUTOCAST_DTYPES:
        return dict(replicas)
    device_type = next(next(iter(replicas.values())).parameters()).device.type
    dtype = AUTOCAST_DTYPES[precision]
    if wrapper in SHARDED_MIXED:
        output = dtype if reduce is None else None
        return {name: ShardedMixedReplica(r, device_type, dtype, output) for name, r in replicas.items()}
    return {name: MixedPrecisionReplica(r, device_type, dtype) for name, r in replicas.items()}
