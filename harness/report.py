"""The three report files (JSON, Markdown, HTML) and the terminal table, rendered from a Matrix."""

from __future__ import annotations

import html
import json
import math
import os
import re
import tempfile
from pathlib import Path

from harness.matrix import (
    DETECTED,
    ERROR,
    FAIL,
    MISSED,
    PASS,
    SKIP,
    STATUSES,
    UNSUPPORTED,
    Cell,
    Matrix,
    printable_line,
    write_atomically,
)

REPORT_NAMES = ("matrix.json", "matrix.md", "matrix.html")

# A Markdown cell shows its status with a symbol so the table reads at a glance.
STATUS_SYMBOLS = {
    PASS: "✅",
    FAIL: "❌",
    ERROR: "💥",
    SKIP: "⏭",
    UNSUPPORTED: "🚫",
    DETECTED: "🎯",
    MISSED: "⚠️",
}
# Cells whose outcome needs no explanation in the Failures section.
QUIET_STATUSES = frozenset({PASS, DETECTED, SKIP})
MAX_FAILURES_SHOWN = 5
ABSENT = "—"
ENVIRONMENT_KEYS = ("python", "torch", "accelerate", "backend", "device", "world_sizes", "seed")

STATUS_MEANINGS = {
    PASS: "every rank matched the oracle",
    FAIL: "some rank did not match the oracle",
    ERROR: "the cell could not be judged (crash, hang, exception)",
    SKIP: "not applicable on this machine",
    UNSUPPORTED: "the installed accelerate lacks the API",
    DETECTED: "canary: the harness caught the known-wrong usage",
    MISSED: "canary: the harness did not catch the known-wrong usage",
}

# Said under every matrix that has world-size-1 cells: their pass is not evidence of sync.
WORLD_SIZE_ONE_NOTE = (
    "ws=1: one rank cannot tell a synced gradient from a local one, so sync is not tested at world size 1; "
    "its cells check the loss scaling, the optimizer steps, the flags and the learning rates only."
)

