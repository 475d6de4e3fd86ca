"""No false alarm over ten seeds: the clean catalogue (one variant of every non-canary case a seed and
wrapper, fp32 and bf16 in turn, moving through each case's variants) at each world size, ten seeds each.

Run: python bench/false_alarms.py [--world-sizes 2,3,4] [--seeds 10] [--wrappers ddp,fsdp2,fsdp1,deepspeed-z2]
Prints, per world size, the clean cells run, the fails (false alarms) and errors, and the seconds;
then each fail with its rerun command. Exit 1 on any fail or error. tests/test_selfcheck.py runs
the same sweep (its sweep_false_alarms) with the ten seeds once each, five at world size 2 and five
at 3, and two at 4; run this
before changing a tolerance (harness/rank/numerics/closeness.py) or the seeding, and on a new torch or accelerate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_selfcheck import SEEDS, sweep_false_alarms  # noqa: E402

from harness import catalogue  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=_ints, default=[2, 3, 4])
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help="how many seeds from %d" % SEEDS[0])
    parser.add_argument("--wrappers", default="ddp",
                        help="comma list of wrappers whose variants each seed runs (default: ddp, the case's own)")
    args = parser.parse_args()
    cases = catalogue.discover(ROOT / "cases")
    seeds = range(SEEDS[0], SEEDS[0] + args.seeds)
    rows = [("world size", "seeds", "cells", "fail", "error", "seconds")]
    problems = []
    for world_size in args.world_sizes:
        started = time.perf_counter()
        cells, failed, errored = sweep_false_alarms(cases, world_size, seeds, wrappers=args.wrappers.split(","))
        rows.append((str(world_size), str(len(seeds)), str(cells), str(len(failed)), str(len(errored)),
                     f"{time.perf_counter() - started:.0f}"))
        problems += [f"world size {world_size}: {line}" for line in failed + list(errored.values())]
        print(f"  world size {world_size}: done", file=sys.stderr, flush=True)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in [rows[0], tuple("-" * w for w in widths), *rows[1:]]:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
