"""The default matrix's wall time serially and under -n auto, and what a fresh launch per cell would cost.

    python bench/matrix_speed.py                                # everything (about 10-15 min on 2 cores)
    python bench/matrix_speed.py --sample 2 -- -k "fused_loss and fp32"   # a quick subset
    python bench/matrix_speed.py --skip-serial --skip-fresh --workers 2 --json speed.json

1. `pytest cases/ -n 0` and `pytest cases/ -n auto` (`--workers`), timed, with their cell counts and
   the speed-up (goal: at least 1.3x on 2 cores). Both must give the same cells with the same statuses.
2. `--sample N` cells of that matrix (not `skip` or `unsupported`; spread evenly over the matrix, at
   least one per world size), each launched alone: `torchrun --standalone --nproc-per-node W -m harness
   launch <nodeid> --world-sizes W`. A nodeid names one cell at one world size (`...[fp32-ws2]`), and
   under a launcher the cells are generated at the launcher's world size only, so the full nodeid
   with W processes selects exactly that cell (with another W pytest finds no such test: ranks exit 4).
   Each launched matrix must hold that one cell with the pool run's status.
   The fresh-launch total is extrapolated from the sample: every cell of the pool run (skip and
   unsupported included: each would still be a launch) costs its world size's sample mean. It is
   compared with both pool runs (goal: at least 60x).

Extra pytest arguments after `--` go to every run (a trailing `--world-sizes W` overrides any in them
for the launches). Exit 0 when measured (goals are reported, not asserted), 1 when the two matrix runs
disagree or a launched cell differs, 2 for bad arguments (or pool runs that produced no matrix).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEEDUP_GOAL = 1.3
FRESH_GOAL = 60.0
NOT_RUN = ("skip", "unsupported")


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return time.monotonic() - started, done


def read_cells(report_dir: Path) -> list[dict] | None:
    path = report_dir / "matrix.json"
    return json.loads(path.read_text())["cells"] if path.exists() else None


def key(cell: dict) -> tuple[str, str, int]:
    return cell["case"], cell["variant"], cell["world_size"]


def run_matrix(name: str, workers: str, extra: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "cases/", "-p", "no:cacheprovider", "-q", "-n", workers,
               "--report-dir", str(out / name), *extra]
    print(f"  running the matrix with -n {workers} ...", file=sys.stderr, flush=True)
    wall_s, done = timed(command)
    cells = read_cells(out / name)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).splitlines()[-5:]
        print(f"{name}: pytest exited {done.returncode}:\n" + "\n".join(tail))
    return {"name": name, "wall_s": wall_s, "rc": done.returncode, "cells": cells}


def differences(a: dict, b: dict) -> list[str]:
    left = {key(c): c["status"] for c in a["cells"]}
    right = {key(c): c["status"] for c in b["cells"]}
    found = []
    for k in sorted(set(left) | set(right)):
        if left.get(k) != right.get(k):
            found.append(f"{k[0]}[{k[1]}-ws{k[2]}]: {left.get(k, 'absent')} ({a['name']}) "
                         f"vs {right.get(k, 'absent')} ({b['name']})")
    return found


def allocate(counts: dict[int, int], n: int) -> dict[int, int]:
    """Sample sizes per world size: in proportion to its cells, at least one each."""
    total = sum(counts.values())
    shares = {w: min(c, max(1, n * c // total)) for w, c in counts.items()}
    while sum(shares.values()) < min(n, total):
        w = max((w for w in counts if shares[w] < counts[w]), key=lambda w: counts[w] / shares[w])
        shares[w] += 1
    return shares


def pick_sample(cells: list[dict], n: int) -> list[dict]:
    by_size: dict[int, list[dict]] = {}
    for cell in cells:  # matrix.json lists them by case, variant, world size
        if cell["status"] not in NOT_RUN:
            by_size.setdefault(cell["world_size"], []).append(cell)
    shares = allocate({w: len(group) for w, group in by_size.items()}, n)
    return [group[int((i + 0.5) * len(group) / shares[w])]
            for w, group in sorted(by_size.items()) for i in range(shares[w])]


def launch_one(cell: dict, extra: list[str], out: Path) -> dict:
    ws = str(cell["world_size"])
    print(f"  launching {cell['nodeid']} on {ws} process(es) ...", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ws,
               "-m", "harness", "launch", cell["nodeid"], "-p", "no:cacheprovider", "-q",
               "--report-dir", str(out), *extra, "--world-sizes", ws]
    wall_s, done = timed(command)
    launched = read_cells(out) or []
    statuses = [c["status"] for c in launched if key(c) == key(cell)]
    ok = len(launched) == 1 and statuses == [cell["status"]]
    got = ",".join(c["status"] for c in launched) or f"no cell (exit {done.returncode})"
    return {"nodeid": cell["nodeid"], "world_size": cell["world_size"], "wall_s": wall_s, "rc": done.returncode,
            "pool_status": cell["status"], "launched": got, "ok": ok}


def estimate(cells: list[dict], launches: list[dict]) -> tuple[dict[int, float], float, float]:
    """Per world size sample means; the extrapolated total over all cells, and over the run ones only."""
    means = {w: statistics.mean(x["wall_s"] for x in launches if x["world_size"] == w)
             for w in sorted({x["world_size"] for x in launches})}
    every = sum(means[c["world_size"]] for c in cells)
    run = sum(means[c["world_size"]] for c in cells if c["status"] not in NOT_RUN)
    return means, every, run


def table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(v).rjust(w) for v, w in zip(row, widths)))
    print()


def report_runs(runs: list[dict]) -> None:
    rows = [(f"-n {'0' if r['name'] == 'serial' else r['workers']}", f"{r['wall_s']:.1f}", len(r["cells"]),
             r["rc"], ", ".join(f"{n} {s}" for s, n in sorted(Counter(c["status"] for c in r["cells"]).items())))
            for r in runs]
    table(rows, ("matrix run", "wall s", "cells", "exit", "statuses"))


def report_fresh(launches: list[dict], means: dict[int, float], cells: list[dict], every: float, run: float,
                 pools: list[dict]) -> None:
    table([(x["nodeid"], x["world_size"], f"{x['wall_s']:.1f}", x["pool_status"], x["launched"],
            "ok" if x["ok"] else "DIFFERS") for x in launches],
          ("sampled cell (fresh torchrun)", "ws", "wall s", "pool", "launched", "check"))
    sizes = Counter(c["world_size"] for c in cells)
    table([(w, sum(x["world_size"] == w for x in launches), f"{m:.1f}", sizes[w], f"{m * sizes[w]:.0f}")
           for w, m in means.items()], ("ws", "sampled", "mean s", "cells in matrix", "estimated s"))
    skipped = sum(c["status"] in NOT_RUN for c in cells)
    print(f"fresh launch per cell, extrapolated from {len(launches)} sampled cell(s): {every:.0f} s for all "
          f"{len(cells)} cells (rule: every cell the pool run reported, {skipped} skip/unsupported included, "
          f"costs its world size's sample mean); {run:.0f} s without those")
    for r in pools:
        print(f"  estimate / pool run -n {r['workers']}: {every / r['wall_s']:.1f}x "
              f"({run / r['wall_s']:.1f}x without skip/unsupported; goal {FRESH_GOAL:.0f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", type=int, default=8, help="cells to launch fresh (default 8)")
    parser.add_argument("--workers", default="auto", help="-n for the parallel run (default auto)")
    parser.add_argument("--skip-serial", action="store_true", help="leave out the -n 0 run")
    parser.add_argument("--skip-fresh", action="store_true", help="leave out the fresh launches")
    parser.add_argument("--keep", type=Path, help="write (and keep) every report dir here")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (e.g. -k fused_loss)")
    args = parser.parse_args()
    if args.sample < 1:
        parser.error("--sample: give at least 1")
    with tempfile.TemporaryDirectory(prefix="matrix-speed-") as scratch:
        out = args.keep or Path(scratch)
        return measure(args, out.resolve())


def measure(args: argparse.Namespace, out: Path) -> int:
    # the parallel run first: it pays any cold caches, so the speed-up is not flattered by them
    runs = [run_matrix("auto", args.workers, args.pytest_args, out)]
    if not args.skip_serial:
        runs.append(run_matrix("serial", "0", args.pytest_args, out))
    for r in runs:
        r["workers"] = args.workers if r["name"] == "auto" else "0"
        if r["cells"] is None:
            print(f"-n {r['workers']}: no matrix.json: nothing to measure (check the pytest arguments)")
            return 2
    report_runs(runs)
    result: dict = {"runs": [{k: r[k] for k in ("name", "workers", "wall_s", "rc")} | {"cells": len(r["cells"])}
                             for r in runs]}
    findings = 0
    if len(runs) == 2:
        found = differences(runs[1], runs[0])
        speedup = runs[1]["wall_s"] / runs[0]["wall_s"]
        print(f"-n {args.workers} over serial: {speedup:.2f}x (goal {SPEEDUP_GOAL}x)")
        print("both runs: the same cells with the same statuses" if not found else
              f"the runs differ in {len(found)} cell(s):\n  " + "\n  ".join(found))
        print()
        findings += len(found)
        result.update(speedup=speedup, differences=found)
    if not args.skip_fresh:
        cells = runs[0]["cells"]
        sample = pick_sample(cells, args.sample)
        if len(sample) > args.sample:
            print(f"--sample {args.sample} raised to {len(sample)}: one cell at least per world size\n")
        launches = [launch_one(c, args.pytest_args, out / "fresh" / str(i)) for i, c in enumerate(sample)]
        if launches:
            means, every, run = estimate(cells, launches)
            report_fresh(launches, means, cells, every, run, runs)
            findings += sum(not x["ok"] for x in launches)
            result["fresh"] = {"launches": launches, "mean_s_by_world_size": means, "estimate_s": every,
                               "estimate_s_without_skip": run,
                               "ratios": {r["name"]: every / r["wall_s"] for r in runs}}
        else:
            print("no cell to launch fresh: every cell is skip or unsupported")
    if args.keep:
        print(f"reports: {out}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
