"""A matrix as a person reads it: the Markdown summary, the HTML page and the terminal table."""

from __future__ import annotations

from harness.matrix.schema import UNAVAILABLE_CHECKS, Cell, Matrix, unavailable_checks
from harness.records import CHECK_TITLES, Status
from harness.render.matrix_page import CellFragments, render_matrix_page
from harness.render.style import ABSENT, STATUS_SYMBOLS, md_status, verdict
from harness.text import md_code, md_text

# Cells whose outcome needs no explanation in the Failures section.
QUIET_STATUSES = frozenset({Status.PASS, Status.DETECTED, Status.SKIP})
MAX_FAILURES_SHOWN = 5
ENVIRONMENT_KEYS = ("python", "torch", "accelerate", "backend", "device", "world_sizes", "seed")
# a launch's place, in the Markdown environment line too when the matrix has it (harness launch)
LAUNCH_KEYS = ("launcher", "nodes", "processes_per_node", "hosts", "devices")

# Said under every matrix that has world-size-1 cells: their pass is not evidence of sync.
WORLD_SIZE_ONE_NOTE = (
    "ws=1: one rank cannot tell a synced gradient from a local one, so sync is not tested at world size 1; "
    "its cells check the loss scaling, the optimizer steps, the flags and the learning rates only."
)

def render_markdown(matrix: Matrix, fragments: CellFragments | None = None) -> str:
    """A Markdown summary that fits a GitHub CI step summary. ``fragments``: the cells' pieces kept
    from an earlier rendering of the same run (each cell's are made once)."""
    fragments = fragments if fragments is not None else CellFragments()
    world_sizes = _world_sizes(matrix)
    good, words = verdict(matrix.counts())
    symbol = STATUS_SYMBOLS[Status.PASS if good else Status.FAIL]
    lines = ["# Gradient-sync matrix", "", _environment_line(matrix), "",
             f"{symbol} **{md_text(words)}** · {md_text(_counts_line(matrix))}"]
    if not matrix.complete:
        lines += ["", "**Incomplete run**: only the cells that finished are shown."]
    for check, reason in unavailable_checks(matrix.environment).items():
        lines += ["", f"**Not checked in this run: {md_text(CHECK_TITLES.get(check, check))}**: {md_text(reason)}"]
    lines += [""]
    if not matrix.cells:
        lines += ["No cells ran."]
        return "\n".join(lines) + "\n"
    header = ["case", "variant"] + [f"ws={ws}" for ws in world_sizes]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + " --- |" * len(header))
    for by_ws in _pivot(matrix).values():
        row = {ws: fragments.get(cell, "md", _md_entries) for ws, cell in by_ws.items()}
        entries = [next(iter(row.values()))[0]]  # a row's case and variant are those of any of its cells
        entries += [row[ws][1] if ws in row else ABSENT for ws in world_sizes]
        lines.append("| " + " | ".join(entries) + " |")
    if 1 in world_sizes:
        lines += ["", f"_{md_text(WORLD_SIZE_ONE_NOTE)}_"]
    explained = [c for c in matrix.sorted_cells() if _needs_explaining(c)]
    if explained:
        lines += ["", "## Failures", ""]
        for cell in explained:
            lines += fragments.get(cell, "md-failures", _md_cell_failures)
    return "\n".join(lines) + "\n"


def render_html(matrix: Matrix, fragments: CellFragments | None = None) -> str:
    """One self-contained page (harness/render/matrix_page.py): inline CSS and script, no network.
    ``fragments``: the cells' pieces kept from an earlier page of the same run."""
    world_sizes = _world_sizes(matrix)
    notes = [WORLD_SIZE_ONE_NOTE] if 1 in world_sizes else []
    return render_matrix_page(matrix, world_sizes=world_sizes, environment_line=_plain_environment_line(matrix),
                              notes=notes, fragments=fragments)


def render_table(matrix: Matrix, width: int | None = None) -> str:
    """A compact plain-text table for the pytest terminal summary, at most ``width`` columns wide
    when one is given (the terminal's): a row per (case, variant) while that fits, else the variants
    under their case, each split at its ``-`` parts over as many lines as it needs."""
    if not matrix.cells:
        return "no cells ran"
    world_sizes = _world_sizes(matrix)
    heads = [f"ws={ws}" for ws in world_sizes]
    pivot = _pivot(matrix)
    statuses = {key: [by_ws[ws].status if ws in by_ws else "-" for ws in world_sizes] for key, by_ws in pivot.items()}
    rows = [["case", "variant"] + heads] + [[case, variant] + statuses[case, variant] for case, variant in pivot]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in rows]
    if width is not None and max(len(line) for line in lines) > width:
        lines = _grouped_table(pivot, statuses, heads, width)
    lines.append(_counts_line(matrix))
    return "\n".join(lines)


