"""DeepSpeed ZeRO-1/2/3 cells: the plugin the harness asks accelerate for, what makes accelerate
drive DeepSpeed on a CPU host (gloo), and how a prepared ``DeepSpeedEngine`` is read by the checks.

Versions this was worked out on: accelerate 1.15.0, deepspeed 0.19.8, torch 2.13 (CPU), with
transformers installed (accelerate's DeepSpeed path needs its metadata, see ``require``). Line
numbers below are of those releases.

Where the gradients are (what ``observe`` reads):

- After the boundary micro-batch (a sync point), ``accelerator.backward`` calls ``engine.backward``
  and then ``engine.step``, which steps and clears the gradients: the boundary gradients exist only
  between the two. ``capture_boundary_gradients`` wraps the engine's ``step`` (an instance
  attribute) to take them whole, with ``safe_get_full_grad``, before it steps.
- ``safe_get_full_grad`` and ``safe_get_full_fp32_param`` are collectives (all-reduce under
  ZeRO-1/2, all-gather under ZeRO-3): every rank calls them for every parameter in the same order,
  as the checks call ``observe`` on every rank. One collective a parameter, a hundred a cell at
  half a millisecond each: the harness reads them all at once (``coalesced``), one collective a
  group. Whether a read happens depends only on state that
  is the same on every rank (the engine's boundary flag, the check's ``sync``).
- Between sync points ZeRO-1 leaves each rank's own accumulated gradient in ``param.grad`` (it
  reduces at the boundary only): compared with the oracle's local gradient as under DDP. ZeRO-2/3
  partition the gradients and reduce them after every micro-batch by design; what they hold in
  between is a partition inside the optimizer, and ``safe_get_full_grad`` there is no read at all
  (ZeRO-2 raises on the ranks owning a fragment while the others enter an all-reduce: a collective
  mismatch). So there they are hidden (``Observed.hidden``, no gradient): no claim; the collective
  accounting allows their per-micro-batch reductions (their specs' ``reduces_every_micro_batch``,
  harness/wrappers/registry.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any, Iterator

import torch

from harness.decorator import SkipCell
from harness.wrappers.observed import Observed

# What the captured boundary gradients are kept under on the engine (name -> full gradient), and
# whether the engine stepped since its last backward.
_CAPTURED = "_harness_boundary_grads"
_INSTRUMENTED = "_harness_instrumented"
# accelerate's DeepSpeed switch (accelerator.py:368 sets it when given a plugin; state.py:204 and
# :974 read it at construction).
USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"


def require(wrapper: str) -> None:
    """SkipCell with a one-line reason unless deepspeed and transformers can be imported.

    transformers: accelerate's ``DeepSpeedPlugin.select`` (state.py:978) calls
    ``set_deepspeed_weakref`` (utils/dataclasses.py:1476), which compares the installed
    transformers' version unconditionally and imports ``transformers.integrations``; without it
    ``Accelerator(deepspeed_plugin=...)`` fails with PackageNotFoundError."""
    for package in ("deepspeed", "transformers"):
        if importlib.util.find_spec(package) is None:
            raise SkipCell(f"wrapper={wrapper} needs {package}, which is not installed "
                           "(pip install 'gradsync-harness[deepspeed]')")
    from harness.wrappers.capabilities import transformers_torch_missing

    missing = transformers_torch_missing()
    if missing:
        raise SkipCell(f"wrapper={wrapper} needs transformers' DeepSpeed integration: {missing}")


def plugin(stage: int, *, num_steps: int, device_type: str, grad_accum: str | None = None) -> Any:
    """The ``DeepSpeedPlugin`` of a cell: ZeRO ``stage``, the case's accumulation steps, no clipping,
    a fixed micro-batch size, bf16 as the Accelerator's ``mixed_precision`` says. Given as a full
    DeepSpeed config, because accelerate's keyword form cannot say two of these:

    - ``bf16: {"enabled": "auto"}``: accelerate fills it from ``mixed_precision`` (``fill_match``);
      it sets bf16 only where the key is absent or ``"auto"``, so an explicit ``False`` would run a
      ``mixed_precision="bf16"`` cell in fp32 (utils/dataclasses.py:1415). fp16 stays off: its loss
      scaler is not modelled under DeepSpeed (harness/wrappers/registry.py, the spec's ``precisions``).

    - ``gradient_clipping: 0.0``: the harness's oracle clips only where a case calls
      ``clip_grad_norm_``. accelerate fills ``"auto"`` with 1.0 (accelerator.py:2224), and
      ``DeepSpeedPlugin(gradient_clipping=0.0)`` leaves the key out, where DeepSpeed's own default
      is also 1.0 (deepspeed/runtime/constants.py:203): every update would be clipped by its norm.
    - ``train_micro_batch_size_per_gpu: 1``: ``"auto"`` is resolved from a DataLoader given to the
      same ``prepare`` (accelerator.py:2179), and a case without one (fused_loss) would be refused.
      DeepSpeed uses the value for its batch bookkeeping and its own data loader only, neither of
      which touches the gradients here (accelerate scales the loss through DeepSpeed by the
      accumulation steps alone).
    - ``data_types: {"grad_accum_dtype": "fp32"}`` where ``grad_accum`` is ``"fp32"`` (the variant's
      ``grad_accum=fp32``): with bf16 under ZeRO-1 DeepSpeed then builds its BF16_Optimizer, which
      accumulates each micro-batch's bf16 gradient in fp32 and all-reduces the sum at the boundary.
    - ``gradient_accumulation_steps``: the Accelerator's (accelerate uses DeepSpeed's value when the
      two differ, accelerator.py:2209), so the engine's boundaries and loss scale are the case's.

    On CPU this also turns off DeepSpeed's shared-memory comm op: starting its comm backend
    JIT-compiles it in C++ (deepspeed/comm/torch.py:207, ``build_shm_op``), about 60 s cold and an
    error without a working compiler; with it marked incompatible (torch.py:49) DeepSpeed uses
    the process group's own gloo, which the pool made already."""
    import accelerate.utils

    from harness.wrappers import probe

    without_shared_memory_comm(device_type)
    cls = probe.require(accelerate.utils, "DeepSpeedPlugin", "DeepSpeedPlugin")
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": num_steps,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": False},
        "bf16": {"enabled": "auto"},
    }
    if grad_accum is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum}
    return cls(hf_ds_config=config, zero_stage=stage, gradient_accumulation_steps=num_steps,
               gradient_clipping=0.0)


