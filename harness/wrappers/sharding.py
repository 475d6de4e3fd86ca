"""A prepared model's parameters and gradients on this rank, read the way its wrapper keeps them.

DDP (or no wrapper) keeps the whole of every tensor on every rank. FSDP2 keeps DTensors: each rank
holds its shard of every parameter and, after a sync, of every gradient; between sync points its
``p.grad`` stays None while the unsharded gradients accumulate inside FSDP. The checks then compare
this rank's shard with the same shard of the oracle's full expectation (docs/wrappers.md,
"The sharded oracle"). FSDP1 (``use_orig_params=True``) keeps flat shards; ``summon_full_params(with_grads=True)``
shows the full tensors, which are compared whole.

Reading full tensors of a sharded model is a collective: every rank reads every model at every
check, in the same order, as the checks already do.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from harness.wrappers.observed import Observed, Piece, _identity
from harness.wrappers.prepared import unwrap


def dtensor_class() -> Any:
    """torch's DTensor class, or None where this torch has none public."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def observe(model: nn.Module, names: list[str], *, sync: bool) -> Observed:
    """Read ``model`` (prepared) as its wrapper keeps it. ``sync``: whether the last backward was due
    to sync (FSDP1 shows full gradients only after one)."""
    from harness.wrappers.prepare import identify, peel_compiled, spec_of_found

    found = identify(model)  # every gradient check reads each model here: its type is looked at once
    its = spec_of_found(found)
    if its is not None and its.flat_parameters:
        return _fsdp1(model, with_grads=sync)
    if found is not None and found[0] == "deepspeed":  # every ZeRO stage, one without a spec too
        from harness.wrappers import deepspeed_cpu

        return deepspeed_cpu.observe(peel_compiled(model), names, sync=sync)
    params = dict(unwrap(model).named_parameters())
    DTensor = dtensor_class()
    if DTensor is None or not any(isinstance(p, DTensor) for p in params.values()):
        return Observed(params={n: p.detach() for n, p in params.items()},
                        grads={n: None if p.grad is None else p.grad.detach() for n, p in params.items()})
    pieces = {n: _piece_fn(p) if isinstance(p, DTensor) else _identity for n, p in params.items()}

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    def full(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    observed = Observed(
        params={n: local(p.detach()) for n, p in params.items()},
        grads={n: None if p.grad is None else local(p.grad.detach()) for n, p in params.items()},
        sharded=True,
        pieces=pieces,
        _full_params=lambda: {n: full(p.detach()) for n in names for p in [params[n]]},
        _full_grads=lambda: {n: None if params[n].grad is None else full(params[n].grad.detach()) for n in names},
    )
    return observed


def _piece_fn(dtensor: Any) -> Piece:
    """This rank's part of a full tensor laid out as ``dtensor`` (Shard and Replicate placements, as
    DTensor itself splits: ``torch.chunk`` along the sharded dimension, empty past the last chunk).
    Other placements (FSDP2's ``_StridedShard`` over a tensor-parallel mesh) are split by DTensor
    itself, each rank from its own copy of the full tensor (``distribute_tensor(src_data_rank=None)``,
    no communication)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = dtensor.device_mesh, dtensor.placements
    coordinate = mesh.get_coordinate()
    local_shape = tuple(dtensor.to_local().shape)
    plain = all(type(p) in (Shard, Replicate) for p in placements)

    def piece(full: torch.Tensor) -> torch.Tensor:
        out = full
        if not plain:
            return _split_by_dtensor(full, mesh, placements, local_shape)
        for mesh_dim, placement in enumerate(placements):
            if placement.is_shard():
                chunks = torch.chunk(out, mesh.size(mesh_dim), dim=placement.dim)
                index = coordinate[mesh_dim]
                out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
            elif not placement.is_replicate():
                raise ValueError(f"the harness cannot compare a tensor placed as {placement}")
        if tuple(out.shape) != local_shape:
            raise ValueError(f"this rank's shard has shape {local_shape}, but its part of the full tensor "
                             f"({tuple(full.shape)}, placed {placements}) has {tuple(out.shape)}")
        return out

    return piece


def _split_by_dtensor(full: torch.Tensor, mesh: Any, placements: Any, local_shape: tuple[int, ...]) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    from harness.wrappers.probe import parameters

    if "src_data_rank" not in parameters(distribute_tensor):
        raise ValueError(f"the harness cannot compare a tensor placed as {placements} on this torch "
                         "(its distribute_tensor has no src_data_rank)")
    out = distribute_tensor(full.detach(), mesh, placements, src_data_rank=None).to_local()
    if tuple(out.shape) != local_shape:
        raise ValueError(f"this rank's shard has shape {local_shape}, but its part of the full tensor "
                         f"({tuple(full.shape)}, placed {placements}) has {tuple(out.shape)}")
    return out


def _fsdp1(model: nn.Module, *, with_grads: bool) -> Observed:
    """Full tensors: after a sync through ``summon_full_params(with_grads=True)``; between sync
    points FSDP1's ``no_sync`` leaves each parameter's full, unsharded local gradient on it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from harness.wrappers.prepare import peel_compiled

    fsdp = peel_compiled(model)
    inner = unwrap(model)
    grads: dict[str, torch.Tensor | None] = {}
    if not with_grads:
        grads = {_clean(n): None if p.grad is None else p.grad.detach().clone() for n, p in inner.named_parameters()}
    with FullyShardedDataParallel.summon_full_params(fsdp, writeback=False, with_grads=with_grads):
        params = {_clean(n): p.detach().clone() for n, p in inner.named_parameters()}
        if with_grads:
            grads = {_clean(n): None if p.grad is None else p.grad.detach().clone() for n, p in inner.named_parameters()}
    shown = [n for n, g in grads.items() if g is not None and n in params and g.shape != params[n].shape]
    return Observed(params=params, grads=grads, shards_shown=shown)


def fsdp2_reduce_groups(model: nn.Module) -> list[list[str]]:
    """The parameters of ``model`` (prepared under FSDP2) by reduce-scatter: one list per FSDP2
    parameter group (each ``fully_shard``ed module), in the group's order, by name in the
    user's module. Read from FSDP2's own state (private: ``_get_fsdp_state``, ``fsdp_params``);
    empty when that cannot be read. A compiled model's root group is on the compiled module, which
    FSDP2 was given (recorded at prepare: harness/wrappers/prepared.py)."""
    from harness.wrappers.prepared import wrapper_of

    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    groups = []
    compiled = wrapper_of(unwrap(model))
    for module in ([compiled] if compiled is not None else []) + list(unwrap(model).modules()):
        try:
            group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator,union-attr]
        except AttributeError:
            continue
        if group is None:
            continue
        try:
            groups.append([names[id(fp.sharded_param)] for fp in group.fsdp_params])
        except (AttributeError, KeyError):
            return []
    return groups


