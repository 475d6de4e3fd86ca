"""What a cell of the run costs, for the progress line's time left (harness/controller/progress.py): its kind
(what runs it, its world size) as its test id says, and what a kind costs before one of its cells is
measured."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from harness.controller.cells import CELL_ID_END

# What a cell costs before the run has timed one of its kind, relative to a DDP cell at world size 2,
# for a case of average cost (PRIOR_COST, by what runs the cell and its world size), and how many times
# that a case's cells cost (CASE_PRIOR, by the case's function; they average 1 over the catalogue's cells
# that run): the default catalogue on 2 cores (torch 2.13.0, accelerate 1.16.0, deepspeed 0.19.8,
# transformers 5.25.0), seven runs of it fitted together as the run fits its own cells (``fit``), by
# `python bench/progress_estimate.py --priors` (a DDP cell at world size 2 took 0.41 s). Each is only a
# start: a kind's measured cells outweigh its prior as they come (PRIOR_CELLS) and a case's own factor
# replaces its prior once it ran, both scaled to every cell measured so far (``Progress.left``), so the
# machine's speed never enters. A kind's cost counts its cells that skip (FSDP on one rank, a 2 x 2 mesh on
# fewer than four) or are unsupported (a Trainer's bf16 under DeepSpeed on a CPU host): a Trainer cell at
# four ranks costs about what one at two does. The heavy kinds and cases come last in the catalogue's
# order (the Trainer's file, four ranks, the compiled variants, the transformers token loss): a pace from
# the cells done alone, every cell alike, promised 3m41s at 317 of 1491 cells where six minutes were left
# (issue 76).
PRIOR_COST = {
    ('ddp', 1): 0.6, ('ddp', 2): 1.0, ('ddp', 4): 1.9,
    ('compiled', 1): 5.2, ('compiled', 2): 6.5, ('compiled', 4): 12.5,
    ('deepspeed-z1', 1): 1.4, ('deepspeed-z1', 2): 1.7, ('deepspeed-z1', 4): 3.0,
    ('deepspeed-z2', 1): 1.2, ('deepspeed-z2', 2): 1.6, ('deepspeed-z2', 4): 3.0,
    ('deepspeed-z3', 1): 1.8, ('deepspeed-z3', 2): 2.4, ('deepspeed-z3', 4): 4.2,
    ('fsdp1', 1): 0.0, ('fsdp1', 2): 1.6, ('fsdp1', 4): 3.0,
    ('fsdp2', 1): 0.0, ('fsdp2', 2): 1.7, ('fsdp2', 4): 3.2,
    ('fsdp2 mesh', 1): 0.0, ('fsdp2 mesh', 2): 0.0, ('fsdp2 mesh', 4): 2.7,
    ('trainer', 1): 1.2, ('trainer', 2): 2.8, ('trainer', 4): 2.9,
}
CASE_PRIOR = {
    'test_accumulate': 0.88,
    'test_accumulate_adamw': 0.99,
    'test_accumulate_clip_grad': 0.97,
    'test_accumulate_clip_grad_norm': 1.08,
    'test_accumulate_dispatch_batches': 0.73,
    'test_accumulate_eval_loop': 0.65,
    'test_accumulate_multi_model': 0.94,
    'test_accumulate_nested': 1.12,
    'test_accumulate_no_dataloader_sync': 0.70,
    'test_accumulate_scheduler': 0.77,
    'test_accumulate_split_batches': 0.66,
    'test_accumulate_sync_each_batch': 0.85,
    'test_accumulate_token_all_processes': 1.72,
    'test_accumulate_token_generation_batch': 1.10,
    'test_accumulate_token_local_count': 1.58,
    'test_accumulate_token_loss': 1.11,
    'test_accumulate_token_loss_transformers': 2.56,
    'test_accumulate_token_mean': 1.37,
    'test_compile_ddp': 1.56,
    'test_deepspeed_by_hand': 0.89,
    'test_deepspeed_by_hand_unmarked': 1.03,
    'test_fsdp1_hybrid_shard': 1.18,
    'test_fused_loss': 0.48,
    'test_multi_forward_trigger_sync': 0.45,
    'test_no_sync': 0.44,
    'test_no_sync_trigger_sync': 0.35,
    'test_no_sync_trigger_sync_compiled': 0.60,
    'test_short_last_window': 1.08,
    'test_short_last_window_rescaled': 1.01,
    'test_static_graph': 0.58,
    'test_trainer_causal_lm': 1.13,
    'test_trainer_classifier': 1.21,
    'test_trainer_classifier_plain_mean': 0.94,
    'test_trainer_compute_loss_mean': 0.88,
    'test_trainer_compute_loss_own_scale': 0.75,
    'test_trainer_compute_loss_remedied': 0.70,
    'test_trainer_default_token_averaging': 0.69,
    'test_trainer_moe_router_loss': 1.37,
    'test_unused_parameters': 0.97,
    'test_unused_until_sync': 1.12,
}
# at a world size or of a kind not measured: a kind's cost at world size 2, times a DDP cell's growth
KIND_COST = {name: cost for (name, world_size), cost in PRIOR_COST.items() if world_size == 2 and cost}
WORLD_SIZE_COST = {1: 0.6, 2: 1.0, 3: 1.45, 4: 1.9}
# a variant's ``key=value`` parts, a value running to the next ``-key=`` (``wrapper=deepspeed-z1``)
_PARAM = re.compile(r"(?:^|-)([a-z_]+)=(.*?)(?=-[a-z_]+=|$)")


def cell_kind(nodeid: str) -> tuple[str, int]:
    """What runs a cell, as its test id says (its world size, its ``wrapper=``, ``compile=``, a Trainer's
    case), for the estimate of the time left: ``("fsdp2", 4)``, ``("trainer", 2)``. A mesh's cell is a
    kind of its own (``"fsdp2 mesh"``): skip below four ranks, a four-rank pool above."""
    function, _, parameters = nodeid.split("::")[-1].partition("[")
    found = CELL_ID_END.search(parameters)
    world_size = int(found.group(1)) if found else 0
    params = dict(_PARAM.findall(parameters[: found.start()] if found else parameters))
    kind = params.get("wrapper", "ddp")
    if "trainer" in function:
        kind = "trainer"
    elif "compile" in params:
        kind = "compiled"
    if "mesh" in params:
        kind += " mesh"
    return kind, world_size


def prior_cost(kind: tuple[str, int]) -> float:
    """A kind's cost before one of its cells is measured, relative to a DDP cell at world size 2."""
    if kind in PRIOR_COST:
        return PRIOR_COST[kind]
    name, world_size = kind
    return KIND_COST.get(name.split(" ")[0], 1.0) * WORLD_SIZE_COST.get(world_size, max(world_size, 1) / 2)


