"""The wrapper a cell trains under: DDP (every cell's until now), FSDP2, FSDP1 or DeepSpeed ZeRO.

A cell under a wrapper other than DDP carries ``wrapper=<name>`` in its variant (docs/wrappers.md).
Here: which cells each wrapper gets (``--wrappers``), how accelerate is asked for it, how a cell
makes sure that the prepared model really is it, and what the wrapper may communicate between sync
points (harness/rank/numerics/accounting.py judges that). The names themselves: harness/wrappers/registry.py.
"""

from __future__ import annotations

import traceback
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from harness.decorator import SkipCell, Unsupported, Variant
from harness.wrappers.registry import AUTO, DDP, WRAPPERS, WrapperSpec, WrongWrapper, mesh_wrappers, of_identity, spec

if TYPE_CHECKING:
    from harness.wrappers.cell import CellConfig


def cell_variants(variants: Iterable[Variant], applies: Iterable[str], selection: tuple[str, ...] | str,
                  meshes: Iterable[str] = ()) -> list[Variant]:
    """A case's variants crossed with the wrappers selected that apply to it.

    DDP keeps the variant ids it always had. Another wrapper adds ``-wrapper=<name>`` and runs the
    precisions the oracle models for it (compiled variants under FSDP2 only). ``auto``: DDP at every variant, and every other wrapper at
    the case's lead variants (its first variant, and its first compiled one), so that the default
    run covers every wrapper once per case (compiled and not) at a fraction of the cost.

    ``meshes`` (the case's ``@case(meshes=...)``): where FSDP2 is selected, each mesh at the case's
    lead variants that are not compiled (one a precision), ``<variant>-mesh=<name>-wrapper=fsdp2``."""
    variants = list(variants)
    applies = set(applies)
    chosen = WRAPPERS if selection == AUTO else selection
    out: list[Variant] = []
    for wrapper in chosen:
        if wrapper not in applies:
            continue
        if wrapper == DDP:  # the default wrapper: the case's own variants, their ids unchanged
            out.extend(variants)
            continue
        its = spec(wrapper)
        # compiled variants in fp32 only: the mixed-precision model is of the eager kernels
        eligible = [v for v in variants if str(v.params.get("precision", "fp32")) in its.precisions
                    and ("compile" not in v.params or its.compiled and v.params.get("precision", "fp32") == "fp32")]
        if selection == AUTO:
            eligible = _lead(eligible)
        for v in eligible:
            out.append(Variant(f"{v.name}-wrapper={wrapper}", {**v.params, "wrapper": wrapper}))
            if v.params.get("precision", "fp32") != "fp32" and its.mixed_axis is not None:
                key, values = its.mixed_axis
                out.extend(Variant(f"{v.name}-{key}={value}-wrapper={wrapper}",
                                   {**v.params, key: value, "wrapper": wrapper})
                           for value in values)
        if its.meshes:
            leads = [v for v in _lead(eligible) if "compile" not in v.params]
            out.extend(Variant(f"{v.name}-mesh={mesh}-wrapper={wrapper}", {**v.params, "mesh": mesh, "wrapper": wrapper})
                       for mesh in meshes for v in leads)
    return out


def _lead(variants: list[Variant]) -> list[Variant]:
    """The first variant of each compile setting (not compiled, then each backend) and precision."""
    seen: dict[Any, Variant] = {}
    for v in variants:
        seen.setdefault((v.params.get("compile"), v.params.get("precision", "fp32")), v)
    return list(seen.values())


# accelerate


