"""The gradient-sync matrix across (torch, accelerate) pairs: one venv and one report folder a pair.

Run: python bench/sweep.py 2.13.0/1.15.0 2.9.1/1.15.0 2.4.1/0.28.0 --world-sizes 1,2 --out reports/sweep
     [--venvs DIR] [--reuse] [--deepspeed] [--wrappers W] [--jobs N] [--python PATH] [-- PYTEST_ARGS...]

Each pair gets a venv under --venvs (torch==X installed first and alone, so that nothing installed
later brings another torch; then this checkout's `.[test]` with accelerate==Y and setuptools<81),
and `python -m pytest -n JOBS cases/ --report-dir OUT/torch-X-accelerate-Y` in it from the repo
root. A pair that cannot be installed is reported and the sweep goes on. At the end
`python -m harness compare OUT/*/matrix.json` writes OUT/compare.md and OUT/compare.html, and a
table of the pairs (exit status, seconds, cells by status) is printed and written to OUT/pairs.md.

`--python PATH` runs every pair with that interpreter instead of making venvs (its torch and
accelerate must be the pair's); `--installed` runs the matrix once in this interpreter, for the
versions installed in it, and exits with pytest's status (what `tox -e torch` runs).

Exit status: 0 every pair wrote its matrix (whatever its cells say: read the table), 1 a pair did
not (install failed, version mismatch, no matrix) or compare failed, 2 bad arguments, 130 Ctrl-C
(the pair it stopped is in the table, the pairs after it as `not run`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.records import STATUSES  # noqa: E402  (plain data: imports neither torch nor pytest)

DEFAULT_VENVS = ROOT / ".sweep-venvs"
DEFAULT_OUT = Path("reports") / "sweep"
# A release as pip takes it after `==`: digits first, then letters, digits, dots, dashes, `+local`.
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+_-]*\Z")
_WORLD_SIZES = re.compile(r"auto\Z|[1-9][0-9]*(,[1-9][0-9]*)*\Z")
_JOBS = re.compile(r"auto\Z|logical\Z|[0-9]+\Z")
# The interpreter's versions, read from its package metadata (no torch import: fast, and it works
# even where torch would not import).
_VERSIONS_SCRIPT = (
    "import importlib.metadata as m\n"
    "for name in ('torch', 'accelerate'):\n"
    "    try:\n"
    "        print(m.version(name))\n"
    "    except m.PackageNotFoundError:\n"
    "        print('')\n"
)


class UsageError(Exception):
    """Bad arguments; the message is one line."""


@dataclass(frozen=True)
class Pair:
    """A torch release and an accelerate release, as given on the command line."""

    torch: str
    accelerate: str

    def __str__(self) -> str:
        return f"{self.torch}/{self.accelerate}"


@dataclass
class PairResult:
    """What came of one pair. ``outcome`` is ``ran`` when pytest ran and wrote a matrix; else it says
    why there are no counts (``install failed``, ``version mismatch``, ``no matrix``, ...) and
    ``reason`` is one line."""

    pair: Pair
    outcome: str
    exit_status: Optional[int] = None
    seconds: Optional[float] = None
    counts: Optional[dict[str, int]] = None
    installed: Optional[tuple[str, str]] = None
    reason: str = ""
    complete: bool = True
    report_dir: Optional[Path] = None
    interrupted: bool = False  # Ctrl-C stopped it: the sweep stops after this pair

    @property
    def ran(self) -> bool:
        return self.outcome == "ran"


@dataclass
class Sweep:
    """The options every pair runs under."""

    out: Path
    venvs: Path
    jobs: str = "auto"
    world_sizes: Optional[str] = None
    wrappers: Optional[str] = None
    deepspeed: bool = False
    reuse: bool = False
    python: Optional[Path] = None
    pytest_args: list[str] = field(default_factory=list)


# --- pure: pairs, names, counts, the table -----------------------------------------------------------

def parse_pair(text: str) -> Pair:
    """``2.9.1/1.15.0`` as a Pair; anything else is a UsageError naming it."""
    parts = text.split("/")
    if len(parts) != 2 or not all(_VERSION.match(p) for p in parts):
        raise UsageError(f"bad pair {text!r}: expected TORCH/ACCELERATE, two release versions such as 2.9.1/1.15.0")
    return Pair(*parts)


def parse_pairs(texts: Sequence[str]) -> list[Pair]:
    """The pairs in the order given; one given twice is a UsageError (both would write one folder)."""
    pairs: list[Pair] = []
    for text in texts:
        pair = parse_pair(text)
        if pair in pairs:
            raise UsageError(f"pair {text!r} given twice")
        pairs.append(pair)
    return pairs


def public_version(version: str) -> str:
    """A version without its local label: ``2.6.0+cu124`` is ``2.6.0``."""
    return version.split("+", 1)[0]


def same_release(asked: str, installed: str) -> bool:
    """Whether pip's ``==asked`` is met by ``installed``: a local label counts only where one was
    asked for, and trailing zeros of the release do not count (``2.6`` is ``2.6.0``)."""
    if "+" not in asked:
        installed = public_version(installed)

    def normal(version: str) -> tuple[tuple[int, ...], str]:
        match = re.match(r"([0-9]+(?:\.[0-9]+)*)(.*)\Z", version)
        if not match:
            return ((), version.lower())
        release = [int(n) for n in match.group(1).split(".")]
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        return (tuple(release), match.group(2).lower())

    return normal(asked) == normal(installed)


def installed_pair(torch_version: str, accelerate_version: str) -> Pair:
    """The pair an interpreter holds, named by its public versions (``2.13.0+cpu`` is 2.13.0)."""
    return Pair(public_version(torch_version), public_version(accelerate_version))


def report_folder(pair: Pair) -> str:
    """The report folder of a pair under --out (also `tox -e torch`'s under reports/)."""
    return f"torch-{pair.torch}-accelerate-{pair.accelerate}"


def venv_folder(pair: Pair, *, deepspeed: bool = False) -> str:
    """The venv of a pair under --venvs; one with deepspeed is another venv."""
    return report_folder(pair) + ("-deepspeed" if deepspeed else "")


def count_statuses(matrix: Any) -> dict[str, int]:
    """Cells by status, every status present (0 where none), from a matrix.json's parsed dict.
    Raises ValueError with one line for a dict that is not a matrix or a status it does not know."""
    if not isinstance(matrix, dict) or not isinstance(matrix.get("cells"), list):
        raise ValueError("not a matrix: no list of cells")
    counts = {status: 0 for status in STATUSES}
    for cell in matrix["cells"]:
        status = cell.get("status") if isinstance(cell, dict) else None
        if status not in counts:
            raise ValueError(f"a cell with status {status!r}, expected one of {', '.join(STATUSES)}")
        counts[status] += 1
    return counts


def last_error_line(log: str) -> str:
    """pip's last ``ERROR:`` line, else the last line it printed: the one line a failed install is
    reported by. pip's closing ``ResolutionImpossible: for help visit ...`` says nothing of the
    pair, so the error before it is the one."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    errors = [line for line in errors if not line.startswith("ERROR: ResolutionImpossible")] or errors
    if errors:
        return errors[-1]
    return lines[-1] if lines else "(pip printed nothing)"


def render_table(results: Sequence[PairResult]) -> str:
    """The sweep's Markdown: one row per pair (the versions that ran, where it ran), its exit status,
    seconds and cells by status; below it one line for every pair that did not run or ran
    incomplete."""
    header = ["torch", "accelerate", "exit", "seconds", *STATUSES]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    notes = []
    for result in results:
        shown = result.installed if result.ran and result.installed else (result.pair.torch, result.pair.accelerate)
        torch_version, accelerate_version = shown
        exit_text = str(result.exit_status) if result.ran else result.outcome
        seconds = f"{result.seconds:.0f}" if result.seconds is not None else "–"
        counts = [str(result.counts[s]) for s in STATUSES] if result.counts else ["–"] * len(STATUSES)
        lines.append("| " + " | ".join([torch_version, accelerate_version, exit_text, seconds, *counts]) + " |")
        if not result.ran:
            notes.append(f"- `{result.pair}`: {result.outcome}: {result.reason}")
        elif not result.complete:
            notes.append(f"- `{result.pair}`: the run did not finish (exit {result.exit_status}); "
                         "its matrix is incomplete")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# --- processes ---------------------------------------------------------------------------------------

def _child_env() -> dict[str, str]:
    """The environment of what the sweep starts: a venv must see only its own packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@dataclass
class Ran:
    """What came of one command: its exit status, the end of its output, and whether Ctrl-C stopped it."""

    status: int
    output: str
    interrupted: bool = False


def _run_logged(command: list[str], log: BinaryIO, *, echo: bool, cwd: Path = ROOT) -> Ran:
    """Run ``command``, its output into ``log`` (and onto stdout with ``echo``). On Ctrl-C the command
    is stopped (``_stop``) while its last output is still copied: nothing the sweep starts outlives it,
    and an interrupted pytest still writes its (incomplete) matrix."""
    process = subprocess.Popen(command, cwd=cwd, env=_child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    tail = bytearray()

    def copy() -> None:
        assert process.stdout is not None
        for chunk in iter(lambda: process.stdout.read1(65536), b""):
            log.write(chunk)
            tail.extend(chunk)
            del tail[:-65536]
            if echo:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    interrupted = False
    try:
        status = process.wait()
    except KeyboardInterrupt:
        interrupted = True
        status = _stop(process)
    copier.join(timeout=30)
    return Ran(status, tail.decode(errors="replace"), interrupted)


def _stop(process: subprocess.Popen) -> int:
    """End ``process`` after Ctrl-C, which reached it too: it is given time to end on its own (pytest
    tears its ranks down and writes its reports), then asked to, then killed; another Ctrl-C moves
    to the next step at once. Its exit status."""
    for ask in (lambda: None, process.terminate, process.kill):
        try:
            ask()
            return process.wait(timeout=30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue
    return process.wait()


def read_versions(python: Path) -> tuple[str, str]:
    """(torch, accelerate) as installed for ``python``; "" for one that is not installed. Raises
    OSError with one line when the interpreter cannot be run."""
    try:
        done = subprocess.run([str(python), "-c", _VERSIONS_SCRIPT], capture_output=True, text=True,
                              env=_child_env(), timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(f"cannot run {python}: {exc}") from None
    lines = done.stdout.splitlines()
    if done.returncode != 0 or len(lines) != 2:
        raise OSError(f"cannot read the versions of {python}: {last_error_line(done.stderr)}")
    return (lines[0].strip(), lines[1].strip())


def _versions_text(versions: tuple[str, str]) -> str:
    torch_version, accelerate_version = versions
    return f"torch {torch_version or '(not installed)'}, accelerate {accelerate_version or '(not installed)'}"


def _mismatch(pair: Pair, versions: tuple[str, str]) -> Optional[str]:
    """None when ``versions`` are the pair's, else the one-line reason."""
    if same_release(pair.torch, versions[0]) and same_release(pair.accelerate, versions[1]):
        return None
    return f"asked for torch {pair.torch}, accelerate {pair.accelerate}; the interpreter has {_versions_text(versions)}"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _step(text: str) -> None:
    print(f"  {text}", flush=True)


def install_pair(pair: Pair, sweep: Sweep, log_path: Path) -> tuple[Optional[Path], str]:
    """The venv python of ``pair``, made (or kept, with --reuse, where it holds the pair); else None
    and the one-line reason."""
    venv = sweep.venvs / venv_folder(pair, deepspeed=sweep.deepspeed)
    python = _venv_python(venv)
    if sweep.reuse and python.exists():
        try:
            versions = read_versions(python)
        except OSError:
            versions = ("", "")
        if _mismatch(pair, versions) is None:
            _step(f"reusing {venv} ({_versions_text(versions)})")
            return python, ""
        _step(f"not reusing {venv}: it has {_versions_text(versions)}")
    extra = "test,deepspeed" if sweep.deepspeed else "test"
    steps = [
        ("make the venv", [sys.executable, "-m", "venv", "--clear", str(venv)]),
        # torch alone and first: once it is in place, nothing installed later can pull another one
        ("pip install torch", [str(python), "-m", "pip", "install", f"torch=={pair.torch}"]),
        # accelerate before 0.21 imports pkg_resources, which setuptools 81 removed
        ("pip install the harness", [str(python), "-m", "pip", "install", "-e", f"{ROOT}[{extra}]",
                                     f"accelerate=={pair.accelerate}", "setuptools<81"]),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        for what, command in steps:
            _step(f"{what}: {shlex.join(command)}")
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            started = time.monotonic()
            ran = _run_logged(command, log, echo=False)
            if ran.interrupted:
                return None, "interrupted"
            if ran.status != 0:
                return None, last_error_line(ran.output)
            _step(f"  done in {time.monotonic() - started:.0f} s")
    return python, ""


def run_pair(pair: Pair, sweep: Sweep) -> PairResult:
    """Install (or find) the pair's interpreter, run the matrix with it, count its cells."""
    report_dir = sweep.out / report_folder(pair)
    # a matrix left from an earlier sweep must not stand in for this one in the table or in compare
    for name in ("matrix.json", "matrix.md", "matrix.html"):
        (report_dir / name).unlink(missing_ok=True)
    if sweep.python is not None:
        python = sweep.python
    else:
        python, reason = install_pair(pair, sweep, report_dir / "install.log")
        if python is None and reason == "interrupted":
            return PairResult(pair, "interrupted", reason="Ctrl-C while installing; the sweep stopped here",
                              interrupted=True)
        if python is None:
            return PairResult(pair, "install failed", reason=f"{reason} (log: {report_dir / 'install.log'})")
    try:
        versions = read_versions(python)
    except OSError as exc:
        return PairResult(pair, "install failed" if sweep.python is None else "version mismatch", reason=str(exc))
    _step(_versions_text(versions))
    problem = _mismatch(pair, versions)
    if problem:
        return PairResult(pair, "version mismatch", installed=versions, reason=problem)
    command = [str(python), "-m", "pytest", *pytest_options(sweep, report_dir)]
    _step(f"from {ROOT}: {shlex.join(command)}")
    started = time.monotonic()
    report_dir.mkdir(parents=True, exist_ok=True)
    with open(report_dir / "pytest.log", "wb") as log:
        ran = _run_logged(command, log, echo=True)
    status = ran.status
    seconds = time.monotonic() - started
    try:
        matrix = json.loads((report_dir / "matrix.json").read_text())
        counts = count_statuses(matrix)
    except FileNotFoundError:
        return PairResult(pair, "no matrix", exit_status=status, seconds=seconds, installed=versions,
                          reason=f"pytest exited {status} and wrote no matrix (log: {report_dir / 'pytest.log'})",
                          interrupted=ran.interrupted)
    except ValueError as exc:
        return PairResult(pair, "no matrix", exit_status=status, seconds=seconds, installed=versions,
                          reason=f"{report_dir / 'matrix.json'}: {str(exc).splitlines()[0]}",
                          interrupted=ran.interrupted)
    return PairResult(pair, "ran", exit_status=status, seconds=seconds, counts=counts, installed=versions,
                      complete=matrix.get("complete") is True, report_dir=report_dir, interrupted=ran.interrupted)


def pytest_options(sweep: Sweep, report_dir: Path) -> list[str]:
    """pytest's arguments for one pair: the catalogue, its options, then the user's own."""
    options = ["-n", sweep.jobs, "cases/"]
    if sweep.world_sizes:
        options += ["--world-sizes", sweep.world_sizes]
    if sweep.wrappers:
        options += ["--wrappers", sweep.wrappers]
    return options + ["--report-dir", str(report_dir.resolve()), *sweep.pytest_args]


def matrices_to_compare(out: Path, results: Sequence[PairResult]) -> list[Path]:
    """OUT/*/matrix.json: this sweep's pairs in the order given, then those of earlier sweeps into
    the same OUT, by name."""
    ours = [r.report_dir / "matrix.json" for r in results if r.ran and r.report_dir is not None]
    others = sorted(p for p in out.glob("*/matrix.json") if p not in ours)
    return ours + others


def compare(out: Path, matrices: Sequence[Path]) -> Optional[str]:
    """`python -m harness compare` into OUT/compare.md and OUT/compare.html; None, or the one-line
    reason it failed."""
    command = [sys.executable, "-m", "harness", "compare", *map(str, matrices),
               "--markdown", str(out / "compare.md"), "--html", str(out / "compare.html")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return last_error_line(done.stderr or done.stdout)
    return None


# --- the command -------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bench/sweep.py", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Arguments after `--` go to pytest as they are, e.g. -- -k \"test_no_sync and fp32\".")
    parser.add_argument("pairs", nargs="*", metavar="TORCH/ACCELERATE", help="e.g. 2.9.1/1.15.0")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where the report folders, compare.md/.html and pairs.md go (default: %(default)s)")
    parser.add_argument("--venvs", type=Path, default=None,
                        help=f"where the venvs are kept (default: {DEFAULT_VENVS.relative_to(ROOT)}/ at the repo root)")
    parser.add_argument("--reuse", action="store_true", help="keep a pair's existing venv where it holds the pair")
    parser.add_argument("--deepspeed", action="store_true", help="install .[test,deepspeed] (a venv of its own)")
    parser.add_argument("--world-sizes", default=None, help="pytest's --world-sizes (default: the harness's, auto)")
    parser.add_argument("--wrappers", default=None, help="pytest's --wrappers (default: the harness's, auto)")
    parser.add_argument("--jobs", default="auto", help="pytest's -n (default: %(default)s; 0 runs without xdist)")
    parser.add_argument("--python", type=Path, default=None,
                        help="run every pair with this interpreter, no venvs (its versions must be the pair's)")
    parser.add_argument("--installed", action="store_true",
                        help="no pairs: run the matrix once here, for the installed versions, into "
                             "OUT/torch-X-accelerate-Y/, and exit with pytest's status")
    return parser


def parse_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[Pair], list[str]]:
    """The options, the pairs and pytest's arguments (those after ``--``); bad ones a UsageError."""
    argv = list(argv)
    pytest_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    args = _parser().parse_args(argv)
    pairs = parse_pairs(args.pairs)
    if args.world_sizes is not None and not _WORLD_SIZES.match(args.world_sizes):
        raise UsageError(f"--world-sizes: {args.world_sizes!r} is not a comma list of positive integers "
                         "(1,2,4) or auto")
    if not _JOBS.match(args.jobs):
        raise UsageError(f"--jobs: {args.jobs!r} is not a number, auto or logical")
    if args.installed and (pairs or args.python is not None):
        raise UsageError("--installed takes no pairs and no --python: it runs the versions installed here")
    if not args.installed and not pairs:
        raise UsageError("give at least one TORCH/ACCELERATE pair, e.g. 2.9.1/1.15.0 (or --installed)")
    if args.python is not None or args.installed:
        given = [name for name, on in (("--venvs", args.venvs is not None), ("--reuse", args.reuse),
                                       ("--deepspeed", args.deepspeed)) if on]
        if given:
            mode = "--python" if args.python is not None else "--installed"
            raise UsageError(f"{', '.join(given)}: nothing is installed with {mode}")
    if args.python is not None and not args.python.is_file():
        raise UsageError(f"--python: {str(args.python)!r} is not a file")
    return args, pairs, pytest_args


def run_installed(sweep: Sweep) -> int:
    """The matrix once, in this interpreter, into OUT/torch-X-accelerate-Y/ named by the installed
    versions; pytest's exit status."""
    versions = read_versions(Path(sys.executable))
    if not all(versions):
        print(f"sweep: this interpreter has {_versions_text(versions)}", file=sys.stderr)
        return 2
    report_dir = sweep.out / report_folder(installed_pair(*versions))
    print(f"{_versions_text(versions)} (python {sys.version.split()[0]}, {sys.executable})")
    print(f"report folder: {report_dir}/", flush=True)
    process = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_options(sweep, report_dir)], cwd=ROOT)
    try:
        return process.wait()
    except KeyboardInterrupt:
        return _stop(process)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args, pairs, pytest_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    sweep = Sweep(out=args.out, venvs=args.venvs or DEFAULT_VENVS, jobs=args.jobs, world_sizes=args.world_sizes,
                  wrappers=args.wrappers, deepspeed=args.deepspeed, reuse=args.reuse,
                  python=args.python.absolute() if args.python else None, pytest_args=pytest_args)
    if args.installed:
        return run_installed(sweep)
    sweep.out.mkdir(parents=True, exist_ok=True)
    results: list[PairResult] = []
    for number, pair in enumerate(pairs, 1):
        print(f"[{number}/{len(pairs)}] torch {pair.torch}, accelerate {pair.accelerate}", flush=True)
        try:
            result = run_pair(pair, sweep)
        except KeyboardInterrupt:
            result = PairResult(pair, "interrupted", reason="Ctrl-C; the sweep stopped here", interrupted=True)
        except OSError as exc:  # a venv or report folder that cannot be written: this pair only
            result = PairResult(pair, "install failed", reason=str(exc))
        results.append(result)
        if result.ran:
            _step(f"exit {result.exit_status} in {result.seconds:.0f} s: "
                  + ", ".join(f"{n} {s}" for s, n in (result.counts or {}).items() if n))
        else:
            print(f"sweep: {pair}: {result.outcome}: {result.reason}", file=sys.stderr, flush=True)
        if result.interrupted:
            results += [PairResult(p, "not run", reason="the sweep stopped before it") for p in pairs[number:]]
            break
    matrices = matrices_to_compare(sweep.out, results)
    compare_problem = None
    if matrices:
        compare_problem = compare(sweep.out, matrices)
        if compare_problem:
            print(f"sweep: compare failed: {compare_problem}", file=sys.stderr)
        else:
            ours = {sweep.out / report_folder(r.pair) for r in results}
            earlier = sum(m.parent not in ours for m in matrices)
            inputs = f"{len(matrices)} {'matrix' if len(matrices) == 1 else 'matrices'}"
            inputs += f", {earlier} from earlier sweeps" if earlier else ""
            print(f"\ncompare ({inputs}): {sweep.out / 'compare.md'}, {sweep.out / 'compare.html'}")
    table = render_table(results)
    (sweep.out / "pairs.md").write_text(table)
    print(f"\n{table}\npairs: {sweep.out / 'pairs.md'}")
    if any(r.interrupted for r in results):
        return 130
    return 0 if all(r.ran for r in results) and not compare_problem else 1


if __name__ == "__main__":
    sys.exit(main())
