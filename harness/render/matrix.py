"""A matrix as a person reads it: the Markdown summary, the HTML page and the terminal table."""

from __future__ import annotations

from harness.matrix import Cell, Matrix
from harness.records import STATUSES, Status
from harness.render.style import ABSENT, PAGE_STYLE, md_status, status_style
from harness.render.text import html_block, html_text, md_code, md_text

# Cells whose outcome needs no explanation in the Failures section.
QUIET_STATUSES = frozenset({Status.PASS, Status.DETECTED, Status.SKIP})
MAX_FAILURES_SHOWN = 5
ENVIRONMENT_KEYS = ("python", "torch", "accelerate", "backend", "device", "world_sizes", "seed")
# a launch's place, in the Markdown environment line too when the matrix has it (harness launch)
LAUNCH_KEYS = ("launcher", "nodes", "processes_per_node", "hosts", "devices")

STATUS_MEANINGS = {
    Status.PASS: "every rank matched the oracle",
    Status.FAIL: "some rank did not match the oracle",
    Status.ERROR: "the cell could not be judged (crash, hang, exception)",
    Status.SKIP: "not applicable on this machine",
    Status.UNSUPPORTED: "the installed accelerate lacks the API",
    Status.DETECTED: "canary: the harness caught the known-wrong usage",
    Status.MISSED: "canary: the harness did not catch the known-wrong usage",
}

# Said under every matrix that has world-size-1 cells: their pass is not evidence of sync.
WORLD_SIZE_ONE_NOTE = (
    "ws=1: one rank cannot tell a synced gradient from a local one, so sync is not tested at world size 1; "
    "its cells check the loss scaling, the optimizer steps, the flags and the learning rates only."
)

HTML_STYLE = (
    PAGE_STYLE
    + """.status { display: inline-block; min-width: 7em; padding: 3px 8px; border-radius: 4px;
          font-weight: 600; color: #fff; }
"""
    + status_style(".status.{status}")
    + """.absent { color: #8c959f; }
.banner { background: #fff8c5; border: 1px solid #d4a72c; padding: 8px 12px; font-weight: 600; }
details summary { cursor: pointer; list-style: none; }
details summary::-webkit-details-marker { display: none; }
details[open] summary .status { outline: 2px solid #1f2328; }
pre { white-space: pre-wrap; max-width: 60em; font-size: 0.85em; background: #f6f8fa;
      padding: 6px; margin: 4px 0 0 0; }
"""
)

def render_markdown(matrix: Matrix) -> str:
    """A Markdown summary that fits a GitHub CI step summary."""
    world_sizes = _world_sizes(matrix)
    lines = ["# Gradient-sync matrix", "", _environment_line(matrix), "", md_text(_counts_line(matrix))]
    if not matrix.complete:
        lines += ["", "**Incomplete run**: only the cells that finished are shown."]
    lines += [""]
    if not matrix.cells:
        lines += ["No cells ran."]
        return "\n".join(lines) + "\n"
    header = ["case", "variant"] + [f"ws={ws}" for ws in world_sizes]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + " --- |" * len(header))
    for (case, variant), by_ws in _pivot(matrix).items():
        entries = [md_text(case), md_text(variant)]
        for ws in world_sizes:
            cell = by_ws.get(ws)
            entries.append(md_status(cell.status) if cell else ABSENT)
        lines.append("| " + " | ".join(entries) + " |")
    if 1 in world_sizes:
        lines += ["", f"_{md_text(WORLD_SIZE_ONE_NOTE)}_"]
    explained = [c for c in matrix.sorted_cells() if _needs_explaining(c)]
    if explained:
        lines += ["", "## Failures", ""]
        for cell in explained:
            lines += _md_cell_failures(cell)
    return "\n".join(lines) + "\n"


