"""Cell-by-cell comparison of two matrices: regressions, improvements, and what only one has."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from harness.matrix import GOOD_STATUSES, Cell, Matrix, printable_line
from harness.report import md_text

CellKey = tuple[str, str, int]

# What a vanished cell's candidate status is shown as.
MISSING = "missing"
VANISHED_SUMMARY = "vanished: no such cell in the candidate, which ran this world size"


@dataclass
class CellChange:
    """One cell present in both matrices whose status differs."""

    base: Cell
    candidate: Cell

    @property
    def key(self) -> CellKey:
        return self.candidate.key


@dataclass
class MatrixDiff:
    """Everything that differs between a base matrix and a candidate, each list sorted by key.

    ``vanished`` holds the base cells that held (pass or detected) and are missing from the
    candidate at a world size the candidate ran: regressions of their own kind. Other base cells
    the candidate lacks are in ``only_in_base``.
    """

    regressions: list[CellChange] = field(default_factory=list)
    improvements: list[CellChange] = field(default_factory=list)
    changed_other: list[CellChange] = field(default_factory=list)
    only_in_base: list[Cell] = field(default_factory=list)
    only_in_candidate: list[Cell] = field(default_factory=list)
    unchanged: int = 0
    notes: list[str] = field(default_factory=list)
    vanished: list[Cell] = field(default_factory=list)

    @property
    def regression_count(self) -> int:
        return len(self.regressions) + len(self.vanished)

    @property
    def has_regressions(self) -> bool:
        return self.regression_count > 0


def order_key(key: CellKey) -> tuple[str, str, int, str]:
    """Sort order for cell keys that tolerates a hand-edited file with odd field types."""
    case, variant, world_size = key
    ws = world_size if isinstance(world_size, int) and not isinstance(world_size, bool) else -1
    return (str(case), str(variant), ws, str(world_size))


def index_cells(matrix: Matrix) -> dict[CellKey, Cell]:
    """Cells by key; a later cell with the same key replaces an earlier one, as in merge_cells."""
    return {cell.key: cell for cell in matrix.cells}


def world_sizes_of(matrix: Matrix) -> list[int]:
    """The world sizes the run asked for, or, when the environment does not say, those its cells have."""
    declared = matrix.environment.get("world_sizes")
    if isinstance(declared, list) and declared:
        return sorted({ws for ws in declared if isinstance(ws, int)})
    return sorted({c.world_size for c in matrix.cells if isinstance(c.world_size, int)})


def format_world_sizes(world_sizes: Sequence[int]) -> str:
    return "[" + ",".join(str(ws) for ws in world_sizes) + "]"


def candidate_world_sizes(base: Matrix, candidate: Matrix) -> set[int]:
    """The world sizes the candidate ran: those it records, and those of its cells (a cell shows
    its world size ran even where the record omits it), else, when it says nothing at all (no
    record, no cell), the base's."""
    ran = set(world_sizes_of(candidate)) | {c.world_size for c in candidate.cells}
    return ran or set(world_sizes_of(base))


def diff_matrices(base: Matrix, candidate: Matrix) -> MatrixDiff:
    """Classify every cell key of either matrix.

    A regression is a cell that held (pass or detected) in base and does not hold in the
    candidate, or that vanished from the candidate although the candidate ran its world size;
    an improvement is the reverse of the first; any other change of status (fail -> error,
    pass -> detected) is reported but decides nothing.
    """
    base_cells = index_cells(base)
    cand_cells = index_cells(candidate)
    ran = candidate_world_sizes(base, candidate)
    diff = MatrixDiff()
    for key in sorted(set(base_cells) | set(cand_cells), key=order_key):
        before = base_cells.get(key)
        after = cand_cells.get(key)
        if after is None:
            if before.status in GOOD_STATUSES and before.world_size in ran:
                diff.vanished.append(before)
            else:
                diff.only_in_base.append(before)
        elif before is None:
            diff.only_in_candidate.append(after)
        elif before.status == after.status:
            diff.unchanged += 1
        else:
            change = CellChange(base=before, candidate=after)
            held_before = before.status in GOOD_STATUSES
            holds_after = after.status in GOOD_STATUSES
            if held_before and not holds_after:
                diff.regressions.append(change)
            elif holds_after and not held_before:
                diff.improvements.append(change)
            else:
                diff.changed_other.append(change)
    diff.notes = describe_mismatched_runs(base, candidate)
    return diff


