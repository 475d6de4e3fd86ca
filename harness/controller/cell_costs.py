"""What a cell of the run costs, for the progress line's time left (harness/controller/progress.py): its kind
(what runs it, its world size) as its test id says, and what a kind costs before one of its cells is
measured."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from harness.controller.cells import CELL_ID_END

# What a cell costs before the run has timed one of its kind, relative to a DDP cell at world size 2:
# the default catalogue's cells measured on 2 cores (torch 2.13.0, accelerate 1.16.0, deepspeed 0.19.8,
# transformers 5.25.0; a DDP cell at world size 2 took 0.33 s), the mean of the cells of each kind, by
# what runs the cell and its world size. Each is only a start: a kind's own measured cells replace it
# as they end, and its scale is fitted to every cell measured so far (``Progress.left``), so the
# machine's speed never enters. A kind's mean counts its cells that skip (FSDP on one rank, a 2 x 2
# mesh on fewer than four) or are unsupported (a Trainer's bf16 under DeepSpeed on a CPU host): a
# Trainer cell at four ranks costs less than one at two. The heavy kinds come last in the catalogue's
# order (the Trainer's file, four ranks, the compiled variants): a pace from the cells done alone,
# every cell alike, promised 3m41s at 317 of 1491 cells where six minutes were left (issue 76).
PRIOR_COST = {
    ("ddp", 1): 0.6, ("ddp", 2): 1.0, ("ddp", 4): 1.9,
    ("fsdp2", 1): 0.0, ("fsdp2", 2): 1.8, ("fsdp2", 4): 3.6,
    ("fsdp2 mesh", 1): 0.0, ("fsdp2 mesh", 2): 0.0, ("fsdp2 mesh", 4): 2.9,
    ("fsdp1", 1): 0.0, ("fsdp1", 2): 1.7, ("fsdp1", 4): 3.4,
    ("deepspeed-z1", 1): 1.5, ("deepspeed-z1", 2): 1.8, ("deepspeed-z1", 4): 3.5,
    ("deepspeed-z2", 1): 1.3, ("deepspeed-z2", 2): 1.7, ("deepspeed-z2", 4): 3.3,
    ("deepspeed-z3", 1): 1.9, ("deepspeed-z3", 2): 2.5, ("deepspeed-z3", 4): 4.6,
    ("compiled", 1): 6.2, ("compiled", 2): 6.9, ("compiled", 4): 13.8,
    ("trainer", 1): 1.1, ("trainer", 2): 3.1, ("trainer", 4): 2.9,
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


# rounds of fitting what a kind and what a case cost (``Progress._costs``)
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


def case_of(nodeid: str) -> str:
    """A cell's case, as its test id says: its file and function (``cases/test_a.py::test_a``)."""
    return nodeid.partition("[")[0]
