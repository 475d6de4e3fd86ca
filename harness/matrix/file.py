"""Reading a matrix file that may hold anything: strict JSON from a regular file (harness.matrix.strictjson),
then every known field checked for its type; each problem one line naming the file and the cell."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

from harness.matrix.schema import SCHEMA_VERSION, Cell, Matrix, MatrixError
from harness.matrix.strictjson import MAX_NESTING, SHOWN_CHARS, Unusable, parse_strict_json, quoted, read_regular_file
from harness.records import STATUSES, Failure
from harness.text import escape_unprintable, printable_line
from harness.timeline import TimelineMark, TimelineStep


class _Invalid(Exception):
    """A problem found while reading or checking a matrix; MatrixError adds the file to it."""


class _Absent:
    def __repr__(self) -> str:
        return "missing"


_ABSENT = _Absent()


def _describe(value: Any) -> str:
    """What a JSON value is, for an error message: short, one line, long values cut."""
    if value is _ABSENT:
        return "missing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = str(value)
        return digits if len(digits) <= SHOWN_CHARS else f"an integer of {len(digits.lstrip('-'))} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f"the string {quoted(value)}" if value else "an empty string"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object" if value else "an empty object"
    return f"a {type(value).__name__}"


def _shown_path(path: str | os.PathLike[str]) -> str:
    """A file name as given, with any character that does not print escaped (it may hold a newline)."""
    text = os.fspath(path)
    return escape_unprintable(text if isinstance(text, str) else os.fsdecode(text))


def _shown_name(text: str) -> str:
    """A case or variant name as shown in an error message."""
    line = printable_line(text)
    return line if len(line) <= SHOWN_CHARS else line[:SHOWN_CHARS] + "…"


def _raise_if(message: Optional[str]) -> None:
    if message:
        raise _Invalid(message)


# A check takes a value and the name it goes by, and returns None or "<name> is ..., expected ...".
Check = Callable[[Any, str], Optional[str]]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _kind(predicate: Callable[[Any], bool], expected: str) -> Check:
    def check(value: Any, name: str) -> Optional[str]:
        return None if predicate(value) else f"{name} is {_describe(value)}, expected {expected}"

    check.expected = expected  # type: ignore[attr-defined]
    return check


def _optional(inner: Check) -> Check:
    def check(value: Any, name: str) -> Optional[str]:
        message = None if value is None else inner(value, name)
        if message and message.startswith(f"{name} is "):  # the value itself, not an item of it
            message = f"{name} is {_describe(value)}, expected {check.expected}"  # type: ignore[attr-defined]
        return message

    check.expected = f"{inner.expected} or null"  # type: ignore[attr-defined]
    return check


def _list_of(item: Check, expected: str) -> Check:
    def check(value: Any, name: str) -> Optional[str]:
        if not isinstance(value, list):
            return f"{name} is {_describe(value)}, expected {expected}"
        for index, element in enumerate(value):
            message = item(element, f"{name}[{index}]")
            if message:
                return message
        return None

    check.expected = expected  # type: ignore[attr-defined]
    return check


TEXT = _kind(lambda v: isinstance(v, str), "a string")
NAME = _kind(lambda v: isinstance(v, str) and v != "", "a non-empty string")
BOOL = _kind(lambda v: isinstance(v, bool), "true or false")
INT = _kind(_is_int, "an integer")
COUNT = _kind(lambda v: _is_int(v) and v >= 0, "a non-negative integer")
POSITIVE = _kind(lambda v: _is_int(v) and v > 0, "a positive integer")
NUMBER = _kind(_is_number, "a finite number")
OBJECT = _kind(lambda v: isinstance(v, dict), "an object")
STATUS = _kind(lambda v: isinstance(v, str) and v in STATUSES, "one of " + ", ".join(STATUSES))


def _environment(value: Any, name: str) -> Optional[str]:
    message = OBJECT(value, name)
    if message is None and "world_sizes" in value:
        message = _list_of(POSITIVE, "a list of positive integers")(value["world_sizes"], f"{name}.world_sizes")
    return message


_MATRIX_CHECKS: dict[str, Check] = {"created": TEXT, "complete": BOOL, "environment": _environment}

# The known fields of a failure and a cell. A field added to Failure or Cell later and missing here
# is checked by its annotation (str, int, float, bool, optional, list of those) where that is simple.
_FAILURE_CHECKS: dict[str, Check] = {
    "rank": INT,
    "step": INT,
    "model": TEXT,
    "param": TEXT,
    "kind": TEXT,  # any name: a newer harness may diagnose kinds this one does not know
    "max_abs_diff": NUMBER,
    "message": TEXT,
    "max_rel_diff": NUMBER,
    "index": _optional(_list_of(INT, "a list of integers")),
    "checked": TEXT,
    "factor": _optional(NUMBER),
    "mismatched": COUNT,
    "numel": COUNT,
    "atol": NUMBER,
    "rtol": NUMBER,
}
def _records(cls: type, what: str) -> Check:
    """A list of objects, each with the fields of the dataclass ``cls`` (checked by their annotations)."""

    def check(value: Any, name: str) -> Optional[str]:
        if not isinstance(value, list):
            return f"{name} is {_describe(value)}, expected a list of {what}s"
        checks, required = _field_checks(cls, {})
        for index, element in enumerate(value):
            where = f"{name}[{index}]"
            if not isinstance(element, dict):
                return f"{where} is {_describe(element)}, expected an object (a {what})"
            try:
                _check_fields(element, checks, required, f"{where}.")
            except _Invalid as exc:
                return str(exc)
        return None

    check.expected = f"a list of {what}s"  # type: ignore[attr-defined]
    return check


def _timeline(value: Any, name: str) -> Optional[str]:
    message = OBJECT(value, name)
    for key, check in (("steps", _records(TimelineStep, "timeline step")),
                       ("marks", _records(TimelineMark, "timeline mark"))):
        if message is None and key in value:
            message = check(value[key], f"{name}.{key}")
    return message


_timeline.expected = "an object (a timeline)"  # type: ignore[attr-defined]

def _texts_by_name(value: Any) -> bool:
    """An object of strings to strings."""
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(t, str) for k, t in value.items())


_CELL_CHECKS: dict[str, Check] = {
    "case": NAME,
    "variant": TEXT,
    "world_size": POSITIVE,
    "status": STATUS,
    "summary": TEXT,
    "max_abs_diff": NUMBER,
    "duration_s": NUMBER,
    "checks": COUNT,
    "grad_checks": COUNT,
    "vacuous_checks": COUNT,
    "comm_checks": COUNT,
    "nodeid": TEXT,
    "rerun": TEXT,
    "detail": TEXT,
    "timeline": _optional(_timeline),
    "unchecked": _kind(_texts_by_name, "an object of check names to reasons"),
    "forced": _kind(_texts_by_name, "an object of settings to 'was -> now'"),
    "wrapper": TEXT,
}
_ANNOTATION_CHECKS: dict[str, Check] = {"str": TEXT, "int": INT, "float": NUMBER, "bool": BOOL}


def _check_for_annotation(annotation: Any) -> Optional[Check]:
    """A check for a dataclass field from its (string) annotation, or None when it is not simple."""
    text = str(annotation).replace(" ", "").replace("'", "").replace('"', "")
    for none in ("|None", "None|"):
        if none in text:
            inner = _check_for_annotation(text.replace(none, "", 1))
            return _optional(inner) if inner else None
    if text.startswith("Optional[") and text.endswith("]"):
        inner = _check_for_annotation(text[len("Optional[") : -1])
        return _optional(inner) if inner else None
    if text in _ANNOTATION_CHECKS:
        return _ANNOTATION_CHECKS[text]
    if text.startswith(("list[", "List[")) and text.endswith("]"):
        inner = _check_for_annotation(text[5:-1])
        return _list_of(inner, f"a list of {inner.expected}s") if inner else None  # type: ignore[attr-defined]
    if text.startswith(("dict", "Dict")):
        return OBJECT
    return None


def _field_checks(cls: type, known: dict[str, Check]) -> tuple[dict[str, Check], tuple[str, ...]]:
    """The checks for every field of ``cls`` and the names of the fields it requires."""
    checks = dict(known)
    required = []
    for spec in dataclasses.fields(cls):
        if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            required.append(spec.name)
        if spec.name not in checks and spec.name != "failures":
            derived = _check_for_annotation(spec.type)
            if derived is not None:
                checks[spec.name] = derived
    return checks, tuple(required)


def _check_fields(data: dict[str, Any], checks: dict[str, Check], required: tuple[str, ...], prefix: str) -> None:
    for name in required:
        if name not in data:
            raise _Invalid(f"{prefix}{name} is missing")
    for name, check in checks.items():
        if name in data:
            _raise_if(check(data[name], f"{prefix}{name}"))


def _parse_cells(raw_cells: list[Any]) -> list[Cell]:
    cell_checks, cell_required = _field_checks(Cell, _CELL_CHECKS)
    failure_checks, failure_required = _field_checks(Failure, _FAILURE_CHECKS)
    identity = ("case", "variant", "world_size")
    seen: dict[tuple[str, str, int], int] = {}
    cells = []
    for index, raw in enumerate(raw_cells):
        where = f"cells[{index}]"
        if not isinstance(raw, dict):
            raise _Invalid(f"{where} is {_describe(raw)}, expected an object (a cell)")
        # Name the cell by as much of its identity as is valid, so that the message finds it.
        named = [
            _shown_name(raw[n]) if n != "world_size" else f"ws={_describe(raw[n])}"
            for n in identity
            if n in raw and cell_checks[n](raw[n], n) is None
        ]
        if named:
            where = f"{where} ({' / '.join(named)})"
        _check_fields(raw, cell_checks, cell_required, f"{where}: ")
        failures = raw.get("failures", [])
        if not isinstance(failures, list):
            raise _Invalid(f"{where}: failures is {_describe(failures)}, expected a list of failures")
        for number, failure in enumerate(failures):
            name = f"failures[{number}]"
            if not isinstance(failure, dict):
                raise _Invalid(f"{where}: {name} is {_describe(failure)}, expected an object (a failure)")
            _check_fields(failure, failure_checks, failure_required, f"{where}: {name}.")
        key = (raw["case"], raw["variant"], raw["world_size"])
        if key in seen:
            raise _Invalid(f"{where}: the same cell as cells[{seen[key]}] (a cell may appear only once)")
        seen[key] = index
        cells.append(Cell.from_dict(raw))
    return cells


def _json_path(parts: tuple[Any, ...]) -> str:
    """``cells[3].summary`` from the keys and indices that lead to a value."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return printable_line(text) or "the top level"