def fsdp2_reduce_op(dtype: Any) -> str:
    """Why FSDP2 on this torch does not reduce-scatter gradients in ``dtype`` with ReduceOp.AVG and
    nothing divided before or after on the default group, or "" where it does (asked of FSDP2's own
    ``_get_gradient_divide_factors``: from torch 2.8 its divide factors and ops, before that its divide
    factors alone, both None where it reduces with AVG; a torch that has another one is said not to)."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

        factors = _get_gradient_divide_factors(dist.group.WORLD, None, dtype, "cpu")
        if len(factors) == 2:  # torch 2.7: (pre, post), and foreach_reduce's AVG where both are None
            pre, post = factors
            op = dist.ReduceOp.AVG if pre is None else dist.ReduceOp.SUM
        else:
            pre, post, op, _ = factors
    except Exception as exc:  # noqa: BLE001 - another torch's private function: its word is unknown
        return f"FSDP2's divide factors could not be read on this torch ({type(exc).__name__})"
    if (pre, post) != (None, None) or op != dist.ReduceOp.AVG:
        name = str(op).rsplit(".", 1)[-1]
        divides = "".join(f", dividing by {f:g} {when}"
                          for f, when in ((pre, "before"), (post, "after")) if f not in (None, 1))
        return f"FSDP2 reduce-scatters with {name}{divides} here, not AVG"
    return ""


def fsdp1_reduce_layout(model: nn.Module) -> tuple[list[tuple[int, dict[str, tuple[int, int]]]], float, float] | str:
    """How FSDP1 reduce-scatters the gradients of ``model`` (the user's module, as prepare wrapped it):
    one entry per flat parameter (each FSDP1 unit), its padded unsharded size and each parameter's
    ``(offset, numel)`` in it by name in the user's module (alignment padding between them, as
    ``_numels_with_padding`` lays it out); and the divide factors before and after the SUM. Read from
    FSDP1's own state (private: ``_handle``, ``flat_param``); a string saying why where it cannot be."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from harness.wrappers.prepared import wrapper_of

    root = wrapper_of(model)
    if not isinstance(root, FullyShardedDataParallel):
        return "FSDP1's wrapper of the model was not seen at prepare"
    try:
        if root._comm_hook is not None:
            return "a communication hook reduces FSDP1's gradients"
        import torch.distributed as dist

        strategy, group = root.sharding_strategy, root.process_group.size()
        if strategy.name == "NO_SHARD" or group != dist.get_world_size():
            # HYBRID_SHARD over nodes of one device becomes NO_SHARD over a group of one (pytorch #154888)
            return f"FSDP1 runs {strategy.name} over a process group of {group} of the {dist.get_world_size()} ranks"
        pre, post = float(root._gradient_predivide_factor), float(root._gradient_postdivide_factor)
        names = {id(p): _clean(n) for n, p in model.named_parameters()}
        handles = []
        for unit in FullyShardedDataParallel.fsdp_modules(root):
            if unit._handle is None:
                continue
            flat_param = unit._handle.flat_param
            params, spans, offset = iter(flat_param._params), {}, 0
            for numel, padding in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
                if not padding:
                    spans[names[id(next(params))]] = (offset, numel)
                offset += numel
            handles.append((flat_param._padded_unsharded_size.numel(), spans))
    except (AttributeError, KeyError, StopIteration, TypeError) as exc:
        return f"FSDP1's flat parameters could not be read on this torch ({type(exc).__name__})"
    return handles, pre, post


