"""One matrix from several runs (one launch per GPU count, per node count, or a catalogue split with -k):
the union of their cells, each world size with the environment of the run that ran it."""

from __future__ import annotations

import datetime
import json
from typing import Any, Sequence

from harness.matrix.schema import UNAVAILABLE_CHECKS, Matrix, MatrixError, merge_cells, with_unavailable_checks
from harness.matrix.strictjson import SHOWN_CHARS
from harness.text import escape_unprintable, printable_line

# What two runs of the same world size must share for their cells to sit in one column.
SHARED_AT_A_WORLD_SIZE = ("python", "torch", "accelerate", "backend", "device", "seed", "fault")
# Keys of the merged environment that merge_matrices sets itself.
MERGE_KEYS = ("world_sizes", "merged_from", "environments")


class MergeError(MatrixError):
    """The inputs cannot make one matrix (a cell in two of them, runs that disagree); one line."""


_ABSENT = object()


def _shown_value(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if isinstance(value, str) and value:
        text = printable_line(value)
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError):
            text = repr(value)
        text = printable_line(text)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


def _shown_cell(case: str, variant: str, world_size: int) -> str:
    name = printable_line(case) + (f"[{printable_line(variant)}]" if variant else "")
    return f"cell {name} at world size {world_size}"


def _is_world_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def ran_world_sizes(matrix: Matrix) -> list[int]:
    """The world sizes a run asked for and those its cells have (a cell shows its world size ran)."""
    recorded = matrix.environment.get("world_sizes")
    sizes = {ws for ws in recorded if _is_world_size(ws)} if isinstance(recorded, list) else set()
    sizes.update(cell.world_size for cell in matrix.cells if _is_world_size(cell.world_size))
    return sorted(sizes)


def environment_at(matrix: Matrix, world_size: int) -> dict[str, Any]:
    """The environment a run had at one world size: a merged input keeps it in `environments`."""
    kept = matrix.environment.get("environments")
    if isinstance(kept, dict) and isinstance(kept.get(str(world_size)), dict):
        return dict(kept[str(world_size)])
    return {k: v for k, v in matrix.environment.items() if k not in ("environments", "merged_from")}


def _common_environment(environments: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The keys whose values are equal in every environment, in the first one's order."""
    first, rest = environments[0], environments[1:]
    return {
        key: value
        for key, value in first.items()
        if key not in MERGE_KEYS and all(key in env and env[key] == value for env in rest)
    }


def _check_agreement(world_size: int, first: tuple[str, dict[str, Any]], other: tuple[str, dict[str, Any]]) -> None:
    (first_source, first_env), (other_source, other_env) = first, other
    for key in SHARED_AT_A_WORLD_SIZE:
        a, b = first_env.get(key, _ABSENT), other_env.get(key, _ABSENT)
        if a is _ABSENT and b is _ABSENT:
            continue
        if a is _ABSENT or b is _ABSENT or a != b:
            raise MergeError(
                f"world size {world_size} ran with {key} {_shown_value(a)} in {_shown_source(first_source)} "
                f"but {_shown_value(b)} in {_shown_source(other_source)} (runs of one world size must agree on "
                + ", ".join(SHARED_AT_A_WORLD_SIZE)
                + ")"
            )


def _shown_source(source: object) -> str:
    """A file name as given, with any character that does not print escaped (it may hold a newline)."""
    return escape_unprintable(str(source))


def now_utc() -> str:
    """The time now as the plugin writes it: UTC, ISO 8601, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def merge_matrices(inputs: list[tuple[str, Matrix]], *, created: str | None = None) -> Matrix:
    """One matrix from several: every cell of every input, `complete` when all are.

    ``inputs`` are (file name as given, matrix). The environment holds the keys equal in every
    input, ``world_sizes`` (the union of the world sizes each input ran), ``merged_from`` (the
    file names) and ``environments``: for each world size, as a string, the full environment of
    the input that ran it. A cell in two inputs, or two inputs that ran one world size with a
    different python, torch, accelerate, backend, device, seed or fault, is a MergeError.
    """
    if not inputs:
        raise MergeError("nothing to merge: give at least one matrix")
    owner: dict[tuple[str, str, int], str] = {}
    for source, matrix in inputs:
        for cell in matrix.cells:
            earlier = owner.get(cell.key)
            if earlier is not None:
                where = (
                    f"twice in {_shown_source(source)}"
                    if earlier == source
                    else f"in both {_shown_source(earlier)} and {_shown_source(source)}"
                )
                raise MergeError(f"{_shown_cell(*cell.key)} is {where}")
            owner[cell.key] = source

    by_world_size: dict[int, tuple[str, dict[str, Any]]] = {}
    for source, matrix in inputs:
        for world_size in ran_world_sizes(matrix):
            here = (source, environment_at(matrix, world_size))
            if world_size in by_world_size:
                _check_agreement(world_size, by_world_size[world_size], here)
            else:
                by_world_size[world_size] = here

    common = _common_environment([matrix.environment for _, matrix in inputs])
    environment: dict[str, Any] = {}
    for key in inputs[0][1].environment:
        if key == "world_sizes":
            environment[key] = sorted(by_world_size)
        elif key in common:
            environment[key] = common[key]
    environment.setdefault("world_sizes", sorted(by_world_size))
    environment["merged_from"] = [str(source) for source, _ in inputs]
    environment["environments"] = {str(ws): by_world_size[ws][1] for ws in sorted(by_world_size)}
    cells = merge_cells(cell for _, matrix in inputs for cell in matrix.cells)
    environment.pop(UNAVAILABLE_CHECKS, None)  # each input's own; the merged cells say it again
    return Matrix(
        environment=with_unavailable_checks(environment, cells),
        cells=cells,
        created=now_utc() if created is None else created,
        complete=all(matrix.complete for _, matrix in inputs),
    )


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def summary_line(merged: Matrix, count: int, out_dir: str, paths: Sequence[object]) -> str:
    """`merged 3 matrices (450 cells, world sizes 1, 2, 4, 8) into DIR: DIR/matrix.json, ...`"""
    sizes = merged.environment.get("world_sizes") or []
    shown_sizes = (
        ("world size " if len(sizes) == 1 else "world sizes ") + ", ".join(map(str, sizes)) if sizes else "no world size"
    )
    return (
        f"merged {_plural(count, 'matrix', 'matrices')} ({_plural(len(merged.cells), 'cell')}, {shown_sizes}) "
        f"into {_shown_source(out_dir)}: " + ", ".join(_shown_source(str(p)) for p in paths)
    )