def describe_mismatched_runs(base: Matrix, candidate: Matrix) -> list[str]:
    """Notes on why two runs may not be comparable everywhere."""
    notes = []
    base_ws, cand_ws = world_sizes_of(base), world_sizes_of(candidate)
    if not cand_ws and base_ws:
        notes.append(
            "the candidate records no world size and has no cell: it is taken to have run the base's "
            f"world sizes {format_world_sizes(base_ws)}"
        )
    elif base_ws != cand_ws:
        notes.append(
            "compared only where cells meet: "
            f"base world sizes {format_world_sizes(base_ws)}, "
            f"candidate {format_world_sizes(cand_ws)}"
        )
    for name in ("backend", "device"):
        before, after = base.environment.get(name), candidate.environment.get(name)
        if before and after and before != after:
            notes.append(f"the runs used different {name}s: base {before}, candidate {after}")
    if not base.complete:
        notes.append("the base run did not finish; its missing cells show as only in the candidate")
    if not candidate.complete:
        notes.append(
            "the candidate run did not finish; a cell it did not reach that held in base counts as vanished"
        )
    return notes


def label_matrix(matrix: Matrix, source: str | Path) -> str:
    """What a person calls this run: its accelerate version when recorded, else its file name."""
    version = matrix.environment.get("accelerate")
    if version:
        return f"accelerate {version}"
    return Path(source).name or str(source)


def label_matrices(matrices: Sequence[tuple[str | Path, Matrix]]) -> list[str]:
    """One distinct label per input: equal labels get the file name, then the whole path, appended."""
    labels = [label_matrix(matrix, source) for source, matrix in matrices]
    names = [Path(source).name or str(source) for source, _ in matrices]
    paths = [str(source) for source, _ in matrices]
    for suffixes in (names, paths):
        labels = _disambiguate(labels, suffixes)
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def _disambiguate(labels: list[str], suffixes: list[str]) -> list[str]:
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    result = []
    for label, suffix in zip(labels, suffixes):
        if counts[label] > 1 and suffix not in label:
            label = f"{label} ({suffix})"
        result.append(label)
    return result


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
    lines += [f"note: {printable_line(note)}" for note in diff.notes]
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
    if len(lines) > 3 + len(diff.notes):
        lines.append("")
    lines.append(count_line(diff))
    return "\n".join(lines) + "\n"


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(md_text(v) for v in row) + " |" for row in rows]
    return lines


def render_diff_markdown(diff: MatrixDiff, base_label: str, cand_label: str) -> str:
    """Markdown for a CI step summary or a pull request comment."""
    lines = [
        f"### Matrix diff: {md_text(base_label)} → {md_text(cand_label)}",
        "",
        f"**{count_line(diff)}**",
        "",
    ]
    for note in diff.notes:
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
        lines += [f"#### {title} ({len(rows)})", "", *_markdown_table(header, rows), ""]
    only_sections = (("Only in base", diff.only_in_base), ("Only in candidate", diff.only_in_candidate))
    for title, cells in only_sections:
        if not cells:
            continue
        rows = [[c.case, c.variant, str(c.world_size), c.status, c.summary] for c in cells]
        header = ["case", "variant", "world size", "status", "summary"]
        lines += [f"#### {title} ({len(cells)})", "", *_markdown_table(header, rows), ""]
    if not (diff.regressions or diff.vanished or diff.improvements or diff.changed_other):
        lines += [f"No cell changed status ({diff.unchanged} compared).", ""]
    return "\n".join(lines)
