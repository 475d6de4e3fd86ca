"""Tests for matrix.html as markup (harness/render/matrix_page.py): one heatmap square and one
permalink per cell, failures first and grouped, the timeline's data, and the page's size; and the
cells' pieces of the three reports that each rewrite reuses. What the page does in a browser is
tests/test_report_pages.py's."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness.matrix.schema import Cell, Matrix, merge_cells
from harness.records import Failure
from harness.render.matrix import render_html, render_markdown
from harness.render.page import cell_anchor, data_json
from harness.render.reports import CellTexts, render_json, write_reports
from harness.timeline import Timeline, TimelineMark, TimelineStep


class Elements(HTMLParser):
    """Every start tag with its attributes, and the page's JSON data."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._in_data = False
        self.data: dict = {}
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        self.tags.append((tag, attributes))
        self._in_data = tag == "script" and attributes.get("id") == "harness-data"

    def handle_data(self, data):
        if self._in_data:
            self.data = json.loads(data)
            self._in_data = False

    def having(self, tag: str, css: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and css in a.get("class", "").split()]


def timeline(ranks: int = 2, steps: int = 4, failing_rank: int = 1, kind: str = "not_synced",
             checks: tuple[str, ...] = ("flag", "grad", "param")) -> Timeline:
    return Timeline(
        steps=[TimelineStep(step=s, epoch=0, batch=s - 1, sync=s % 2 == 0, optimizer_step=s % 2 == 0)
               for s in range(1, steps + 1)],
        marks=[TimelineMark(rank=r, step=s, check=c, kind=kind if r == failing_rank and c == "grad" else None)
               for s in range(1, steps + 1) for r in range(ranks) for c in checks],
    )


def failing(case: str, variant: str, ws: int, kinds=("not_synced",), steps=(2, 4)) -> Cell:
    failures = [Failure(rank=1, step=s, model="model", param="w", kind=k, max_abs_diff=0.5,
                        message=f"gradient of 'model.w' on rank 1 at step {s}: {k}\nMismatched elements: 3 / 4 (75.0%)")
                for s in steps for k in kinds]
    return Cell(case, variant, ws, "fail", summary="2 mismatches on rank 1", failures=failures,
                rerun=f"pytest 'cases/x.py::{case}[{variant}-ws{ws}]'", timeline=timeline(ranks=ws))


def matrix() -> Matrix:
    cells = [Cell("accumulate", f"steps={s}", ws, "pass", summary="every rank matched") for s in (1, 2) for ws in (1, 2)]
    cells += [failing("no_sync", "fp32", 2, kinds=("not_synced", "stale")), failing("no_sync", "bf16", 2),
              Cell("no_sync", "fp32", 1, "pass"),
              Cell("fused_loss", "fp32", 2, "error", summary="rank 1 hung after 120 s", detail="Thread 0x1 (most recent call first)"),
              Cell("canary", "fp32", 2, "detected", summary="caught", failures=failing("canary", "fp32", 2).failures,
                   timeline=timeline()),
              Cell("odd", "a/b c#d", 2, "skip", summary="not here")]
    return Matrix(environment={"world_sizes": [1, 2]}, cells=cells)


def test_the_heatmap_has_one_linked_square_per_cell_whose_id_is_its_permalink():
    page = Elements(render_html(matrix()))
    marks = page.having("a", "m")
    cells = matrix().sorted_cells()
    assert len(marks) == len(cells)
    assert sorted(m["id"] for m in marks) == sorted(cell_anchor(c.case, c.variant, c.world_size) for c in cells)
    assert all(m["href"] == "#" + m["id"] for m in marks)
    assert {m["class"] for m in marks} == {f"m s-{s}" for s in ("pass", "fail", "error", "detected", "skip")}
    ids = [a["id"] for _, a in page.tags if "id" in a]
    assert len(ids) == len(set(ids))
    # a variant with no cell at a world size is drawn as a gap, not a square
    assert len(page.having("span", "gap")) == 1  # no_sync bf16 at ws=1


def test_failures_come_first_grouped_by_case_with_kinds_ranks_and_first_step():
    text = render_html(matrix())
    page = Elements(text)
    entries = page.having("details", "failure")
    assert [(e["data-case"], e["data-status"]) for e in entries] == [
        ("fused_loss", "error"), ("no_sync", "fail"), ("no_sync", "fail")]  # not the detected canary
    assert text.index('id="failures"') < text.index('id="heatmap"')
    no_sync = text[text.index('<div class="group" data-case="no_sync">'):]
    assert "not_synced ×2" in no_sync and "stale ×2" in no_sync and "rank 1, first at step 2" in no_sync
    assert "rank 1 hung after 120 s" in text and "Thread 0x1" in text


