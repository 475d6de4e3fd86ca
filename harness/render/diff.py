"""A matrix diff as a person reads it: plain text for a terminal or CI log, Markdown for a step summary."""

from __future__ import annotations

from typing import Sequence

from harness.matrix.diff import CellChange, CellKey, MatrixDiff
from harness.matrix.schema import Cell
from harness.render.matrix import selection_text
from harness.render.style import STATUS_SYMBOLS, md_status
from harness.text import md_text, printable_line

# What a vanished cell's candidate status is shown as.
MISSING = "missing"
VANISHED_SUMMARY = "vanished: no such cell in the candidate, which ran this world size"


def format_world_sizes(world_sizes: Sequence[int]) -> str:
    return "[" + ",".join(str(ws) for ws in world_sizes) + "]"


def notes(diff: MatrixDiff) -> list[str]:
    """Why the two runs may not be comparable everywhere."""
    lines = []
    base_ws, cand_ws = diff.base_world_sizes, diff.candidate_world_sizes
    if not cand_ws and base_ws:
        lines.append(
            "the candidate records no world size and has no cell: it is taken to have run the base's "
            f"world sizes {format_world_sizes(base_ws)}"
        )
    elif base_ws != cand_ws:
        lines.append(
            "compared only where cells meet: "
            f"base world sizes {format_world_sizes(base_ws)}, "
            f"candidate {format_world_sizes(cand_ws)}"
        )
    if diff.not_selected:
        lines.append(
            f"the candidate ran a narrower selection{_narrower(diff.candidate_selection)}: "
            f"{_plural(len(diff.not_selected), 'cell', 'cells')} of the base it did not select "
            "are not compared (not selected); a selected cell it lacks is still a regression"
        )
    for name, (before, after) in diff.changed_environment.items():
        lines.append(f"the runs used different {name}s: base {before}, candidate {after}")
    if not diff.base_complete:
        lines.append("the base run did not finish; its missing cells show as only in the candidate")
    if not diff.candidate_complete:
        lines.append(
            "the candidate run did not finish; a cell it did not reach that held in base counts as vanished"
        )
    return lines


def _narrower(selection: dict) -> str:
    return f" ({selection_text(selection)})" if selection else ""


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def count_line(diff: MatrixDiff) -> str:
    regressions = _plural(diff.regression_count, "regression", "regressions")
    if diff.vanished:
        regressions += f" ({len(diff.vanished)} vanished)"
    return ", ".join(
        [
            regressions,
            _plural(len(diff.improvements), "improvement", "improvements"),
            _plural(len(diff.changed_other), "other change", "other changes"),
            _plural(len(diff.only_in_base), "cell only in base", "cells only in base"),
            f"{len(diff.only_in_candidate)} only in candidate",
        ]
        + ([f"{len(diff.not_selected)} not selected"] if diff.not_selected else [])
    )


def describe_key(key: CellKey) -> str:
    case, variant, world_size = key
    return f"{printable_line(case)} / {printable_line(variant)} / ws={printable_line(world_size)}"


def _change_line(tag: str, change: CellChange) -> str:
    before, after = printable_line(change.base.status), printable_line(change.candidate.status)
    line = f"{tag} {describe_key(change.key)}: {before} -> {after}"
    summary = printable_line(change.candidate.summary)
    return f"{line} — {summary}" if summary else line


def _only_line(tag: str, cell: Cell) -> str:
    line = f"{tag} {describe_key(cell.key)}: {printable_line(cell.status)}"
    summary = printable_line(cell.summary)
    return f"{line} — {summary}" if summary else line


def render_diff_text(diff: MatrixDiff, base_label: str, cand_label: str) -> str:
    """Plain text for a terminal or CI log: regressions first, then a count line.

    One line per entry: every text from the matrices is shown by printable_line, so a newline, an ANSI
    escape or a bidi override in a summary or a name is printed escaped, never acted on.
    """
    lines = [f"base: {printable_line(base_label)}", f"candidate: {printable_line(cand_label)}"]
    lines += [f"note: {printable_line(note)}" for note in notes(diff)]
    lines.append("")
    for change in diff.regressions:
        lines.append(_change_line("REGRESSION", change))
        if change.candidate.rerun:
            lines.append(f"    rerun: {printable_line(change.candidate.rerun)}")
    for cell in diff.vanished:
        lines.append(f"VANISHED {describe_key(cell.key)}: {printable_line(cell.status)} -> {MISSING}")
        if cell.rerun:
            lines.append(f"    rerun: {printable_line(cell.rerun)}")
    lines += [_change_line("IMPROVEMENT", change) for change in diff.improvements]
    lines += [_change_line("CHANGED", change) for change in diff.changed_other]
    lines += [_only_line("ONLY IN BASE", cell) for cell in diff.only_in_base]
    lines += [_only_line("ONLY IN CANDIDATE", cell) for cell in diff.only_in_candidate]
    if len(lines) > 3 + len(notes(diff)):
        lines.append("")
    lines.append(count_line(diff))
    return "\n".join(lines) + "\n"


def _markdown_table(header: list[str], rows: list[list[str]], status_columns: frozenset[int]) -> list[str]:
    """A table; the columns in ``status_columns`` show a status with its symbol, as matrix.md does."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(md_status(v) if i in status_columns else md_text(v) for i, v in enumerate(row)) + " |"
        for row in rows
    ]
    return lines


def verdict_line(diff: MatrixDiff) -> str:
    """The Markdown verdict: the count line, after ❌ with a regression (exit 1), else ✅."""
    symbol = STATUS_SYMBOLS["fail"] if diff.has_regressions else STATUS_SYMBOLS["pass"]
    return f"{symbol} **{count_line(diff)}**"


def render_diff_markdown(diff: MatrixDiff, base_label: str, cand_label: str) -> str:
    """Markdown for a CI step summary or a pull request comment: the verdict line first."""
    lines = [
        f"### Matrix diff: {md_text(base_label)} → {md_text(cand_label)}",
        "",
        verdict_line(diff),
        "",
    ]
    for note in notes(diff):
        lines += [f"> note: {md_text(note)}", ""]
    change_sections = (
        ("Regressions", diff.regressions),
        ("Improvements", diff.improvements),
        ("Other changes", diff.changed_other),
    )
    for title, changes in change_sections:
        rows = [
            [c.key[0], c.key[1], str(c.key[2]), c.base.status, c.candidate.status, c.candidate.summary]
            for c in changes
        ]
        if title == "Regressions":
            rows += [[c.case, c.variant, str(c.world_size), c.status, MISSING, VANISHED_SUMMARY] for c in diff.vanished]
        if not rows:
            continue
        header = ["case", "variant", "world size", "base", "candidate", "candidate summary"]
        lines += [f"#### {title} ({len(rows)})", "", *_markdown_table(header, rows, frozenset({3, 4})), ""]
    only_sections = (("Only in base", diff.only_in_base), ("Only in candidate", diff.only_in_candidate))
    for title, cells in only_sections:
        if not cells:
            continue
        rows = [[c.case, c.variant, str(c.world_size), c.status, c.summary] for c in cells]
        header = ["case", "variant", "world size", "status", "summary"]
        lines += [f"#### {title} ({len(cells)})", "", *_markdown_table(header, rows, frozenset({3})), ""]
    if not (diff.regressions or diff.vanished or diff.improvements or diff.changed_other):
        lines += [f"No cell changed status ({diff.unchanged} compared).", ""]
    return "\n".join(lines)
