"""The wrapper ``prepare`` put around each of the user's modules, by the module.

FSDP1 and DeepSpeed wrap the user's module (``FullyShardedDataParallel``, ``DeepSpeedEngine``) and
leave it no way back to its wrapper; the oracle, made before ``prepare``, holds the user's module, and
its bf16 reductions are laid out and configured by the wrapper (harness/wrappers/sharding.py,
harness/rank/sharded_reduce.py). The harness's wrappers of ``accelerator.prepare``
(harness/wrappers/prepare.py, harness/wrappers/deepspeed_cpu.py) record each wrapper they see here.
Weak: a cell's modules go when the cell does.
"""

from __future__ import annotations

import weakref
from typing import Any

from harness.rank.replica import unwrap

_WRAPPERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def remember(wrapper: Any) -> None:
    """``wrapper`` (a module that wraps the user's), under the user's module inside it."""
    inner = unwrap(wrapper)
    if inner is not wrapper:
        _WRAPPERS[inner] = wrapper


def wrapper_of(model: Any) -> Any:
    """The wrapper ``prepare`` put around ``model`` (the user's module), or None."""
    return _WRAPPERS.get(model)
