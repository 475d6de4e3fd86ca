"""A large model's gradient check fused with its sync's average (harness/rank/numerics/fused_check.py): on real
gloo ranks it passes the average bit for bit, fails every rank together when one rank is off, decides
in a second pass what the average alone cannot (cancellation, alike ranks); and on the catalogue's
own DDP cells, run through it (GRADSYNC_HARNESS_FUSED_FROM=0), every cell clean and under every
planted fault is what the small-model path makes it: the same statuses, diagnoses, checks and vacuous
checks, and at two ranks the same greatest difference."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks

from harness.rank.oracle.averaging import FUSED_FROM_VARIABLE

SHAPES = {"w": (64, 33), "b": (64,)}


def _grads(rank: int, scenario: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 if scenario == "alike" else 100 + rank)
    grads = {k: torch.randn(*shape, generator=generator) for k, shape in SHAPES.items()}
    if scenario == "cancel":  # the ranks' values nearly cancel: the average is far smaller than its allowance
        base = {k: torch.randn(*shape, generator=torch.Generator().manual_seed(5)) for k, shape in SHAPES.items()}
        grads = {k: base[k] * (1 if rank == 0 else -1) + 1e-6 * grads[k] for k in SHAPES}
    return grads


def _fused_job(rank: int, world_size: int, scenario: str) -> dict[str, object]:
    import torch.distributed as dist

    from harness.rank.numerics.closeness import no_allowance
    from harness.rank.numerics.collectives import Collectives
    from harness.rank.numerics.fused_check import check_synced

    grads = _grads(rank, scenario)
    summed = {k: g.clone() for k, g in grads.items()}
    for t in summed.values():
        dist.all_reduce(t)
    average = {k: t / world_size for k, t in summed.items()}  # DDP's average here: the oracle's bit for bit
    actual = {k: t.clone() for k, t in average.items()}
    if scenario == "one_off" and rank == 1:
        actual["w"][3, 5] *= 1 + 1e-5
    if scenario == "cancel":
        # half of the allowance off: close, but only the allowance itself can say so
        magnitude = sum(g.abs() for g in [_grads(r, scenario)["b"] for r in range(world_size)])
        actual["b"] = actual["b"] + 0.5 * 2 * torch.finfo(torch.float32).eps * magnitude
    params = {k: torch.zeros_like(g) for k, g in grads.items()}
    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        outcome = check_synced(Collectives(rank=rank, world_size=world_size), params=params, grads=grads,
                               carried={k: no_allowance() for k in grads}, rounded=set(grads), local=grads,
                               actual=actual)
    finally:
        dist.all_reduce = all_reduce
    assert all(torch.equal(outcome.average[k], average[k]) for k in grads) or not outcome.passed
    return {"passed": outcome.passed, "same": outcome.same, "max_abs": outcome.max_abs,
            "distinguishable": outcome.distinguishable, "calls": calls}


def test_the_average_bit_for_bit_passes_on_one_pass_of_the_values_alone():
    got = run_on_ranks(_fused_job, 2, "exact")
    assert [g["passed"] for g in got] == [True, True] and [g["same"] for g in got] == [True, True]
    assert [g["max_abs"] for g in got] == [0.0, 0.0] and all(g["distinguishable"] for g in got)
    elements = sum(torch.Size(s).numel() for s in SHAPES.values())
    # the values and the allowance at the samples, then the flag: no allowance of every element
    assert got[0]["calls"][0] < 1.2 * elements and len(got[0]["calls"]) == 2


def test_one_rank_off_by_1e5_once_fails_every_rank_together():
    got = run_on_ranks(_fused_job, 2, "one_off")
    assert [g["passed"] for g in got] == [False, False]  # rank 0 passed its own: it must diagnose too
    assert got[0]["max_abs"] == 0.0 and got[1]["max_abs"] > 0.0


def test_where_the_ranks_cancel_the_allowance_itself_decides_in_a_second_pass():
    got = run_on_ranks(_fused_job, 2, "cancel")
    assert [g["passed"] for g in got] == [True, True] and got[0]["max_abs"] > 0.0
    elements = sum(torch.Size(s).numel() for s in SHAPES.values())
    assert any(n >= 2 * elements for n in got[0]["calls"])  # values and every element's allowance share


def test_alike_ranks_are_vacuous_only_after_every_element_was_asked():
    got = run_on_ranks(_fused_job, 2, "alike")
    assert [g["passed"] for g in got] == [True, True]
    assert [g["distinguishable"] for g in got] == [False, False]
    assert len(got[0]["calls"]) == 4  # the sample could not tell them apart: the whole pass, then its flag


# The catalogue's DDP cells through the fused pass, against the small-model path: clean at two and
# three ranks, under each fault of accelerate's logic at two.
CASES = ["fused_loss", "accumulate", "no_sync", "no_sync_trigger_sync", "accumulate_clip_grad", "accumulate_adamw",
         "accumulate_sync_each_batch", "accumulate_multi_model", "unused_parameters", "accumulate_token_loss"]
FAULTS = [None, "no_sync_still_syncs", "trigger_noop", "loss_not_scaled", "zero_grad_skipped", "grads_summed",
          "optimizer_every_batch", "sync_each_batch_ignored", "perturb:1e-06"]


def _cells(world_size: int, faults: list[str | None], fused: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    from conftest import ROOT

    from harness import catalogue
    from harness.selfcheck import run as selfcheck

    if fused:
        monkeypatch.setenv(FUSED_FROM_VARIABLE, "0")
    else:
        monkeypatch.delenv(FUSED_FROM_VARIABLE, raising=False)
    known = {c.name for c in catalogue.discover(ROOT / "cases")}
    targets = selfcheck.select_targets(catalogue.discover(ROOT / "cases"), cases=[c for c in CASES if c in known],
                                       variants=["fp32", "bf16"])
    first = {}
    for t in targets:  # each case's first DDP variant of each precision
        if t.wrapper == "ddp" and "compile" not in t.variant.params:
            first.setdefault((t.case.name, t.precision), t)
    targets = list(first.values())
    out = {}
    with selfcheck.Runner(world_size=world_size) as runner:
        for fault in faults:
            for target in targets:
                cell = runner.run(target, fault=fault)
                out[(fault, target.label)] = (cell.status, sorted({f.kind for f in cell.failures}), cell.checks,
                                              cell.grad_checks, cell.vacuous_checks, cell.max_abs_diff)
    return out


@pytest.mark.parametrize("world_size, faults", [(2, FAULTS), (3, [None])], ids=["ws2-faults", "ws3-clean"])
def test_the_catalogues_cells_through_the_fused_pass_are_what_the_small_model_path_makes_them(
        world_size, faults, monkeypatch):
    small = _cells(world_size, faults, False, monkeypatch)
    fused = _cells(world_size, faults, True, monkeypatch)
    assert set(small) == set(fused) and len(small) >= 20 * len(faults)
    caught = [k for k, v in small.items() if k[0] is not None and v[0] == "fail"]
    assert len(caught) > 10 or faults == [None]  # the faults were caught: diagnoses compared, not only passes
    at_three = world_size > 2  # a ring of three adds in the buffer's order: the greatest difference moves
    differ = {k: (small[k], fused[k]) for k in small
              if (small[k][:5] != fused[k][:5]) or (not at_three and small[k][5] != fused[k][5])}
    assert differ == {}
