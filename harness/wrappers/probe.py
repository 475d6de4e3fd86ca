"""What the installed accelerate offers: an API, or ``Unsupported`` naming the one it lacks.

Every release from 0.19 is supported by asking, never by comparing version numbers: a case that
needs an API a release lacks becomes an ``unsupported`` cell, not an error.
"""

from __future__ import annotations

import inspect
from typing import Any

from harness.decorator import Unsupported


def parameters(function: Any) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def require(owner: Any, attribute: str, api: str | None = None) -> Any:
    """``getattr(owner, attribute)``, or ``Unsupported`` naming the API when it is missing."""
    value = getattr(owner, attribute, None)
    if value is None:
        raise Unsupported(api or f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}")
    return value


def takes_parameter(function: Any, parameter: str) -> bool:
    """Whether ``function`` takes ``parameter`` by name (or any keyword, or its signature is hidden)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True
    takes_var_keyword = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    return parameter in signature.parameters or takes_var_keyword


def require_parameter(function: Any, parameter: str, api: str) -> None:
    """``Unsupported`` naming the API when ``function`` does not take ``parameter``."""
    if not takes_parameter(function, parameter):
        raise Unsupported(api)


def gradient_accumulation_kwargs(num_steps: int, **options: Any) -> dict[str, Any]:
    """``Accelerator`` keyword arguments for ``GradientAccumulationPlugin(num_steps=..., **options)``."""
    import accelerate
    import accelerate.utils

    plugin = getattr(accelerate.utils, "GradientAccumulationPlugin", None) or getattr(
        accelerate, "GradientAccumulationPlugin", None
    )
    if plugin is None:
        raise Unsupported("GradientAccumulationPlugin")
    require_parameter(accelerate.Accelerator, "gradient_accumulation_plugin",
                      "Accelerator(gradient_accumulation_plugin=...)")
    for name in options:
        require_parameter(plugin, name, f"GradientAccumulationPlugin({name}=...)")
    return {"gradient_accumulation_plugin": plugin(num_steps=num_steps, **options)}


def dataloader_kwargs(**options: Any) -> dict[str, Any]:
    """``Accelerator`` keyword arguments for dataloader options (``split_batches``,
    ``dispatch_batches``): a ``DataLoaderConfiguration`` where the installed accelerate has one,
    else the ``Accelerator`` arguments of older releases."""
    import accelerate
    import accelerate.utils

    config = getattr(accelerate.utils, "DataLoaderConfiguration", None)
    takes_config = "dataloader_config" in parameters(accelerate.Accelerator)
    if config is not None and takes_config:
        for name in options:
            require_parameter(config, name, f"DataLoaderConfiguration({name}=...)")
        return {"dataloader_config": config(**options)}
    for name in options:
        if name not in parameters(accelerate.Accelerator):
            raise Unsupported(f"DataLoaderConfiguration({name}=...) or Accelerator({name}=...)")
    return dict(options)


def ddp_kwargs(**options: Any) -> dict[str, Any]:
    """``Accelerator`` keyword arguments that hand ``options`` to DistributedDataParallel."""
    import accelerate.utils

    handler = require(accelerate.utils, "DistributedDataParallelKwargs", "DistributedDataParallelKwargs")
    for name in options:
        require_parameter(handler, name, f"DistributedDataParallelKwargs({name}=...)")
    return {"kwargs_handlers": [handler(**options)]}


def reset_accelerate() -> None:
    """Forget the last cell's Accelerator; keep the process group.

    Every release from 0.19 has a ``_reset_state`` on ``AcceleratorState``, ``PartialState`` and
    ``GradientState``; 0.19 replaces the shared dicts, later releases clear them in place, and none
    destroys the process group. ``AcceleratorState``'s takes ``reset_partial_state`` where it can
    forget ``PartialState`` too; without it, each is reset on its own."""
    from accelerate import state

    reset_accelerator_state = state.AcceleratorState._reset_state
    if "reset_partial_state" in parameters(reset_accelerator_state):
        reset_accelerator_state(reset_partial_state=True)
    else:
        reset_accelerator_state()
        partial_state = getattr(state, "PartialState", None)
        if partial_state is not None:
            partial_state._reset_state()
    state.GradientState._reset_state()
