"""The cross-release table as a person reads it: Markdown for a step summary, and compare.html, one
self-contained page on the shared look (harness/render/page.py; its script: compare.js)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

from harness.matrix.comparison import Comparison, ComparisonColumn, ComparisonRow
from harness.matrix.diff import world_sizes_of
from harness.matrix.schema import Cell
from harness.records import STATUSES
from harness.render.diff import format_world_sizes
from harness.render.page import STATUS_MEANINGS, cell_anchor, legend, page_head, page_tail, status_badge
from harness.render.style import ABSENT, STATUS_SYMBOLS, md_status
from harness.text import html_text, md_text, printable_line

DIFFERS_MARK = "≠"
REGRESSED_MARK = "regressed"
# How much of a cell's summary its status's tooltip carries (matrix.json and the matrix page have it all).
SUMMARY_CHARS = 300


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def verdict_line(comparison: Comparison) -> str:
    """One line, as matrix.md's counts line: how many cells differ across how many inputs, and how
    many of those regressed as `diff` counts it (pass or detected, then anything else in the next input)."""
    line = (f"{len(comparison.differing_rows)} of {len(comparison.rows)} cells differ across "
            f"{_plural(len(comparison.columns), 'input', 'inputs')}")
    regressed = len(comparison.regressed_rows)
    return f"{line}, {regressed} regressed" if regressed else line


def _environment_parts(column: ComparisonColumn) -> list[str]:
    env = column.matrix.environment
    parts = [f"{name} {env[name]}" for name in ("torch", "python", "backend", "device") if env.get(name)]
    parts.append(f"world sizes {format_world_sizes(world_sizes_of(column.matrix))}")
    return parts


def _environment_line(column: ComparisonColumn) -> str:
    parts = _environment_parts(column)
    if not column.matrix.complete:
        parts.append("incomplete run")
    return ", ".join(parts)


def render_comparison_markdown(comparison: Comparison, *, changed_only: bool = False) -> str:
    """Markdown: the verdict line, per-input counts, then one row per cell with ≠ on rows whose
    statuses differ (only those rows with ``changed_only``)."""
    columns = comparison.columns
    if comparison.regressed_rows:
        symbol = STATUS_SYMBOLS["fail"]
    elif comparison.differing_rows:
        symbol = DIFFERS_MARK
    else:
        symbol = STATUS_SYMBOLS["pass"]
    lines = [
        "### Cross-version comparison",
        "",
        f"{symbol} **{verdict_line(comparison)}.**",
        "",
        "| input | source | environment | " + " | ".join(md_status(s) for s in STATUSES) + " |",
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
        f"{ABSENT} means the input has no such cell. A cell regressed, as `diff` "
        f"counts it, when it was {md_status('pass')} or {md_status('detected')} in one input and anything "
        "else in the next input that has it.",
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


COMPARE_CSS = """
.verdict.differs { background: #fff8c5; border: 1px solid #d4a72c; }
.verdict .why { font-weight: 400; font-size: .85em; margin-left: .6em; }
ol.inputs { list-style: none; padding: 0; margin: .6em 0; }
ol.inputs li { margin: 4px 0; }
ol.inputs .heading { font-weight: 600; margin-right: .4em; }
ol.inputs .env { display: inline; margin: 0 .4em; }
ol.inputs .source { color: #57606a; font-size: .8em; font-family: ui-monospace, monospace; }
.incomplete-mark { background: #fff8c5; border: 2px solid #d4a72c; border-radius: 4px; padding: 0 5px;
                   font-weight: 700; font-size: .8em; }
#compare-filters { display: flex; flex-wrap: wrap; gap: .4em 1.2em; align-items: center; margin: .8em 0;
                   padding: 6px 10px; background: #f6f8fa; border-radius: 6px; font-size: .9em; }
#compare-filters[hidden] { display: none; }
table.cells thead th { position: sticky; top: 0; z-index: 1; }
table.cells td.variant { font-family: ui-monospace, monospace; font-size: .85em; }
table.cells td.mark { text-align: center; font-weight: 700; white-space: nowrap; }
tr.differs td.mark { background: #fff8c5; }
tr.regressed td.mark { background: #ffebe9; color: #cf222e; }
td.turned { box-shadow: inset 3px 0 0 #cf222e; }
.absent { color: #8c959f; }
a.cell-link { text-decoration: none; }
tr:target td { background: #ddf4ff; }
.legend td { border: 0; padding: 1px 6px; }
"""


def _verdict_banner(comparison: Comparison) -> str:
    if comparison.regressed_rows:
        css, why = "bad", ("a cell was pass or detected in one input and something else in the next input "
                           "that has it (a regression, as diff counts it)")
    elif comparison.differing_rows:
        css, why = "differs", "no cell regressed (none was pass or detected, then something else)"
    else:
        css, why = "good", "every cell has the same status in every input that has it"
    return (f'<div id="verdict" class="verdict {css}" role="status">{html_text(verdict_line(comparison))}'
            f'<span class="why">{html_text(why)}</span></div>')


def _page_href(page: Path, html_path: Path | None) -> str | None:
    """How compare.html, written to ``html_path``, reaches ``page``: a relative URL (lexical, as the
    browser resolves it against compare.html's own path); none for the page itself."""
    if html_path is None:
        return None
    target, here = os.path.abspath(page), os.path.abspath(html_path)
    if target == here:
        return None
    try:
        relative = os.path.relpath(target, os.path.dirname(here))
    except ValueError:  # another drive (Windows): no relative path
        return Path(target).as_uri()
    return quote(Path(relative).as_posix(), safe="/")


def _inputs(comparison: Comparison, hrefs: list[str | None]) -> list[str]:
    out = ['<ol class="inputs" id="inputs">']
    for column, href in zip(comparison.columns, hrefs):
        counts = column.matrix.counts()
        heading = html_text(column.heading)
        if href is not None:
            heading = f'<a href="{html_text(href)}" title="this run\'s matrix page">{heading}</a>'
        badges = "".join(status_badge(s, f"{counts[s]} {s}") for s in STATUSES if counts.get(s))
        if not badges:
            badges = '<span class="muted">no cells</span>'
        incomplete = ('<span class="incomplete-mark" title="the run did not finish: a cell it lacks was never judged">'
                      "INCOMPLETE</span> ") if not column.matrix.complete else ""
        out.append(
            f'<li><span class="heading">{heading}</span>{badges}'
            f'<span class="env">{html_text(", ".join(_environment_parts(column)))}</span>'
            f'{incomplete}<span class="source">{html_text(column.source)}</span></li>'
        )
    out.append("</ol>")
    return out


def _filters(comparison: Comparison) -> list[str]:
    cases = sorted({str(row.key[0]) for row in comparison.rows})
    world_sizes = sorted({row.key[2] for row in comparison.rows}, key=lambda ws: (not isinstance(ws, int), str(ws)))
    case_options = "".join(f'<option value="{html_text(c)}">{html_text(c)}</option>' for c in cases)
    ws_options = "".join(f'<option value="{html_text(ws)}">ws={html_text(ws)}</option>' for ws in world_sizes)
    # Shown by compare.js: without the script the filters could do nothing.
    return [
        '<div id="compare-filters" role="group" aria-label="filters" hidden>',
        '<label><input type="checkbox" id="only-differing"> only cells that differ</label>',
        '<label>case <select id="compare-case"><option value="">all cases</option>' + case_options + "</select></label>",
        '<label>world size <select id="compare-ws"><option value="">all</option>' + ws_options + "</select></label>",
        '<button type="button" id="compare-reset">show all</button>',
        '<span id="compare-shown" aria-live="polite"></span>',
        "</div>",
    ]


def _cell_title(column: ComparisonColumn, cell: Cell | None) -> str:
    if cell is None:
        return f"{column.heading}: no such cell"
    summary = printable_line(cell.summary)
    if len(summary) > SUMMARY_CHARS:
        summary = summary[:SUMMARY_CHARS] + "…"
    title = f"{column.heading}: {cell.status}"
    return f"{title} — {summary}" if summary else title


def _status_cell(column: ComparisonColumn, cell: Cell | None, turned: bool, page_href: str | None) -> str:
    css = ' class="turned"' if turned else ""
    title = html_text(_cell_title(column, cell))
    if cell is None:
        return f'<td{css}><span class="absent" title="{title}">{html_text(ABSENT)}</span></td>'
    badge = status_badge(cell.status)
    if page_href is None:
        return f'<td{css}><span title="{title}">{badge}</span></td>'
    href = f"{page_href}#{cell_anchor(cell.case, cell.variant, cell.world_size)}"
    return f'<td{css}><a class="cell-link" href="{html_text(href)}" title="{title}">{badge}</a></td>'


def _row(comparison: Comparison, row: ComparisonRow, hrefs: list[str | None], *, with_id: bool) -> str:
    case, variant, world_size = row.key
    anchor = html_text(cell_anchor(case, variant, world_size))
    classes = " ".join(name for name, on in (("differs", row.differs), ("regressed", row.regressed)) if on)
    attributes = (
        (f' id="{anchor}"' if with_id else "")
        + (f' class="{classes}"' if classes else "")
        + f' data-case="{html_text(case)}" data-ws="{html_text(world_size)}"'
        + f' data-differs="{"1" if row.differs else "0"}"'
    )
    mark = html_text(DIFFERS_MARK) if row.differs else ""
    if row.regressed:
        mark += f" {REGRESSED_MARK}"
    tds = [
        f'<td class="mark">{mark}</td>',
        f"<td>{html_text(case)}</td>",
        f'<td class="variant">{html_text(variant)}'
        f'<a class="permalink" href="#{anchor}" title="permalink to this cell">¶</a></td>',
        f"<td>{html_text(world_size)}</td>",
    ]
    for column, cell, turned, href in zip(comparison.columns, row.cells, row.turned_bad, hrefs):
        tds.append(_status_cell(column, cell, turned, href))
    return f"<tr{attributes}>" + "".join(tds) + "</tr>"


def _table(comparison: Comparison, rows: list[ComparisonRow], hrefs: list[str | None], *,
           table_id: str, with_ids: bool) -> list[str]:
    head = (
        '<tr><th scope="col" title="≠: the statuses differ">≠</th><th scope="col">case</th>'
        '<th scope="col">variant</th><th scope="col">ws</th>'
        + "".join(f'<th scope="col">{html_text(c.heading)}</th>' for c in comparison.columns)
        + "</tr>"
    )
    return ([f'<table class="cells" id="{table_id}">', f"<thead>{head}</thead>", "<tbody>"]
            + [_row(comparison, row, hrefs, with_id=with_ids) for row in rows]
            + ["</tbody>", "</table>"])


def render_comparison_html(comparison: Comparison, *, html_path: Path | None = None) -> str:
    """compare.html: the verdict and each input's counts, the cells that differ, then the whole table,
    with inline CSS and script only (nothing fetched). ``html_path`` is where the page is written:
    a status then links to its cell on the input's own matrix.html, where that page sits beside
    the input's matrix.json (relative to ``html_path``); without it, nothing links out."""
    hrefs = []
    for column in comparison.columns:
        page = column.matrix_page()
        hrefs.append(_page_href(page, html_path) if page is not None else None)
    differing = comparison.differing_rows
    out = page_head("Cross-version comparison", COMPARE_CSS) + ["<body>", "<h1>Cross-version comparison</h1>"]
    out.append(_verdict_banner(comparison))
    out += _inputs(comparison, hrefs)
    out += _filters(comparison)
    out.append(f'<section id="differing"><h2>Cells that differ ({len(differing)})</h2>')
    if differing:
        out += _table(comparison, differing, hrefs, table_id="differing-cells", with_ids=False)
    else:
        out.append('<p class="muted">No cell differs between the inputs that have it.</p>')
    out.append("</section>")
    out.append(f'<section id="all"><h2>All cells ({len(comparison.rows)})</h2>')
    out += _table(comparison, comparison.rows, hrefs, table_id="all-cells", with_ids=True)
    out.append("</section>")
    linked = any(href is not None for href in hrefs)
    out += [
        "<h2>Legend</h2>",
        legend(STATUS_MEANINGS),
        f"<p>{html_text(DIFFERS_MARK)} marks a cell whose status differs between the inputs that have it; "
        f"{html_text(REGRESSED_MARK)}, one that was pass or detected in one input and anything else in "
        "the next input that has it, a regression as diff counts it (a red edge marks the status where it turned); "
        f'<span class="absent">{html_text(ABSENT)}</span> means the input has no such cell. '
        "Hover over a status for its summary"
        + ("; a linked status opens that cell on its run's matrix page." if linked else ".")
        + " ¶ is a cell's permalink on this page.</p>",
    ]
    data = {
        "inputs": [column.heading for column in comparison.columns],
        "cells": len(comparison.rows),
        "differing": len(differing),
        "regressed": len(comparison.regressed_rows),
    }
    out += page_tail(data, script="compare.js")
    return "\n".join(out) + "\n"