def ddp_reduce_layout(model: nn.Module, world_size: int) -> tuple[dict[str, tuple[int, int, int]], bool] | str:
    """How DDP all-reduced the gradients of ``model`` (the user's module, as prepare wrapped it) in the
    backward just run: each parameter's ``(offset, numel, buffer elements)`` in the flat buffer one
    all-reduce summed it in, by name in the user's module, and whether every rank multiplied its
    gradient by ``1/world size`` into it (True) or divided it by the world size (False). The C++
    reducer multiplies into its buckets (``Reducer::mark_variable_ready_dense`` without a communication
    hook), read from the reducer (private: ``_get_zeros_like_grad_buckets``; DDP rebuilds them in the
    forward after its first backward, so read after a backward they are the ones it used); the Python
    reducer of compiled autograd divides each gradient and all-reduces it alone (``_setup_in_backward``'s
    ``compiled_accum_grad_hook``). At two ranks no layout is needed (empty): either reducer halves each
    gradient exactly and sums two terms, one rounding in either order. A string says why where the
    layout or that arithmetic does not hold."""
    from harness.wrappers.prepared import wrapper_of

    ddp = wrapper_of(model)
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return "DDP's wrapper of the model was not seen at prepare"
    try:
        if ddp._comm_hooks:
            return "a communication hook reduces DDP's gradients"
        if ddp.mixed_precision is not None or ddp._delay_all_reduce_params:
            return "DDP reduces some gradients outside its buckets (mixed precision or a delayed all-reduce)"
        if ddp.process_group.size() != world_size:
            return "DDP reduces over a group that is not the whole world"
        if world_size <= 2:
            return {}, True
        names = {id(p): n for n, p in model.named_parameters()}
        if ddp._use_python_reducer:
            return {names[id(p)]: (0, p.numel(), p.numel()) for p in ddp._module_parameters if p.requires_grad}, False
        layout: dict[str, tuple[int, int, int]] = {}
        for bucket in ddp.reducer._get_zeros_like_grad_buckets():
            params = bucket.parameters()
            total, offset = sum(p.numel() for p in params), 0
            for p in params:
                layout[names[id(p)]] = (offset, p.numel(), total)
                offset += p.numel()
    except (AttributeError, KeyError, RuntimeError, TypeError) as exc:
        return f"DDP's buckets could not be read on this torch ({type(exc).__name__})"
    return layout, True


def tensor_parallel_share(models: Mapping[str, nn.Module], needed: int) -> int:
    """Of ``needed`` gradient elements (counted on the whole parameters), those of this rank's
    tensor-parallel slices: under a mesh with a ``tp`` dimension a rank reduces only its slice of a
    parameter sharded over ``tp`` (read from each parameter's DTensor placements); elsewhere ``needed``."""
    DTensor = dtensor_class()
    whole = local = 0
    for model in models.values():
        for p in unwrap(model).parameters():
            whole += p.numel()
            share = p.numel()
            if DTensor is not None and isinstance(p, DTensor):
                names = p.device_mesh.mesh_dim_names or ()
                for dim, placement in enumerate(p.placements):
                    if dim < len(names) and names[dim] == "tp" and placement.is_shard():
                        share //= p.device_mesh.size(dim)
            local += share
    return needed if whole == 0 or local == whole else -(-needed * local // whole)
