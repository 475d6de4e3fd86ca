"""How a warm cell's cost scales: with the world size, with the number of cells a run has, with the model size.

Run: python bench/scaling.py [--only world,cells,size] [--world-sizes 1,2,4,8] [--repeats 10]
         [--cells 1000] [--params 1e3,1e4,1e5,1e6,1e7 (and 1e8)] [--size-world-size 2] [--json PATH]

1. world: fused_loss[fp32] and accumulate[steps=2-fp32] on a pool of each world size: pool start,
   warm cell ms (median of --repeats after one unmeasured run) beside the floor (the cell's own
   collectives issued bare, bench/rig.py). Does a cell stay near its floor as ranks are added, and
   where does the machine run out of cores (more ranks than os.cpu_count())?
2. cells: one world-size-2 pool runs --cells cells one after another, cycling through cheap DDP fp32
   cells of the catalogue (CYCLE), and after each one rewrites the three reports as the pytest
   plugin does (write_reports with one CellTexts; each cell under a key of its own, as in a real run
   of that many cells). Mean cell and report-rewrite ms per bin of cells, and the ranks' and the
   controller's RSS at each bin's end. Does the per-cell cost stay flat from 10 to 1,000 cells, and
   does memory grow?
3. size: bench/scaling_case.py's model_size case (fused_loss on a model of about N parameters) at
   --size-world-size, on a bench's own ranks (bench/model_size.py): the checked cell beside the sum of
   what it cannot avoid, the same steps unchecked (the case's own forward, backward, DDP's collectives
   and optimizer step), the oracle replica's step alone and the oracle's collectives issued bare; and
   the memory the checked cell holds beyond the unchecked one, in copies of the model. How close does
   a checked step come to the cost of the step itself as the model grows?

Every measured cell must pass: one that does not is printed to stderr and the bench exits 1.
Exit 2 on bad arguments. Machines are shared and noisy: read ratios and trends, not exact numbers.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import model_size  # noqa: E402
import scaling_case  # noqa: E402
from rig import floors  # noqa: E402

from harness.catalogue import load_case_file  # noqa: E402
from harness.controller.cells import cell_spec, run_cell  # noqa: E402
from harness.controller.options import resolve  # noqa: E402
from harness.controller.pool import PoolSet  # noqa: E402
from harness.decorator import grid  # noqa: E402
from harness.matrix.schema import Cell, Matrix, merge_cells  # noqa: E402
from harness.records import Status  # noqa: E402
from harness.render.reports import CellTexts, write_reports  # noqa: E402

WORLD_CELLS = [("cases/test_fused_loss.py", "fused_loss", "fp32"),
               ("cases/test_accumulate.py", "accumulate", "steps=2-fp32")]
# cheap DDP fp32 cells that pass at world size 2 (checked as they run); five, so that every bin
# (10, 90, 900 cells) holds each of them equally often
CYCLE = WORLD_CELLS + [("cases/test_no_sync.py", "no_sync", "fp32"),
                       ("cases/test_accumulate_optim.py", "accumulate_adamw", "steps=2-fp32"),
                       ("cases/test_unused_parameters.py", "unused_parameters", "steps=2-pattern=same-fp32")]
BIG_MODEL = 1_000_000  # above this many parameters a size is run at most BIG_REPEATS times
BIG_REPEATS = 5
PARTS = ("world", "cells", "size")


class CellFailed(Exception):
    pass


def find(path: str, name: str, variant_name: str) -> tuple[Any, Any]:
    case = next(c for c in load_case_file(ROOT / path) if c.name == name)
    return case, next(v for v in case.info.variants if v.name == variant_name)


def settings(world_size: int, timeout_s: int = 120) -> Any:
    return resolve(world_sizes=str(world_size), backend="gloo", report_dir="reports", case_timeout=str(timeout_s),
                   seed="1234", gpu_count=0)


def checked(pools: PoolSet, case: Any, variant: Any, world_size: int, setting: Any) -> tuple[Cell, float]:
    started = time.perf_counter()
    cell = run_cell(pools, case, variant, world_size, setting)
    elapsed = time.perf_counter() - started
    if cell.status != Status.PASS:
        raise CellFailed(f"{case.name}[{variant.name}] at world size {world_size}: {cell.status}: {cell.summary}")
    return cell, elapsed


def warm_ms(pools: PoolSet, case: Any, variant: Any, world_size: int, setting: Any, repeats: int) -> tuple[Cell, float]:
    """One unmeasured run (imports the case), then the median ms of ``repeats`` runs."""
    times = [checked(pools, case, variant, world_size, setting) for _ in range(repeats + 1)]
    return times[-1][0], statistics.median(t for _, t in times[1:]) * 1000


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def ratio(cell_ms: float, floor_ms: float) -> str:
    return f"{cell_ms / floor_ms:.1f}" if floor_ms > 0 else "-"


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    cells = [tuple(str(v) for v in row) for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def by_world_size(world_sizes: list[int], repeats: int) -> tuple[str, list[dict[str, Any]]]:
    cpus = os.cpu_count() or 1
    cells = [find(*c) for c in WORLD_CELLS]
    out = []
    for world_size in world_sizes:
        setting = settings(world_size)
        pools = PoolSet(backend="gloo")
        try:
            started = time.perf_counter()
            pools.get(world_size)
            start_s = time.perf_counter() - started
            measured = [warm_ms(pools, case, variant, world_size, setting, repeats) for case, variant in cells]
        finally:
            pools.close()
        # the floors on a bench's own ranks, with the pool gone (they would share the cores)
        specs = [cell_spec(case, variant, world_size, setting, label="bench floor") for case, variant in cells]
        for (case, variant), (cell, ms), (count, floor_ms) in zip(cells, measured, floors(world_size, specs)):
            out.append({"world_size": world_size, "cpus": cpus, "oversubscribed": world_size > cpus,
                        "pool_start_s": start_s, "cell": f"{case.name}[{variant.name}]", "checks": cell.checks,
                        "warm_ms": ms, "floor_ms": floor_ms, "collectives": count})
        progress(f"world size {world_size}: measured")
    rows = [(r["world_size"], f"{r['world_size']}/{r['cpus']}" + (" over" if r["oversubscribed"] else ""),
             f"{r['pool_start_s']:.2f}", r["cell"], r["checks"], f"{r['warm_ms']:.0f}", f"{r['floor_ms']:.1f}",
             r["collectives"], ratio(r["warm_ms"], r["floor_ms"])) for r in out]
    text = table(("world size", "ranks/cpus", "pool start s", "cell", "checks", f"warm ms (median of {repeats})",
                  "floor ms", "collectives", "cell/floor"), rows)
    note = (f"over: more ranks than the {cpus} CPUs of os.cpu_count(); the controller is one process more "
            "(it mostly waits while a cell runs). No floor at world size 1: it issues no collectives.")
    return f"{text}\n{note}", out


def bins(total: int) -> list[tuple[int, int]]:
    """1-10, 11-100, 101-1000, ... cut at ``total``."""
    edges, edge = [], 10
    while edge < total:
        edges.append(edge)
        edge *= 10
    edges.append(total)
    return [(1 if i == 0 else edges[i - 1] + 1, e) for i, e in enumerate(edges)]


def by_cells(total: int, world_size: int = 2) -> tuple[str, list[dict[str, Any]]]:
    cycle = [find(*c) for c in CYCLE]
    setting = settings(world_size)
    environment = {"python": sys.version.split()[0], "torch": importlib.metadata.version("torch"),
                   "accelerate": importlib.metadata.version("accelerate"), "backend": "gloo", "device": "cpu",
                   "world_sizes": [world_size], "wrappers": "auto", "seed": setting.seed}
    created = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    texts, kept = CellTexts(), []
    cell_s, report_s, out = [], [], []
    pools = PoolSet(backend="gloo")
    try:
        pool = pools.get(world_size)
        for case, variant in cycle:  # one unmeasured pass: each case's import and first run
            checked(pools, case, variant, world_size, setting)
        rss = {"ranks_mb": [rss_mb(p.pid) for p in pool.processes], "controller_mb": rss_mb(os.getpid())}
        out.append({"cells": "0 (warm-up)", **rss})
        ends = {last: first for first, last in bins(total)}
        with tempfile.TemporaryDirectory(prefix="bench-scaling-") as report_dir:
            for n in range(1, total + 1):
                case, variant = cycle[(n - 1) % len(cycle)]
                cell, elapsed = checked(pools, case, variant, world_size, setting)
                started = time.perf_counter()
                # as the plugin: the cell travels as a dict (user_properties) and is read back; the
                # reports are rewritten from every cell so far. A key of its own per cell, as in a
                # real run of that many cells (merge_cells would fold a repeated key into one).
                data = cell.to_dict()
                data["variant"] = f"{data['variant']}-run{n}"
                kept.append(Cell.from_dict(data))
                matrix = Matrix(environment=environment, cells=merge_cells(kept), created=created, complete=False)
                write_reports(matrix, report_dir, texts=texts)
                report_s.append(time.perf_counter() - started)
                cell_s.append(elapsed)
                if n in ends:
                    first, last = ends[n], n
                    size = sum(p.stat().st_size for p in Path(report_dir).iterdir() if not p.name.startswith("."))
                    out.append({"cells": f"{first}-{last}", "cell_ms": statistics.mean(cell_s[first - 1:]) * 1000,
                                "report_ms": statistics.mean(report_s[first - 1:]) * 1000, "last_report_ms": report_s[-1] * 1000,
                                "report_kb": size / 1024,
                                "ranks_mb": [rss_mb(p.pid) for p in pool.processes],
                                "controller_mb": rss_mb(os.getpid())})
                    progress(f"cells {first}-{last}: measured")
    finally:
        pools.close()
    specs = [cell_spec(case, variant, world_size, setting, label="bench floor") for case, variant in cycle]
    floor_ms = statistics.mean(ms for _, ms in floors(world_size, specs))
    rows = []
    for r in out:
        if "cell_ms" in r:
            total_ms = r["cell_ms"] + r["report_ms"]
            rows.append((r["cells"], f"{r['cell_ms']:.1f}", f"{r['report_ms']:.1f}", f"{r['last_report_ms']:.1f}",
                         f"{total_ms:.1f}", f"{r['report_kb']:.0f}", f"{floor_ms:.1f}", ratio(r["cell_ms"], floor_ms),
                         " ".join(f"{m:.0f}" for m in r["ranks_mb"]), f"{r['controller_mb']:.0f}"))
        else:
            rows.append((r["cells"], "", "", "", "", "", "", "", " ".join(f"{m:.0f}" for m in r["ranks_mb"]),
                         f"{r['controller_mb']:.0f}"))
        r["floor_ms"] = floor_ms
    text = table(("cells", "cell ms", "report ms", "last report ms", "total ms", "reports KB", "floor ms", "cell/floor",
                  "ranks RSS MB", "controller RSS MB"), rows)
    names = ", ".join(f"{c.name}[{v.name}]" for c, v in cycle)
    note = (f"means per cell over each bin; world size {world_size}, one pool; cycle: {names}; "
            "floor: the mean of the cycle's floors; last report ms,\n"
            "reports KB and RSS: at the end of each bin")
    return f"{text}\n{note}", out


def by_size(sizes: list[int], world_size: int, repeats: int) -> tuple[str, list[dict[str, Any]]]:
    case = load_case_file(ROOT / "bench" / "scaling_case.py")[0]
    setting = settings(world_size, timeout_s=900)
    warm = cell_spec(case, grid(params=[min(scaling_case.PARAMS)])[0], world_size, setting, label="bench warm-up")
    out = []
    for n in sizes:
        exact = scaling_case.param_count(n)
        runs = repeats if exact <= BIG_MODEL else min(repeats, BIG_REPEATS)
        spec = cell_spec(case, grid(params=[n])[0], world_size, setting, label="bench model size")
        measured = model_size.measure(world_size, spec, warm, runs)
        parts = measured["unchecked"]["ms"] + measured["replica"]["busy_ms"] + measured["collectives_ms"]
        out.append({"params": n, "exact_params": exact, "width": scaling_case.width(n), "runs": runs,
                    "checked_ms": measured["checked"]["ms"], "unchecked_ms": measured["unchecked"]["ms"],
                    "replica_ms": measured["replica"]["busy_ms"], "oracle_collectives": measured["oracle_collectives"],
                    "collectives_ms": measured["collectives_ms"], "sum_ms": parts,
                    "memory_mb": measured["memory_mb"], "copies": model_size.copies(measured["memory_mb"], exact)})
        progress(f"model size {n}: measured")
    rows = [(f"{r['params']:g}", r["exact_params"], f"{r['exact_params'] * 4 / 2**20:.1f}", r["runs"],
             f"{r['checked_ms']:.0f}", f"{r['unchecked_ms']:.0f}", f"{r['replica_ms']:.0f}",
             f"{r['collectives_ms']:.0f} ({r['oracle_collectives']})", f"{r['sum_ms']:.0f}",
             ratio(r["checked_ms"], r["sum_ms"]), ratio(r["checked_ms"], r["unchecked_ms"]),
             " ".join(f"{m['unchecked']:.0f}/{m['checked']:.0f}" for m in r["memory_mb"]), f"{r['copies']:.1f}")
            for r in out]
    text = table(("params", "exact params", "fp32 MB", "runs", "checked ms", "unchecked ms", "replica ms",
                  "oracle collectives ms (n)", "sum ms", "checked/sum", "checked/unchecked",
                  "peak MB by rank, unchecked/checked", "model copies"), rows)
    note = (f"model_size[params=N] (bench/scaling_case.py: Linear(k, k), tanh, Linear(k, 1)) at world size "
            f"{world_size}, on a bench's own ranks (bench/model_size.py), medians of warm runs, rank 0; above "
            f"{BIG_MODEL:,} parameters at most {BIG_REPEATS} runs.\n"
            "unchecked: the case's own steps (forward, backward, DDP's collectives, optimizer step), the oracle "
            "doing nothing; replica: the oracle's replicas' backwards and steps alone; oracle collectives: the "
            "checked cell's collectives beyond the unchecked one's, issued bare; sum: the three.\n"
            "model copies: the checked cell's peak resident memory over the unchecked one's (the largest over "
            "the ranks), in fp32 copies of the model: what the harness holds beyond the case's own model")
    return f"{text}\n{note}", out


def int_list(parser: argparse.ArgumentParser, option: str, text: str, *, number: type = int) -> list[int]:
    try:
        values = [int(number(part)) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(f"{option}: {text!r} is not a comma list of numbers")
    if not values or any(v < 1 for v in values):
        parser.error(f"{option}: every value must be a positive number")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help="comma list of world, cells, size")
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cells", type=int, default=1000)
    parser.add_argument("--params", default="1e3,1e4,1e5,1e6,1e7")
    parser.add_argument("--size-world-size", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"--only: a comma list of {', '.join(PARTS)}")
    world_sizes = int_list(parser, "--world-sizes", args.world_sizes)
    sizes = int_list(parser, "--params", args.params, number=float)
    for option, value in (("--repeats", args.repeats), ("--cells", args.cells),
                          ("--size-world-size", args.size_world_size)):
        if value < 1:
            parser.error(f"{option}: must be at least 1")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} at the start; gloo on CPU\n", flush=True)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        for part in PARTS:
            if part not in parts:
                continue
            if part == "world":
                title, (text, data) = "Against world size", by_world_size(world_sizes, args.repeats)
            elif part == "cells":
                title, (text, data) = f"Against the number of cells ({args.cells})", by_cells(args.cells)
            else:
                title, (text, data) = "Against model size", by_size(sizes, args.size_world_size, args.repeats)
            results[part] = data
            print(f"{title}\n{text}\n", flush=True)
    except CellFailed as exc:
        print(f"a measured cell did not pass (a benchmark of failing cells measures nothing): {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
