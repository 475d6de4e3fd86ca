"""FSDP's and DeepSpeed's gradient reduction in bf16 and fp32, reproduced on one rank for the oracle.

FSDP2, FSDP1 and DeepSpeed in bf16 differentiate bf16 copies of the fp32 masters
(harness/rank/oracle/replica.py, ``ShardedMixedReplica``), so each backward's unsharded gradient is bf16; in
fp32 they differentiate the unsharded fp32 parameters, and every cast below is a no-op (FSDP1's one
difference: in fp32 autograd sums a backward's forwards' contributions to its flat parameter before
adding them to its gradient, ``adds_contributions_once``).
What happens to it until the sync, and at the sync, is the wrapper's own arithmetic, and the oracle
repeats it (DeepSpeed's: ``ShardedReduce._deepspeed_layout`` and docs/wrappers.md):

- between syncs the unsharded gradients accumulate: FSDP2 casts each backward's to the reduce dtype
  and adds it there (``FSDPParam.unsharded_accumulated_grad``); FSDP1 lets autograd add it into the
  flat parameter's gradient, in the param dtype (the flat parameter is bf16 in the backward), and
  casts the sum to the reduce dtype at the sync (``_post_backward_hook``);
- at the sync they are reduce-scattered in the reduce dtype: FSDP2 with ReduceOp.AVG (gloo sums,
  then divides by the world size), FSDP1 with SUM between its own pre- and post-divide factors
  (``_gradient_predivide_factor``: 2 at world sizes 2 to 5, the post factor the rest: 1.5 at 3);
- the reduced shard, cast to fp32, is added to the sharded gradient held (FSDP2's ``sharded_param.grad``,
  FSDP1's ``_saved_grad_shard``): the fp32 add the oracle does on the whole gradient, bit for bit.

On gloo the reduce-scatter is reproduced bit for bit (harness/rank/numerics/collectives.py, ``ring_average``)
from the wrapper's layout: FSDP2's per-group ``_chunk_cat`` of dim-0 shards, FSDP1's flat parameter
with its alignment padding. Where the order is not known (another backend, another divide, a layout
that cannot be read), the reduction is allowed its dtype's sum bound and the cell says so.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
from torch import nn

from harness.decorator import GLOO_AVG_SUMS
from harness.rank.numerics.backend_defects import found
from harness.rank.numerics.closeness import Expectation, no_allowance, rounding_allowance
from harness.rank.numerics.collectives import Collectives, Reduction
from harness.rank.numerics.ring_order import flat_segments, ring_order_holds, ring_segments
from harness.rank.oracle.replica import AUTOCAST_DTYPES
from harness.wrappers import sharding
from harness.wrappers.cell import CellConfig
from harness.wrappers.prepared import unwrap

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# the precisions whose reduction under a sharded wrapper is reproduced here, and the dtype the wrapper
# differentiates in: bf16 (and fp16) as above; fp32, the same arithmetic with every cast a no-op
SHARDED_PRECISIONS = {**AUTOCAST_DTYPES, "fp32": torch.float32}
Key = tuple[str, str]  # (model name, parameter name)


class ShardedReduce:
    """One rank's unsharded gradients since the last sync under the cell's wrapper and its dtype policy
    (``config``: harness/wrappers/cell.py; fp32, or bf16), and their reduction at the sync. ``models``:
    the user's models by name, which FSDP prepares in place (FSDP2) or wraps (FSDP1; its wrapper
    recorded at prepare), read at a sync for the layout."""

    def __init__(self, config: CellConfig, params: Mapping[str, Mapping[str, torch.Tensor]],
                 models: Mapping[str, nn.Module], collectives: Collectives) -> None:
        spec = config.spec
        self.spec = spec
        self.mesh = config.mesh  # a harness/wrappers/mesh.py Shape, or None
        self.param_dtype = SHARDED_PRECISIONS[config.precision]
        self.reduce_dtype = torch.float32 if config.reduce == "fp32" else self.param_dtype
        # DeepSpeed's BF16_Optimizer (ZeRO-1 with ``grad_accum=fp32``) adds each micro-batch's bf16
        # gradient to an fp32 sum, reduced in bf16 at the boundary, the world size divided after
        self.bf16_optimizer = config.grad_accum == "fp32"
        self.accumulate_dtype = (self.reduce_dtype if spec.accumulates_in == "reduce"
                                 else torch.float32 if self.bf16_optimizer else self.param_dtype)
        # DeepSpeed's ZeRO stage (None under FSDP), and whether it reduces every micro-batch (ZeRO-2/3:
        # the reduced gradients then add up in bf16 until the boundary, in ``reduced``)
        self.stage = spec.zero_stage
        # FSDP1 without mixed precision differentiates the flat parameter itself: autograd sums the
        # forwards' contributions to it (last forward first, ``ShardedMixedReplica.contributions``)
        # and adds the sum to its gradient once; in bf16 each is added apart (measured, torch 2.13)
        self.adds_contributions_once = spec.flat_parameters and self.param_dtype == torch.float32
        self.every_backward = spec.reduces_every_micro_batch
        self.models = dict(models)
        self.collectives = collectives
        self.world_size = collectives.world_size
        # since the last sync (fp32 tensors holding accumulate-dtype values), and which took part:
        # FSDP2 reduce-scatters only the gradients it holds, and their layout sets each element's order
        self.pending = {name: {p: torch.zeros_like(t) for p, t in ps.items()} for name, ps in params.items()}
        self.taking_part: set[Key] = set()
        self.reduced: dict[Key, Expectation] = {}
        # each model's parameters in the order the last backward gave them their gradients
        # (harness/rank/oracle/replica.py): ZeRO-2's bucket order
        self.order: dict[str, list[str]] = {}
        # the backend's probed defects (``PROBED``, harness/decorator.py) the wrapper's syncs went through
        self.defects: set[str] = set()

    def flat_groups(self, name: str) -> list[list[str]] | None:
        """FSDP1: the parameters of each of the model's flat parameters, in their order (one group of
        every parameter where the layout cannot be read); FSDP2 (no flat parameters): None."""
        if not self.spec.flat_parameters:
            return None
        layout = sharding.fsdp1_reduce_layout(unwrap(self.models[name]))
        if isinstance(layout, str):
            return [list(self.pending[name])]
        return [list(spans) for _, spans in layout[0]]

    def add(self, name: str, pname: str, grad: torch.Tensor) -> None:
        """One backward's unsharded gradient (bf16 values, upcast exactly), added as the wrapper adds it."""
        self.pending[name][pname] = self.round(self.pending[name][pname] + grad)
        self.taking_part.add((name, pname))

    def round(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the wrapper's accumulation holds it (rounded to its dtype), in ``value``'s dtype."""
        return value.to(self.accumulate_dtype).to(value.dtype)

    def adopt(self, name: str, pname: str, grad: torch.Tensor) -> None:
        """The rank's own unsharded gradient since the last sync (FSDP1 shows it between syncs)."""
        self.pending[name][pname] = grad.detach().to(self.pending[name][pname].dtype)

    def clear(self) -> None:
        for ps in self.pending.values():
            for t in ps.values():
                t.zero_()
        self.taking_part.clear()

    def held_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype ``held`` rounds a gradient of ``dtype`` to: DeepSpeed's accumulation dtype, else its own."""
        return self.accumulate_dtype if self.stage is not None else dtype

    def held(self, base: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        """A sync's average added to the gradient the wrapper holds, as it adds them: FSDP in fp32 (its
        sharded gradient), DeepSpeed in bf16 (its gradient partition, until the boundary)."""
        total = base + average
        return self.round(total) if self.stage is not None else total

    def after_backward(self, order: Mapping[str, list[str]], *, uncertain: bool = False) -> str:
        """After each backward: under ZeRO-2/3 its gradients reduced now, as DeepSpeed reduces every
        micro-batch, and added in bf16 to those reduced since the boundary (``reduced``); ``order``:
        by model, the parameters in the order the backward gave them their gradients; ``uncertain``:
        every rank's inputs are known only within their allowance (a backward with two token seeds),
        so the reduction keeps its bound and each add one rounding. Why the reduction is judged
        within its bound for an unknown order, or "" (a collective under ZeRO-2/3)."""
        self.order = dict(order)
        if not self.every_backward:
            return ""
        averaged, why = self._reduce(uncertain)
        for key, new in averaged.items():
            held = self.reduced.get(key)
            if held is None:
                self.reduced[key] = new
            else:
                value = self.round(held.value + new.value)
                # uncertain inputs (two token seeds): the add of sums known within an allowance may round apart
                allowed = held.allowed + new.allowed + (rounding_allowance(value, dtype=self.accumulate_dtype)
                                                        if uncertain else 0.0)
                self.reduced[key] = Expectation(value, allowed)
        return why

    def average(self, *, uncertain: bool = False) -> tuple[dict[Key, Expectation], str]:
        """Every pending gradient reduced as the wrapper reduces it at a sync, by (model, parameter),
        then cleared (under ZeRO-2/3: what every backward reduced since the last boundary); and why
        the reduction is judged within its bound for an unknown order, or "" where it is reproduced
        exactly or its inputs are ``uncertain`` (as in ``after_backward``: the bound, said nowhere)."""
        if self.every_backward:
            none = {(n, p): Expectation(torch.zeros_like(t), no_allowance(t.dtype))
                    for n, ps in self.pending.items() for p, t in ps.items()}
            averaged = {**none, **self.reduced}  # a parameter no backward reduced: nothing to add
            self.reduced = {}
            self.clear()
            return averaged, ""
        return self._reduce(uncertain)

    def _reduce(self, uncertain: bool) -> tuple[dict[Key, Expectation], str]:
        self._note_defects()
        pending: dict[Hashable, torch.Tensor] = {(n, p): t for n, ps in self.pending.items() for p, t in ps.items()}
        averaged = None
        if uncertain:
            why = ""  # the bound: the inputs, not the order, are what is not known (no NOT CHECKED)
        elif self.mesh is not None:
            staged, why = self._mesh_stages()
            if staged is not None:
                stages, segments = staged
                averaged = self.collectives.staged_average(pending, self.reduce_dtype, stages, segments)
        else:
            layout, why = self._layout()
            if layout is not None:
                segments, pre, post = layout
                averaged = self.collectives.ring_average(pending, segments, self.reduce_dtype, pre=pre, post=post,
                                                         post_scales=self.bf16_optimizer)
        if averaged is None:
            [averaged] = self.collectives.reduce_all([Reduction(pending, summed_in=self.reduce_dtype)])
            why = (f"the {DTYPE_NAMES.get(self.reduce_dtype, self.reduce_dtype)} reduction is judged "
                   f"within its rounding bound: {why}") if why else ""
        self.clear()
        return averaged, why  # type: ignore[return-value]

    def _note_defects(self) -> None:
        """FSDP2 reduce-scatters with ReduceOp.AVG over its shard group (the world, or under a mesh the
        ranks differing in dp_shard and cp): where the rank's start-up probe found gloo's AVG to sum
        (harness/rank/numerics/backend_defects.py), this sync goes through that defect. The oracle still averages."""
        if self.spec.fsdp_version != 2 or GLOO_AVG_SUMS not in found():
            return
        width = (len(self.mesh.peers(self.collectives.rank, ("dp_shard", "cp"))) if self.mesh is not None
                 else self.world_size)
        if width > 1 and not sharding.fsdp2_reduce_op(self.reduce_dtype):
            self.defects.add(GLOO_AVG_SUMS)

    def _mesh_stages(self) -> tuple[tuple[list[Any], dict[Hashable, torch.Tensor] | None] | None, str]:
        """FSDP2 over a mesh reduces in stages: a reduce-scatter over its shard group (accelerate's
        ``dp_shard_cp``: the ranks differing in dp_shard and cp), then, under HSDP, an all-reduce of
        the shard over the ``dp_replicate`` group, each with ReduceOp.AVG (torch's
        ``foreach_reduce``); tensor-parallel peers each reduce their own slice. Each stage's group, by
        rank, and where the shard group has more than two ranks each element's ring segment in its
        reduce-scatter (``_fsdp2_segments``); else None and why the order is not known."""
        mesh = self.mesh
        why = sharding.fsdp2_reduce_op(self.reduce_dtype)
        if why:
            return None, why

        def shard(r: int) -> list[int]:
            return mesh.peers(r, ("dp_shard", "cp"))

        def replicate(r: int) -> list[int]:
            return mesh.peers(r, ("dp_replicate",))

        if mesh.size("dp_replicate") > 2:
            return None, (f"FSDP2 over mesh={mesh.name} ({mesh.describe()}) all-reduces over {mesh.size('dp_replicate')} "
                          "replicas, in an order the oracle does not reproduce")
        segments = None
        width = len(shard(self.collectives.rank))
        if width > 2:
            why = ring_order_holds(self.world_size, self.reduce_dtype)
            if why:
                return None, why
            segments = self._fsdp2_segments(width)
            if isinstance(segments, str):
                return None, segments
        return ([shard, replicate], segments), ""

    def _fsdp2_segments(self, width: int) -> dict[Hashable, torch.Tensor] | str:
        """Each pending element's ring segment in FSDP2's reduce-scatter over a group of ``width``
        ranks: FSDP2's layout (``ring_segments``) of the gradients taking part, by parameter group;
        under a mesh's ``tp`` those are this rank's tensor-parallel slices (harness/wrappers/mesh.py's
        plan: column-wise rows, row-wise weight columns), mapped back to the elements of the whole
        gradient, elements of other slices staying 0 (not this rank's). A string says why where the
        layout cannot be read."""
        from harness.wrappers.mesh import tensor_parallel_plan

        mesh = self.mesh
        parts, part = (mesh.size("tp"), mesh.coordinate(self.collectives.rank)["tp"]) if mesh is not None else (1, 0)
        segments: dict[Hashable, torch.Tensor] = {(n, p): torch.zeros(t.numel(), dtype=torch.long)
                                                  for n, ps in self.pending.items() for p, t in ps.items()}
        for name, model in self.models.items():
            groups = sharding.fsdp2_reduce_groups(model)
            if not groups:
                return f"FSDP2's parameter groups of {name!r} could not be read"
            plan = tensor_parallel_plan(unwrap(model)) if parts > 1 else {}
            for group in groups:
                taking_part = [pname for pname in group if (name, pname) in self.taking_part]
                places = []
                for pname in taking_part:
                    full = self.pending[name][pname]
                    module, kind = pname.rpartition(".")[::2]
                    style = plan.get(module)
                    dim = 0 if style == "colwise" else 1 if style == "rowwise" and kind == "weight" else None
                    index = torch.arange(full.numel()).view(full.shape)
                    places.append(index if dim is None else index.chunk(parts, dim)[part].contiguous())
                for pname, place, segment in zip(taking_part, places, ring_segments([p.shape for p in places], width)):
                    segments[(name, pname)][place.reshape(-1)] = segment
        return segments

    def _layout(self) -> tuple[tuple[dict[Hashable, torch.Tensor], float, float | None] | None, str]:
        """Each pending element's ring segment and the divide factors before and after the sum (None:
        the world size after, as ReduceOp.AVG), or None and why the order is not known here."""
        segments: dict[Hashable, torch.Tensor] = {(n, p): torch.zeros(t.numel(), dtype=torch.long)
                                                  for n, ps in self.pending.items() for p, t in ps.items()}
        if self.stage is not None:
            return self._deepspeed_layout(segments)
        if not self.spec.flat_parameters:  # FSDP2: dim-0 shards of each parameter, grouped
            why = "" if self.world_size == 1 else sharding.fsdp2_reduce_op(self.reduce_dtype) or ring_order_holds(
                self.world_size, self.reduce_dtype)
            if why:
                return None, why
            fsdp2 = self._fsdp2_segments(self.world_size)
            return (None, fsdp2) if isinstance(fsdp2, str) else ((fsdp2, 1.0, None), "")
        factors: set[tuple[float, float]] = set()
        for name, model in self.models.items():
            layout = sharding.fsdp1_reduce_layout(unwrap(model))
            if isinstance(layout, str):
                return None, f"{name!r}: {layout}"
            handles, pre, post = layout
            factors.add((pre, post))
            for total, spans in handles:
                pnames = list(spans)
                for pname, segment in zip(pnames, flat_segments([spans[p] for p in pnames], total, self.world_size)):
                    segments[(name, pname)] = segment
        if len(factors) != 1:  # one world, one pair: FSDP1 derives them from the world size alone
            return None, f"FSDP1 divides by {sorted(factors)} in different models"
        [(pre, post)] = factors
        why = ring_order_holds(self.world_size, self.reduce_dtype, average=False) if self.world_size > 1 else ""
        return (None, why) if why else ((segments, pre, post), "")

    def _deepspeed_layout(self, segments: dict[Hashable, torch.Tensor]
                          ) -> tuple[tuple[dict[Hashable, torch.Tensor], float, float | None] | None, str]:
        """DeepSpeed's bf16 reduction: every rank divides its gradients by the world size in bf16,
        then they are summed in bf16 (harness/wrappers/deepspeed_cpu.py says where): ZeRO-1 and 2 with
        one all-reduce of a flat bucket (ZeRO-1's in parameter order, at the boundary; ZeRO-2's in
        the order the backward gave the gradients), ZeRO-3 with one reduce-scatter of every
        parameter's flat chunks by rank (FSDP2's layout of 1-D tensors). Only the gradients taking
        part are in it. BF16_Optimizer's: its fp32 sum cast to bf16, every parameter in parameter order
        in one flat buffer padded to a multiple of twice the world size, summed in bf16 by one
        all-reduce, then scaled by 1/world size (in fp32, rounded to bf16)."""
        from harness.wrappers import deepspeed_cpu

        why = ""
        for name, model in self.models.items():
            why = why or deepspeed_cpu.reduction_unlike_modelled(unwrap(model), self.reduce_dtype, self.bf16_optimizer)
        if not why and self.world_size > 1:
            why = ring_order_holds(self.world_size, self.reduce_dtype, average=False)
        if why:
            return None, why
        for name in self.models:
            if self.bf16_optimizer:  # every parameter, used or not: its flat fp32 sum holds them all
                taking_part = list(self.pending[name])
            elif self.stage == 2:
                taking_part = [p for p in self.order.get(name, []) if (name, p) in self.taking_part]
            else:
                taking_part = [p for p in self.pending[name] if (name, p) in self.taking_part]
            sizes = [self.pending[name][p].numel() for p in taking_part]
            if self.stage == 3:
                places = ring_segments([torch.Size([n]) for n in sizes], self.world_size)
            else:
                spans = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
                pad = 2 * self.world_size if self.bf16_optimizer else 1  # BF16_Optimizer aligns to 2 x ws
                places = flat_segments(spans, -(-sum(sizes) // pad) * pad, self.world_size)
            for pname, segment in zip(taking_part, places):
                segments[(name, pname)] = segment
        if self.bf16_optimizer:  # summed first, scaled by 1 / world size after
            return (segments, 1.0, float(self.world_size)), ""
        return (segments, float(self.world_size), 1.0), ""

