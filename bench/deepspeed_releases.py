"""The catalogue's DeepSpeed cells across deepspeed releases, with this interpreter's torch,
accelerate and transformers: which releases fail which cells, with which diagnosis
(docs/wrappers.md, "ZeRO-2 across deepspeed releases" and "bf16 under DeepSpeed").

Run: python bench/deepspeed_releases.py [RELEASE ...] [--wrappers deepspeed-z2] [--world-sizes 2]
     [--out reports/deepspeed-releases] [--targets DIR] [--jobs 2] [-- PYTEST_ARGS...]

Each release is built with pip into a folder of its own under --targets (``pip install --no-deps
--target``: deepspeed ships as source; what it imports is this environment's), put first on
PYTHONPATH, and ``python -m pytest -n JOBS cases/ --wrappers W`` runs with it (the ranks inherit the
path). A folder already there is reused. Prints, and writes to OUT/releases.md, one row per release
(bench/trainer_releases.py's rows). Without releases: the ones around deepspeed issue #7718 (ZeRO-2
keeping only a window's last micro-batch, 0.17.6 to 0.18.2).

Exit status: 0 every release ran (whatever its cells say), 1 one could not be installed or wrote no
matrix, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_releases import ROOT, run_releases  # noqa: E402  (bench/ is not a package)

RELEASES = ["0.17.5", "0.17.6", "0.18.2", "0.18.3"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", default=RELEASES)
    parser.add_argument("--wrappers", default="deepspeed-z2")
    parser.add_argument("--world-sizes", default="2")
    parser.add_argument("--jobs", default="2", help="pytest-xdist workers (default: 2)")
    parser.add_argument("--out", type=Path, default=Path("reports") / "deepspeed-releases")
    parser.add_argument("--targets", type=Path, default=ROOT / ".sweep-venvs" / "deepspeed")
    args = parser.parse_args(argv)
    return run_releases("deepspeed", args.releases, ["cases/", "--wrappers", args.wrappers], targets=args.targets,
                        out=args.out, world_sizes=args.world_sizes, extra=extra, jobs=args.jobs)


if __name__ == "__main__":
    sys.exit(main())
