"""The wrapper ``prepare`` put around each of the user's modules, by the module, and the user's module
inside a wrapper (``unwrap``).

FSDP1 and DeepSpeed wrap the user's module (``FullyShardedDataParallel``, ``DeepSpeedEngine``) and
leave it no way back to its wrapper; the oracle, made before ``prepare``, holds the user's module, and
its bf16 reductions are laid out and configured by the wrapper (harness/wrappers/sharding.py,
harness/rank/oracle/sharded_reduce.py). The harness's wrappers of ``accelerator.prepare``
(harness/wrappers/prepare.py, harness/wrappers/deepspeed_cpu.py) record each wrapper they see here.
Weak: a cell's modules go when the cell does.
"""

from __future__ import annotations

import weakref
from typing import Any

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


_WRAPPERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside ``optimizer``: accelerate's wrapper (an Optimizer by class), ZeRO's
    (under DeepSpeed, the one that steps ZeRO's flat partitions), or ``optimizer`` itself."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def remember(wrapper: Any) -> None:
    """``wrapper`` (a module that wraps the user's), under the user's module inside it."""
    inner = unwrap(wrapper)
    if inner is not wrapper:
        _WRAPPERS[inner] = wrapper


def wrapper_of(model: Any) -> Any:
    """The wrapper ``prepare`` put around ``model`` (the user's module), or None."""
    return _WRAPPERS.get(model)
