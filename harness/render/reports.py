"""The three report files of a run (matrix.json, matrix.md, matrix.html): the schema-1 JSON form, and
writing them so that a reader never sees half a file."""

from __future__ import annotations

import json
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Iterable

from harness.matrix.schema import Cell, Matrix
from harness.render.matrix import render_html, render_markdown
from harness.render.matrix_page import CellFragments

REPORT_NAMES = ("matrix.json", "matrix.md", "matrix.html")
# A report is written in parts (matrix.json: one per cell): buffered, in a few large writes.
WRITE_BUFFER = 1 << 20

# JSON has no infinity or NaN, and `diff` refuses a file that holds them: a difference that is
# infinite (a NaN or an infinity in a gradient) is written as this, as a failure's ratios are (harness/rank/judging/recorder.py).
JSON_INFINITY = 1e308


def _finite_json(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return -JSON_INFINITY if value < 0 else JSON_INFINITY
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(item) for item in value]
    return value


class CellTexts(CellFragments):
    """Each judged cell's pieces of the three reports (its JSON text, its heatmap square, its page
    data, its Markdown lines...), each made once: see CellFragments. A run rewrites its reports after
    every cell, so without this every cell would be rendered again each time (quadratic in the
    cells); a piece is reused only for the very cell object it was made from, which the plugin never
    changes (its cells are read back from each test's report and only read after)."""

    def text(self, cell: Cell) -> str:
        """The cell's text in matrix.json: json.dumps's (indent 2) of its dict, indented as a list item."""
        return self.get(cell, "json", _cell_json)


def _cell_json(cell: Cell) -> str:
    return textwrap.indent(_dumps(cell.to_dict()), "    ")


def _dumps(data: object) -> str:
    return json.dumps(_finite_json(data), indent=2, sort_keys=False, allow_nan=False)


def render_json(matrix: Matrix, texts: CellTexts | None = None) -> str:
    """The schema-1 JSON form of the matrix: strict JSON, which `diff` and `compare` read back. The
    text is json.dumps's (indent 2) of ``matrix.to_dict()``, put together from each cell's own."""
    return "".join(_json_parts(matrix, texts if texts is not None else CellTexts()))


def _json_parts(matrix: Matrix, texts: CellTexts) -> list[str]:
    """render_json's text in parts: written as they are, a file of many megabytes is never copied whole."""
    data = matrix.to_dict(with_cells=False)
    head = _dumps({**data, "cells": []})
    cells = matrix.sorted_cells()
    if not cells:
        return [head, "\n"]
    assert head.endswith('"cells": []\n}')
    parts = [head[: -len("[]\n}")], "[\n"]
    for n, cell in enumerate(cells):
        parts += [",\n", texts.text(cell)] if n else [texts.text(cell)]
    parts.append("\n  ]\n}\n")
    return parts


def write_reports(matrix: Matrix, report_dir: str | os.PathLike[str], *, texts: CellTexts | None = None) -> list[Path]:
    """Write matrix.json, matrix.md and matrix.html into report_dir; return their paths. ``texts``:
    the cells' pieces kept from an earlier write of the same run (without it, each is made anew)."""
    directory = Path(report_dir)
    directory.mkdir(parents=True, exist_ok=True)
    kept = texts if texts is not None else CellTexts()
    renderers = (lambda m: _json_parts(m, kept), lambda m: render_markdown(m, kept), lambda m: render_html(m, kept))
    paths = []
    for name, render in zip(REPORT_NAMES, renderers):
        path = directory / name
        write_atomically(path, render(matrix))
        paths.append(path)
    return paths


def check_report_dir(report_dir: str | os.PathLike[str]) -> str | None:
    """None when reports can be written into report_dir, else a one-line reason. It creates nothing
    (the folder is made when the first cell's reports are written): the plugin is loaded in every
    pytest run where the harness is installed, and a run without cells must leave no trace."""
    directory = Path(report_dir)
    existing = directory
    while not existing.exists() and not existing.is_symlink() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        reason = "exists and is not a directory" if existing == directory else "Not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = "Permission denied"
    else:
        return None
    return f"cannot write to reports dir '{directory}': {reason}"


def _current_umask() -> int:
    # The only way to read the umask is to set it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str | os.PathLike[str], text: str | Iterable[str]) -> None:
    """Write through a temporary file and rename, so that a reader never sees half a file.
    ``text``: the text, or its parts in order.

    The file gets the mode any new file would (0o666 less the umask), not mkstemp's 0o600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", buffering=WRITE_BUFFER) as handle:
            if isinstance(text, str):
                handle.write(text)
            else:
                handle.writelines(text)
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
