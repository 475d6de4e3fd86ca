"""The backend's probed defects (``PROBED`` in harness/decorator.py; harness/rank/numerics/backend_defects.py):
the ranks' start-up probe finds gloo's AVG reduce-scatter that sums (pytorch/pytorch#162338) where it
is planted, and nothing on a gloo that averages; and on such a gloo every FSDP2 cell whose syncs go
through it is ``detected`` naming it, while every other cell is judged as usual."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest
from conftest import ROOT
from distributed import run_on_ranks

from harness.decorator import GLOO_AVG_SUMS

# every process started with this folder on PYTHONPATH has a gloo whose AVG reduce-scatter sums
SUMMING_GLOO = Path(__file__).resolve().parent / "planted" / "gloo_avg_sums"


def _probe(rank: int, world_size: int, plant: bool) -> tuple[list[str], float]:
    """What the probe finds on this rank, and what a reduce-scatter with AVG gave (rank r holding r + 1)."""
    import torch
    import torch.distributed as dist

    from harness.rank.numerics import backend_defects

    if plant:
        runpy.run_path(str(SUMMING_GLOO / "sitecustomize.py"))
    out = torch.empty(1)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, torch.full((world_size,), float(rank + 1)), op=dist.ReduceOp.AVG)
    backend_defects.probe()
    return sorted(backend_defects.found()), out.item()


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_probe_finds_a_summing_avg_where_planted_and_agrees_with_the_installed_gloo_elsewhere(world_size):
    for rank, (found, given) in enumerate(run_on_ranks(_probe, world_size, True)):
        assert given == world_size * (world_size + 1) / 2  # the plant sums
        assert found == [GLOO_AVG_SUMS], f"rank {rank}"
    for rank, (found, given) in enumerate(run_on_ranks(_probe, world_size, False)):
        sums = given == world_size * (world_size + 1) / 2
        assert sums or given == (world_size + 1) / 2
        assert found == ([GLOO_AVG_SUMS] if sums else []), f"rank {rank}: the gloo gave {given}"


def _refusing_avg(rank: int, world_size: int, plant: bool) -> str:
    """What the probe says of the backend's all-reduce with AVG, where it is refused as gloo before
    torch 2.8 refuses it (planted) or not."""
    import torch.distributed as dist

    from harness.rank.numerics import backend_defects

    if plant:
        real = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == dist.ReduceOp.AVG:
                raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")
            return real(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = all_reduce
    backend_defects.probe()
    return backend_defects.lacks(backend_defects.AVG_ALL_REDUCE)


def test_a_backend_that_refuses_an_avg_all_reduce_is_found_and_an_hsdp_cell_is_skip_saying_so(monkeypatch):
    assert run_on_ranks(_refusing_avg, 2, False) == ["", ""]
    refused = run_on_ranks(_refusing_avg, 2, True)
    assert all("gloo refuses it (Cannot use ReduceOp.AVG with Gloo)" in why for why in refused), refused
    from harness.decorator import SkipCell
    from harness.rank.numerics import backend_defects
    from harness.wrappers.mesh import accelerator_kwargs, shape

    monkeypatch.setattr(backend_defects, "_lacks", {backend_defects.AVG_ALL_REDUCE: refused[0]})
    with pytest.raises(SkipCell, match="mesh=hsdp: FSDP2 averages the replicas' shards with an all-reduce with "
                                       "ReduceOp.AVG, which this backend cannot do: torch .*'s gloo refuses it"):
        accelerator_kwargs(shape("hsdp", 4), device_type="cpu")
    accelerator_kwargs(shape("cp", 4), device_type="cpu")  # no replicas to all-reduce: a cp mesh runs


def test_one_process_has_nothing_to_average_and_the_probe_finds_nothing():
    from harness.rank.numerics import backend_defects

    backend_defects.probe()  # no process group: one rank
    assert backend_defects.found() == frozenset()


def test_on_a_gloo_whose_avg_sums_the_fsdp2_cells_are_detected_naming_it_and_the_rest_judged_as_usual(run_pytest):
    session = run_pytest("cases/test_fused_loss.py", "cases/test_accumulate.py", "-k",
                         "(fused_loss or test_accumulate[) and not bf16 and not compile and not mesh",
                         "--world-sizes", "1,2", "--wrappers", "ddp,fsdp2",
                         PYTHONPATH=os.pathsep.join([str(ROOT), str(SUMMING_GLOO)]))
    cells = session.cells()
    fsdp2 = {key: c for key, c in cells.items() if "wrapper=fsdp2" in key[1] and key[2] == 2}
    assert fsdp2, sorted(cells)
    for key, c in fsdp2.items():
        assert c["status"] == "detected", (key, c["summary"])
        assert "pytorch/pytorch#162338" in c["summary"] and "fixed in torch 2.9.0" in c["summary"], c["summary"]
    others = {key: c for key, c in cells.items() if key not in fsdp2 and c["status"] != "skip"}
    assert others and all(c["status"] == "pass" for c in others.values()), {k: c["summary"] for k, c in others.items()}
    assert session.returncode == 0, session.stdout[-2000:]


def _reduce_ops(rank: int, world_size: int, factors: tuple) -> str:
    """What the harness reads of FSDP2's reduce-scatter where ``_get_gradient_divide_factors`` answers
    ``factors`` (torch 2.7's two-tuple, or 2.8's four)."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from harness.wrappers.sharding import fsdp2_reduce_op

    _fsdp_collectives._get_gradient_divide_factors = lambda *args, **kwargs: factors
    return fsdp2_reduce_op(torch.float32)


def test_fsdp2s_reduce_op_is_read_from_torch_27s_two_factors_and_28s_four():
    """Torch 2.7's FSDP2 answers (pre, post), reducing with AVG where both are None; from 2.8 it answers
    the ops too: where either says AVG, the probed gloo defect can touch the cell (the oracle's order too)."""
    import torch.distributed as dist

    assert run_on_ranks(_reduce_ops, 1, (None, None)) == [""]
    assert run_on_ranks(_reduce_ops, 1, (2.0, 1.0)) == [
        "FSDP2 reduce-scatters with SUM, dividing by 2 before here, not AVG"]
    assert run_on_ranks(_reduce_ops, 1, (None, None, dist.ReduceOp.AVG, dist.ReduceOp.AVG)) == [""]