def render_html(matrix: Matrix) -> str:
    """One self-contained HTML page: no scripts, no network, no external assets."""
    world_sizes = _world_sizes(matrix)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        "<title>Gradient-sync matrix</title>",
        f"<style>{HTML_STYLE}</style>",
        "</head>",
        "<body>",
        "<h1>Gradient-sync matrix</h1>",
    ]
    if not matrix.complete:
        parts.append(
            '<p class="banner">Incomplete run: only the cells that finished are shown.</p>'
        )
    parts.append("<h2>Environment</h2>")
    parts.append("<table>")
    if matrix.created:
        parts.append(f"<tr><th>created</th><td>{html_text(matrix.created)}</td></tr>")
    for key, value in _environment_items(matrix):
        parts.append(f"<tr><th>{html_text(key)}</th><td>{html_text(value)}</td></tr>")
    parts.append("</table>")
    parts.append(f"<p>{html_text(_counts_line(matrix))}</p>")
    parts.append("<h2>Cells</h2>")
    if not matrix.cells:
        parts.append("<p>No cells ran.</p>")
    else:
        parts.append("<table>")
        header = "".join(f"<th>ws={ws}</th>" for ws in world_sizes)
        parts.append(f"<tr><th>case</th><th>variant</th>{header}</tr>")
        for (case, variant), by_ws in _pivot(matrix).items():
            row = [f"<td>{html_text(case)}</td>", f"<td>{html_text(variant)}</td>"]
            for ws in world_sizes:
                cell = by_ws.get(ws)
                row.append(f"<td>{_html_cell(cell)}</td>" if cell else _html_absent())
            parts.append("<tr>" + "".join(row) + "</tr>")
        parts.append("</table>")
        parts.append("<p>Click a cell to see its summary and failures.</p>")
    parts.append("<h2>Legend</h2>")
    parts.append("<table>")
    for status in STATUSES:
        box = f'<span class="status {status}">{status}</span>'
        parts.append(f"<tr><td>{box}</td><td>{html_text(STATUS_MEANINGS[status])}</td></tr>")
    parts.append("</table>")
    if 1 in world_sizes:
        parts.append(f'<p class="ws1">{html_text(WORLD_SIZE_ONE_NOTE)}</p>')
    parts += ["</body>", "</html>"]
    return "\n".join(parts) + "\n"


