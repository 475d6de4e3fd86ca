"""The oracle's replicas, run as the variant's precision documents."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from harness.wrappers.registry import ShardedForward

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def as_optimizers(value: Any) -> tuple[Any, ...]:
    """One optimizer, or a list or tuple of them, as a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


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
        return _cast_floating(out, torch.float32, low_only=True)


class ShardedMixedReplica(nn.Module):
    """A replica computing as FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16, ...)``, or FSDP1
    under ``MixedPrecision(param_dtype=bf16, ...)``, does: floating inputs cast to bf16
    (``cast_forward_inputs``; FSDP1's root), the module run with its fp32 parameters cast to bf16
    (the all-gather in the param dtype; FSDP1 casts the floating buffers too, ``buffer_dtype``), its
    outputs cast to the policy's ``output_dtype`` (FSDP2's post-forward; None leaves them as
    computed). accelerate 1.15 prepares an FSDP2 model without its autocast and fp32-outputs wrapper
    (``Accelerator._prepare_fsdp2`` never calls ``prepare_model``), an FSDP1 model with it, inside
    FSDP1; where the prepared model has it (``_original_forward``, ``autocast_of``), ``autocast`` is
    set and the module runs under autocast with outputs made fp32 first. DeepSpeed's bf16 casts the
    parameters alone (no input or output cast, no autocast; buffers as the prepared module keeps
    them, ``buffer_dtypes``). The parameters stay the fp32 masters; the oracle takes the gradients
    of the bf16 ones (``unshard``). In fp32 (``dtype`` fp32, nothing cast) the leaves are the fp32
    parameters themselves, taken as the wrapper takes its unsharded ones."""

    def __init__(self, inner: nn.Module, device_type: str, dtype: torch.dtype, output_dtype: torch.dtype | None,
                 *, cast_buffers: bool = False, cast_inputs: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype
        self.output_dtype = output_dtype
        self.cast_buffers = cast_buffers
        self.cast_inputs = cast_inputs
        # each floating buffer's dtype in the prepared module, where the wrapper decides it per buffer
        # (DeepSpeed 0.19 keeps fp32 buffers, rotary ``inv_freq`` say; earlier releases cast them all):
        # set by the oracle before each backward, it overrides ``cast_buffers``
        self.buffer_dtypes: dict[str, torch.dtype] | None = None
        # the order this backward's leaves received their gradients (their post-accumulate-grad
        # hooks, which DeepSpeed's ZeRO-2 buckets by), by parameter name
        self.order: list[str] = []
        self.autocast = False
        # ZeRO-3's module boundaries (``module_boundaries``), set by the oracle before each backward
        self.boundaries = False
        self.unsharded: dict[str, torch.Tensor] = {}
        self.flats: list[tuple[list[str], torch.Tensor]] = []
        self.calls: list[list[torch.Tensor]] = []
        # each parameter's shape, which a flat leaf is viewed back into (read once: the module's
        # parameters do not change shape)
        self.shapes = {n: p.shape for n, p in inner.named_parameters()}
        self.unshard()

    def unshard(self, groups: Sequence[Sequence[str]] | None = None) -> None:
        """The bf16 parameters of the next backward, cast anew from the fp32 masters. FSDP2: one
        leaf per parameter, as its unsharded parameter is: a parameter used in several forwards
        before a backward (two forwards, one loss) sums its contributions there, in bf16, before
        FSDP2 takes the sum. FSDP1 (``groups``: each flat parameter's parameters, in its order): the
        flat parameter, which every forward views anew (``_use_unsharded_views``), and whose
        gradient takes each forward's contribution apart, last forward first, each added into
        the gradient it already holds in bf16 (measured on torch 2.13: a discriminator called
        three times in one loss, after a ``no_sync`` backward); so here each forward has a leaf of
        its own (``contributions``)."""
        masters = dict(self.inner.named_parameters())
        self.calls = []
        self.order = []
        if groups is None:
            self.unsharded = {n: p.detach().to(self.dtype).requires_grad_(p.requires_grad) for n, p in masters.items()}
            for n, leaf in self.unsharded.items():
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(lambda _, n=n: self.order.append(n))
            self.flats = []
            return
        self.unsharded = {}
        self.flats = [(list(names), torch.cat([masters[n].detach().reshape(-1) for n in names]).to(self.dtype))
                      for names in groups]

    def leaves(self) -> list[torch.Tensor]:
        """The leaves of this backward: FSDP2's unsharded parameters, or one flat leaf per FSDP1
        flat parameter and forward since ``unshard``."""
        if not self.flats:
            return list(self.unsharded.values())
        return [leaf for call in self.calls for leaf in call]

    def contributions(self, grads: Sequence[torch.Tensor | None]) -> dict[str, list[torch.Tensor]]:
        """The gradients of ``leaves()`` (in its order) by parameter name, as the wrapper adds them
        into the parameter's gradient, in that order (one under FSDP2, one per forward under FSDP1)."""
        if not self.flats:
            return {n: [g] for n, g in zip(self.unsharded, grads) if g is not None}
        out: dict[str, list[torch.Tensor]] = {}
        per_call = [grads[i:i + len(self.flats)] for i in range(0, len(grads), len(self.flats))]
        for call in reversed(per_call):
            for (names, _), grad in zip(self.flats, call):
                if grad is not None:
                    for n, piece in zip(names, self._views(names, grad)):
                        out.setdefault(n, []).append(piece.detach())
        return out

    def _views(self, names: Sequence[str], flat: torch.Tensor) -> list[torch.Tensor]:
        pieces = flat.split([self.shapes[n].numel() for n in names])
        return [piece.view(self.shapes[n]) for n, piece in zip(names, pieces)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.func import functional_call

        if self.cast_inputs:
            args, kwargs = _cast_floating((args, kwargs), self.dtype)
        tensors = dict(self.unsharded)
        if self.flats:
            call = [values.detach().requires_grad_() for _, values in self.flats]
            self.calls.append(call)
            for (names, _), leaf in zip(self.flats, call):
                tensors.update(zip(names, self._views(names, leaf)))
        if self.buffer_dtypes is not None:
            tensors.update((n, _cast_floating(b, self.buffer_dtypes.get(n, b.dtype)))
                           for n, b in self.inner.named_buffers())
        elif self.cast_buffers:
            tensors.update((n, _cast_floating(b, self.dtype)) for n, b in self.inner.named_buffers())
        with module_boundaries(self.inner) if self.boundaries else contextlib.nullcontext():
            if self.autocast:
                with torch.autocast(device_type=self.device_type, dtype=self.dtype):
                    out = _cast_floating(functional_call(self.inner, tensors, args, kwargs), torch.float32,
                                         low_only=True)
            else:
                out = functional_call(self.inner, tensors, args, kwargs)
        return out if self.output_dtype is None else _cast_floating(out, self.output_dtype)


class _Boundary(torch.autograd.Function):
    """The identity, as a node of its own in the graph: the gradients that reach its output are summed
    there before they go on."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _bounded(value: Any) -> Any:
    """Every tensor in ``value`` (tuples, lists and dicts, a dict in place) through a ``_Boundary``, as
    DeepSpeed's ``apply_to_tensors_only`` walks a module's inputs and outputs (any dict subclass, a
    model output say, in place; where a pytree ``tree_map`` would pass over an unregistered one)."""
    if isinstance(value, torch.Tensor):
        return _Boundary.apply(value)
    if isinstance(value, (tuple, list)):
        items = [_bounded(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _bounded(value[key])
    return value


@contextlib.contextmanager
def module_boundaries(root: nn.Module) -> Iterator[None]:
    """``root``'s forward with ZeRO-3's module boundaries: DeepSpeed's stage 3 hooks every module
    (not inside one marked ``_z3_leaf``) to pass its positional tensor inputs and its tensor outputs
    through an identity autograd function (``PostBackwardFunctionModule`` and
    ``PreBackwardFunctionForModule``, deepspeed/runtime/zero/parameter_offload.py). The values are the
    same, but a tensor used both inside a module and outside it has the gradients from inside summed
    first, then added to the rest: in another order than autograd sums them without the functions
    (measured: a tiny Llama's residual stream, used by the RMSNorm twice and by the residual add, takes
    one fp32 ulp apart in about half the elements upstream of it)."""
    handles = []

    def hook(module: nn.Module) -> None:
        handles.append(module.register_forward_pre_hook(lambda _, args: _bounded(args)))
        handles.append(module.register_forward_hook(lambda _, __, out: _bounded(out)))
        if not getattr(module, "_z3_leaf", False):
            for child in module.children():
                hook(child)

    hook(root)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def unsharded_grads(outputs: torch.Tensor, models: Mapping[str, ShardedMixedReplica], keys: Sequence[tuple[str, str]],
                    *, retain_graph: bool = False) -> list[list[torch.Tensor]]:
    """The gradients of ``outputs`` (a loss) with respect to the sharded replicas' bf16 leaves of this
    backward, for ``keys`` (model, parameter), in order: each as the contributions the wrapper adds
    into the parameter's gradient one after the other (none: the parameter took no part). Through
    ``backward`` into the leaves (each model's ``order`` records which received one when)."""
    leaves = {name: m.leaves() for name, m in models.items()}
    every = [leaf for ls in leaves.values() for leaf in ls]
    for leaf in every:
        leaf.grad = None
    for m in models.values():
        m.order = []
    torch.autograd.backward(outputs, inputs=every, retain_graph=retain_graph)
    by_name = {name: models[name].contributions([leaf.grad for leaf in ls]) for name, ls in leaves.items()}
    for leaf in every:
        leaf.grad = None
    return [by_name[name].get(pname, []) for name, pname in keys]


def autocast_of(prepared: nn.Module) -> bool:
    """Whether accelerate wrapped ``prepared``'s forward in its autocast and fp32-outputs wrapper
    (``Accelerator.prepare_model`` keeps the unwrapped one as ``_original_forward``)."""
    return "_original_forward" in vars(prepared)


def _cast_floating(value: Any, dtype: torch.dtype, *, low_only: bool = False) -> Any:
    """``value``'s floating tensors (in lists, tuples and dicts) cast to ``dtype``; ``low_only``: only
    the fp16 and bf16 ones (accelerate's ``convert_outputs_to_fp32``)."""
    if isinstance(value, torch.Tensor):
        cast = value.dtype in (torch.float16, torch.bfloat16) if low_only else value.is_floating_point()
        return value.to(dtype) if cast else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, dtype, low_only=low_only) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype, low_only=low_only) for k, v in value.items()}
    return value