def without_shared_memory_comm(device_type: str) -> None:
    """On CPU, DeepSpeed's shared-memory comm op marked incompatible (``plugin``), so that DeepSpeed
    uses the process group's gloo instead of JIT-compiling the op."""
    if device_type == "cpu":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def accelerator_kwargs(wrapper: str, stage: int, *, device_type: str, num_steps: int,
                       grad_accum: str | None = None) -> dict[str, Any]:
    """The ``Accelerator`` keyword arguments for a DeepSpeed cell.

    ``cpu=False`` even on a CPU host: accelerate selects DeepSpeed only when ``not cpu`` (state.py:201
    and :974); with ``cpu=True`` it silently drops the plugin and runs MULTI_CPU (DDP)."""
    require(wrapper)
    return {"deepspeed_plugin": plugin(stage, num_steps=num_steps, device_type=device_type, grad_accum=grad_accum),
            "cpu": False}


def after_construction(accelerator: Any, *, stage: int) -> None:
    """Make the Accelerator drive DeepSpeed on this host, and read its engine's boundary gradients.

    On a CPU host (the one workaround of the state): accelerate's ``_prepare_backend`` finds no
    GPU, so the backend stays None and state.py:288 sets ``num_processes=1``,
    ``process_index=0`` on every rank before it switches the type to DEEPSPEED (state.py:312).
    ``deepspeed.initialize`` then fails its batch assertion, and a prepared DataLoader would give
    every rank the whole dataset. This copies the real world size, rank and backend into
    PartialState's and AcceleratorState's shared dicts (two dicts: AcceleratorState copies
    PartialState's at construction). When accelerate already selected DeepSpeed with the right
    world size (a GPU host, or one process) it does nothing there.

    Then: ``ACCELERATE_USE_DEEPSPEED``, which accelerate sets for the process when given a plugin
    (accelerator.py:368), is removed again: it is read only at construction, and a later cell in
    the same pool would otherwise be handed a DeepSpeedPlugin made from the environment. And
    ``prepare`` is wrapped (an instance attribute) so that the engine it makes captures its
    boundary gradients (``capture_boundary_gradients``)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    from harness.wrappers.registry import WrongWrapper

    os.environ.pop(USE_DEEPSPEED, None)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise WrongWrapper(f"accelerate chose {accelerator.distributed_type}, not DeepSpeed, for a "
                           f"deepspeed-z{stage} cell")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if (accelerator.num_processes, accelerator.process_index) != (world_size, rank):
        if accelerator.device.type != "cpu":
            raise WrongWrapper(f"accelerate counts {accelerator.num_processes} processes on "
                               f"{accelerator.device} where there are {world_size}; the harness corrects "
                               "that only on a CPU host")
        real = {"num_processes": world_size, "process_index": rank,
                "local_process_index": int(os.environ.get("LOCAL_RANK", rank)), "backend": dist.get_backend()}
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            shared.update(real)

    original = accelerator.prepare

    @functools.wraps(original)
    def prepare(*args: Any, **kwargs: Any) -> Any:
        _one_process_launch(world_size)
        result = original(*args, **kwargs)
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is not None:
            from harness.wrappers import prepared

            capture_boundary_gradients(wrapped.engine)
            prepared.remember(wrapped.engine)
        return result

    accelerator.prepare = prepare


def _one_process_launch(world_size: int) -> None:
    """At world size 1, ``LOCAL_RANK=0`` from ``prepare`` on, as a one-process launch sets it.

    A pool of one rank is one process with its process group made and no launcher variables.
    DeepSpeed reads LOCAL_RANK in ``deepspeed.initialize`` (an assertion, deepspeed/runtime/engine.py:1972)
    and, under ZeRO-3, in every forward (runtime/zero/utils.py:85). Every launcher sets it
    (``accelerate launch --num_processes 1``, torchrun, deepspeed), and ``deepspeed.init_distributed``
    does when it discovers the group itself (comm/comm.py:942); here the group exists, so it does
    not. It is set after the Accelerator is built, so that accelerate still sees the plain process
    it was built in (num_processes 1), and the rank puts the environment back after the cell
    (harness/rank/process/cell.py), so that a later cell of the pool is again a plain process."""
    if world_size == 1 and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = "0"


def capture_boundary_gradients(engine: Any) -> None:
    """Keep the engine's full gradients at each step it takes at a boundary, on the engine.

    ``engine.backward`` forgets the last capture (a backward since then makes it stale);
    ``engine.step`` at a gradient-accumulation boundary reads every parameter's full gradient
    (``safe_get_full_grad``, a collective: the boundary flag is the same on every rank) before it
    steps. The harness's own reductions there are not counted as the engine's
    (accounting.uncounted)."""
    if getattr(engine, _INSTRUMENTED, False):
        return
    from deepspeed.utils import safe_get_full_grad

    from harness.rank.numerics.accounting import uncounted

    backward, step = engine.backward, engine.step
    setattr(engine, _CAPTURED, None)

    @functools.wraps(backward)
    def backward_forgetting(*args: Any, **kwargs: Any) -> Any:
        setattr(engine, _CAPTURED, None)
        return backward(*args, **kwargs)

    @functools.wraps(step)
    def step_capturing(*args: Any, **kwargs: Any) -> Any:
        if engine.is_gradient_accumulation_boundary():
            with uncounted():
                with coalesced():
                    views = {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}
                grads = {name: None if g is None else g.detach().clone() for name, g in views.items()}
            setattr(engine, _CAPTURED, grads)
        return step(*args, **kwargs)

    engine.backward = backward_forgetting
    engine.step = step_capturing
    setattr(engine, _INSTRUMENTED, True)


def observe(engine: Any, names: list[str], *, sync: bool) -> Observed:
    """A DeepSpeedEngine's parameters (full fp32, every stage: a collective) and gradients.

    After a step at a boundary (an optimizer step of the schedule): the full gradients captured
    before the engine stepped. Otherwise (between optimizer steps, and at a point where the
    contract syncs but the engine took no step: ``sync_each_batch``, or a boundary the engine
    missed): ZeRO-1's own gradient (``param.grad``; BF16_Optimizer's fp32 sum), what it reduces only
    at a boundary, compared as usual;
    ZeRO-2/3's hidden (``Observed.hidden``: no claim; a missed step still shows in the
    parameters)."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    named = list(module.named_parameters())
    with coalesced():
        views = {n: safe_get_full_fp32_param(p) for n, p in named}
    params = {n: v.detach().clone() for n, v in views.items()}
    stage = int(engine.zero_optimization_stage())
    captured = getattr(engine, _CAPTURED, None)
    if sync and captured is not None:
        return Observed(params=params, grads=dict(captured), owned=_owned(named) if stage < 3 else {})
    if stage < 2:
        # BF16_Optimizer leaves only the latest micro-batch's gradient in param.grad: the rank's own
        # sum since the boundary is its fp32 ``_hp_grad`` (a view of the flat accumulator)
        held = "_hp_grad" if type(engine.optimizer).__name__ == "BF16_Optimizer" else "grad"
        shown = {n: getattr(p, held, None) for n, p in named}
        return Observed(params=params, grads={n: None if g is None else g.detach().reshape(p.shape).clone()
                                              for (n, p), g in zip(named, shown.values())})
    grads: dict[str, torch.Tensor | None] = {n: None for n, _ in named}
    return Observed(params=params, grads=grads, sharded=True, hidden=True)


