"""How well the progress line's "time left" holds: the catalogue run as the README's first command
runs it, each progress line stamped as it arrives, and each line's promise set against the time the
run really took from there.

Run: python bench/progress_estimate.py [--out reports/progress-estimate] [-- PYTEST_ARGS...]
     (default PYTEST_ARGS: -n 2 -v cases/; under -v each progress line is written when it is made,
     not held until a line of dots ends, and each cell's own line stamps when it ended)

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
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


CELL_LINE = re.compile(r" (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) ")


def even_pace(ended_cells: list[float], at: float, total: int) -> float | None:
    """What the old estimate said at ``at``: the wall time since the first cell ended over the cells
    done since, times the cells left; None before two cells ended."""
    done = [t for t in ended_cells if t <= at]
    if len(done) < 2:
        return None
    return (at - done[0]) / (len(done) - 1) * (total - len(done))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else ["-n", "2", "-v", "cases/"]
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports") / "progress-estimate")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    stamped: list[tuple[float, int, int, float]] = []
    ended_cells: list[float] = []  # when each cell's own line came (-v)
    with open(args.out / "pytest.log", "w") as log:
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
            if CELL_LINE.search(line):
                ended_cells.append(now)
            for part in line.split("\r"):
                counts = re.search(r"gradient-sync: (\d+)/(\d+) cells", part)
                left = promised(part)
                if counts and left is not None:
                    stamped.append((now, int(counts.group(1)), int(counts.group(2)), left))
        process.wait()
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
