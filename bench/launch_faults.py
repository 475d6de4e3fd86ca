"""Every planted rank fault under a launcher: two torchrun agents (two "nodes" on this machine, one
rank each), rank 1 failing in the planted way (tests/planted/planted_cases.py), then a healthy cell.
Prints, per fault: the faulty cell's status and time, its summary, what became of the next cell and
how long after the faulty one it ended (the group's recovery and the healthy cell: pytest's time for
it, from junit XML), the launch's wall time and exit statuses, and the processes left when it ended
(there must be none).

    python bench/launch_faults.py [--case-timeout 4] [--fault raise ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ("raise", "exit", "kill", "hang_in_collective", "hang_outside")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def left(token: str) -> int:
    """Live processes carrying the token in their environment, a few seconds after the launch ended."""
    time.sleep(3)
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "environ").read_bytes():
                count += "\nState:\tZ" not in (entry / "status").read_text()
        except OSError:
            continue
    return count


def launch(fault: str, timeout: float, out: Path) -> dict:
    token = f"launch-faults-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAUNCH_FAULTS_TOKEN": token}
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", token,
             "-m", "harness", "launch", "tests/planted/planted_cases.py", "-k", f"planted_rank_fault and {fault}",
             "--case-timeout", f"{timeout:g}", "--report-dir", str(out), "--junitxml", str(out / "junit.xml"),
             "-p", "no:cacheprovider", "-q"]
    started = time.monotonic()
    agents = [subprocess.Popen(agent, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for _ in range(2)]
    codes = [a.wait() for a in agents]
    wall = time.monotonic() - started
    cells = {c["variant"]: c for c in json.loads((out / "matrix.json").read_text())["cells"]}
    times = {case.get("name", ""): float(case.get("time", "nan"))
             for case in ElementTree.parse(out / "junit.xml").iter("testcase")}
    after = next((t for name, t in times.items() if f"after_{fault}" in name), float("nan"))
    return {"fault": fault, "cell": cells[fault], "next": cells[f"after_{fault}"], "after": after, "wall": wall,
            "codes": codes, "left": left(token)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case-timeout", type=float, default=4.0)
    parser.add_argument("--fault", action="append", choices=FAULTS, help="only these faults (default: all)")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="launch-faults-"))
    rows = [launch(fault, args.case_timeout, out / fault) for fault in args.fault or FAULTS]
    print(f"two torchrun agents x 1 rank, --case-timeout {args.case_timeout:g}; rank 1 fails")
    print(f"{'fault':<20}{'cell':<8}{'to error s':>11}{'next s':>8}{'launch s':>10}  {'exits':<8}{'left':>5}  "
          "next cell")
    for row in rows:
        print(f"{row['fault']:<20}{row['cell']['status']:<8}{row['cell']['duration_s']:>11.1f}{row['after']:>8.1f}"
              f"{row['wall']:>10.1f}  "
              f"{','.join(map(str, row['codes'])):<8}{row['left']:>5}  {row['next']['status']}: "
              f"{row['next']['summary'][:60]}")
    print("summaries:")
    for row in rows:
        print(f"  {row['fault']}: {row['cell']['summary']}")
    print(f"reports: {out}")
    return 1 if any(row["left"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
