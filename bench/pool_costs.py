"""What a rank pool costs on this machine: start-up per world size, and one warm cell.

Ranks are forked from a server that imported torch and accelerate once (harness/rank/process/preload.py):
its start is timed on its own (a run pays it once, while it imports the case files), then each
pool's start from it, and its restart (what every cell that ends in a fault pays).

Run: python bench/pool_costs.py [--world-sizes 1,2,4] [--repeats 10]
Prints a table; targets live here, not in timed tests (machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.catalogue import load_case_file  # noqa: E402
from harness.controller import pool, rank_server  # noqa: E402
from harness.controller.cells import run_cell  # noqa: E402
from harness.controller.options import resolve  # noqa: E402
from harness.records import Status  # noqa: E402

# (case file, variant): a one-step cell and an accumulating one
CELLS = [("cases/test_fused_loss.py", "fp32"), ("cases/test_accumulate.py", "steps=2-fp32")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--spawn", action="store_true", help="spawn every rank (each importing torch), as where "
                        "there is no fork server")
    args = parser.parse_args()
    if args.spawn:
        rank_server._rank_server["failed"] = "--spawn"
    rows = []
    cells = []
    for path, variant_name in CELLS:
        case = load_case_file(ROOT / path)[0]
        cells.append((case, next(v for v in case.info.variants if v.name == variant_name)))
    started = time.perf_counter()
    first = pool.PoolSet(backend="gloo")
    try:
        first.get(1)  # starts the fork server; its imports are done once it has forked a rank
    finally:
        first.close()
    server_s = time.perf_counter() - started
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        settings = resolve(world_sizes=str(world_size), backend="gloo", report_dir="reports", case_timeout="120",
                           seed="1234")
        pools = pool.PoolSet(backend="gloo")
        started = time.perf_counter()
        pools.get(world_size).kill()
        start_s = time.perf_counter() - started
        started = time.perf_counter()
        pools.get(world_size)
        restart_s = time.perf_counter() - started
        try:
            for case, variant in cells:
                times = []
                for _ in range(args.repeats + 1):
                    t = time.perf_counter()
                    cell = run_cell(pools, case, variant, world_size, settings)
                    times.append(time.perf_counter() - t)
                    if cell.status != Status.PASS:
                        print(f"{case.name}[{variant.name}] at world size {world_size}: {cell.status}: {cell.summary}",
                              file=sys.stderr)
                        return 1
                warm = times[1:]  # the first run of a case imports its module
                rows.append((world_size, f"{start_s:.2f}", f"{restart_s:.2f}", f"{case.name}[{variant.name}]", cell.checks,
                             f"{statistics.median(warm) * 1000:.0f}", f"{min(warm) * 1000:.0f}"))
                print(f"  measured {case.name}[{variant.name}] at world size {world_size}", file=sys.stderr)
        finally:
            pools.close()
    how = "forked from the fork server" if rank_server.rank_context().get_start_method() == "forkserver" else "spawned"
    print(f"ranks {how}; the first pool (world size 1), with the server's start: {server_s:.2f} s")
    header = ("world size", "pool start s", "restart s", "cell", "checks", "warm cell ms (median)", "min ms")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