# A kind's prior counts as this many cells of its kind beside those measured (``Progress.left``): the
# first cells of a kind on a pool pay what the pool had not yet imported or warmed (a four-rank pool's
# first Trainer cells: a kind measured from them alone promised 29% too much, issue 76), and the
# prior's weight fades as the kind's cells come. Chosen on seven recorded catalogue runs replayed
# (bench/progress_estimate.py --replay; 0, 2 and 4 cells: 4 the best or as good on each run).
PRIOR_CELLS = 4.0
# rounds of fitting what a kind and what a case cost (``fit``)
COST_FIT_ROUNDS = 20


def ratios(timed: list[tuple[Any, float, float]], *, empty: float) -> dict[Any, float]:
    """By the first of each (key, seconds, units): the seconds over the units; ``empty`` where either is
    nothing."""
    seconds: dict[Any, float] = defaultdict(float)
    units: dict[Any, float] = defaultdict(float)
    for key, s, unit in timed:
        seconds[key] += s
        units[key] += unit
    return {k: seconds[k] / units[k] if seconds[k] > 0 and units[k] > 0 else empty for k in seconds}


def fit(timed: list[tuple[str, tuple[str, int], float, bool]]) -> tuple[dict[tuple[str, int], float], dict[str, float]]:
    """What cells cost, from cells timed, each (its case, its kind, its seconds, whether it ran: not skip
    or unsupported): by kind, for a case of average cost; and by case, how many times its kinds' cost
    its cells took. A case's cells cost alike relative to their kind whatever their wrapper and world
    size (a Trainer's causal LM against the catalogue's regressor). The two are fitted to the cells'
    seconds together, each in turn from the other (a few rounds settle them) on the cells that ran (one
    that skips on one rank says nothing of its case's cost on two, and a kind whose cells mostly skip
    would make the one case that runs there look costly); the cases' factors average 1 over those
    cells. A kind's cost is then its cells' seconds over their cases' factors, those that skip too (its
    cells left skip alike)."""
    ran = [cell for cell in timed if cell[3]]
    cases: dict[str, float] = {}
    for _ in range(COST_FIT_ROUNDS if ran else 0):
        kinds = ratios([(kind, s, cases.get(case, 1.0)) for case, kind, s, _ in ran], empty=0.0)
        cases = ratios([(case, s, kinds[kind]) for case, kind, s, _ in ran], empty=1.0)
        mean = sum(cases[case] for case, *_ in ran) / len(ran)
        cases = {case: factor / mean for case, factor in cases.items()} if mean > 0 else cases
    return ratios([(kind, s, cases.get(case, 1.0)) for case, kind, s, _ in timed], empty=0.0), cases


def case_of(nodeid: str) -> str:
    """A cell's case, as its test id says: its file and function (``cases/test_a.py::test_a``)."""
    return nodeid.partition("[")[0]


def case_prior(case: str) -> float:
    """How many times its kind's cost a case's cell costs before one is measured (``CASE_PRIOR``, by the
    case's function; 1, a case of average cost, for one not in the catalogue)."""
    return CASE_PRIOR.get(case.rpartition("::")[2], 1.0)
