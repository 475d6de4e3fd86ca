"""How well the progress line's "time left" holds: the catalogue run as the README's first command
runs it, each progress line stamped as it arrives, and each line's promise set against the time the
run really took from there.

Run: python bench/progress_estimate.py [--out reports/progress-estimate] [-- PYTEST_ARGS...]
     (default PYTEST_ARGS: -n 2 -v cases/; under -v each progress line is written when it is made,
     not held until a line of dots ends, and each cell's own line stamps when it ended)
     python bench/progress_estimate.py --replay OUT
     (the estimate of today's harness over a run recorded in OUT: its cells' ends as they came, each
     cell's seconds from its matrix, xdist's hand-out as the run's lines show it; models compared on
     the same run, without running it again)
     python bench/progress_estimate.py --priors MATRIX.json [MATRIX.json ...]
     (the priors of harness/controller/cell_costs.py fitted to the cells of default catalogue runs:
     ``PRIOR_COST`` and ``CASE_PRIOR`` as Python, from each cell's ``duration_s``)

Prints a table of the lines from the first quarter of the cells on: cells done, seconds since the
start, the time left the line promised, the time that was left, the error as a share of the latter,
and what the old estimate (every cell alike: the pace since the first cell times the cells left)
would have promised at the same moment; then the largest error of each while more than a minute was
left (below that the line's own interval, 10 s, and one cell's time are most of it). The goal (issue
76): within 25% from the first quarter on. Writes the table to OUT/progress.md and the run's output to
OUT/pytest.log. Exit status: 0 when the run wrote progress lines (whatever its cells say), 1 when it
wrote none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the harness of this checkout, for --replay and --priors
SECONDS = re.compile(r"(?:(\d+)h(\d+)m)|(?:(\d+)m(\d+)s)|(?:(\d+)s)")


def promised(text: str) -> float | None:
    """The seconds a progress line says are left (``1m52s``, ``45s``, ``2h05m``), or None."""
    found = re.search(r" · (\S+) left", text)
    if not found:
        return None
    match = SECONDS.fullmatch(found.group(1))
    if not match:
        return None
    h, hm, m, ms, s = match.groups()
    if h is not None:
        return int(h) * 3600 + int(hm) * 60
    if m is not None:
        return int(m) * 60 + int(ms)
    return float(s)


# a test's own line under -v: how it ended
OUTCOMES = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
CELL_LINE = re.compile(rf" ({OUTCOMES}) ")


def even_pace(ended_cells: list[float], at: float, total: int) -> float | None:
    """What the old estimate said at ``at``: the wall time since the first cell ended over the cells
    done since, times the cells left; None before two cells ended."""
    done = [t for t in ended_cells if t <= at]
    if len(done) < 2:
        return None
    return (at - done[0]) / (len(done) - 1) * (total - len(done))


STARTED = re.compile(r"^(\S+::\S+\]) $")
ENDED = re.compile(rf"^\[(gw\d+)\] \[ *\d+%\] ({OUTCOMES}) (\S+::\S+\])")


def replay(out: Path) -> str:
    """Today's estimate (harness/controller/progress.py) over the run recorded in ``out`` (``stamps.tsv``,
    ``reports/matrix.json``): each cell given to the estimate when its line came, with its worker and its
    seconds; a world size's cells given to the worker that ran them from when its first cell started
    (xdist's scheduler hands them out whole), the world sizes not started yet queued; the estimate read
    where the run wrote a progress line, set against the time the run then took."""
    from harness.controller.cells import CELL_ID_END
    from harness.controller.progress import Progress

    cells = {c["nodeid"]: c for c in json.loads((out / "reports" / "matrix.json").read_text())["cells"]}
    events = []
    for row in (out / "stamps.tsv").read_text().splitlines():
        at, _, line = row.partition("\t")
        events.append((float(at), line))
    ended = events[-1][0]
    scope_of = {nodeid: CELL_ID_END.search(nodeid).group(1) for nodeid in cells}
    scopes: dict[str, list[str]] = {}
    for nodeid, scope in scope_of.items():
        scopes.setdefault(scope, []).append(nodeid)
    worker_of = {}
    for _, line in events:
        found = ENDED.match(line)
        if found:
            worker_of.setdefault(scope_of[found.group(3)], found.group(1))
    given: dict[str, list[str]] = {}  # by worker
    started: set[str] = set()
    clock = [0.0]
    progress = Progress(None, clock=lambda: clock[0], tick_s=None)
    progress.expect(len(cells), list(cells))
    progress.queues = lambda: (given, [scopes[s] for s in sorted(scopes, key=int, reverse=True) if s not in started])
    rows, worst = [], 0.0
    for at, line in events:
        clock[0] = at
        found = STARTED.match(line)
        if found and found.group(1) in scope_of and scope_of[found.group(1)] not in started:
            scope = scope_of[found.group(1)]
            started.add(scope)
            given.setdefault(worker_of[scope], []).extend(scopes[scope])
        found = ENDED.match(line)
        if found:
            cell = cells[found.group(3)]
            progress.cell_done(cell["status"], found.group(3), nodeid=found.group(3), seconds=cell["duration_s"],
                               worker=found.group(1))
        counts = re.search(r"gradient-sync: (\d+)/(\d+) cells .* left", line)
        if counts and progress.done * 4 >= progress.total and 1 < progress.done < progress.total:
            left, really = progress.left(at), ended - at
            error = (left - really) / really if really > 0 else 0.0
            if really > 60:
                worst = max(worst, abs(error))
            rows.append(f"| {progress.done}/{progress.total} | {at:.0f} | {left:.0f} | {really:.0f} | {error:+.0%} |")
    return "\n".join(["| cells done | at (s) | estimate now (s) | really left (s) | error |", "| --- | --- | --- | --- | --- |",
                      *rows, f"\nrun: {ended:.0f} s; the largest error from the first quarter of the cells on, while "
                      f"more than a minute was left: {worst:.0%}"])


def priors(matrices: list[Path]) -> str:
    """``PRIOR_COST`` (by kind, relative to a DDP cell at world size 2) and ``CASE_PRIOR`` (by case, over
    the catalogue's cells that ran) fitted as the progress line fits the cells done (cell_costs.fit),
    to every cell of ``matrices`` together."""
    from harness.controller.cell_costs import case_of, cell_kind, fit

    timed = []
    for path in matrices:
        for cell in json.loads(path.read_text())["cells"]:
            timed.append((case_of(cell["nodeid"]), cell_kind(cell["nodeid"]), cell["duration_s"],
                          cell["status"] not in ("skip", "unsupported")))
    kinds, cases = fit(timed)
    unit = kinds[("ddp", 2)]
    lines = [f"# fitted to {len(timed)} cells of {len(matrices)} runs; a DDP cell at world size 2: {unit:.2f} s",
             "PRIOR_COST = {"]
    for name in sorted({name for name, _ in kinds}, key=lambda n: (n != "ddp", n)):
        row = [f"({name!r}, {ws}): {kinds[(name, ws)] / unit:.1f}" for ws in sorted(w for n, w in kinds if n == name)]
        lines.append("    " + ", ".join(row) + ",")
    lines += ["}", "CASE_PRIOR = {"]
    for case in sorted(cases, key=lambda c: c.rpartition("::")[2]):
        lines.append(f"    {case.rpartition('::')[2]!r}: {cases[case]:.2f},")
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else ["-n", "2", "-v", "cases/"]
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports") / "progress-estimate")
    parser.add_argument("--replay", type=Path, metavar="OUT", help="today's estimate over the run recorded in OUT")
    parser.add_argument("--priors", type=Path, nargs="+", metavar="MATRIX",
                        help="print the priors fitted to these runs' matrix.json, running nothing")
    args = parser.parse_args(argv)
    if args.priors:
        print(priors(args.priors))
        return 0
    if args.replay:
        print(replay(args.replay))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    stamped: list[tuple[float, int, int, float]] = []
    ended_cells: list[float] = []  # when each cell's own line came (-v)
    # pytest.log: the run's output; stamps.tsv: every line with its time, for --replay
    with open(args.out / "pytest.log", "w") as log, open(args.out / "stamps.tsv", "w") as stamps:
        # unbuffered: a line is stamped when pytest writes it, not when a pipe's buffer fills
        process = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir",
                                    str(args.out / "reports"), *extra], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert process.stdout is not None
        for line in process.stdout:
            now = time.monotonic() - started
            log.write(line)
            log.flush()
            stamps.write(f"{now:.3f}\t{line}")
            if CELL_LINE.search(line):
                ended_cells.append(now)
            for part in line.split("\r"):
                counts = re.search(r"gradient-sync: (\d+)/(\d+) cells", part)
                left = promised(part)
                if counts and left is not None:
                    stamped.append((now, int(counts.group(1)), int(counts.group(2)), left))
        process.wait()
        stamps.write(f"{time.monotonic() - started:.3f}\t(ended)\n")
    ended = time.monotonic() - started
    rows = ["| cells done | at (s) | promised left (s) | really left (s) | error | every cell alike (s) | its error |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    worst = {"learned": 0.0, "alike": 0.0}
    for at, done, total, left in stamped:
        if done * 4 < total:
            continue
        really = ended - at
        error = (left - really) / really if really > 0 else 0.0
        alike = even_pace(ended_cells, at, total)
        alike_error = (alike - really) / really if really > 0 and alike is not None else None
        if really > 60:
            worst["learned"] = max(worst["learned"], abs(error))
            if alike_error is not None:
                worst["alike"] = max(worst["alike"], abs(alike_error))
        rows.append(f"| {done}/{total} | {at:.0f} | {left:.0f} | {really:.0f} | {error:+.0%} | "
                    + (f"{alike:.0f} | {alike_error:+.0%} |" if alike_error is not None else "- | - |"))
    rows.append(f"\nrun: {ended:.0f} s, pytest exit {process.returncode}; the largest error from the first quarter "
                f"of the cells on, while more than a minute was left: {worst['learned']:.0%} (every cell alike: "
                f"{worst['alike']:.0%})")
    text = "\n".join(rows)
    (args.out / "progress.md").write_text(text + "\n")
    print(text)
    return 0 if stamped else 1


if __name__ == "__main__":
    sys.exit(main())
