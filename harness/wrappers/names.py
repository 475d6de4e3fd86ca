"""The wrapper names and what each wrapper does between sync points, as data (imports nothing).

A cell under a wrapper other than DDP carries ``wrapper=<name>`` in its variant (docs/wrappers.md).
``--wrappers`` selects them (``parse``). How a cell gets its wrapper from accelerate and makes sure it
has it: harness/wrappers/prepare.py.
"""

from __future__ import annotations

DDP = "ddp"
# The public names, in report order (docs/wrappers.md).
WRAPPERS = (DDP, "fsdp2", "fsdp1", "deepspeed-z1", "deepspeed-z2", "deepspeed-z3")
FSDP = ("fsdp2", "fsdp1")
DEEPSPEED = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3}
AUTO = "auto"
# ZeRO >= 2 partitions gradients: it reduces them after every micro-batch by design, and accelerate
# skips ``no_sync`` for it (accelerate PR #3656). Every other wrapper issues no gradient reduction
# between sync points.
REDUCES_EVERY_MICRO_BATCH = frozenset({"deepspeed-z2", "deepspeed-z3"})
# The precisions the oracle models under each wrapper. FSDP's and DeepSpeed's bf16 is not autocast:
# accelerate gives FSDP2 ``param_dtype=reduce_dtype=output_dtype=bf16``, FSDP1 ``MixedPrecision(param_dtype=
# reduce_dtype=buffer_dtype=bf16)`` and DeepSpeed bf16 weights over fp32 masters, which the oracle
# models as such (harness/rank/oracle/replica.py, harness/rank/oracle/sharded_reduce.py). fp16 is modelled under DDP
# only (its loss scaler).
PRECISIONS = {DDP: ("fp32", "bf16", "fp16"), **{w: ("fp32", "bf16") for w in WRAPPERS if w != DDP}}
# The bf16 cells a wrapper also runs with another dtype policy, as (variant parameter, its values):
# FSDP2 with an explicit MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (``reduce=fp32``;
# without it, accelerate's own policy: param, reduce and output dtype bf16); ZeRO-1 with DeepSpeed's
# ``data_types.grad_accum_dtype: fp32`` (``grad_accum=fp32``), the one configuration that builds
# DeepSpeed's BF16_Optimizer under ZeRO (fp32 accumulation, the reduction still bf16), where
# DeepSpeed PR #7985's defect lived.
MIXED_AXES = {"fsdp2": ("reduce", ("fp32",)), "deepspeed-z1": ("grad_accum", ("fp32",))}
DEFAULT_PRECISIONS = ("fp32",)
# The wrappers compiled variants run under: DDP, where compiled no_sync has had real bugs (pytorch
# #109774), and FSDP2, which torch.compile is built to trace.
COMPILED = frozenset({DDP, "fsdp2"})
# The meshes a case can run on (``@case(meshes=...)``), from accelerate's ``ParallelismConfig``, under
# FSDP2 (the wrapper accelerate applies a mesh with): each names the data-parallel and the other
# dimensions of a world of 4 (2 x 2) or more (harness/wrappers/mesh.py gives the shape at each size).
# ``hsdp``: dp_replicate=2 x dp_shard=world/2; ``tp``: dp_shard=world/2 x tp=2; ``cp``: dp_shard=world/2 x cp=2.
MESHES = ("hsdp", "tp", "cp")
MESH_WRAPPER = "fsdp2"


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