def _check_structure(data: Any) -> None:
    """Refuse JSON nested deeper than MAX_NESTING and strings that are not Unicode text (lone
    surrogates from escapes such as \\ud800, which no file, terminal or page can hold)."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, parts = stack.pop()
        if isinstance(value, (dict, list)):
            if depth >= MAX_NESTING:
                raise _Invalid(f"JSON nested too deeply (more than {MAX_NESTING} levels) at {_json_path(parts)}")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, element in items:
                if isinstance(key, str) and not _is_text(key):
                    raise _Invalid(f"a key in {_json_path(parts)} is not Unicode text (it holds a lone surrogate)")
                stack.append((element, depth + 1, parts + (key,)))
        elif isinstance(value, str) and not _is_text(value):
            raise _Invalid(f"{_json_path(parts)} is not Unicode text (it holds a lone surrogate)")


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_matrix(path: str | os.PathLike[str]) -> Matrix:
    """Read a matrix file; any problem is a MatrixError with a one-line reason naming the file.

    Only a regular file is read (a directory, FIFO, device or socket is refused before it is
    opened), at most MAX_FILE_BYTES of it, as strict JSON, then checked by Matrix.from_dict.
    """
    shown = _shown_path(path)
    try:
        data = parse_strict_json(read_regular_file(Path(path)))
    except Unusable as exc:
        raise MatrixError(f"{shown}: {exc}") from None
    return parse_matrix(data, source=shown)



def parse_matrix(data: Any, *, source: str = "matrix") -> Matrix:
    """A Matrix from parsed schema-1 JSON, every known field checked for its type.

    Any problem is a MatrixError whose one-line message starts with ``source`` and names the
    field (and the cell) at fault. Keys this harness does not know are accepted and ignored,
    so that matrices written by a newer harness stay readable.
    """
    source = _shown_path(source)
    if not isinstance(data, dict):
        raise MatrixError(f"{source}: not a matrix (the top level is {_describe(data)}, expected a JSON object)")
    try:
        _check_structure(data)
        version = data.get("schema_version", _ABSENT)
        if not (_is_int(version) and version == SCHEMA_VERSION):
            raise _Invalid(f"schema_version is {_describe(version)}, expected {SCHEMA_VERSION}")
        for name, check in _MATRIX_CHECKS.items():
            if name in data:
                _raise_if(check(data[name], name))
        if "cells" not in data:
            raise _Invalid("not a matrix: cells is missing, expected a list of cells")
        if not isinstance(data["cells"], list):
            raise _Invalid(f"cells is {_describe(data['cells'])}, expected a list of cells")
        cells = _parse_cells(data["cells"])
    except _Invalid as exc:
        raise MatrixError(f"{source}: {exc}") from None
    return Matrix(
        environment=dict(data.get("environment", {})),
        cells=cells,
        created=data.get("created", ""),
        complete=data.get("complete", True),
    )