def _grouped_table(pivot: dict[tuple[str, str], dict[int, Cell]], statuses: dict[tuple[str, str], list[str]],
                   heads: list[str], width: int) -> list[str]:
    column = max([len(h) for h in heads] + [len(s) for row in statuses.values() for s in row])
    status_width = len(heads) * (column + 2)
    text_width = max(width - status_width, 24)  # a terminal narrower than that wraps, but keeps every part

    def line(text: str, cells: list[str]) -> str:
        return (text.ljust(text_width) + "".join("  " + c.ljust(column) for c in cells)).rstrip()

    out = [line("case / variant", heads)]
    case_seen = None
    for case, variant in pivot:
        if case != case_seen:
            out.append(case)
            case_seen = case
        pieces = _split_variant(variant or "(no variant)", text_width - 2)
        out.append(line("  " + pieces[0], statuses[case, variant]))
        out += ["    " + piece for piece in pieces[1:]]
    return out


def _split_variant(variant: str, room: int) -> list[str]:
    """``variant`` in lines of at most ``room`` characters, broken after a ``-`` that ends a part
    (``key=value``; ``wrapper=deepspeed-z1`` stays whole). Continuation lines are indented two more,
    so they get two less."""
    chunks = variant.split("-")
    units = [chunks[0]]
    for chunk in chunks[1:]:
        if "=" not in chunk and "=" in units[-1]:
            units[-1] += "-" + chunk  # a value with a dash in it
        else:
            units.append(chunk)
    parts = [unit + "-" for unit in units]
    parts[-1] = parts[-1][:-1]
    lines: list[str] = []
    current = ""
    for part in parts:
        limit = room if not lines else room - 2
        if current and len(current) + len(part) > limit:
            lines.append(current)
            current = ""
        current += part
    lines.append(current)
    return lines


def terminal_summary(matrix: Matrix, reports: list[str], write_error: str = "",
                     width: int | None = None) -> tuple[str, list[str]]:
    """The title and lines of the pytest terminal summary: the table, then where the reports are
    (one line, or one per report where that line would not fit ``width``)."""
    title = "gradient-sync matrix" + ("" if matrix.complete else " (INCOMPLETE)")
    lines = render_table(matrix, width).splitlines()
    one_line = "reports: " + ", ".join(reports)
    if width is None or len(one_line) <= width:
        lines.append(one_line)
    else:
        lines += ["reports:"] + ["  " + report for report in reports]
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
    # the checks a run could not perform have a banner line each (matrix.md, matrix.html) instead
    keys = list(ENVIRONMENT_KEYS) + [k for k in env if k not in ENVIRONMENT_KEYS and k != UNAVAILABLE_CHECKS]
    # a merged matrix keeps what its runs differ in per world size (`environments`)
    absent = "(per world size)" if "environments" in env else "?"
    items = []
    for key in keys:
        value = env.get(key, absent)
        if key == "environments" and isinstance(value, dict):
            items.append((key, "; ".join(f"ws={ws}: {{{_plain(_shown(v))}}}" for ws, v in value.items())))
            continue
        items.append((key, _plain(_shown(env)[key] if key == "selection" else value)))
    return items


def selection_text(selection: dict) -> str:
    """A run's selection as a command line reads it: its paths, then ``-k`` and ``-m`` (each only
    where it has one): ``cases/ -k 'fp32'``."""
    parts = [str(a) for a in selection.get("args") or []]
    parts += [f"-k {selection['keyword']!r}"] if selection.get("keyword") else []
    parts += [f"-m {selection['markers']!r}"] if selection.get("markers") else []
    return " ".join(parts)


def _shown(environment: object) -> object:
    """An environment with its ``selection`` as a person reads it: the paths, -k and -m, and how many
    cells they selected (the cells themselves are for ``diff``)."""
    if not isinstance(environment, dict) or not isinstance(environment.get("selection"), dict):
        return environment
    selection = environment["selection"]
    selected = selection.get("selected")
    counted = f"({len(selected)} cells)" if isinstance(selected, list) else ""
    return {**environment, "selection": " ".join(p for p in (selection_text(selection), counted) if p)}


def _plain_environment_line(matrix: Matrix) -> str:
    """Every environment value in one line, the run's time last."""
    shown = " · ".join(f"{key.replace('_', ' ')} {value}" for key, value in _environment_items(matrix))
    return shown + (f" · created {matrix.created}" if matrix.created else "")


def _environment_line(matrix: Matrix) -> str:
    shown = [(k, v) for k, v in _environment_items(matrix)
             if k in ENVIRONMENT_KEYS or (k in LAUNCH_KEYS and k in matrix.environment)]
    return " · ".join(f"{md_text(key.replace('_', ' '))} {md_code(value)}" for key, value in shown)


def _needs_explaining(cell: Cell) -> bool:
    return cell.status not in QUIET_STATUSES and bool(cell.summary or cell.failures)


def _md_entries(cell: Cell) -> tuple[str, str]:
    """The case and variant entries of a cell's row in the Markdown table, and its own entry."""
    return f"{md_text(cell.case)} | {md_text(cell.variant)}", md_status(cell.status)


def _md_cell_failures(cell: Cell) -> tuple[str, ...]:
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
    return tuple(lines)
