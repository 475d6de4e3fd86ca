"""One table of cell statuses across several matrices, e.g. one per accelerate release."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from harness.diff import (
    CellKey,
    format_world_sizes,
    index_cells,
    label_matrices,
    order_key,
    world_sizes_of,
)
from harness.matrix import STATUSES, Cell, Matrix, printable_line
from harness.report import PAGE_STYLE, md_status, md_text, status_style


@dataclass
class ComparisonColumn:
    """One input matrix and the heading it is shown under."""

    heading: str
    source: str
    matrix: Matrix


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


@dataclass
class Comparison:
    columns: list[ComparisonColumn]
    rows: list[ComparisonRow]

    @property
    def differing_rows(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.differs]


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


ABSENT = "—"
DIFFERS_MARK = "≠"


def _environment_line(column: ComparisonColumn) -> str:
    env = column.matrix.environment
    parts = [f"{name} {env[name]}" for name in ("torch", "python", "backend", "device") if env.get(name)]
    parts.append(f"world sizes {format_world_sizes(world_sizes_of(column.matrix))}")
    if not column.matrix.complete:
        parts.append("incomplete run")
    return ", ".join(parts)


def render_comparison_markdown(comparison: Comparison, *, changed_only: bool = False) -> str:
    """Markdown: per-input counts, then one row per cell with ≠ on rows whose statuses differ
    (only those rows with ``changed_only``)."""
    columns = comparison.columns
    lines = [
        "### Cross-version comparison",
        "",
        f"**{len(comparison.differing_rows)} of {len(comparison.rows)} cells differ "
        f"across {len(columns)} inputs.**",
        "",
        "| input | source | environment | " + " | ".join(STATUSES) + " |",
        "|" + "---|" * (3 + len(STATUSES)),
    ]
    for column in columns:
        counts = column.matrix.counts()
        cells = [column.heading, column.source, _environment_line(column)]
        cells += [str(counts.get(status, 0)) for status in STATUSES]
        lines.append("| " + " | ".join(md_text(c) for c in cells) + " |")
    lines += [
        "",
        f"**{DIFFERS_MARK}** marks a cell whose status differs between the inputs that have it; "
        f"{ABSENT} means the input has no such cell.",
        "",
        "| | case | variant | world size | "
        + " | ".join(md_text(c.heading) for c in columns)
        + " |",
        "|" + "---|" * (4 + len(columns)),
    ]
    for row in comparison.differing_rows if changed_only else comparison.rows:
        case, variant, world_size = row.key
        marker = f"**{DIFFERS_MARK}**" if row.differs else ""
        statuses = []
        for status in row.statuses:
            text = ABSENT if status is None else md_status(status)
            statuses.append(f"**{text}**" if row.differs and status is not None else text)
        cells = [marker, md_text(case), md_text(variant), str(world_size)]
        lines.append("| " + " | ".join(cells + statuses) + " |")
    return "\n".join(lines) + "\n"


_CSS = (
    PAGE_STYLE
    + ".status { font-weight: 600; color: #fff; text-align: center; }\n"
    + status_style(".s-{status}")
    + """.s-absent { background: #fff; color: #8c959f; }
tr.differs td { border-top: 2px solid #1f2328; border-bottom: 2px solid #1f2328; }
tr.differs td.mark { background: #fff8c5; font-weight: 700; }
.legend span { display: inline-block; padding: 2px 8px; margin-right: 4px; border-radius: 4px; }
"""
)

def _e(text: object) -> str:
    # One line, control characters and lone surrogates shown as escapes, then HTML-escaped.
    return html.escape(printable_line(text), quote=True)


def _status_class(status: str | None) -> str:
    if status is None:
        return "s-absent"
    return f"s-{status}" if status in STATUSES else "s-absent"


def _cell_title(column: ComparisonColumn, cell: Cell | None) -> str:
    if cell is None:
        return f"{column.heading}: no such cell"
    summary = printable_line(cell.summary)
    title = f"{column.heading}: {cell.status}"
    return f"{title} — {summary}" if summary else title


def render_comparison_html(comparison: Comparison) -> str:
    """One self-contained HTML page: inline CSS only, no scripts, no links, nothing fetched."""
    columns = comparison.columns
    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        "<title>Cross-version comparison</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        "<h1>Cross-version comparison</h1>",
        f"<p><strong>{len(comparison.differing_rows)} of {len(comparison.rows)} cells differ "
        f"across {len(columns)} inputs.</strong></p>",
        "<table>",
        "<tr><th>input</th><th>source</th><th>environment</th>"
        + "".join(f'<th class="{_status_class(s)}">{_e(s)}</th>' for s in STATUSES)
        + "</tr>",
    ]
    for column in columns:
        counts = column.matrix.counts()
        out.append(
            f"<tr><td>{_e(column.heading)}</td><td>{_e(column.source)}</td>"
            f"<td>{_e(_environment_line(column))}</td>"
            + "".join(f"<td>{counts.get(s, 0)}</td>" for s in STATUSES)
            + "</tr>"
        )
    out += [
        "</table>",
        '<p class="legend">'
        + "".join(f'<span class="{_status_class(s)}">{_e(s)}</span>' for s in STATUSES)
        + f'<span class="s-absent">{_e(ABSENT)} no such cell</span></p>',
        f"<p>{_e(DIFFERS_MARK)} marks a cell whose status differs between the inputs that have it. "
        "Hover over a status for its summary.</p>",
        "<table>",
        "<tr><th></th><th>case</th><th>variant</th><th>world size</th>"
        + "".join(f"<th>{_e(c.heading)}</th>" for c in columns)
        + "</tr>",
    ]
    for row in comparison.rows:
        case, variant, world_size = row.key
        row_class = ' class="differs"' if row.differs else ""
        marker = _e(DIFFERS_MARK) if row.differs else ""
        tds = [
            f'<td class="mark">{marker}</td>',
            f"<td>{_e(case)}</td>",
            f"<td>{_e(variant)}</td>",
            f"<td>{_e(world_size)}</td>",
        ]
        for column, cell in zip(columns, row.cells):
            status = cell.status if cell is not None else None
            tds.append(
                f'<td class="status {_status_class(status)}" title="{_e(_cell_title(column, cell))}">'
                f"{_e(ABSENT if status is None else status)}</td>"
            )
        out.append(f"<tr{row_class}>" + "".join(tds) + "</tr>")
    out += ["</table>", "</body>", "</html>"]
    return "\n".join(out) + "\n"
