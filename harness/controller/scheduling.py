"""How xdist hands a run's cells to its workers (the plugin's ``pytest_xdist_make_scheduler``), and what it
has left to hand out, for the estimate of the time left (harness/controller/progress.py)."""

from __future__ import annotations

from typing import Any

from harness.controller.cells import CELL_ID_END


def world_size_scheduler(config: Any, log: Any, *, one_scope: bool) -> Any:
    """xdist's scope scheduler with a cell's world size as its scope: every cell of one world size goes to
    one worker, so that no worker starts a pool it barely uses. ``one_scope``: every cell to one worker
    (nccl: a local pool's rank r uses GPU r, so pools must not overlap)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorldSizeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            match = CELL_ID_END.search(nodeid)
            if match and one_scope:
                return "gpus"
            return f"world-size-{match.group(1)}" if match else nodeid

    return WorldSizeScheduling(config, log)


def work_left(scheduler: Any) -> tuple[dict[str, list[str]], list[list[str]]]:
    """What ``scheduler`` (a ``world_size_scheduler``) has left: by worker, the test ids it was given and
    has not finished (its running test's among them); and the units (a world size's tests) no worker
    has been given yet, in the order they will be handed out, each to the first worker with little
    left. Read from the scheduler's own state (``LoadScopeScheduling``'s ``assigned_work`` and
    ``workqueue``), copied first: xdist's thread may change it as it is read."""
    assigned = list(scheduler.assigned_work.items())
    given = {node.gateway.id: [test for unit in list(work.values()) for test, done in list(unit.items()) if not done]
             for node, work in assigned}
    return given, [list(unit) for unit in list(scheduler.workqueue.values())]
