"""How often the self-check's cells name the fault that broke them: from the JSON of one or more
``python -m harness selfcheck --json FILE`` runs (each a world size and a selection of variants), a
table of every fault's cells that caught it and of those whose diagnoses at their first failing step
name it (the fault's declared ``diagnoses``, harness/selfcheck/faults*.py), one column a run.

Run: python bench/diagnosis_accuracy.py LABEL=FILE [LABEL=FILE ...] [--markdown]
e.g. python -m harness selfcheck --no-sensitivity --variants bf16 --world-size 4 --json ws4-bf16.json, then
python bench/diagnosis_accuracy.py "ws 4 bf16=ws4-bf16.json". A run's cells are scored with the
declarations of the harness this script imports, so a JSON written by an earlier harness (which had
none) is scored alike: the before and after of a change are comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.matrix.schema import Cell  # noqa: E402
from harness.selfcheck.faults import FAULTS  # noqa: E402
from harness.selfcheck.run import FaultResult  # noqa: E402


def score(path: Path) -> dict[str, tuple[int, int]]:
    """By fault: (cells that caught it and name it, cells that caught it)."""
    data = json.loads(path.read_text())
    out = {}
    for fault in data["faults"]:
        if fault["name"] not in FAULTS:
            continue
        result = FaultResult(FAULTS[fault["name"]], [Cell.from_dict(d) for d in fault["cells"]])
        out[fault["name"]] = (len(result.named_by), len(result.caught_by))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=FILE: a column's heading and a selfcheck JSON")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (default: plain text)")
    args = parser.parse_args()
    runs = []
    for run in args.runs:
        label, sep, file = run.partition("=")
        if not sep:
            parser.error(f"{run!r}: give LABEL=FILE")
        runs.append((label, score(Path(file))))
    faults = [name for name in FAULTS if any(name in scores for _, scores in runs)]
    rows = [["fault", *(label for label, _ in runs)]]
    for name in faults:
        cells = []
        for _, scores in runs:
            named, caught = scores.get(name, (0, 0))
            cells.append(f"{named} / {caught}" if caught else "-")
        rows.append([name, *cells])
    totals = ["every fault"]
    for _, scores in runs:
        named = sum(n for n, _ in scores.values())
        caught = sum(c for _, c in scores.values())
        always = sum(1 for n, c in scores.values() if c and n == c)
        faults_caught = sum(1 for _, c in scores.values() if c)
        totals.append(f"{named} / {caught} ({named / caught:.0%}); {always} / {faults_caught} faults"
                      if caught else "-")
    rows.append(totals)
    if args.markdown:
        print("| " + " | ".join(rows[0]) + " |")
        print("| " + " | ".join("---" for _ in rows[0]) + " |")
        for row in rows[1:]:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
