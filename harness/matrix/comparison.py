"""The cross-release table (`python -m harness compare`): one row per cell, one column per matrix,
e.g. one per accelerate release (the text is harness/render/comparison.py's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from harness.matrix.diff import CellKey, index_cells, label_matrices, order_key
from harness.matrix.schema import Cell, Matrix
from harness.records import GOOD_STATUSES


@dataclass
class ComparisonColumn:
    """One input matrix and the heading it is shown under."""

    heading: str
    source: str
    matrix: Matrix

    def matrix_page(self) -> Path | None:
        """The matrix.html written beside this input's matrix.json (the same name with .html, as
        `pytest cases/` writes them), when it is there now; else None."""
        page = Path(self.source).with_suffix(".html")
        return page if page.is_file() else None


@dataclass
class ComparisonRow:
    """One cell key and its cell in each column (None where that input lacks it)."""

    key: CellKey
    cells: list[Cell | None]

    @property
    def statuses(self) -> list[str | None]:
        return [cell.status if cell is not None else None for cell in self.cells]

    @property
    def differs(self) -> bool:
        """True when the inputs that have this cell disagree on its status."""
        return len({s for s in self.statuses if s is not None}) > 1

    @property
    def turned_bad(self) -> list[bool]:
        """Per column: True where this cell regressed as `diff` counts it: it held (pass, detected)
        in the nearest column before it that has the cell, and is anything else here; consecutive
        inputs, absent ones skipped (compare cannot tell a vanished cell from one not run)."""
        turned, before = [], None
        for status in self.statuses:
            turned.append(status is not None and status not in GOOD_STATUSES and before in GOOD_STATUSES)
            before = status if status is not None else before
        return turned

    @property
    def regressed(self) -> bool:
        """True when the cell stopped holding between two consecutive inputs that have it."""
        return any(self.turned_bad)


@dataclass
class Comparison:
    columns: list[ComparisonColumn]
    rows: list[ComparisonRow]

    @property
    def differing_rows(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.differs]

    @property
    def regressed_rows(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.regressed]


def build_comparison(matrices: Sequence[tuple[str | Path, Matrix]]) -> Comparison:
    """Rows: every cell key of any input, sorted; columns: the inputs, in the order given."""
    headings = label_matrices(matrices)
    columns = [
        ComparisonColumn(heading=heading, source=str(source), matrix=matrix)
        for heading, (source, matrix) in zip(headings, matrices)
    ]
    indexed = [index_cells(column.matrix) for column in columns]
    keys = sorted({key for cells in indexed for key in cells}, key=order_key)
    rows = [ComparisonRow(key=key, cells=[cells.get(key) for cells in indexed]) for key in keys]
    return Comparison(columns=columns, rows=rows)
