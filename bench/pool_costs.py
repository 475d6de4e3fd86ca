"""What a rank pool costs on this machine: start-up per world size, and one warm cell.

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

from harness.messages import CellSpec  # noqa: E402
from harness.pool import RankPool  # noqa: E402

CELLS = [
    ("fused_loss", "fp32", {"precision": "fp32"}, "cases/test_fused_loss.py", "test_fused_loss"),
    ("accumulate", "steps=2-fp32", {"steps": 2, "precision": "fp32"}, "cases/test_accumulate.py", "test_accumulate"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        pool = RankPool(world_size, backend="gloo")
        started = time.perf_counter()
        pool.start()
        start_s = time.perf_counter() - started
        try:
            for case, variant, params, path, attr in CELLS:
                spec = CellSpec(case=case, variant=variant, variant_params=params, world_size=world_size,
                                seed=1234, backend="gloo", case_file=str(ROOT / path), case_attr=attr)
                times = []
                for _ in range(args.repeats + 1):
                    t = time.perf_counter()
                    outcome = pool.run(spec, timeout_s=120)
                    times.append(time.perf_counter() - t)
                    if not outcome.ok:
                        print(f"{case} at world size {world_size}: {outcome.faults[0].what}", file=sys.stderr)
                        return 1
                checks = sum(r.checks for r in outcome.results.values())
                warm = times[1:]  # the first run of a case imports its module
                rows.append((world_size, f"{start_s:.2f}", f"{case}[{variant}]", checks,
                             f"{statistics.median(warm) * 1000:.0f}", f"{min(warm) * 1000:.0f}"))
                print(f"  measured {case}[{variant}] at world size {world_size}", file=sys.stderr)
        finally:
            pool.close()
            pool.remove_workdir()
    header = ("world size", "pool start s", "cell", "checks", "warm cell ms (median)", "min ms")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
