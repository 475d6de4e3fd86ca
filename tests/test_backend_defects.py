"""The backend's probed defects (``PROBED`` in harness/decorator.py; harness/rank/backend_defects.py):
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

    from harness.rank import backend_defects

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


def test_one_process_has_nothing_to_average_and_the_probe_finds_nothing():
    from harness.rank import backend_defects

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