def accelerator_kwargs(config: CellConfig, kwargs: Mapping[str, Any], *, device_type: str) -> dict[str, Any]:
    """The ``Accelerator`` keyword arguments that ask for the cell's wrapper (and, under FSDP2, for its
    mesh: a harness/wrappers/mesh.py ``Shape``) as ``config`` says them; SkipCell when it cannot run
    here."""
    its, wrapper, mesh = config.spec, config.wrapper, config.mesh
    if mesh is not None:
        if not its.meshes:
            raise ValueError(f"mesh={mesh.name} runs under wrapper={' or '.join(s.name for s in mesh_wrappers())}, "
                             f"not {wrapper}")
        if kwargs.get("parallelism_config") is not None:
            raise ValueError(f"mesh={mesh.name}: the harness makes the ParallelismConfig; the case gave one")
        from harness.wrappers import mesh as meshes

        made = accelerator_kwargs(replace(config, mesh=None), kwargs, device_type=device_type)
        return {**made, **meshes.accelerator_kwargs(mesh, device_type=device_type)}
    if its.family == "ddp":
        return {}
    if its.family == "fsdp" and config.world_size < 2:
        # a local pool of one rank is a plain process (no launcher): accelerate wraps nothing there,
        # as it wraps nothing in DDP, and one rank has nothing to shard or reduce
        raise SkipCell(f"wrapper={wrapper} runs at world size 2 and more: at world size 1 accelerate "
                       "applies no wrapper (a single process without a launcher)")
    given = [k for k in ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins") if kwargs.get(k) is not None]
    if given:
        raise ValueError(f"wrapper={wrapper}: the harness makes the {wrapper} plugin; the case gave {given[0]}=")
    if its.family == "fsdp":
        return _fsdp_kwargs(its, device_type=device_type, reduce=config.reduce)
    return _deepspeed_kwargs(its, device_type=device_type, num_steps=config.num_steps, grad_accum=config.grad_accum)


def _fsdp_kwargs(its: WrapperSpec, *, device_type: str, reduce: str | None) -> dict[str, Any]:
    """The FSDP plugin of the wrapper's FSDP version; SkipCell when it cannot run here."""
    import accelerate.utils

    from harness.wrappers import probe

    plugin = probe.require(accelerate.utils, "FullyShardedDataParallelPlugin", "FullyShardedDataParallelPlugin")
    if its.fsdp_version == 2:
        probe.require_parameter(plugin, "fsdp_version", "FullyShardedDataParallelPlugin(fsdp_version=2)")
        from harness.wrappers import capabilities

        missing = capabilities.fsdp2_missing(device_type)
        if missing:
            raise SkipCell(f"wrapper={its.name} cannot run here: {missing}")
        options: dict[str, Any] = {"fsdp_version": 2}
        if reduce is not None:
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            options["mixed_precision_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[reduce])
        try:
            return {"fsdp_plugin": plugin(**options)}
        except ImportError as exc:  # accelerate's own word on this torch ("FSDP2 requires PyTorch >= 2.6.0")
            raise SkipCell(f"wrapper={its.name} cannot run here: accelerate refuses it: {exc}") from None
    return _fsdp1_plugin(plugin)


def _fsdp1_plugin(plugin: Any) -> dict[str, Any]:
    """FSDP1 with the user's parameters kept (their names, and full gradients when summoned);
    releases before FSDP2 have no fsdp_version and are FSDP1. sync_module_states=False: the
    harness builds the same weights on every rank (and checks so at start-up), so the sync is
    not needed; releases before 1.x default it to True and then insist on a GPU for it ("There
    are currently no available devices found", 0.31; FSDP1's "CPU parameters or buffers when
    sync_module_states=True", 0.22). From 1.x it is False by default: the same FSDP1 as before.
    Older releases (0.22.0 and 0.31.0 here) overwrite these fields from the environment whatever
    the plugin is given (FSDP_USE_ORIG_PARAMS, FSDP_SYNC_MODULE_STATES, as `accelerate launch` sets them):
    the same values are set there too, for this cell only (harness/rank/process/cell.py puts the
    environment back after each cell)."""
    from harness.wrappers import probe

    options: dict[str, Any] = {"use_orig_params": True}
    if "fsdp_version" in probe.parameters(plugin):
        options["fsdp_version"] = 1
    if "sync_module_states" in probe.parameters(plugin):
        options["sync_module_states"] = False
    import os

    os.environ["FSDP_USE_ORIG_PARAMS"] = "true"
    os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
    made = plugin(**options)
    if getattr(made, "use_orig_params", None) is not True:
        raise Unsupported("FullyShardedDataParallelPlugin(use_orig_params=True)",
                          f"the plugin made has use_orig_params={getattr(made, 'use_orig_params', None)!r}")
    return {"fsdp_plugin": made}


def _deepspeed_kwargs(its: WrapperSpec, *, device_type: str, num_steps: int, grad_accum: str | None) -> dict[str, Any]:
    """The DeepSpeed plugin (and ``cpu=False``, which accelerate needs to select DeepSpeed at all);
    harness/wrappers/deepspeed_cpu.py says why each setting is what it is."""
    from harness.wrappers import deepspeed_cpu

    return deepspeed_cpu.accelerator_kwargs(its.name, its.zero_stage, device_type=device_type, num_steps=num_steps,
                                            grad_accum=grad_accum)


def after_construction(wrapper: str, accelerator: Any, kwargs: Mapping[str, Any], mesh: Any = None) -> None:
    """What the Accelerator needs once built for ``wrapper`` (and ``mesh``) to be what ``prepare`` applies."""
    family = spec(wrapper).family
    if family == "fsdp":
        fsdp_on_cpu(accelerator, kwargs["fsdp_plugin"])
        if mesh is not None:
            from harness.wrappers import mesh as meshes

            meshes.after_construction(mesh, accelerator)
        _patch_prepare(accelerator, wrapper, mesh)
    elif family == "deepspeed":
        from harness.wrappers import deepspeed_cpu

        deepspeed_cpu.after_construction(accelerator, stage=spec(wrapper).zero_stage)
    else:
        _remember_ddp(accelerator)


def _patch_prepare(accelerator: Any, wrapper: str, mesh: Any = None) -> None:
    """Replace ``accelerator.prepare`` (an instance attribute: the class and every other Accelerator
    are untouched) with one that records the wrappers it made, shards a tp mesh's models first, and
    names what an accelerate release's FSDP ``prepare`` cannot do in the cell instead of a harness
    error:

    - Old releases call torch's FSDP1 with arguments a later torch no longer takes (0.21.0:
      ``FullyShardedDataParallel(ignored_parameters=...)``; 0.22.0 remakes the optimizer as
      ``type(optimizer)(params, **optimizer.defaults)``, and torch 2.13's AdamW keeps a default its
      own constructor does not take): a TypeError naming the argument, ``skip``.
    - An AttributeError or KeyError raised inside accelerate's own code: accelerate 1.1.1 reads
      transformers' ``_tied_weights_keys`` from every model it wraps in FSDP1, which a plain
      ``nn.Module`` has not; 1.6.0's FSDP2 maps a compiled model's parameters by names that
      ``torch.compile``'s wrapper prefixes (``KeyError: 'fc1.weight'``) and cannot switch two models'
      optimizers to their shards ("A parameter in the optimizer couldn't be switched"):
      ``unsupported``, naming what accelerate raised. A diff against a release that passes still
      counts it a regression.
    - An ImportError raised in accelerate's own code: 1.15.0's tensor-parallel prepare under FSDP2
      imports ``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5
      no longer has (4.57 has): ``unsupported``, naming it.

    Under ``mesh=tp`` the models are first sharded over the mesh's ``tp`` dimension, as a user
    shards them before ``prepare`` (harness/wrappers/mesh.py, ``tensor_parallel``)."""
    import functools

    original = accelerator.prepare

    @functools.wraps(original)
    def prepare(*args: Any, **kwargs: Any) -> Any:
        if mesh is not None and mesh.size("tp") > 1:
            from harness.wrappers import mesh as meshes

            meshes.tensor_parallel_all(args, accelerator.torch_device_mesh)
        try:
            prepared = original(*args, **kwargs)
        except TypeError as exc:
            if "unexpected keyword argument" not in str(exc):
                raise
            import accelerate
            import torch

            raise SkipCell(f"wrapper={wrapper} cannot run here: accelerate {accelerate.__version__}'s prepare "
                           f"calls torch {torch.__version__} with an argument it does not take ({exc})") from None
        except (AttributeError, KeyError, ImportError) as exc:
            if _raised_in(exc, skipping="torch") != "accelerate":
                raise
            import accelerate

            raise Unsupported(f"a {wrapper} prepare that can wrap this case's models and optimizers",
                              f"accelerate {accelerate.__version__} raised {type(exc).__name__}: {exc}") from None
        remember_wrappers(prepared)
        return prepared

    accelerator.prepare = prepare


def remember_wrappers(prepared: Any) -> None:
    """Record the wrappers around the user's module (a spec's ``wraps_module``: DDP, FSDP1) among what
    ``prepare`` returned (or, for an Accelerator the harness did not make, such as Trainer's, what it
    prepared: harness/rank/trainer.py), by the user's module (harness/wrappers/prepared.py), and the
    compiled module FSDP2 made its root of a compiled model: the oracle reads how they reduce
    (harness/wrappers/sharding.py)."""
    from torch import nn

    from harness.wrappers.prepared import remember

    # accelerate returns a tuple (FSDP2's prepare: a list) for several objects, the object for one
    for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):
        if not isinstance(obj, nn.Module):
            continue
        its = prepared_spec(obj)
        if its is None:
            continue
        if its.wraps_module:
            remember(peel_compiled(obj))
        elif peel_compiled(obj) is not obj:
            remember(obj)


def _remember_ddp(accelerator: Any) -> None:
    """Under DDP, ``accelerator.prepare`` records each DDP wrapper it makes (an instance attribute:
    the class and every other Accelerator are untouched)."""
    import functools

    original = accelerator.prepare

    @functools.wraps(original)
    def prepare(*args: Any, **kwargs: Any) -> Any:
        prepared = original(*args, **kwargs)
        remember_wrappers(prepared)
        return prepared

    accelerator.prepare = prepare


def fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Make accelerate apply FSDP on a CPU host, where it would silently use DDP instead.

    Why: accelerate's ``AcceleratorState`` selects ``DistributedType.FSDP`` only in the branch for
    accelerator device types (MULTI_GPU, MULTI_XPU, ...; accelerate/state.py, 1.15.0); on
    MULTI_CPU an ``fsdp_plugin`` is ignored and ``prepare`` wraps the model in DDP. torch's FSDP2
    and FSDP1 themselves run on CPU with gloo. So, after construction, this does what that branch
    does (the distributed type on AcceleratorState and PartialState, the plugin, its mixed
    precision) and, for FSDP1, gives the state the index-less ``cpu`` device: accelerate passes
    ``device_id=accelerator.device`` (``cpu:0`` on MULTI_CPU) and torch's FSDP1 takes a CPU
    module's compute device to be ``cpu``, refusing the pair ("Inconsistent compute device").

    With harness/wrappers/deepspeed_cpu.py, one of the two places where the harness steps around accelerate.
    When a release selects FSDP on CPU by itself, the distributed type is already FSDP and this
    does nothing."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return
    if accelerator.device.type != "cpu":
        raise WrongWrapper(f"accelerate chose {accelerator.distributed_type} on {accelerator.device}, not FSDP, "
                           "and the harness forces FSDP only on a CPU host")
    state, partial = AcceleratorState(), PartialState()
    state.distributed_type = DistributedType.FSDP
    partial.distributed_type = DistributedType.FSDP
    mixed = str(getattr(state, "mixed_precision", "no"))
    if mixed != "no":
        plugin.set_mixed_precision(mixed)
    state.fsdp_plugin = plugin
    if getattr(plugin, "fsdp_version", 1) == 1:
        import torch

        state.device = partial.device = torch.device("cpu")


def refusal(wrapper: str, exc: BaseException) -> Unsupported | None:
    """A case's exception that is the library refusing what the pattern asks under ``wrapper`` (the
    pair of releases has no such support), as ``Unsupported`` naming it; None for anything else,
    which stays a raise of the case (an ``error`` cell).

    accelerate before PR #3656 enters the DeepSpeed engine's ``no_sync`` inside
    ``accumulate``, and DeepSpeed (0.19.8 here) refuses it: under ZeRO-2/3 ("no_sync context manager
    is incompatible with gradient partitioning"), under ZeRO-1 at the engine's step inside it ("It is
    illegal to call Engine.step() inside no_sync context manager"). A user's loop fails as loudly."""
    if spec(wrapper).family != "deepspeed" or not isinstance(exc, AssertionError) or "no_sync" not in str(exc):
        return None
    if _raised_in(exc) != "deepspeed":
        return None
    import accelerate
    import deepspeed

    return Unsupported(f"accumulate under ZeRO-{spec(wrapper).zero_stage} with deepspeed {deepspeed.__version__}",
                       f"accelerate {accelerate.__version__} enters the engine's no_sync, which it refuses: {exc}")


def _raised_in(exc: BaseException, *, skipping: str = "") -> str:
    """The package (``accelerate``, ``deepspeed``, ``torch``, ...) of the innermost frame that raised
    ``exc``, passing over frames of ``skipping`` (an attribute lookup that torch's ``Module``
    answers is raised there for its caller) and of Python's own library (accelerate 1.10 to 1.12 ask
    ``importlib.metadata`` for transformers' version, which raises there for accelerate); "" when none
    is a package's."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"].replace("\\", "/").rstrip("/") + "/"
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.replace("\\", "/").startswith(stdlib) and "-packages/" not in frame.filename:
            continue
        parts = frame.filename.replace("\\", "/").split("/")
        if "site-packages" in parts or "dist-packages" in parts:
            index = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
            package = parts[index + 1] if index + 1 < len(parts) else ""
        else:
            package = next((p for p in ("accelerate", "deepspeed", "torch") if p in parts), "")
        if package and package == skipping:
            continue
        return package
    return ""


# what the prepared model is


def peel_compiled(model: Any) -> Any:
    """The module inside ``torch.compile``'s wrapper."""
    return getattr(model, "_orig_mod", model)


def identify(model: Any) -> tuple[str, int | None] | None:
    """What a prepared model is, by its type, as a spec's ``identity``: ``("ddp", None)``, ``("fsdp",
    <version>)``, ``("deepspeed", <ZeRO stage>)``; None for a plain module (accelerate wraps nothing at
    world size 1)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    # accelerate compiles a DDP or FSDP1 model after wrapping it, and fully_shard()s a compiled one
    # (FSDP2 swaps the class of the module it is given, torch.compile's wrapper included)
    fsdp2 = _fsdp2_class()
    if fsdp2 is not None and isinstance(model, fsdp2):
        return ("fsdp", 2)
    inner = peel_compiled(model)
    if fsdp2 is not None and isinstance(inner, fsdp2):
        return ("fsdp", 2)

    if isinstance(inner, FullyShardedDataParallel):
        return ("fsdp", 1)
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return ("ddp", None)
    if type(inner).__name__ == "DeepSpeedEngine":
        return ("deepspeed", getattr(inner, "zero_optimization_stage", lambda: 0)())
    return None


def prepared_as(model: Any) -> str:
    """The wrapper a prepared model is, by name: ``ddp``, ``fsdp2``, ``fsdp1``, ``deepspeed-z<stage>``
    (a stage the harness has no spec of too), or ``none`` (a plain module)."""
    found = identify(model)
    if found is None:
        return "none"
    its = of_identity(*found)
    return its.name if its is not None else f"{found[0]}-z{found[1]}"


def prepared_spec(model: Any) -> WrapperSpec | None:
    """The spec of the wrapper a prepared model is (``identify``), or None: a plain module, or a
    wrapper the harness has no spec of (DeepSpeed without ZeRO)."""
    return spec_of_found(identify(model))


def spec_of_found(found: tuple[str, int | None] | None) -> WrapperSpec | None:
    """``prepared_spec`` of what ``identify`` already found, for a caller that reads both."""
    return None if found is None else of_identity(*found)


def _fsdp2_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def verify(wrapper: str, model: Any, *, name: str, world_size: int) -> None:
    """WrongWrapper unless the prepared ``model`` is the wrapper the cell names, by its spec's
    ``identity``. A DDP cell (not sharded) also takes a plain module: accelerate wraps nothing at world
    size 1, and a loop may average by hand."""
    its, found = spec(wrapper), identify(model)
    if found == its.identity or (found is None and not its.sharded):
        return
    raise WrongWrapper(f"model {name!r} was prepared as {prepared_as(model)} ({type(model).__name__}), "
                       f"but the cell is wrapper={wrapper}")
