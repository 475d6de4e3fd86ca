"""The catalogue launched by two torchrun agents (two "nodes" on this machine, N processes each, c10d
rendezvous on a local port) against the local rank pool of the same world size, cell by cell: status,
check counts and max |diff| must be the same. Prints both wall times and every difference; exit 1
if there is one.

    python bench/launch_vs_pools.py                  # 2 agents x 2 processes against the pool at world size 4
    python bench/launch_vs_pools.py --nproc 1 -k fp32
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPARED = ("status", "checks", "grad_checks", "vacuous_checks", "max_abs_diff")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cells(report_dir: Path) -> dict[tuple[str, str], dict]:
    matrix = json.loads((report_dir / "matrix.json").read_text())
    return {(c["case"], c["variant"]): c for c in matrix["cells"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes per agent (default 2: world size 4)")
    parser.add_argument("--out", type=Path, default=None, help="where both runs' reports go (default: a temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments for both runs (e.g. -k fp32)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="launch-vs-pools-"))
    world_size = 2 * args.nproc
    common = ["cases/", "-p", "no:cacheprovider", "-q", *args.pytest_args]

    started = time.monotonic()
    pools = subprocess.run([sys.executable, "-m", "pytest", *common, "--world-sizes", str(world_size),
                            "--report-dir", str(out / "pools")], cwd=ROOT, capture_output=True, text=True)
    pool_s = time.monotonic() - started

    endpoint = f"127.0.0.1:{free_port()}"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(args.nproc),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"bench-{os.getpid()}",
             "-m", "harness", "launch", *common, "--report-dir", str(out / "launch")]
    started = time.monotonic()
    agents = [subprocess.Popen(agent, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    logs = [a.communicate()[0] for a in agents]
    launch_s = time.monotonic() - started

    local, launched = cells(out / "pools"), cells(out / "launch")
    differences = []
    for key in sorted(set(local) | set(launched)):
        a, b = local.get(key), launched.get(key)
        if a is None or b is None:
            differences.append(f"{key[0]}[{key[1]}]: only in {'the launch' if a is None else 'the pool'}")
            continue
        for field in COMPARED:
            if a[field] != b[field]:
                differences.append(f"{key[0]}[{key[1]}]: {field} {a[field]!r} (pool) vs {b[field]!r} (launch)")
    statuses: dict[str, int] = {}
    for cell in launched.values():
        statuses[cell["status"]] = statuses.get(cell["status"], 0) + 1
    print(f"world size {world_size}: 2 torchrun agents x {args.nproc} processes vs the local pool")
    print(f"{'run':<28}{'wall s':>8}  exit")
    print(f"{'local pool (pytest)':<28}{pool_s:>8.1f}  {pools.returncode}")
    print(f"{'2 agents (harness launch)':<28}{launch_s:>8.1f}  {[a.returncode for a in agents]}")
    print(f"cells: {len(launched)} launched, {len(local)} pooled; launched statuses: "
          + ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())))
    print(f"compared per cell: {', '.join(COMPARED)}")
    if differences:
        print(f"{len(differences)} difference(s):")
        for line in differences:
            print(f"  {line}")
    else:
        print("no difference")
    print(f"reports: {out / 'pools'}, {out / 'launch'}")
    if any(a.returncode not in (0, 1) for a in agents):
        print(logs[0][-3000:])
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