def _owned(named: list[tuple[str, Any]]) -> dict[str, tuple[int, int]]:
    """The span of each parameter's flattened gradient in this rank's partition (ZeRO-1/2: DeepSpeed's
    ``_hp_mapping.lp_fragment_address``, where the rank owns a part of it)."""
    owned = {}
    for n, p in named:
        address = getattr(getattr(p, "_hp_mapping", None), "lp_fragment_address", None)
        if address is not None and int(address.numel) > 0:
            owned[n] = (int(address.start), int(address.numel))
    return owned


@contextlib.contextmanager
def coalesced() -> Iterator[None]:
    """DeepSpeed's readers of a whole parameter or gradient (``get_full_hp_param``, ZeRO-3's
    ``_fp32_state_allgather``) each fill a fresh buffer and sum it (ZeRO-1/2: every element has one
    owner, the other ranks give zeros) or gather it (ZeRO-3) over the group, and return a view of
    it. In the block those collectives are only noted; after it they are issued together, one per
    group and dtype, and each buffer gets its own part back: the same values, bit for bit (a sum with
    one non-zero term is exact in any order). Read the views after the block, never in it."""
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    reduces: list[tuple[torch.Tensor, Any]] = []
    gathers: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    all_reduce, all_gather_into_tensor = ds_comm.all_reduce, ds_comm.all_gather_into_tensor

    def note_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False,
                    **kwargs: Any) -> Any:
        if async_op or kwargs or op not in (dist.ReduceOp.SUM, getattr(ds_comm, "ReduceOp", dist.ReduceOp).SUM):
            return all_reduce(tensor, op=op, group=group, async_op=async_op, **kwargs)
        reduces.append((tensor, group))
        return None

    def note_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        if async_op:
            return all_gather_into_tensor(output, tensor, group=group, async_op=async_op)
        gathers.append((output, tensor, group))
        return None

    ds_comm.all_reduce, ds_comm.all_gather_into_tensor = note_reduce, note_gather
    try:
        yield
    finally:
        ds_comm.all_reduce, ds_comm.all_gather_into_tensor = all_reduce, all_gather_into_tensor
    for (group, _), batch in _batches(reduces, lambda r: (r[1], r[0].dtype)):
        buffer = torch.cat([t.reshape(-1) for t, _ in batch])
        all_reduce(buffer, group=group)
        _scatter_back(buffer, [t for t, _ in batch])
    for (group, _), batch in _batches(gathers, lambda g: (g[2], g[1].dtype)):
        mine = torch.cat([t.reshape(-1) for _, t, _ in batch])
        world = dist.get_world_size(group=group)
        everyone = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_into_tensor(everyone, mine, group=group)
        for rank, part in enumerate(everyone.chunk(world)):  # rank r's inputs, one after another
            _scatter_back(part, [out.reshape(-1).chunk(world)[rank] for out, _, _ in batch])


