"""Cell-by-cell comparison of two matrices: regressions, improvements, and what only one has
(the text is harness/render/diff.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from harness.matrix.schema import Cell, Matrix
from harness.records import GOOD_STATUSES

CellKey = tuple[str, str, int]


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
    candidate at a world size the candidate ran and inside its selection: regressions of their own
    kind. ``not_selected`` holds the base cells the candidate's selection left out (``-k``, ``-m``,
    paths, ``--world-sizes``, ``--wrappers``, ``--meshes``; its environment's ``selection``): not compared. Other
    base cells the candidate lacks are in ``only_in_base``.
    """

    regressions: list[CellChange] = field(default_factory=list)
    improvements: list[CellChange] = field(default_factory=list)
    changed_other: list[CellChange] = field(default_factory=list)
    only_in_base: list[Cell] = field(default_factory=list)
    only_in_candidate: list[Cell] = field(default_factory=list)
    unchanged: int = 0
    vanished: list[Cell] = field(default_factory=list)
    not_selected: list[Cell] = field(default_factory=list)
    candidate_selection: dict[str, Any] = field(default_factory=dict)  # -k, -m, paths, where narrower
    # why the two runs may not be comparable everywhere
    base_world_sizes: list[int] = field(default_factory=list)  # as recorded, else of its cells
    candidate_world_sizes: list[int] = field(default_factory=list)
    changed_environment: dict[str, tuple[str, str]] = field(default_factory=dict)  # backend, device
    base_complete: bool = True
    candidate_complete: bool = True

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


def candidate_world_sizes(base: Matrix, candidate: Matrix) -> set[int]:
    """The world sizes the candidate ran: those it records, and those of its cells (a cell shows
    its world size ran even where the record omits it), else, when it says nothing at all (no
    record, no cell), the base's."""
    ran = set(world_sizes_of(candidate)) | {c.world_size for c in candidate.cells}
    return ran or set(world_sizes_of(base))


def selection_id(nodeid: str) -> str:
    """A cell's pytest node id as a selection records it: the case file's name, not its path (the
    installed catalogue and a checkout's ``cases/`` give the same ids)."""
    path, sep, rest = nodeid.partition("::")
    return PurePosixPath(path.replace("\\", "/")).name + sep + rest


def _selections(matrix: Matrix) -> list[dict[str, Any]] | None:
    """The selection of every run in ``matrix``: its own, or a merged matrix's runs'; None when one is
    not recorded (a matrix from before the harness recorded it)."""
    environments = matrix.environment.get("environments")
    if "selection" not in matrix.environment and isinstance(environments, dict) and environments:
        found = [env.get("selection") if isinstance(env, dict) else None for env in environments.values()]
    else:
        found = [matrix.environment.get("selection")]
    if not all(isinstance(s, dict) and isinstance(s.get("selected"), list) for s in found):
        return None
    return found  # type: ignore[return-value]


def selected_ids(matrix: Matrix) -> set[str] | None:
    """The cells (``selection_id``) the run of ``matrix`` selected, whether or not they finished;
    None when it does not record its selection."""
    selections = _selections(matrix)
    if selections is None:
        return None
    return {str(i) for s in selections for i in s["selected"]}


def narrowing(base: Matrix, candidate: Matrix) -> dict[str, Any]:
    """What of the candidate's selection (``-k``, ``-m``, paths) differs from the base's."""
    before, after = _selections(base), _selections(candidate)
    if after is None or len(after) != 1:
        return {}
    mine = after[0]
    theirs = before[0] if before is not None and len(before) == 1 else {}
    return {key: mine.get(key) for key in ("args", "keyword", "markers")
            if mine.get(key) and mine.get(key) != theirs.get(key)}


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
    selected = selected_ids(candidate)
    diff = MatrixDiff()
    for key in sorted(set(base_cells) | set(cand_cells), key=order_key):
        before = base_cells.get(key)
        after = cand_cells.get(key)
        if after is None:
            if selected is not None and before.nodeid and selection_id(before.nodeid) not in selected:
                diff.not_selected.append(before)
            elif before.status in GOOD_STATUSES and before.world_size in ran:
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
    diff.base_world_sizes, diff.candidate_world_sizes = world_sizes_of(base), world_sizes_of(candidate)
    for name in ("backend", "device"):
        before, after = base.environment.get(name), candidate.environment.get(name)
        if before and after and before != after:
            diff.changed_environment[name] = (str(before), str(after))
    diff.base_complete, diff.candidate_complete = base.complete, candidate.complete
    diff.candidate_selection = narrowing(base, candidate)
    return diff


def label_matrix(matrix: Matrix, source: str | Path, *, with_torch: bool = False) -> str:
    """What a person calls this run: its accelerate version when recorded (and its torch's, with
    ``with_torch``), else its file name."""
    version = matrix.environment.get("accelerate")
    torch = matrix.environment.get("torch") if with_torch else None
    if version:
        return (f"torch {torch}, " if torch else "") + f"accelerate {version}"
    return Path(source).name or str(source)


def label_matrices(matrices: Sequence[tuple[str | Path, Matrix]]) -> list[str]:
    """One distinct label per input: the torch release is named too where the inputs ran different
    ones (a sweep across torch releases). Inputs with the same label are told apart by their file
    names, or where those are the same too by their paths (one of the two, never both), and a file
    given twice by ``#2``."""
    torches = {str(matrix.environment.get("torch")) for _, matrix in matrices}
    labels = [label_matrix(matrix, source, with_torch=len(torches) > 1) for source, matrix in matrices]
    names = [Path(source).name or str(source) for source, _ in matrices]
    paths = [str(source) for source, _ in matrices]
    result = list(labels)
    groups: dict[str, list[int]] = {}
    for index, label in enumerate(labels):
        groups.setdefault(label, []).append(index)
    for label, members in groups.items():
        if len(members) < 2:
            continue
        suffixes = names if len({names[i] for i in members}) == len(members) else paths
        for i in members:
            # a label that is the file's name already becomes its path, not "name (path)"
            result[i] = suffixes[i] if label == names[i] else f"{label} ({suffixes[i]})"
    seen: dict[str, int] = {}
    unique = []
    for label in result:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique
