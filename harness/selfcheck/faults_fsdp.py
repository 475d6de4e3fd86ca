"""Sync faults of the sharded paths (FSDP2, FSDP1), planted as harness/selfcheck/faults.py plants the others.

Each is a plausible regression of accelerate or torch, and one of them is history: before accelerate
PR #3762 (released in 1.11.0) ``Accelerator.no_sync`` did nothing under FSDP2, so every micro-batch
was reduce-scattered. The final gradients were right; only the collectives (and the shards FSDP2
then shows between sync points) give it away.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

from harness.selfcheck.planted import Fault, _patched, register


@contextlib.contextmanager
def _fsdp2_no_sync_noop(rank: int) -> Iterator[None]:
    # FSDP2's set_requires_gradient_sync(False) does nothing: accelerate's no_sync (and accumulate
    # between sync points) leaves gradient sync on, as every release before 1.11.0 did.
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_requires_gradient_sync

    def set_requires_gradient_sync(self: Any, requires_gradient_sync: bool, *args: Any, **kwargs: Any) -> None:
        if requires_gradient_sync:
            original(self, requires_gradient_sync, *args, **kwargs)

    with _patched(FSDPModule, "set_requires_gradient_sync", set_requires_gradient_sync):
        yield


@contextlib.contextmanager
def _fsdp2_reduce_sums(rank: int) -> Iterator[None]:
    # FSDP2 reduce-scatters the gradients with SUM and divides by nothing: the reduction torch picks
    # for one rank (_get_gradient_divide_factors' world-size-1 answer), taken at every world size.
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    def _get_gradient_divide_factors(*args: Any, **kwargs: Any) -> Any:
        return None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM

    with _patched(_fsdp_collectives, "_get_gradient_divide_factors", _get_gradient_divide_factors):
        yield


@contextlib.contextmanager
def _fsdp2_reduce_in_param_dtype(rank: int) -> Iterator[None]:
    # FSDP2 reduce-scatters in the parameter dtype (bf16) although MixedPrecisionPolicy asked for
    # reduce_dtype=fp32, the shape of pytorch #190626 (fix PR #190627): foreach_reduce is given bf16.
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original = _fsdp_param_group.foreach_reduce

    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        if len(args) > 6 and args[6] == torch.float32:  # (fsdp_params, grads, group, stream, comm, orig, reduce, ...)
            args[6] = torch.bfloat16
        elif kwargs.get("reduce_dtype") == torch.float32:
            kwargs["reduce_dtype"] = torch.bfloat16
        return original(*args, **kwargs)

    with _patched(_fsdp_param_group, "foreach_reduce", foreach_reduce):
        yield


@contextlib.contextmanager
def _fsdp1_no_sync_noop(rank: int) -> Iterator[None]:
    # FullyShardedDataParallel.no_sync does nothing: FSDP1 reduce-scatters every micro-batch and
    # shows each rank its shard where the full local gradient was due.
    from torch.distributed.fsdp import FullyShardedDataParallel

    @contextlib.contextmanager
    def no_sync(self: Any) -> Iterator[None]:
        yield

    with _patched(FullyShardedDataParallel, "no_sync", no_sync):
        yield


def _is_hsdp(module: Any) -> bool:
    """Whether an FSDP2 module reduces over a replicate dimension too (HSDP): its parameter group
    all-reduces the reduce-scattered shard over a second process group."""
    try:
        group = module._get_fsdp_state()._fsdp_param_group
        return group is not None and group._all_reduce_process_group is not None
    except (AttributeError, AssertionError):
        return False


@contextlib.contextmanager
def _hsdp_replicate_last_only(rank: int) -> Iterator[None]:
    # Under HSDP, no_sync defers only the replicate all-reduce (FSDPModule.set_requires_all_reduce,
    # the optimisation torchtitan PR #4505 and VeOmni PR #781 make): every micro-batch is
    # reduce-scattered and kept as a partial shard; at the sync the all-reduce is given the last
    # micro-batch's shard alone, the earlier ones dropped: the bug class of pytorch PR #125484's
    # warning and Megatron-LM PR #7186 ("only the last microbatch's gradient reaches the optimizer").
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original_sync, original_reduce = FSDPModule.set_requires_gradient_sync, _fsdp_param_group.foreach_reduce

    def set_requires_gradient_sync(self: Any, requires_gradient_sync: bool, *args: Any, **kwargs: Any) -> None:
        if not _is_hsdp(self):
            return original_sync(self, requires_gradient_sync, *args, **kwargs)
        original_sync(self, True, *args, **kwargs)
        self.set_requires_all_reduce(requires_gradient_sync, *args, **kwargs)

    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original_reduce).bind(*args, **kwargs)
        if bound.arguments.get("all_reduce_grads"):
            bound.arguments["partial_reduce_output"] = None
        return original_reduce(*bound.args, **bound.kwargs)

    with _patched(FSDPModule, "set_requires_gradient_sync", set_requires_gradient_sync), \
            _patched(_fsdp_param_group, "foreach_reduce", foreach_reduce):
        yield


@contextlib.contextmanager
def _hsdp_replicate_never(rank: int) -> Iterator[None]:
    # Under HSDP the replicate all-reduce never runs (FSDP2 reduces as if its mesh had no replicate
    # dimension): every rank's shard is the average over its dp_shard group only.
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original = _fsdp_param_group.foreach_reduce

    def foreach_reduce(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.arguments["all_reduce_group"] = None
        return original(*bound.args, **bound.kwargs)

    with _patched(_fsdp_param_group, "foreach_reduce", foreach_reduce):
        yield


register(Fault("fsdp2_no_sync_noop", "FSDP2's set_requires_gradient_sync(False) does nothing (accelerate before "
               "1.11.0: no_sync a no-op under FSDP2)", _fsdp2_no_sync_noop, wrappers=("fsdp2",),
               diagnoses=("synced_early", "comm_unexpected")))
register(Fault("fsdp2_reduce_sums", "FSDP2 reduce-scatters the gradients without dividing by the world size",
               _fsdp2_reduce_sums, wrappers=("fsdp2",),
               diagnoses=("wrong_scale", "misweighted")))
register(Fault("fsdp2_reduce_in_param_dtype", "FSDP2 reduce-scatters in bf16 although reduce_dtype=fp32 was asked "
               "(pytorch #190626)", _fsdp2_reduce_in_param_dtype, wrappers=("fsdp2",), needs="reduce=fp32",
               diagnoses=("mismatch",)))
register(Fault("fsdp1_no_sync_noop", "FullyShardedDataParallel.no_sync does nothing (FSDP1 syncs every micro-batch)",
               _fsdp1_no_sync_noop, wrappers=("fsdp1",),
               diagnoses=("synced_early", "comm_unexpected")))
register(Fault("hsdp_replicate_last_only", "under HSDP no_sync defers only the replicate all-reduce, which at the sync "
               "gets the last micro-batch's shard alone (Megatron-LM PR #7186's shape)", _hsdp_replicate_last_only,
               wrappers=("fsdp2",), needs="mesh=hsdp",
               diagnoses=("comm_unexpected", "misweighted")))
register(Fault("hsdp_replicate_never", "under HSDP the replicate all-reduce never runs: each shard is averaged over "
               "its dp_shard group only", _hsdp_replicate_never, wrappers=("fsdp2",), needs="mesh=hsdp",
               diagnoses=("comm_missing", "misweighted")))
