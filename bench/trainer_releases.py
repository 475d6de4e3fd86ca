"""The Trainer cases (cases/test_trainer.py) across transformers releases, with this interpreter's
torch and accelerate: which releases fail which cells, with which diagnosis (README, "Trainer").

Run: python bench/trainer_releases.py [RELEASE ...] [--world-sizes 1,2] [--out reports/trainer-releases]
     [--targets DIR] [-- PYTEST_ARGS...]

Each release is installed with pip into a folder of its own under --targets (``pip install --target``,
with the dependencies that release asks for, less numpy, which torch was built against here), put
first on PYTHONPATH, and ``python -m pytest cases/test_trainer.py`` runs with it (the ranks inherit
the path). A folder already there is reused. Prints, and writes to OUT/releases.md, one row per
release: its cells by status, and every cell that is not pass, skip or the declared canary's
``detected``, with its diagnoses (kind, what was checked, the factors of wrong_scale). Without
releases: the last patch of every minor release from 4.45 to the newest this index has.

Exit status: 0 every release ran (whatever its cells say), 1 one could not be installed or wrote no
matrix, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ["4.45.2", "4.46.3", "4.47.1", "4.48.3", "4.49.0", "4.50.3", "4.51.3", "4.52.4", "4.53.3", "4.54.1",
            "4.55.4", "4.56.2", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0",
            "5.8.1", "5.9.0", "5.10.4", "5.11.0", "5.12.1", "5.13.1", "5.14.1", "5.15.1", "5.16.1", "5.17.0",
            "5.18.0", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0"]
# installed alongside: what the interpreter's torch needs as it is
DROPPED = ("numpy", "numpy.libs", "torch", "bin")
# what is put beside an older transformers, by the module of this environment that needs it: accelerate
# imports datasets where it is installed, and transformers from 4.52 imports kernels where it is
# installed; the environment's own, newer than the release's huggingface_hub, fail to import beside
# it. Releases of that hub's time (.ci/run puts the same datasets beside transformers 4.57.1), with
# --no-deps: on this environment's pyarrow and the rest.
BESIDE = {"datasets": ["datasets==4.4.1", "httpx==0.29.0", "httpcore==1.0.9"], "kernels": ["kernels==0.10.4"]}


def install(release: str, targets: Path, package: str = "transformers") -> tuple[Path | None, str]:
    """``package==release`` in a folder of its own under ``targets`` (reused when there): transformers
    with the dependencies it asks for (and BESIDE), deepspeed alone (it is built
    from source, and what it imports is this environment's)."""
    target = targets / f"{package}-{release}"
    if (target / package).is_dir():
        return target, ""
    shutil.rmtree(target, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(target)]
    own = ["--no-deps"] if package == "deepspeed" else []
    done = subprocess.run([*pip, *own, f"{package}=={release}"], capture_output=True, text=True)
    beside = [r for module, releases in BESIDE.items() if importlib.util.find_spec(module) for r in releases]
    if done.returncode == 0 and package == "transformers" and beside:
        done = subprocess.run([*pip, "--no-deps", *beside], capture_output=True, text=True)
    if done.returncode != 0:
        return None, (done.stderr.strip().splitlines() or ["pip failed"])[-1]
    for entry in target.iterdir():
        if entry.name in DROPPED or entry.name.startswith(("numpy-", "torch-")):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink()
    return target, ""


def diagnoses(cell: dict) -> str:
    """``kind (checked ×factors)`` for each kind of the cell's failures."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for failure in cell.get("failures", []):
        factor = failure.get("factor")
        found[(failure["kind"], failure.get("checked", ""))].add(f"×{factor:.3g}" if factor else "")
    return "; ".join(f"{kind} ({checked} {' '.join(sorted(f for f in factors if f))})".replace(" )", ")")
                     for (kind, checked), factors in sorted(found.items()))


def row(release: str, matrix: dict) -> str:
    statuses = Counter(cell["status"] for cell in matrix["cells"])
    notes = []
    for cell in sorted(matrix["cells"], key=lambda c: (c["case"], c["variant"], c["world_size"])):
        if cell["status"] in ("pass", "skip"):
            continue
        if cell["status"] == "detected" and "average_tokens=false" in cell["variant"]:
            continue  # the canary, detected as it must be
        what = diagnoses(cell) or (cell.get("summary") or "").splitlines()[0][:160]
        notes.append(f"{cell['case']}[{cell['variant']}] ws{cell['world_size']} {cell['status']}: {what}")
    counts = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
    return f"| {release} | {counts} | {'<br>'.join(notes) or 'every cell as declared'} |"


def run_releases(package: str, releases: list[str], cases: list[str], *, targets: Path, out: Path,
                 world_sizes: str, extra: list[str], jobs: str = "0") -> int:
    """Each release of ``package`` installed and put first on the path of ``pytest CASES``; prints and
    writes OUT/releases.md, a row per release. 0 when every release wrote its matrix, else 1."""
    targets.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    rows = [f"| {package} | cells | cells that are not as declared: status: diagnoses (what was checked, factors) |",
            "| --- | --- | --- |"]
    failed = False
    for release in releases:
        target, why = install(release, targets, package)
        report = out / f"{package}-{release}"
        if target is None:
            rows.append(f"| {release} | not installed | {why} |")
            failed = True
            print(rows[-1], flush=True)
            continue
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
        with open(out / f"{package}-{release}.log", "w") as log:
            subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", jobs, *cases,
                            "--world-sizes", world_sizes, "--report-dir", str(report), *extra],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        matrix_path = report / "matrix.json"
        if not matrix_path.exists():
            rows.append(f"| {release} | no matrix | see {out}/{package}-{release}.log |")
            failed = True
        else:
            rows.append(row(release, json.loads(matrix_path.read_text())))
        print(rows[-1], flush=True)
    (out / "releases.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", default=RELEASES)
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--out", type=Path, default=Path("reports") / "trainer-releases")
    parser.add_argument("--targets", type=Path, default=ROOT / ".sweep-venvs" / "transformers")
    args = parser.parse_args(argv)
    return run_releases("transformers", args.releases, ["cases/test_trainer.py"], targets=args.targets, out=args.out,
                        world_sizes=args.world_sizes, extra=extra)


if __name__ == "__main__":
    sys.exit(main())
