"""The wrappers a cell can train under, one spec a wrapper, as data (imports nothing).

A cell under a wrapper other than DDP carries ``wrapper=<name>`` in its variant (docs/wrappers.md,
"One spec a wrapper", whose table tests/test_docs.py holds to ``SPECS``). ``--wrappers`` selects them
(``parse``). How a cell gets its wrapper from accelerate and makes sure it has it:
harness/wrappers/prepare.py, which asks the spec, as the oracle and the checks do.
"""

from __future__ import annotations

from dataclasses import dataclass

DDP = "ddp"
AUTO = "auto"
FAMILIES = ("ddp", "fsdp", "deepspeed")
# what the wrapper adds each backward's unsharded gradient up in between syncs: the dtype it
# differentiates in (``param``), or the dtype it reduces in (``reduce``: FSDP2's
# ``FSDPParam.unsharded_accumulated_grad``)
ACCUMULATES_IN = ("param", "reduce")


@dataclass(frozen=True)
class ShardedForward:
    """How a sharded wrapper runs a forward in bf16, which is not autocast over fp32 parameters: the
    oracle's replica runs it so (harness/rank/oracle/replica.py, ``forward_as``). ``casts_buffers``:
    the floating buffers are cast too (FSDP1: accelerate's ``MixedPrecision(buffer_dtype=bf16)``);
    ``casts_inputs``: the floating inputs are cast to bf16 (FSDP; DeepSpeed casts nothing but the
    module's parameters); ``outputs_low``: accelerate's own policy (no ``reduce`` in the variant)
    leaves the outputs in bf16 (FSDP2's ``output_dtype=bf16``; an explicit MixedPrecisionPolicy leaves
    them as computed)."""

    casts_buffers: bool
    casts_inputs: bool
    outputs_low: bool


@dataclass(frozen=True)
class WrapperSpec:
    """One wrapper: what it is, what the oracle models of it, and how it is told apart once prepared.
    Each field says what it is below it."""

    name: str
    """The wrapper's public name, as ``--wrappers`` and a cell's ``wrapper`` field take it."""
    family: str
    """How accelerate is asked for it: ``ddp``; ``fsdp``, by ``fsdp_version``; ``deepspeed``, by ``zero_stage``."""
    precisions: tuple[str, ...]
    """The precisions the oracle models under it. FSDP's and DeepSpeed's bf16 is not autocast (accelerate
    gives FSDP2 ``param_dtype=reduce_dtype=output_dtype=bf16``, FSDP1
    ``MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=bf16)``, DeepSpeed bf16 weights over fp32
    masters); fp16 is modelled under DDP only (its loss scaler)."""
    fsdp_version: int | None = None
    """FSDP's version (1 or 2) for the ``fsdp`` family, else None."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage (1 to 3) for the ``deepspeed`` family, else None."""
    mixed_axis: tuple[str, tuple[str, ...]] | None = None
    """The variant parameter, and its values, with which its bf16 cells also run under another dtype policy:
    FSDP2 with an explicit ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (``reduce=fp32``);
    ZeRO-1 with DeepSpeed's ``data_types.grad_accum_dtype: fp32`` (``grad_accum=fp32``), the one
    configuration that builds DeepSpeed's BF16_Optimizer under ZeRO, where DeepSpeed PR #7985's defect lived."""
    compiled: bool = False
    """Whether compiled variants run under it: DDP (where compiled ``no_sync`` has had real bugs, pytorch
    #109774) and FSDP2 (which torch.compile is built to trace)."""
    meshes: bool = False
    """Whether accelerate applies a ``ParallelismConfig``'s mesh with it (``MESHES``)."""
    reduces_every_micro_batch: bool = False
    """ZeRO >= 2 partitions the gradients and reduces them after every micro-batch by design (accelerate
    skips ``no_sync`` for it, PR #3656); every other wrapper reduces nothing between sync points."""
    wraps_module: bool = True
    """Whether ``prepare`` returns a module around the user's (FSDP2 swaps the class of the user's own)."""
    accumulates_in: str = "param"
    """What it adds each backward's unsharded gradient up in between syncs (``ACCUMULATES_IN``)."""
    sharded_forward: ShardedForward | None = None
    """How its bf16 forward runs (``ShardedForward``); None for DDP, whose bf16 is autocast."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"wrapper {self.name!r}: family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.accumulates_in not in ACCUMULATES_IN:
            raise ValueError(f"wrapper {self.name!r}: accumulates_in={self.accumulates_in!r}; "
                             f"known: {', '.join(ACCUMULATES_IN)}")
        if (self.fsdp_version is None) == (self.family == "fsdp"):
            raise ValueError(f"wrapper {self.name!r}: an fsdp_version for FSDP, none for another family")
        if (self.zero_stage is None) == (self.family == "deepspeed"):
            raise ValueError(f"wrapper {self.name!r}: a zero_stage for DeepSpeed, none for another family")
        if (self.sharded_forward is None) == self.sharded:
            raise ValueError(f"wrapper {self.name!r}: a sharded_forward for a sharded wrapper, none for DDP")

    @property
    def identity(self) -> tuple[str, int | None]:
        """What a prepared model shows of it: its family and FSDP version or ZeRO stage
        (harness/wrappers/prepare.py, ``identify``)."""
        return (self.family, self.fsdp_version if self.family == "fsdp" else self.zero_stage)

    @property
    def sharded(self) -> bool:
        """FSDP and DeepSpeed: the rank holds a part of each gradient, reduced as the wrapper reduces it
        (harness/rank/oracle/sharded_reduce.py); DDP holds the whole, all-reduced."""
        return self.family != "ddp"

    @property
    def flat_parameters(self) -> bool:
        """FSDP1: the user's parameters are views into flat parameters, which autograd differentiates
        and which are reduce-scattered whole (their layout: harness/wrappers/sharding.py)."""
        return self.fsdp_version == 1


_FSDP_BF16 = ("fp32", "bf16")
_DEEPSPEED_FORWARD = ShardedForward(casts_buffers=False, casts_inputs=False, outputs_low=False)
# in report order (docs/wrappers.md)
SPECS = (
    WrapperSpec(DDP, "ddp", ("fp32", "bf16", "fp16"), compiled=True),
    WrapperSpec("fsdp2", "fsdp", _FSDP_BF16, fsdp_version=2, mixed_axis=("reduce", ("fp32",)), compiled=True,
                meshes=True, wraps_module=False, accumulates_in="reduce",
                sharded_forward=ShardedForward(casts_buffers=False, casts_inputs=True, outputs_low=True)),
    WrapperSpec("fsdp1", "fsdp", _FSDP_BF16, fsdp_version=1,
                sharded_forward=ShardedForward(casts_buffers=True, casts_inputs=True, outputs_low=False)),
    WrapperSpec("deepspeed-z1", "deepspeed", _FSDP_BF16, zero_stage=1, mixed_axis=("grad_accum", ("fp32",)),
                sharded_forward=_DEEPSPEED_FORWARD),
    WrapperSpec("deepspeed-z2", "deepspeed", _FSDP_BF16, zero_stage=2, reduces_every_micro_batch=True,
                sharded_forward=_DEEPSPEED_FORWARD),
    WrapperSpec("deepspeed-z3", "deepspeed", _FSDP_BF16, zero_stage=3, reduces_every_micro_batch=True,
                sharded_forward=_DEEPSPEED_FORWARD),
)
# The public names, in report order (docs/wrappers.md).
WRAPPERS = tuple(s.name for s in SPECS)
_BY_NAME = {s.name: s for s in SPECS}
_BY_IDENTITY = {s.identity: s for s in SPECS}
# The meshes a case can run on (``@case(meshes=...)``), from accelerate's ``ParallelismConfig``, under
# the wrapper accelerate applies a mesh with (``mesh_wrappers``): each names the data-parallel and the
# other dimensions of a world of 4 (2 x 2) or more (harness/wrappers/mesh.py gives the shape at each
# size). ``hsdp``: dp_replicate=2 x dp_shard=world/2; ``tp``: dp_shard=world/2 x tp=2; ``cp``:
# dp_shard=world/2 x cp=2.
MESHES = ("hsdp", "tp", "cp")


def spec(name: str) -> WrapperSpec:
    """The spec of the wrapper ``name``; ValueError names the known ones."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ValueError(f"unknown wrapper {name!r}; known: {', '.join(WRAPPERS)}")
    return found


