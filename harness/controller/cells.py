"""Running one cell: a case, a variant and a world size to a judged Cell, the one way every caller runs
a cell (the pytest plugin, the self-check, the benchmarks).

A cell is named by its pytest node id (``cases/test_x.py::test_x[fp32-ws2]``) and can always be run
again alone by the command ``rerun_command`` prints.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shlex
import time
import traceback
from typing import Callable

from harness.catalogue import CaseRef, portable_location
from harness.controller.options import DEFAULT_CASE_TIMEOUT_S, Settings
from harness.controller.pool import GroupLost, Pools, PoolStartError
from harness.controller.verdict import judge
from harness.decorator import Variant
from harness.matrix.schema import Cell
from harness.messages import CellSpec, watched
from harness.records import Status
from harness.controller.script import SCRIPT_CELLS
from harness.controller.script import rerun_command as watch_rerun
from harness.wording import nccl_skip_summary, not_run_summary

# Inside the report dir: where a printed rerun command writes its reports.
RERUN_DIR = "rerun"

_sequence = itertools.count(1)


def cell_id(variant: str, world_size: int) -> str:
    """The id pytest gives a cell among its case's cells: ``fp32-ws2``."""
    return f"{variant}-ws{world_size}"


# how a cell's test id ends (``test_case[fp32-ws2]``, ``cell_id``): its world size
CELL_ID_END = re.compile(r"-ws(\d+)\]$")


def nodeid(case: CaseRef, variant: str, world_size: int) -> str:
    """The pytest node id of a cell, with the case file relative to the working directory where it can be."""
    try:
        path = os.path.relpath(case.path)
    except ValueError:
        path = str(case.path)
    return f"{path}::{case.attr}[{cell_id(variant, world_size)}]"


def rerun_command(nodeid: str, *, world_size: int, backend: str, seed: int, report_dir: str = "reports",
                  case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S, fault: str | None = None,
                  relaunch: tuple[str, ...] = ()) -> str:
    """The command that runs one cell again: on local pools, or under the launcher that ran it
    (``relaunch``: its command up to ``-m harness launch``). Its reports go to a folder of their own
    inside the report dir, so that running it never replaces a whole run's matrix with one cell."""
    if relaunch:
        parts = [*relaunch, "-m", "harness", "launch", nodeid]
    else:
        parts = ["pytest", nodeid, "--world-sizes", str(world_size)]
    parts += ["--backend", backend, "--seed", str(seed), "--report-dir", os.path.join(report_dir, RERUN_DIR)]
    if case_timeout_s != DEFAULT_CASE_TIMEOUT_S:
        parts += ["--case-timeout", f"{case_timeout_s:g}"]
    if fault:
        parts += ["--harness-fault", fault]
    return shlex.join(parts)


def cell_spec(case: CaseRef, variant: Variant, world_size: int, settings: Settings, *, label: str) -> CellSpec:
    """What the ranks are sent. ``cell_id`` is unique in this process (the label and a sequence
    number), so that a late result of an earlier cell can never be taken for this one's."""
    anchor, relpath = portable_location(case.path)
    return CellSpec(
        case=case.name, variant=variant.name, variant_params=dict(variant.params), world_size=world_size,
        seed=settings.seed, backend=settings.backend, case_file=str(case.path), case_attr=case.attr,
        fault=settings.fault, cell_id=f"{label} #{next(_sequence)}", case_anchor=anchor, case_relpath=relpath,
    )


def run_cell(pools: Pools, case: CaseRef, variant: Variant, world_size: int, settings: Settings, *,
             node: str | None = None, while_waiting: Callable[[], None] | None = None) -> Cell:
    """Run the cell on the pool of its world size (started if need be) and judge it.

    Whatever goes wrong is the cell's verdict, never an exception: a pool that cannot start, a rank
    that raises, dies or hangs, or the controller failing while it waits (the pool is then killed,
    and the next cell starts a new one)."""
    # the rerun command names the case file from the working directory, so that it runs from here
    # whatever pytest's rootdir (an installed catalogue lies outside it)
    runnable = nodeid(case, variant.name, world_size)
    node = node or runnable
    if case.path.parts[-2:] == SCRIPT_CELLS and watched() is not None:  # `python -m harness watch SCRIPT`'s cell
        rerun = watch_rerun(world_size=world_size, variant=variant.name, case_timeout_s=settings.case_timeout_s,
                            report_dir=os.path.join(settings.report_dir, RERUN_DIR))
    else:
        rerun = rerun_command(runnable, world_size=world_size, backend=settings.backend, seed=settings.seed,
                              report_dir=settings.report_dir, case_timeout_s=settings.case_timeout_s,
                              fault=settings.fault, relaunch=settings.relaunch)
    common = dict(case=case.name, variant=variant.name, world_size=world_size, nodeid=node, rerun=rerun)
    if settings.backend == "nccl" and not settings.launched and world_size > settings.gpu_count:
        return Cell(status=Status.SKIP, summary=nccl_skip_summary(world_size, settings.gpu_count), **common)
    spec = cell_spec(case, variant, world_size, settings, label=node)
    common.update(detects=case.info.detects_for(variant), timeout_s=settings.case_timeout_s)
    try:
        pool = pools.get(world_size)
    except GroupLost as exc:  # under a launcher, after a rank died or hung
        return Cell(case=case.name, variant=variant.name, world_size=world_size, nodeid=node,
                    rerun=str(common["rerun"]), status=Status.ERROR, summary=not_run_summary(str(exc)))
    except PoolStartError as exc:
        return judge(outcome=None, duration_s=0.0, start_error=str(exc), **common)
    started = time.perf_counter()  # the cell's own time; starting the pool is not part of it
    try:
        outcome = pool.run(spec, timeout_s=settings.case_timeout_s, while_waiting=while_waiting)
    except Exception:
        pool.kill()
        return judge(outcome=None, duration_s=time.perf_counter() - started,
                     controller_error=traceback.format_exc(), **common)
    return judge(outcome=outcome, duration_s=time.perf_counter() - started, **common)


def settings_for(settings: Settings, *, seed: int | None = None, fault: str | None = None) -> Settings:
    """``settings`` for one more run of a cell with another seed or a planted fault."""
    return dataclasses.replace(settings, seed=settings.seed if seed is None else seed, fault=fault)
