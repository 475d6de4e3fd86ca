"""Where a warm cell's time goes, on every rank: each section's own time (its callees' not counted),
per cell, averaged over warm runs of the cell on a bench's own ranks (rig.py), beside the cell's
floor (its collectives issued bare).

Run: python bench/profile_cell.py [--world-size 2] [--runs 30] [CASE_FILE VARIANT ...]
     (default: cases/test_fused_loss.py fp32 cases/test_accumulate.py steps=2-fp32)

The sections are made by wrapping the functions named in SECTIONS on the rank (nothing in the harness
knows it is measured); "case body" is what is left of the case function itself: its forwards, the
dataloader, its loop. "collectives" are the Python-level torch.distributed calls, by whose section
issued them; DDP's own reductions run inside "accelerate backward" and "prepare".
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rig import cell_spec, floors, run_ranks  # noqa: E402

# (module, attribute path, section)
SECTIONS = [
    ("accelerate", "Accelerator.__init__", "Accelerator()"),
    ("accelerate", "Accelerator.prepare", "prepare (DDP, broadcast)"),
    ("accelerate", "Accelerator.backward", "accelerate backward (+DDP reduce)"),
    ("accelerate.optimizer", "AcceleratedOptimizer.step", "optimizer step, zero_grad"),
    ("accelerate.optimizer", "AcceleratedOptimizer.zero_grad", "optimizer step, zero_grad"),
    ("harness.rank.numerics.accounting", "_records", "collective accounting (flight recorder)"),
    ("harness.rank.oracle.core", "Oracle.__init__", "oracle replicas"),
    ("harness.rank.oracle.core", "Oracle.backward", "oracle backward"),
    ("harness.rank.oracle.core", "Oracle.step", "oracle step"),
    ("harness.rank.judging.checks", "Checks.grads", "checks: compare, diagnose"),
    ("harness.rank.judging.checks", "Checks.params", "checks: compare, diagnose"),
    ("harness.rank.judging.checks", "Checks.sync_flag", "checks: compare, diagnose"),
    ("harness.rank.context", "RankContext.model", "models and data"),
    ("harness.rank.context", "RankContext.batch", "models and data"),
    ("harness.rank.context", "RankContext.dataset", "models and data"),
    ("harness.rank.context", "RankContext.schedule", "models and data"),
    ("harness.wrappers.probe", "reset_accelerate", "state reset"),
    ("harness.rank.process.cell", "_restore_environment", "state reset"),
    ("harness.rank.process.cell", "run_rank_cell", "rank bookkeeping"),
]
DIST_CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")
ORACLE_SECTIONS = ("oracle", "checks")


class Sections:
    """Each section's own time: a call's time less its inner sections' calls."""

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self.stack: list[list[Any]] = []  # [section, time in inner sections]

    def timed(self, section: Any, function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = section() if callable(section) else section
            frame = [name, 0.0]
            self.stack.append(frame)
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.stack.pop()
                self.own[name] = self.own.get(name, 0.0) + elapsed - frame[1]
                if self.stack:
                    self.stack[-1][1] += elapsed
        return wrapper

    def collective_section(self) -> str:
        inside_oracle = any(frame[0].startswith(ORACLE_SECTIONS) for frame in self.stack)
        return "collectives: oracle's" if inside_oracle else "collectives: other"

    def install(self, body_owner: Any, body_attr: str) -> None:
        import importlib

        import torch.distributed as dist

        for module_name, path, section in SECTIONS:
            owner: Any = importlib.import_module(module_name)
            *parents, attribute = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, attribute, self.timed(section, getattr(owner, attribute)))
        for name in DIST_CALLS:
            setattr(dist, name, self.timed(self.collective_section, getattr(dist, name)))
        # a CaseInfo is frozen: the body is wrapped in place, for this bench's ranks only
        object.__setattr__(body_owner, body_attr,
                           self.timed("case body (forwards, loop, data)", getattr(body_owner, body_attr)))


def _profile_job(rank: int, world_size: int, device: Any, spec: Any, runs: int) -> dict[str, Any]:
    import harness.rank.process.cell as rank_side
    from harness.catalogue import find_case, locate

    for _ in range(3):  # import the case, warm every path
        rank_side.run_rank_cell(spec, rank, device)
    case = find_case(locate(spec.case_anchor, spec.case_relpath, spec.case_file), spec.case_attr)
    sections = Sections()
    sections.install(case, "body")
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in range(runs):
        result = rank_side.run_rank_cell(spec, rank, device)
    wall = (time.perf_counter() - started) / runs
    started = time.perf_counter()
    message = pickle.dumps(result)
    sections.own["message (pickle the result)"] = (time.perf_counter() - started) * runs
    return {"wall_ms": wall * 1000, "sections": {k: v / runs * 1000 for k, v in sections.own.items()},
            "message_bytes": len(message), "outcome": result.outcome.value}


def profile(world_size: int, case_file: str, variant: str, runs: int) -> list[dict[str, Any]]:
    spec = cell_spec(case_file, variant, world_size)
    return run_ranks(world_size, _profile_job, spec, runs)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(world_size: int, case_file: str, variant: str, runs: int) -> str:
    per_rank = profile(world_size, case_file, variant, runs)
    count, floor_ms = floors(world_size, [cell_spec(case_file, variant, world_size)])[0]
    names = sorted({n for r in per_rank for n in r["sections"]}, key=lambda n: -per_rank[0]["sections"].get(n, 0.0))
    header = ("section", *(f"rank {r} ms" for r in range(world_size)), "share")
    rows = [header]
    for name in names:
        values = [r["sections"].get(name, 0.0) for r in per_rank]
        rows.append((name, *(f"{v:.2f}" for v in values), f"{100 * values[0] / per_rank[0]['wall_ms']:.0f}%"))
    rows.append(("cell, warm (wall)", *(f"{r['wall_ms']:.2f}" for r in per_rank), ""))
    rows.append((f"floor: its {count} collectives, bare", f"{floor_ms:.2f}", *([""] * (world_size - 1)), ""))
    case_name = Path(case_file).stem.removeprefix("test_")
    return (f"{case_name}[{variant}] at world size {world_size}: {runs} warm runs, result message "
            f"{per_rank[0]['message_bytes']} bytes\n{table(rows)}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("cells", nargs="*", help="CASE_FILE VARIANT pairs")
    args = parser.parse_args()
    cells = args.cells or ["cases/test_fused_loss.py", "fp32", "cases/test_accumulate.py", "steps=2-fp32"]
    if len(cells) % 2:
        parser.error("give cells as CASE_FILE VARIANT pairs")
    for case_file, variant in zip(cells[::2], cells[1::2]):
        print(report(args.world_size, case_file, variant, args.runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
