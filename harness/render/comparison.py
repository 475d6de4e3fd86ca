"""The cross-release table as a person reads it: Markdown for a step summary, a self-contained HTML page."""

from __future__ import annotations

from harness.comparison import Comparison, ComparisonColumn
from harness.diff import world_sizes_of
from harness.matrix import Cell
from harness.records import STATUSES
from harness.render.diff import format_world_sizes
from harness.render.style import ABSENT, PAGE_STYLE, md_status, status_style
from harness.render.text import html_text, md_text, printable_line

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
        + "".join(f'<th class="{_status_class(s)}">{html_text(s)}</th>' for s in STATUSES)
        + "</tr>",
    ]
    for column in columns:
        counts = column.matrix.counts()
        out.append(
            f"<tr><td>{html_text(column.heading)}</td><td>{html_text(column.source)}</td>"
            f"<td>{html_text(_environment_line(column))}</td>"
            + "".join(f"<td>{counts.get(s, 0)}</td>" for s in STATUSES)
            + "</tr>"
        )
    out += [
        "</table>",
        '<p class="legend">'
        + "".join(f'<span class="{_status_class(s)}">{html_text(s)}</span>' for s in STATUSES)
        + f'<span class="s-absent">{html_text(ABSENT)} no such cell</span></p>',
        f"<p>{html_text(DIFFERS_MARK)} marks a cell whose status differs between the inputs that have it. "
        "Hover over a status for its summary.</p>",
        "<table>",
        "<tr><th></th><th>case</th><th>variant</th><th>world size</th>"
        + "".join(f"<th>{html_text(c.heading)}</th>" for c in columns)
        + "</tr>",
    ]
    for row in comparison.rows:
        case, variant, world_size = row.key
        row_class = ' class="differs"' if row.differs else ""
        marker = html_text(DIFFERS_MARK) if row.differs else ""
        tds = [
            f'<td class="mark">{marker}</td>',
            f"<td>{html_text(case)}</td>",
            f"<td>{html_text(variant)}</td>",
            f"<td>{html_text(world_size)}</td>",
        ]
        for column, cell in zip(columns, row.cells):
            status = cell.status if cell is not None else None
            tds.append(
                f'<td class="status {_status_class(status)}" title="{html_text(_cell_title(column, cell))}">'
                f"{html_text(ABSENT if status is None else status)}</td>"
            )
        out.append(f"<tr{row_class}>" + "".join(tds) + "</tr>")
    out += ["</table>", "</body>", "</html>"]
    return "\n".join(out) + "\n"