def render_table(matrix: Matrix) -> str:
    """A compact plain-text table for the pytest terminal summary."""
    if not matrix.cells:
        return "no cells ran"
    world_sizes = _world_sizes(matrix)
    header = ["case", "variant"] + [f"ws={ws}" for ws in world_sizes]
    rows = [header]
    for (case, variant), by_ws in _pivot(matrix).items():
        row = [case, variant]
        for ws in world_sizes:
            cell = by_ws.get(ws)
            row.append(cell.status if cell else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(_counts_line(matrix))
    return "\n".join(lines)


def terminal_summary(matrix: Matrix, reports: list[str], write_error: str = "") -> tuple[str, list[str]]:
    """The title and lines of the pytest terminal summary: the table, then where the reports are."""
    title = "gradient-sync matrix" + ("" if matrix.complete else " (INCOMPLETE)")
    lines = render_table(matrix).splitlines() + ["reports: " + ", ".join(reports)]
    if write_error:
        lines.append(f"while the run went on, the reports could not be rewritten: {write_error}")
    return title, lines


def _world_sizes(matrix: Matrix) -> list[int]:
    # Requested world sizes with no cell still get a column, so a gap is visible.
    requested = matrix.environment.get("world_sizes") or []
    sizes = {int(ws) for ws in requested if isinstance(ws, int) or str(ws).isdigit()}
    sizes.update(cell.world_size for cell in matrix.cells)
    return sorted(sizes)


def _pivot(matrix: Matrix) -> dict[tuple[str, str], dict[int, Cell]]:
    rows: dict[tuple[str, str], dict[int, Cell]] = {}
    for cell in matrix.sorted_cells():
        rows.setdefault((cell.case, cell.variant), {})[cell.world_size] = cell
    return rows


def _counts_line(matrix: Matrix) -> str:
    counts = matrix.counts()
    shown = [f"{counts[s]} {s}" for s in counts if counts[s]]
    noun = "cell" if len(matrix.cells) == 1 else "cells"
    return f"{len(matrix.cells)} {noun}: " + (", ".join(shown) if shown else "none")


def _plain(value: object) -> str:
    """An environment value as one line: lists joined by commas, records as ``key=value``, nested ones in braces."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_plain(v) if not isinstance(v, (dict, list)) else '{' + _plain(v) + '}'}"
                         for k, v in value.items())
    if isinstance(value, (list, tuple)):
        nested = any(isinstance(v, (dict, list, tuple)) for v in value)
        return ("; " if nested else ",").join(_plain(v) for v in value)
    return str(value)


def _environment_items(matrix: Matrix) -> list[tuple[str, str]]:
    env = matrix.environment
    keys = list(ENVIRONMENT_KEYS) + [k for k in env if k not in ENVIRONMENT_KEYS]
    # a merged matrix keeps what its runs differ in per world size (`environments`)
    absent = "(per world size)" if "environments" in env else "?"
    items = []
    for key in keys:
        value = env.get(key, absent)
        if key == "environments" and isinstance(value, dict):
            items.append((key, "; ".join(f"ws={ws}: {{{_plain(v)}}}" for ws, v in value.items())))
            continue
        items.append((key, _plain(value)))
    return items


def _environment_line(matrix: Matrix) -> str:
    shown = [(k, v) for k, v in _environment_items(matrix)
             if k in ENVIRONMENT_KEYS or (k in LAUNCH_KEYS and k in matrix.environment)]
    return " · ".join(f"{md_text(key.replace('_', ' '))} {md_code(value)}" for key, value in shown)


def _needs_explaining(cell: Cell) -> bool:
    return cell.status not in QUIET_STATUSES and bool(cell.summary or cell.failures)


def _md_cell_failures(cell: Cell) -> list[str]:
    title = f"{md_text(cell.case)} / {md_text(cell.variant)} / ws={md_text(cell.world_size)}: {md_status(cell.status)}"
    if cell.summary:
        title += f" — {md_text(cell.summary)}"
    lines = [f"- {title}"]
    for failure in cell.failures[:MAX_FAILURES_SHOWN]:
        lines.append(
            f"  - rank {md_text(failure.rank)}, step {md_text(failure.step)}, "
            f"{md_code(f'{failure.model}.{failure.param}')}: {md_text(failure.kind)}, "
            f"max abs diff {failure.max_abs_diff:.3g}"
        )
    hidden = len(cell.failures) - MAX_FAILURES_SHOWN
    if hidden > 0:
        lines.append(f"  - … and {hidden} more")
    if cell.rerun:
        lines.append(f"  - rerun: {md_code(cell.rerun)}")
    return lines


def _html_absent() -> str:
    return f'<td class="absent" title="no result for this world size">{ABSENT}</td>'


def _html_cell(cell: Cell) -> str:
    box = f'<span class="status {html_text(cell.status)}">{html_text(cell.status)}</span>'
    title = html_text(cell.summary) if cell.summary else html_text(cell.status)
    details = _cell_details(cell)
    if not details:
        return f'<span title="{title}">{box}</span>'
    return (
        f'<details title="{title}"><summary>{box}</summary>'
        f"<pre>{html_block(details)}</pre></details>"
    )


def _cell_details(cell: Cell) -> str:
    lines = []
    if cell.summary:
        lines.append(cell.summary)
    if cell.duration_s:
        lines.append(f"duration {cell.duration_s:.2f}s, max abs diff {cell.max_abs_diff:.3g}")
    for failure in cell.failures:
        lines += ["", failure.message or f"{failure.model}.{failure.param}: {failure.kind}"]
    if cell.rerun:
        lines += ["", f"rerun: {cell.rerun}"]
    return "\n".join(lines)
