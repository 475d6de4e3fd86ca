"""A cell's device mesh: accelerate's ``ParallelismConfig`` at one of the harness's shapes (``mesh=``
in the variant, under FSDP2; docs/wrappers.md, "Meshes").

``Shape`` is the harness's own account of the mesh, from the sizes alone, and it is what the oracle,
the data and the collective accounting go by:

- where each rank sits: ``init_device_mesh`` lays the ranks out row-major over the dimensions in
  accelerate's order (dp_replicate, dp_shard, cp, tp), and the mesh accelerate built is checked
  against this layout after the Accelerator is made (``verify``);
- which ranks average each other's gradients: those that differ in a data-parallel or context
  dimension only (accelerate's ``dp_cp``: context ranks hold different tokens of the same batch);
  tensor-parallel peers hold other slices of the same parameters, never replicas;
- which ranks draw the same batch: tensor- and context-parallel peers (accelerate's dataloader gives
  rank ``r`` the batches of data shard ``r // (tp * cp)``, one of ``dp_replicate * dp_shard``).

On CPU accelerate builds the mesh (gloo) but would not apply FSDP (harness/wrappers/prepare.py,
``fsdp_on_cpu``), and its ``ParallelismConfig`` refuses a mesh that is not FSDP's at construction:
that check is run once FSDP is in place instead, every word of it (``after_construction``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from harness.decorator import SkipCell, Unsupported
from harness.wrappers.registry import MESHES, WrongWrapper

# accelerate's order of mesh dimensions (ParallelismConfig._get_mesh), the slowest-varying first
ORDER = ("dp_replicate", "dp_shard", "cp", "tp")
DATA_PARALLEL = ("dp_replicate", "dp_shard")
AVERAGED = ("dp_replicate", "dp_shard", "cp")  # accelerate's dp_cp: where the loss is averaged


@dataclass(frozen=True)
class Shape:
    """A mesh of ``world_size`` ranks: its name and the size of each dimension (1 where unused)."""

    name: str
    sizes: tuple[tuple[str, int], ...]  # every dimension of ORDER, in that order

    def size(self, dim: str) -> int:
        return dict(self.sizes)[dim]

    @property
    def world_size(self) -> int:
        return math.prod(n for _, n in self.sizes)

    @property
    def active(self) -> tuple[tuple[str, int], ...]:
        """The dimensions of size > 1, as accelerate's mesh has them."""
        return tuple((d, n) for d, n in self.sizes if n > 1)

    def describe(self) -> str:
        return " x ".join(f"{d}={n}" for d, n in self.active)

    def coordinate(self, rank: int) -> dict[str, int]:
        out, rest = {}, rank
        for dim, n in reversed(self.sizes):
            out[dim] = rest % n
            rest //= n
        return out

    def rank_of(self, coordinate: dict[str, int]) -> int:
        rank = 0
        for dim, n in self.sizes:
            rank = rank * n + coordinate[dim]
        return rank

    def peers(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """The ranks that sit where ``rank`` does but in ``dims`` (``rank`` among them), in rank order."""
        mine = self.coordinate(rank)
        ranges = [range(self.size(d)) if d in dims else [mine[d]] for d, _ in self.sizes]
        return sorted(self.rank_of(dict(zip(ORDER, c))) for c in itertools.product(*ranges))

    def averaging_group(self, rank: int) -> list[int]:
        """The ranks whose gradients ``rank``'s must be the average of (its own among them)."""
        return self.peers(rank, AVERAGED)

    def dimensions_of(self, group: list[int], rank: int) -> set[str]:
        """The active dimensions a process group of ``rank`` spans: those ``D`` whose peers of
        ``rank`` in ``D`` are the group (a group the mesh does not have spans none)."""
        active = [d for d, _ in self.active]
        for count in range(1, len(active) + 1):
            for dims in itertools.combinations(active, count):
                if self.peers(rank, dims) == group:
                    return set(dims)
        return set()

    def tensor_parallel_group(self, rank: int) -> list[int]:
        return self.peers(rank, ("tp",))

    @property
    def data_shards(self) -> int:
        """How many different batches the ranks draw at each step (accelerate's dataloader)."""
        return self.size("dp_replicate") * self.size("dp_shard")

    def shard_ranks(self) -> list[list[int]]:
        """The ranks that draw each data shard, by shard."""
        return [[r for r in range(self.world_size) if self.data_index(r) == i] for i in range(self.data_shards)]

    def data_index(self, rank: int) -> int:
        """The data shard ``rank`` draws: tensor- and context-parallel peers draw the same."""
        return rank // (self.size("cp") * self.size("tp"))


def shape(name: str, world_size: int) -> Shape:
    """The mesh ``name`` at ``world_size`` ranks; SkipCell where it cannot be formed (each of the
    harness's meshes has a dimension of 2 beside a data-parallel one of at least 2)."""
    if name not in MESHES:
        raise ValueError(f"unknown mesh {name!r}; known: {', '.join(MESHES)}")
    if world_size < 4 or world_size % 2:
        raise SkipCell(f"mesh={name} runs at an even world size of 4 or more (2 x 2): "
                       f"{world_size} ranks cannot form it")
    half = world_size // 2
    sizes = {"dp_replicate": 1, "dp_shard": half, "cp": 1, "tp": 1}
    sizes.update({"hsdp": {"dp_replicate": 2}, "tp": {"tp": 2}, "cp": {"cp": 2}}[name])
    return Shape(name, tuple((d, sizes[d]) for d in ORDER))


def accelerator_kwargs(mesh: Shape, *, device_type: str) -> dict[str, Any]:
    """``parallelism_config=`` for ``mesh``; Unsupported where the installed accelerate has no
    ``ParallelismConfig``. On CPU its check of the Accelerator is deferred to ``after_construction``
    (see the module's docstring)."""
    import accelerate
    import accelerate.utils

    from harness.rank.numerics.backend_defects import AVG_ALL_REDUCE, lacks
    from harness.wrappers import probe

    if mesh.size("dp_replicate") > 1 and lacks(AVG_ALL_REDUCE):
        raise SkipCell(f"mesh={mesh.name}: FSDP2 averages the replicas' shards with an {AVG_ALL_REDUCE}, "
                       f"which this backend cannot do: {lacks(AVG_ALL_REDUCE)}")
    config_class = probe.require(accelerate.utils, "ParallelismConfig", "accelerate.utils.ParallelismConfig")
    probe.require_parameter(accelerate.Accelerator, "parallelism_config", "Accelerator(parallelism_config=...)")
    sizes = {f"{d}_size": n for d, n in mesh.sizes if n > 1}
    try:
        config = config_class(**sizes)
    except ImportError as exc:  # accelerate 1.10 to 1.12: tp_size needs transformers (its version read at once)
        spelled = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise Unsupported(f"ParallelismConfig({spelled})",
                          f"accelerate {accelerate.__version__} raised {type(exc).__name__}: {exc}") from None
    if device_type == "cpu":
        deferred = config._validate_accelerator
        config._validate_accelerator = lambda accelerator: None  # an instance attribute: the class is untouched
        config._harness_deferred_validation = deferred
    return {"parallelism_config": config}


def after_construction(mesh: Shape, accelerator: Any) -> None:
    """accelerate's own check of the mesh against the Accelerator (deferred on CPU), then the mesh it
    built against the harness's layout: WrongWrapper where it differs (the cell would check another mesh)."""
    config = accelerator.parallelism_config
    deferred = getattr(config, "_harness_deferred_validation", None)
    if deferred is not None:
        del config._validate_accelerator
        deferred(accelerator)
    verify(mesh, accelerator.torch_device_mesh)


def verify(mesh: Shape, device_mesh: Any) -> None:
    """WrongWrapper unless ``device_mesh`` has the mesh's dimensions and its ranks laid out row-major."""
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    expected_names = tuple(d for d, _ in mesh.active)
    if names != expected_names:
        raise WrongWrapper(f"accelerate built a mesh of dimensions {names}, but the cell is mesh={mesh.name} "
                           f"({mesh.describe()})")
    layout = [int(r) for r in device_mesh.mesh.reshape(-1).tolist()]
    if layout != list(range(mesh.world_size)):
        raise WrongWrapper(f"accelerate's mesh places the ranks as {layout}, not row-major over "
                           f"{mesh.describe()} as the harness expects")


def tensor_parallel_plan(model: Any) -> dict[str, str]:
    """Which Linear layers of ``model`` tensor parallelism shards, and how (``colwise``, ``rowwise``):
    in each module, a ``Linear`` whose output feeds the next ``Linear`` (in_features == out_features,
    even) column-wise, that next one row-wise (Megatron's MLP split). Every other parameter is left
    for accelerate, which replicates it over ``tp``."""
    from torch import nn

    plan: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        linears = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        index = 0
        while index + 1 < len(linears):
            (first, a), (second, b) = linears[index], linears[index + 1]
            if a.out_features == b.in_features and a.out_features % 2 == 0:
                prefix = f"{parent_name}." if parent_name else ""
                plan[prefix + first], plan[prefix + second] = "colwise", "rowwise"
                index += 2
            else:
                index += 1
    return plan


def tensor_parallel(model: Any, device_mesh: Any) -> None:
    """Shard ``model`` over the mesh's ``tp`` dimension (``tensor_parallel_plan``) before accelerate
    prepares it, as a user does ("Model should undergo tensor parallel before passing it to
    accelerate"). A model with nothing to shard cannot run under mesh=tp: SkipCell."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = tensor_parallel_plan(model)
    if not plan:
        raise SkipCell(f"mesh=tp: {type(model).__name__} has no pair of Linear layers to shard over tp")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, device_mesh["tp"], {name: styles[style]() for name, style in plan.items()})


def split_like_tensor_parallel(replica: Any, parts: int) -> None:
    """Make the oracle's ``replica`` (unsharded) compute its tensor-parallel layers as ``parts`` ranks
    do, so that its rounding is theirs (each layer's forward replaced on the instance; the parameters
    and their names are untouched):

    - column-wise: each rank's rows of the weight (and bias) applied to the whole input, the outputs
      side by side (``ColwiseParallel``: Shard(0) weight, Replicate input);
    - row-wise: each rank's columns of the weight applied to its slice of the input, with the bias
      divided by ``parts`` on every rank (DTensor makes a Replicate bias Partial so to add it to a
      Partial product), the partial outputs then summed (the all-reduce of ``RowwiseParallel``'s
      Partial output). At two ranks the sum's order does not matter; the backward's sums of two
      partial gradients neither."""
    import functools

    import torch
    from torch.nn import functional

    def colwise(module: Any, x: Any) -> Any:
        weights = [w.contiguous() for w in module.weight.chunk(parts, 0)]
        biases = module.bias.chunk(parts, 0) if module.bias is not None else [None] * parts
        return torch.cat([functional.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)

    def rowwise(module: Any, x: Any) -> Any:
        bias = module.bias / parts if module.bias is not None else None
        # each rank's slice is a tensor of its own (contiguous), as the kernels see it there
        outputs = [functional.linear(xk.contiguous(), wk.contiguous(), bias)
                   for xk, wk in zip(x.chunk(parts, -1), module.weight.chunk(parts, 1))]
        total = outputs[0]
        for out in outputs[1:]:
            total = total + out
        return total

    for name, style in tensor_parallel_plan(replica).items():
        module = replica.get_submodule(name)
        module.forward = functools.partial(colwise if style == "colwise" else rowwise, module)


def tensor_parallel_all(objects: Any, device_mesh: Any) -> None:
    """``tensor_parallel`` on every model among ``objects`` (what a case hands ``prepare``), and its
    optimizers among them pointed at the sharded parameters, as if they had been made after the
    sharding (parallelize_module replaces each sharded parameter by a DTensor one)."""
    import torch
    from torch import nn

    models = [obj for obj in objects if isinstance(obj, nn.Module)]
    before = {id(p): (index, name) for index, model in enumerate(models) for name, p in model.named_parameters()}
    for model in models:
        tensor_parallel(model, device_mesh)
    after = {(index, name): p for index, model in enumerate(models) for name, p in model.named_parameters()}
    for optimizer in (obj for obj in objects if isinstance(obj, torch.optim.Optimizer)):
        if optimizer.state:
            raise ValueError("mesh=tp: an optimizer that has stepped cannot be moved to the sharded parameters")
        for group in optimizer.param_groups:
            group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