def of_identity(family: str, level: int | None = None) -> WrapperSpec | None:
    """The spec whose ``identity`` is ``(family, level)`` (an FSDP version, a ZeRO stage), or None."""
    return _BY_IDENTITY.get((family, level))


def of_family(family: str) -> tuple[WrapperSpec, ...]:
    """The specs of ``family``, in report order."""
    return tuple(s for s in SPECS if s.family == family)


def mesh_wrappers() -> tuple[WrapperSpec, ...]:
    """The wrappers accelerate applies a mesh with (FSDP2)."""
    return tuple(s for s in SPECS if s.meshes)


class WrongWrapper(Exception):
    """The prepared model is not the wrapper the cell names: the cell is an ``error``, never a
    silent DDP cell under another name."""


def parse(value: str) -> tuple[str, ...] | str:
    """``--wrappers``: ``auto`` or a comma list of wrapper names; ValueError names what is wrong."""
    value = value.strip()
    if value == AUTO:
        return AUTO
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError(f"expected {AUTO!r} or a comma list of {', '.join(WRAPPERS)}; got {value!r}")
    unknown = [n for n in names if n not in WRAPPERS]
    if unknown:
        raise ValueError(f"unknown wrapper {unknown[0]!r}; known: {', '.join(WRAPPERS)} (or {AUTO!r})")
    return tuple(n for n in WRAPPERS if n in names)


def parse_meshes(value: str) -> tuple[str, ...] | str:
    """``--meshes``: ``auto`` (each case's own, ``@case(meshes=...)``), ``none``, or a comma list of
    mesh names; ValueError names what is wrong."""
    value = value.strip()
    if value in (AUTO, "none"):
        return AUTO if value == AUTO else ()
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in MESHES]
    if unknown or not names:
        raise ValueError(f"unknown mesh {unknown[0]!r}; known: {', '.join(MESHES)} (or {AUTO!r}, 'none')" if unknown
                         else f"expected {AUTO!r}, 'none' or a comma list of {', '.join(MESHES)}; got {value!r}")
    return tuple(n for n in MESHES if n in names)