def forward_as(replicas: Mapping[str, nn.Module], precision: str, *, sharded: ShardedForward | None = None,
               reduce: str | None = None) -> dict[str, nn.Module]:
    """The modules the oracle runs its micro-batches through: the replicas themselves in fp32, under
    autocast for ``bf16`` and ``fp16`` (the parameters, and so the gradients, stay fp32 either way);
    under a sharded wrapper (FSDP2, FSDP1 or DeepSpeed, whose bf16 is not autocast over fp32
    parameters: ``sharded``, its spec's ``sharded_forward``), in bf16 and in fp32 (every cast then a
    no-op), as the sharded replica above, whose gradients are taken as the wrapper takes them
    (harness/rank/oracle/sharded_reduce.py reduces them as it does). The outputs are left in bf16
    where the wrapper's policy is accelerate's own (no ``reduce`` in the variant) and casts them."""
    device_type = next(next(iter(replicas.values())).parameters()).device.type
    if precision == "fp32" and sharded is not None:
        # fp32 under a sharded wrapper: nothing is cast, but the gradients are taken as the wrapper takes
        # them (of its unsharded parameters, FSDP1's flat ones), for its reduction to be reproduced
        return {name: ShardedMixedReplica(r, device_type, torch.float32, None, cast_buffers=False, cast_inputs=False)
                for name, r in replicas.items()}
    if precision not in AUTOCAST_DTYPES:
        return dict(replicas)
    dtype = AUTOCAST_DTYPES[precision]
    if sharded is not None:
        output = dtype if sharded.outputs_low and reduce is None else None
        return {name: ShardedMixedReplica(r, device_type, dtype, output, cast_buffers=sharded.casts_buffers,
                                          cast_inputs=sharded.casts_inputs)
                for name, r in replicas.items()}
    return {name: MixedPrecisionReplica(r, device_type, dtype) for name, r in replicas.items()}


def gradients(loss: torch.Tensor, flat: list[tuple[str, str, nn.Parameter]], *,
          retain_graph: bool = False) -> list[torch.Tensor | None]:
    """Each parameter's gradient of ``loss`` alone (None where it has none), leaving p.grad as it was:
    torch's own accumulation into the leaves (as the case's backward adds a model's several uses),
    from none, so that torch hands over the tensor it summed into rather than adding it to another."""
    saved = [p.grad for _, _, p in flat]
    for _, _, p in flat:
        p.grad = None
    torch.autograd.backward(loss, inputs=[p for _, _, p in flat], retain_graph=retain_graph)
    grads = []
    for (_, _, p), held in zip(flat, saved):
        grads.append(p.grad)
        p.grad = held
    return grads
