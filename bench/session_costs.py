"""What a pytest session of the harness costs on this machine before its first cell: the CPU and wall
time of a session that only collects one case file, and of a run of one cell, on a fork server of its
own (as a user's run) and on one it adopts (as the harness's own tests' sessions do: docs/contributing.md).
And what the libraries only some cells use cost a pool: its first Trainer, compiled and DeepSpeed cells
at world size 2, each rank importing them, or forked from a server that did (harness/rank/process/preload_all.py).

The CPU is the machine's busy time over the command (/proc/stat: every process the session starts,
its fork server and ranks among them), so run it on an otherwise idle machine. Median of --repeats.

Run: python bench/session_costs.py [--repeats 5]
Prints a table; targets live here, not in timed tests (machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.controller import rank_server  # noqa: E402

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
ONE_CELL = ["cases/test_fused_loss.py", "--world-sizes", "2", "-k", "fp32-ws2"]
# `python -m harness watch` of a small script, one cell at world size 2 (its controller imports no torch)
WATCH = [sys.executable, "-m", "harness", "watch", "tests/planted/scripts/hand_loop.py", "--nproc", "2",
         "--num-steps", "2", "--report-dir", "reports/session-costs", "--", "--accumulation", "2"]
# A pool of two running the first cell of a Trainer case, a compiled one and a DeepSpeed one; with an
# argument "all", its fork server also imports the libraries those use (rank_server.preload_all).
OPTIONAL_CELLS = """
import sys
from pathlib import Path
from harness.catalogue import load_case_file
from harness.controller import rank_server
from harness.controller.cells import run_cell
from harness.controller.options import resolve
from harness.controller.pool import PoolSet
from harness.wrappers.prepare import cell_variants
if sys.argv[1:] == ["all"]:
    rank_server.preload_all()
settings = resolve(world_sizes="2", backend="gloo", report_dir="reports", case_timeout="300", seed="1234")
pools = PoolSet(backend="gloo")
try:
    for path, name, variant in [("cases/test_trainer.py", "trainer_classifier", "steps=2-fp32"),
                                ("cases/test_fused_loss.py", "fused_loss", "fp32-compile=aot_eager"),
                                ("cases/test_fused_loss.py", "fused_loss", "fp32-wrapper=deepspeed-z1")]:
        case = next(c for c in load_case_file(Path(path)) if c.name == name)
        every = cell_variants(case.info.variants, case.info.wrappers, ("ddp", "deepspeed-z1"))
        cell = run_cell(pools, case, next(v for v in every if v.name == variant), 2, settings)
        assert cell.status not in ("error", "fail"), (name, variant, cell.status, cell.summary)
finally:
    pools.close()
"""


def busy_s() -> float:
    """The machine's busy CPU time so far, in seconds (/proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, *_ = map(int, stat.readline().split()[1:])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def measure(command: list[str], env: dict[str, str], repeats: int) -> tuple[float, float]:
    """The median busy CPU and wall seconds of ``command``, run from the checkout ``repeats`` times."""
    cpu, wall = [], []
    for _ in range(repeats):
        busy, started = busy_s(), time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall.append(time.perf_counter() - started)
        cpu.append(busy_s() - busy)
        if result.returncode not in (0, 5):
            raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return statistics.median(cpu), statistics.median(wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    own = {**os.environ, rank_server.SHARED_SERVER_VARIABLE: ""}
    rows = [
        ("python -c 'import torch' (for scale)", [sys.executable, "-c", "import torch"]),
        ("collect one case file", [*PYTEST, "--collect-only", "cases/test_fused_loss.py"]),
        ("one cell, its own fork server", [*PYTEST, *ONE_CELL]),
        ("Trainer, compiled, DeepSpeed cells, ranks import", [sys.executable, "-c", OPTIONAL_CELLS]),
        ("the same, the server imported them", [sys.executable, "-c", OPTIONAL_CELLS, "all"]),
    ]
    measured = [(name, *measure(command, own, args.repeats)) for name, command in rows]
    # the shared server started now, and given one session first: its imports are not the sessions'
    server, value = rank_server.start_shared_server()
    shared = {**os.environ, rank_server.SHARED_SERVER_VARIABLE: value}
    try:
        measure([*PYTEST, *ONE_CELL], shared, 1)
        measured.insert(3, ("one cell, an adopted fork server", *measure([*PYTEST, *ONE_CELL], shared, args.repeats)))
        measured.insert(4, ("watch a script, one cell, an adopted server", *measure(WATCH, shared, args.repeats)))
    finally:
        rank_server.end_shared_server(server)
    width = max(len(name) for name, *_ in measured)
    print(f"{'session':<{width}}  CPU s  wall s")
    print(f"{'-' * width}  -----  ------")
    for name, cpu, wall in measured:
        print(f"{name:<{width}}  {cpu:5.2f}  {wall:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