def _batches(calls: list[Any], key: Any) -> list[tuple[Any, list[Any]]]:
    """``calls`` grouped by ``key`` (a group compared by identity), in the order first seen: every rank
    made the same calls in the same order, so every rank issues the same collectives."""
    groups: list[tuple[Any, list[Any]]] = []
    for call in calls:
        k = key(call)
        for seen, batch in groups:
            if seen[0] is k[0] and seen[1] == k[1]:
                batch.append(call)
                break
        else:
            groups.append((k, [call]))
    return groups


def _scatter_back(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    offset = 0
    for target in targets:
        target.copy_(flat[offset : offset + target.numel()].view_as(target))
        offset += target.numel()


# DeepSpeed's bf16 reduction as the oracle reproduces it (harness/rank/oracle/sharded_reduce.py), as found on
# deepspeed 0.19.8: gradients accumulated in bf16 (no ``data_types.grad_accum_dtype``, so no
# BF16_Optimizer), each rank's divided by the world size in bf16 before a SUM in bf16
# (stage_1_and_2.py:1688 ``average_tensor``, coalesced_collectives.py:124), nothing after; ZeRO-1/2 one
# all-reduce of one bucket, not overlapped with the backward. With ``data_types.grad_accum_dtype:
# fp32`` under ZeRO-1, BF16_Optimizer: each micro-batch's bf16 gradient added to an fp32 sum
# (bf16_optimizer.py ``_update_hp_grad``, after the backward, before any all-reduce from 0.19.0 on:
# PR #7985), the sum cast to the communication dtype at the boundary, all-reduced as one flat padded
# bucket (engine.py ``buffered_allreduce_fallback``), then multiplied by 1/world size.
_MODELLED_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def reduction_unlike_modelled(model: Any, dtype: torch.dtype, bf16_optimizer: bool = False) -> str:
    """Why the DeepSpeed engine prepare put around ``model`` (the user's module) does not reduce its
    gradients as modelled above, in ``dtype`` (with ``bf16_optimizer``: BF16_Optimizer's way), or ""
    where it does. Read off the engine and its optimizer (no collective)."""
    from harness.wrappers.prepared import wrapper_of

    engine = wrapper_of(model)
    optimizer = getattr(engine, "optimizer", None)
    kind = type(optimizer).__name__
    if bf16_optimizer:
        return _bf16_optimizer_unlike_modelled(engine, optimizer, dtype)
    if kind not in _MODELLED_OPTIMIZERS:
        return f"DeepSpeed's {kind} reduces its own way (the modelled one is {' or '.join(_MODELLED_OPTIMIZERS)})"
    settings = {"communication_data_type": dtype, "gradient_accumulation_dtype": dtype,
                "gradient_predivide_factor": 1.0, "postscale_gradients": True}
    if kind == "DeepSpeedZeroOptimizer":
        settings["overlap_comm"] = False
    for name, expected in settings.items():
        value = getattr(optimizer, name, None)
        if value != expected:
            return f"DeepSpeed's {name} is {value!r} here, not {expected!r}"
    numel = sum(p.numel() for p in engine.module.parameters())
    if getattr(optimizer, "reduce_bucket_size", 0) < numel:
        return "DeepSpeed's reduce bucket is smaller than the model: the reduction is cut in several"
    return ""


def _bf16_optimizer_unlike_modelled(engine: Any, optimizer: Any, dtype: torch.dtype) -> str:
    kind = type(optimizer).__name__
    if kind != "BF16_Optimizer":
        return f"DeepSpeed built its {kind} for data_types.grad_accum_dtype fp32, not the modelled BF16_Optimizer"
    settings = {"communication_data_type": (engine.communication_data_type, dtype),
                "gradient_predivide_factor": (engine.gradient_predivide_factor(), 1.0),
                "postscale_gradients": (engine.postscale_gradients(), True),
                "grad_acc_dtype": (getattr(optimizer, "grad_acc_dtype", None), torch.float32),
                "parameter groups": (len(getattr(optimizer, "bf16_groups", ())), 1)}
    for name, (value, expected) in settings.items():
        if value != expected:
            return f"DeepSpeed's {name} is {value!r} here, not {expected!r}"
    return ""

