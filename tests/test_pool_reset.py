"""A pool's ranks live for the whole run and keep what is not the cell's own (the process group, the
imported libraries, the objects frozen out of the garbage collector's reach): a cell must still see
what it would see in a fresh process. Proved by result, not by listing state: the same cells run on a
fresh pool and again after a varied run of other cells on one pool give the same cell, bit for bit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.catalogue import load_case_file
from harness.controller.cells import run_cell, settings_for
from harness.controller.options import resolve
from harness.controller.pool import PoolSet
from harness.selfcheck.run import Target
from harness.wrappers.registry import WRAPPERS
from harness.wrappers.prepare import cell_variants

ROOT = Path(__file__).resolve().parent.parent


def target(case_file: str, variant: str) -> Target:
    name, _, variant = variant.partition(":")
    case = next(c for c in load_case_file(ROOT / "cases" / case_file) if c.name == name)
    known = cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
    return Target(case, next(v for v in known if v.name == variant))


PROBES = [("test_fused_loss.py", "fused_loss:fp32"), ("test_accumulate.py", "accumulate:steps=3-bf16"),
          ("test_accumulate_optim.py", "accumulate_adamw:steps=2-fp32")]
# every kind of cell the catalogue runs on one pool: precisions, a compiled model, sharded wrappers,
# token losses, a canary, several models, a scheduler, clipping
BETWEEN = [("test_accumulate.py", "accumulate:steps=2-fp32-compile=aot_eager"),
           ("test_accumulate.py", "accumulate:steps=2-fp32-wrapper=fsdp2"),
           ("test_fused_loss.py", "fused_loss:fp32-wrapper=fsdp1"),
           ("test_token_loss.py", "accumulate_token_mean:sync_each_batch=false-bf16"),
           ("test_accumulate.py", "accumulate_multi_model:steps=2-models=3-fp32"),
           ("test_accumulate_optim.py", "accumulate_scheduler:steps=2-split_batches=false-fp32"),
           ("test_accumulate_optim.py", "accumulate_clip_grad:steps=2-bf16")]
if importlib.util.find_spec("deepspeed") is not None:
    BETWEEN += [("test_accumulate.py", "accumulate:steps=2-fp32-wrapper=deepspeed-z3"),
                ("test_token_loss.py", "accumulate_token_loss_transformers:sync_each_batch=false-fp32-wrapper=deepspeed-z2"),
                # Trainer's ZeRO-3 leaves transformers' process-wide DeepSpeed config set while anything
                # holds it: every later from_config (a classifier's base model) would build under zero.Init
                ("test_trainer.py", "trainer_causal_lm:steps=2-average_tokens=true-fp32-wrapper=deepspeed-z3")]
if importlib.util.find_spec("transformers") is not None:
    PROBES += [("test_trainer.py", "trainer_classifier_plain_mean:steps=2-fp32")]


def _outcome(cell):
    return (cell.status, cell.checks, cell.grad_checks, cell.vacuous_checks, cell.comm_checks, cell.max_abs_diff,
            [f.message for f in cell.failures], cell.timeline.to_dict() if cell.timeline else None)


class Pool:
    """One pool of one world size, as the plugin runs cells on it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.settings = resolve(world_sizes=str(world_size), backend="gloo", report_dir="reports",
                                case_timeout="120", seed="1234", gpu_count=0)
        self.pools = PoolSet(backend="gloo")

    def run(self, chosen: Target, fault: str | None = None):
        return run_cell(self.pools, chosen.case, chosen.variant, self.world_size,
                        settings_for(self.settings, fault=fault))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_cell_after_every_kind_of_cell_on_one_pool_is_the_cell_of_a_fresh_pool(world_size, monkeypatch):
    monkeypatch.chdir(ROOT)
    probes = [target(*p) for p in PROBES]
    fresh, used = Pool(world_size), Pool(world_size)
    try:
        first = [_outcome(fresh.run(p)) for p in probes]
        fresh.pools.close()
        between = [used.run(target(*b)) for b in BETWEEN]
        between.append(used.run(probes[0], fault="perturb_rank1" if world_size > 1 else "grads_summed"))
        again = [_outcome(used.run(p)) for p in probes]
    finally:
        fresh.pools.close()
        used.pools.close()
    assert all(c.status in ("pass", "detected", "skip") for c in between[:-1]), \
        [(c.case, c.variant, c.status, c.summary) for c in between]
    assert between[-1].status == ("fail" if world_size > 1 else "pass")  # a failing cell went by, at 2 ranks
    assert [o[0] for o in first] == ["pass"] * len(probes)
    assert again == first