# Shared with harness.crossversion, so that a reader learns one page layout and one set of colours.
PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1f2328; }
h1 { font-size: 1.5em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
"""
# status -> (background, text colour)
STATUS_COLOURS = {
    PASS: ("#1a7f37", "#fff"),
    FAIL: ("#cf222e", "#fff"),
    ERROR: ("#8250df", "#fff"),
    SKIP: ("#6e7781", "#fff"),
    UNSUPPORTED: ("#d0d7de", "#1f2328"),
    DETECTED: ("#0a7b83", "#fff"),
    MISSED: ("#d4a72c", "#1f2328"),
}


def status_style(selector: str) -> str:
    """One CSS rule per status; ``selector`` has ``{status}`` where the status name goes."""
    return "".join(
        f"{selector.format(status=status)} {{ background: {background}; color: {text}; }}\n"
        for status, (background, text) in STATUS_COLOURS.items()
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

# Markdown: every text from a matrix goes through md_text (or md_code), the one place that makes
# data safe in Markdown. harness.diff and harness.crossversion use the same two functions.
_MARKDOWN_ESCAPES = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\\": "\\\\", "|": "\\|", "`": "\\`"}
)
# Text holding any of these is never put in a code span, where Markdown would show it raw.
_NOT_IN_CODE_SPANS = frozenset("<>&|")


def md_text(text: object) -> str:
    """``text`` made safe anywhere in Markdown: a table cell, a heading, a list item, a step summary.

    One line (whitespace runs become a space, other control and format characters are shown as
    escapes like ``\\x1b``: see printable_line); ``&``, ``<`` and ``>`` become HTML entities, so
    that no tag or comment (``<!--``) from the data reaches the page; ``\\``, ``|`` and a backtick
    are backslash-escaped, so that the text cannot end a table cell or open a code span.
    """
    return printable_line(text).translate(_MARKDOWN_ESCAPES)


def md_code(text: object) -> str:
    """``text`` as a Markdown code span (shown literally, in monospace), also safe anywhere.

    The fence is one backtick longer than the longest run of backticks in the text, so none of
    them can close it. A code span shows its content raw (an entity or a backslash escape would be
    shown as typed), so text holding ``<``, ``>``, ``&`` or ``|`` is rendered by md_text instead.
    """
    line = printable_line(text)
    if not line or _NOT_IN_CODE_SPANS.intersection(line):
        return md_text(line)
    if "`" not in line:
        return f"`{line}`"
    longest = max(len(run) for run in re.findall("`+", line))
    fence = "`" * (longest + 1)
    return f"{fence} {line} {fence}"


# JSON has no infinity or NaN, and `diff` refuses a file that holds them: a difference that is
# infinite (a NaN or an infinity in a gradient) is written as this, as compare.py does for ratios.
JSON_INFINITY = 1e308


def _finite_json(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return -JSON_INFINITY if value < 0 else JSON_INFINITY
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    return value


def render_json(matrix: Matrix) -> str:
    """The schema-1 JSON form of the matrix: strict JSON, which `diff` and `compare` read back."""
    return json.dumps(_finite_json(matrix.to_dict()), indent=2, sort_keys=False, allow_nan=False) + "\n"


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
        parts.append(f"<tr><th>created</th><td>{_esc(matrix.created)}</td></tr>")
    for key, value in _environment_items(matrix):
        parts.append(f"<tr><th>{_esc(key)}</th><td>{_esc(value)}</td></tr>")
    parts.append("</table>")
    parts.append(f"<p>{_esc(_counts_line(matrix))}</p>")
    parts.append("<h2>Cells</h2>")
    if not matrix.cells:
        parts.append("<p>No cells ran.</p>")
    else:
        parts.append("<table>")
        header = "".join(f"<th>ws={ws}</th>" for ws in world_sizes)
        parts.append(f"<tr><th>case</th><th>variant</th>{header}</tr>")
        for (case, variant), by_ws in _pivot(matrix).items():
            row = [f"<td>{_esc(case)}</td>", f"<td>{_esc(variant)}</td>"]
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
        parts.append(f"<tr><td>{box}</td><td>{_esc(STATUS_MEANINGS[status])}</td></tr>")
    parts.append("</table>")
    if 1 in world_sizes:
        parts.append(f'<p class="ws1">{_esc(WORLD_SIZE_ONE_NOTE)}</p>')
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


def write_reports(matrix: Matrix, report_dir: str | os.PathLike[str]) -> list[Path]:
    """Write matrix.json, matrix.md and matrix.html into report_dir; return their paths."""
    directory = Path(report_dir)
    directory.mkdir(parents=True, exist_ok=True)
    renderers = (render_json, render_markdown, render_html)
    paths = []
    for name, render in zip(REPORT_NAMES, renderers):
        path = directory / name
        write_atomically(path, render(matrix))
        paths.append(path)
    return paths


def check_report_dir(report_dir: str | os.PathLike[str]) -> str | None:
    """None when reports can be written into report_dir (creating it), else a one-line reason."""
    directory = Path(report_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if isinstance(exc, FileExistsError) or (directory.exists() and not directory.is_dir()):
            reason = "exists and is not a directory"
        return f"cannot write to reports dir '{directory}': {reason}"
    return None


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


def _environment_items(matrix: Matrix) -> list[tuple[str, str]]:
    env = matrix.environment
    keys = list(ENVIRONMENT_KEYS) + [k for k in env if k not in ENVIRONMENT_KEYS]
    items = []
    for key in keys:
        value = env.get(key, "?")
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        items.append((key, str(value)))
    return items


def _environment_line(matrix: Matrix) -> str:
    shown = [(k, v) for k, v in _environment_items(matrix) if k in ENVIRONMENT_KEYS]
    return " · ".join(f"{md_text(key.replace('_', ' '))} {md_code(value)}" for key, value in shown)


def _needs_explaining(cell: Cell) -> bool:
    return cell.status not in QUIET_STATUSES and bool(cell.summary or cell.failures)


def md_status(status: str) -> str:
    """A status for Markdown, after its symbol."""
    symbol = STATUS_SYMBOLS.get(status)
    return f"{symbol} {md_text(status)}" if symbol else md_text(status)


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


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _html_absent() -> str:
    return f'<td class="absent" title="no result for this world size">{ABSENT}</td>'


def _html_cell(cell: Cell) -> str:
    box = f'<span class="status {_esc(cell.status)}">{_esc(cell.status)}</span>'
    title = _esc(printable_line(cell.summary)) if cell.summary else _esc(cell.status)
    details = _cell_details(cell)
    if not details:
        return f'<span title="{title}">{box}</span>'
    return (
        f'<details title="{title}"><summary>{box}</summary>'
        f"<pre>{_esc(details)}</pre></details>"
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
