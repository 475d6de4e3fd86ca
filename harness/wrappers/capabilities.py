"""What the installed torch can do on this device, asked of torch itself, never read from its version
number (docs/upgrade-checks.md, "Supported versions"): a wrapper cell that cannot run here is ``skip`` naming
what is missing, not a harness ``error``."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def fsdp2_missing(device_type: str) -> str | None:
    """Why FSDP2 (``fully_shard``) cannot run on ``device_type`` with this torch, or None when it can.

    - ``fully_shard`` itself: public in ``torch.distributed.fsdp`` (where accelerate imports it) from
      torch 2.6; earlier releases have at most the private ``torch.distributed._composable.fsdp``.
    - Its collectives run on streams of the device's handle and wait on the events they record
      (``all_gather_stream.record_event()``, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
      On a CPU torch 2.6 the handle's ``Stream`` has no ``record_event``: every all-gather raises
      ``AttributeError: 'Stream' object has no attribute 'record_event'``."""
    import torch

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
    try:
        from torch.distributed.device_mesh import _get_device_handle

        handle = _get_device_handle(device_type)
        stream = handle.Stream() if handle is not None else None
    except Exception as exc:  # a device whose handle makes no stream here
        return (f"torch {torch.__version__}'s FSDP2 makes its streams from the {device_type} device handle, "
                f"which fails here ({type(exc).__name__}: {exc})")
    if stream is None:
        return f"torch {torch.__version__} has no {device_type} device handle for FSDP2's streams"
    if not callable(getattr(stream, "record_event", None)):
        return (f"torch {torch.__version__}'s FSDP2 waits on events its {device_type} streams record, and "
                f"a {device_type} Stream here has no record_event")
    return None


def transformers_torch_missing() -> str | None:
    """Why the installed transformers will not use the installed torch, or None when it does (or is
    not installed: its absence is said by whoever needs it). A transformers newer than the torch
    turns its torch side off ("PyTorch was not found"): its models do not load, and its
    ``HfDeepSpeedConfig``, which accelerate's DeepSpeed path builds, is a bare ``object``."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return None
    import torch
    import transformers
    from transformers.utils import is_torch_available

    if is_torch_available():
        return None
    return (f"transformers {transformers.__version__} does not use torch {torch.__version__} "
            "(it reports PyTorch as not found: the torch is older than it supports)")