def test_the_data_carries_each_timeline_and_the_messages_only_once():
    text = render_html(matrix())
    page = Elements(text)
    by_id = {c["i"]: c for c in page.data["cells"]}
    failing_cell = by_id[cell_anchor("no_sync", "fp32", 2)]
    assert "f" not in failing_cell  # its messages are in its Failures entry
    assert text.count("on rank 1 at step 2: stale") == 1
    kinds, checks = page.data["kinds"], page.data["checks"]
    marks = failing_cell["t"]["m"]
    assert len(marks) == 2 * 4 * 3
    assert {(checks[c], kinds[k] if k >= 0 else None) for r, s, c, k in marks if r == 1} == {
        ("flag", None), ("grad", "not_synced"), ("param", None)}
    assert failing_cell["t"]["s"][1] == [2, 0, 1, True, True]
    canary = by_id[cell_anchor("canary", "fp32", 2)]
    assert canary["t"] and canary["f"]  # a detected cell is not under Failures: its panel has them


def test_a_permalink_is_one_to_one_and_readable():
    assert cell_anchor("accumulate", "steps=2-fp32", 2) == "cell-accumulate/steps=2-fp32/ws2"
    names = [("a", "b/c", 1), ("a/b", "c", 1), ("a", "b c", 1), ("a", "b%20c", 1), ("a", "b", 11)]
    anchors = [cell_anchor(*n) for n in names]
    assert len(set(anchors)) == len(anchors)
    assert all(re.fullmatch(r"cell-[A-Za-z0-9=,._%-]+/[A-Za-z0-9=,._%-]*/ws\d+", a) for a in anchors)


def test_a_thousand_cells_fit_in_about_a_megabyte():
    # 1,000 cells as the default run has them, scaled: most pass, one in eight a canary's detected
    # cell with its timeline, a few failing with 64 failures each.
    cells = []
    for n in range(1000):
        case, variant, ws = f"case_{n % 40}", f"variant_{n // 120}-fp32-wrapper=fsdp2", 1 + n % 3
        if n % 100 == 7:
            cell = failing(case, variant, 4, kinds=("not_synced", "stale", "mismatch", "sync_flag"))
            cell.world_size = ws
            cell.failures = cell.failures * 8
            cell.timeline = timeline(ranks=4, steps=10)
        elif n % 8 == 3:
            cell = Cell(case, variant, ws, "detected", summary="diagnosed as declared (not_synced in model): " * 2,
                        failures=failing(case, variant, ws).failures, timeline=timeline(ranks=4, steps=10))
        else:
            cell = Cell(case, variant, ws, "pass", duration_s=0.1234,
                        summary="every rank matched the oracle: 60 checks, 20 of gradients (0 vacuous), 20 backwards' collectives")
        cells.append(cell)
    page = render_html(Matrix(environment={"world_sizes": [1, 2, 3]}, cells=cells))
    assert len(Elements(page).having("a", "m")) == 1000
    assert len(page.encode("utf-8")) < 1_000_000


# A run rewrites its reports after every cell, reusing each cell's pieces (CellTexts): the files
# are byte for byte those made afresh whatever arrives, and a rewrite remakes only what changed.

HOSTILE = "<!-- x --> <b>&amp; | `t` \x1b[31m\u202e\nnext"


def run_cells() -> list[Cell]:
    """Cells in the order a run finishes them, largest world size first: every status; failing and
    canary cells with timelines, failures of several kinds and more of them than are shown; errors
    with tracebacks; text that needs escaping; an infinite difference; a check and a kind no page knows."""
    outcomes = ("pass", "fail", "skip", "detected", "error", "pass", "unsupported", "missed")
    cells = []
    for ws in (4, 2, 1):
        names = [(c, v) for c in ("no_sync", "accumulate", HOSTILE, "zz_last") for v in ("fp32", "bf16-fsdp2", "a|b <i>&")]
        for n, (case, variant) in enumerate(names):
            status = outcomes[(n + ws) % len(outcomes)]
            cell = Cell(case, variant, ws, status, summary=f"{status}: 60 checks on {ws} ranks <{HOSTILE}>",
                        duration_s=0.1 * n, checks=60, grad_checks=20, comm_checks=4,
                        rerun=f"pytest 'cases/x.py::{case}[{variant}-ws{ws}]'")
            if status in ("fail", "detected"):
                kinds = ("not_synced", "stale", "mismatch", "weird_kind")[: 1 + n % 4]
                cell.failures = failing(case, variant, ws, kinds, steps=range(1, 3 + n % 5)).failures
                cell.timeline = timeline(ranks=ws, failing_rank=min(1, ws - 1), kind=kinds[-1],
                                         checks=("flag", "grad", "param") + (("sharding",) if n % 3 == 0 else ()))
                cell.max_abs_diff = float("inf") if n == 5 else 0.5
            elif status == "error":
                cell.detail = f"--- rank 1 raised ---\nTraceback\n\t{HOSTILE}\n" + "x" * 5000
            cells.append(cell)
    return cells


def test_rewrites_with_the_kept_pieces_are_byte_for_byte_fresh_ones(tmp_path: Path) -> None:
    cells = run_cells()
    # a case that sorts before others arrives late (their places move), with a check and a kind that
    # sort first too (every timeline's marks are numbered anew); a rerun's result replaces an earlier
    # cell's; and a cell already written has a field set anew (None: that step)
    late = failing("aaa_first", "fp32", 2, kinds=("odd_kind",))
    late.timeline = timeline(kind="odd_kind", checks=("flag", "grad", "a_check"))
    rerun = Cell(cells[3].case, cells[3].variant, cells[3].world_size, "error", summary="rerun", detail="boom")
    written = cells[10]
    steps: list[Cell | None] = cells[:20] + [late] + cells[20:25] + [rerun] + cells[25:30] + [None] + cells[30:]
    texts, arrived = CellTexts(), []
    for n, new in enumerate(steps):
        if new is None:
            written.status, written.summary = "missed", "set anew after it was written"
        else:
            arrived.append(new)
        matrix = Matrix(environment={"world_sizes": [1, 2, 4], "seed": 1}, cells=merge_cells(arrived),
                        created="2025-01-01T00:00:00+00:00", complete=n == len(steps) - 1)
        paths = write_reports(matrix, tmp_path, texts=texts)
        fresh = {"matrix.json": render_json(matrix), "matrix.md": render_markdown(matrix), "matrix.html": render_html(matrix)}
        for path in paths:
            assert path.read_bytes() == fresh[path.name].encode("utf-8"), (n, path.name)
    assert len(matrix.cells) == len(cells) + 1 and rerun in matrix.cells and written.status == "missed"
    page = paths[2].read_text(encoding="utf-8")
    text = re.search(r'<script type="application/json" id="harness-data">(.*?)</script>', page).group(1)
    data = json.loads(text)
    assert data["checks"][-2:] == ["a_check", "sharding"] and data["kinds"][-2:] == ["odd_kind", "weird_kind"]
    assert data["cases"][:2] == [HOSTILE, "aaa_first"]
    # put together from each cell's own, the page's data is data_json's text of the whole
    assert text == data_json(data)


def test_a_rewrite_remakes_only_the_pieces_of_what_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.render.matrix as matrix_md
    import harness.render.matrix_page as matrix_page
    import harness.render.reports as report

    made: list[str] = []

    def counted(module, name):
        make = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args: (made.append(name), make(*args))[1])

    for module, name in ((report, "_cell_json"), (matrix_md, "_md_entries"), (matrix_page, "_square"),
                         (matrix_page, "_cell_data"), (matrix_page, "_failure_entry")):
        counted(module, name)
    cells = [c for c in run_cells() if c.case != "zz_last"]
    texts = CellTexts()
    write_reports(Matrix(environment={}, cells=cells), tmp_path, texts=texts)
    made.clear()
    write_reports(Matrix(environment={}, cells=list(cells)), tmp_path, texts=texts)
    assert made == []
    new = failing("zz_last", "fp32", 2)
    write_reports(Matrix(environment={}, cells=cells + [new]), tmp_path, texts=texts)
    assert sorted(made) == ["_cell_data", "_cell_json", "_failure_entry", "_md_entries", "_square"]
    # a case sorted before others moves their index in the page's data: only that is made again
    made.clear()
    first = Cell("aaa", "fp32", 2, "pass")
    write_reports(Matrix(environment={}, cells=cells + [new, first]), tmp_path, texts=texts)
    moved = [c for c in cells if c.case > "aaa"]
    assert 0 < len(moved) < len(cells)
    assert made.count("_cell_data") == len(moved) + 2
    assert made.count("_cell_json") == made.count("_md_entries") == 1
    # a field set anew on a cell already written: its pieces are made again
    made.clear()
    new.status = "error"
    write_reports(Matrix(environment={}, cells=cells + [new, first]), tmp_path, texts=texts)
    assert made.count("_cell_json") == made.count("_md_entries") == made.count("_cell_data") == 1
